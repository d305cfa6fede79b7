"""Triton kernels (interpreted on CPU, compiled on a GPU) against the torch backend.

The checks every backend shares (float64 matrix, saturated regime, offset/rectangular directional
op, determinism) are in test_backends.py; tiles, launches and hostile inputs in test_triton_*.py.
"""

import pytest
import torch

from cases import make_pair
from helpers import assert_close_rel
from hnclip_kernels import hn_clip_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_backend(dtype):
    # both backends accumulate a tensor's gradient in float32 and round it once (bf16 included)
    img, txt = make_pair(65, 64, dtype, seed=2)
    tau = torch.tensor(0.07, requires_grad=True)
    out = {}
    for backend in ("torch", "triton"):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau.grad = None
        loss = hn_clip_loss(*leaves, tau, gamma=2.0, label_smoothing=0.1, backend=backend)
        loss.backward()
        out[backend] = (loss, leaves[0].grad.float(), leaves[1].grad.float(), tau.grad.clone())
    # float32: both backends' gradients are float32-accurate before any rounding. bf16: the Triton
    # backward multiplies a float16 dS once (about 1e-4 before the final rounding), so a few % of
    # the bf16 gradient elements land on the neighbouring value (one bf16 ulp is 7.8e-3 relative)
    grad_tol = 1e-4 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(("loss", "d img", "d txt", "d tau"), out["triton"], out["torch"]):
        assert_close_rel(a, b, 1e-5 if name == "loss" else (1e-4 if name == "d tau" else grad_tol), name)
