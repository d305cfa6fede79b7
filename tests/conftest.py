"""Test setup: without a CUDA device, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported (torch does not import it).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
