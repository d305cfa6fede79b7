"""Test setup: without a CUDA device, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported (torch does not import it).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90: ahead-of-time sm_90a compile check of the Triton kernels "
                                       "(tests/tooling/test_sm90_compile.py, minutes when not cached); "
                                       "deselect with -m 'not sm90'")
