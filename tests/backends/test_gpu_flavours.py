"""GPU-only call flavours: global CUDA matmul settings and autocast must not cost any
backend its accuracy. Needs CUDA (skipped without); ``tools/gpu_check.sh`` runs it in its
"tests" step.

* ``torch.backends.cuda.matmul.allow_tf32 = True`` (open_clip's trainer turns it on): float32
  features keep the float32 bounds on every backend, the torch backend included (its matmuls
  run in IEEE float32 inside the loss: ``numerics.ieee_float32``);
* ``allow_bf16_reduced_precision_reduction`` / ``allow_fp16_reduced_precision_reduction``: the
  16-bit bounds hold for 16-bit features, the float32 bounds for float32 ones;
* ``torch.autocast("cuda")`` around the forward, the backward or both: float32 accuracy.

Bounds are the README's ("Numerical guarantees"), against a float64 evaluation on the CPU.
Bound: N ≤ 130, D = 64, about 20 s on an H200 (Triton compiles included).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cases import TOL_F32_GRAD, TOL_F32_LOSS, TOL_F32_LOSS_SATURATED, TOL_LOWP_LOSS, make_pair
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_BACKENDS = ("torch", "triton")


@contextlib.contextmanager
def _matmul_flags(**flags):
    matmul = torch.backends.cuda.matmul
    saved = {name: getattr(matmul, name) for name in flags}
    for name, value in flags.items():
        setattr(matmul, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(matmul, name, value)


def _tf32_on():
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # newer torch: the one switch behind allow_tf32
        return _matmul_flags(fp32_precision="tf32")
    return _matmul_flags(allow_tf32=True)


def _check(
    backend,
    img,
    txt,
    tau,
    *,
    forward_ctx=contextlib.nullcontext,
    backward_ctx=contextlib.nullcontext,
    gamma=0.5,
    eps=0.1,
    saturated=False,
):
    leaves = [x.cuda().requires_grad_(True) for x in (img, txt)]
    tau_leaf = torch.tensor(tau, device="cuda", requires_grad=True)
    with forward_ctx():
        loss = hn_clip_loss(*leaves, tau_leaf, gamma=gamma, label_smoothing=eps, backend=backend)
    with backward_ctx():
        loss.backward()
    ref_leaves = [x.double().requires_grad_(True) for x in (img, txt)]
    ref_tau = torch.tensor(tau, dtype=torch.float64, requires_grad=True)
    ref = hn_clip_loss_f64(*ref_leaves, ref_tau, gamma, eps)
    ref.backward()
    lowp = img.dtype in (torch.float16, torch.bfloat16)
    loss_tol = TOL_LOWP_LOSS if lowp else (TOL_F32_LOSS_SATURATED if saturated else TOL_F32_LOSS)
    assert_close_rel(loss.cpu(), ref, loss_tol, "loss")
    for leaf, ref_leaf, name in zip(leaves, ref_leaves, ("d img", "d txt")):
        truth = ref_leaf.grad
        if lowp:
            floor = float((truth.to(img.dtype).double() - truth).norm() / truth.norm())
            assert_close_rel(leaf.grad.cpu(), truth, 2 * floor + 2e-3, name)
        else:
            assert_close_rel(leaf.grad.cpu(), truth, TOL_F32_GRAD, name)
    assert_close_rel(tau_leaf.grad.cpu(), ref_tau.grad, TOL_LOWP_LOSS if lowp else TOL_F32_GRAD, "d tau")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("n, tau, saturated", [(17, 0.07, False), (130, 0.07, False), (40, 0.01, True)])
def test_tf32_allowed_keeps_float32_accuracy(backend, n, tau, saturated):
    img, txt = make_pair(n, 64, seed=n, aligned=0.95 if saturated else 0.0)
    with _tf32_on():
        _check(backend, img, txt, tau, saturated=saturated)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reduced_precision_reductions_allowed(backend, dtype):
    img, txt = make_pair(130, 64, dtype, seed=3)
    with _matmul_flags(allow_bf16_reduced_precision_reduction=True, allow_fp16_reduced_precision_reduction=True):
        _check(backend, img, txt, 0.07)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("where", ["forward", "backward", "both"])
def test_autocast_keeps_float32_accuracy(backend, where):
    img, txt = make_pair(64, 64, seed=5)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    forward_ctx = autocast if where in ("forward", "both") else contextlib.nullcontext
    backward_ctx = autocast if where in ("backward", "both") else contextlib.nullcontext
    with _tf32_on():  # open_clip's trainer runs autocast with TF32 allowed
        _check(backend, img, txt, 0.07, forward_ctx=forward_ctx, backward_ctx=backward_ctx)
