"""Test setup: without a CUDA device, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported (torch does not import it).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(params=["interpret", "gpu"])
def launch(request, monkeypatch):
    """Each Triton launch configuration under the interpreter: its own small tiles, then the
    GPU's (``HNCLIP_TRITON_LAUNCH=gpu``: the tiles, warps and splits an H200 runs)."""
    from hnclip_kernels.backends.triton import config as cfg

    if request.param == "gpu":
        monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    else:
        monkeypatch.delenv("HNCLIP_TRITON_LAUNCH", raising=False)
    assert cfg.launch_mode() == request.param
    return request.param
