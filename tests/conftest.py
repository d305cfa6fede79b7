"""Test setup: without a CUDA device, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported (torch does not import it).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90: ahead-of-time sm_90a compile check of the Triton kernels "
                                       "(tests/tooling/test_sm90_compile.py, minutes when not cached); "
                                       "deselect with -m 'not sm90'")


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
