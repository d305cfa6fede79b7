"""Scales and rounding that no test held before, each checked to fail on the code change it guards.

* rows of very different norms in one Triton batch (the power-of-two scale of W),
* the tf32 head of the multi-pass split rounds to nearest (the rounding helpers, directly),
* the overflow bound's (2 + γ)/τ gap (its factor 2),
* ``lost_positive_rows_fp32`` counts both directions.

(The fifth, ranks differing in ``precision`` / ``gather_with_grad``, is in
tests/distributed/test_distributed.py's ``_error_checks``, which already spawns the ranks.)
Each test runs in about a second or less (N ≤ 8; Triton interpreted).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cases import ALL_BACKENDS, TOL_F32_GRAD
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends.triton.precision import _head, _round_bf16, _tail
from hnclip_kernels.diagnostics import saturation_report


# ---- Triton: rows of very different norms in one batch
def test_triton_rows_of_very_different_norms():
    # every huge-norm test scaled all rows alike; W's power-of-two scale must come from the
    # largest inverse norm, or the rows of norm 1e-10 overflow (NaN gradients)
    gen = torch.Generator().manual_seed(5)
    img, txt = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    scales = torch.tensor([1e16, 1e-10, 1.0, 1e16, 1e-10, 3e-7, 1e12, 1.0])
    img, txt = img * scales[:, None], txt * scales.flip(0)[:, None]
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    tau = torch.tensor(0.07, requires_grad=True)
    loss = hn_clip_loss(*leaves, tau, gamma=0.5, label_smoothing=0.1, backend="triton")
    loss.backward()
    ref_leaves = [x.double().requires_grad_(True) for x in (img, txt)]
    ref_tau = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    ref = hn_clip_loss_f64(*ref_leaves, ref_tau, gamma=0.5, label_smoothing=0.1)
    ref.backward()
    assert_close_rel(loss, ref, 1e-5, "loss")
    assert_close_rel(tau.grad, ref_tau.grad, TOL_F32_GRAD, "d tau")
    for leaf, ref_leaf, name in zip(leaves, ref_leaves, ("d img", "d txt")):
        assert torch.isfinite(leaf.grad).all(), f"{name}: non-finite\n{leaf.grad}"
        # the README's bound: relative error in norm of the whole gradient (dominated by the rows of
        # norm 1e-10, whose gradients scale as 1/‖row‖)
        assert_close_rel(leaf.grad, ref_leaf.grad, TOL_F32_GRAD, name)


# ---- the rounding helpers of the tensor-core emulation
@triton.jit
def _apply_kernel(x_ptr, out_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if MODE == 0:
        y = _head(x, False)  # the tf32x3 split's head: tf32, to nearest
    elif MODE == 1:
        y = _tail(x, False)  # a remainder as the tensor core reads it: tf32, truncated
    else:
        y = _round_bf16(x)  # bf16, to nearest even
    tl.store(out_ptr + offs, y, mask=mask)


def _apply(x: np.ndarray, mode: int) -> np.ndarray:
    xt = torch.from_numpy(x.astype(np.float32))
    out = torch.empty_like(xt)
    _apply_kernel[(1,)](xt, out, xt.numel(), MODE=mode, BLOCK=triton.next_power_of_2(xt.numel()))
    return out.numpy()


def _rounded(x: np.ndarray, mantissa_bits: int, how: str) -> np.ndarray:
    """x (float32 values) rounded to ``mantissa_bits`` explicit bits, in float64 arithmetic:
    "nearest" (ties away from zero), "even" (ties to even) or "truncate" (towards zero)."""
    x = x.astype(np.float64)
    ulp = np.ldexp(1.0, np.frexp(np.abs(x))[1] - 1 - mantissa_bits)
    q = np.abs(x) / ulp
    if how == "nearest":
        r = np.floor(q + 0.5)
    elif how == "even":
        r = np.where(q - np.floor(q) == 0.5, 2 * np.round(q / 2), np.round(q))
    else:
        r = np.floor(q)
    return np.sign(x) * r * ulp


def _boundary_values(mantissa_bits: int) -> np.ndarray:
    """Values just below, at and just above the midpoint between two neighbours of the format,
    at several binades and signs (float32 spacing 2⁻²³ relative)."""
    values = []
    for base in (1.0, -1.0, 1.5, -3.25, 7.0e-3, 1.2345e4, -6.1e-5):
        e = math.frexp(base)[1] - 1
        step = math.ldexp(1.0, e - mantissa_bits)  # the format's spacing at base
        grid = math.copysign(math.floor(abs(base) / step) * step, base)
        f32_step = math.ldexp(1.0, e - 23)
        half = math.copysign(step / 2, base)
        for offset in (-f32_step, 0.0, f32_step):
            values.append(grid + half + offset * math.copysign(1.0, base))
    return np.array(values, dtype=np.float32)


def test_tf32_head_rounds_to_nearest():
    # the GPU's tf32x3 split rounds its head to nearest; a truncated head moves the emulated
    # product by 4e-7, inside the 1e-6 tolerance of the value tests
    x = _boundary_values(10)
    got = _apply(x, 0)
    want = _rounded(x, 10, "nearest")
    assert np.array_equal(got.astype(np.float64), want), np.stack([x, got, want.astype(np.float32)])
    assert not np.array_equal(want, _rounded(x, 10, "truncate"))  # the values do tell the two apart


def test_tf32_tail_truncates():
    x = _boundary_values(10)
    assert np.array_equal(_apply(x, 1).astype(np.float64), _rounded(x, 10, "truncate"))


def test_bf16_rounds_to_nearest_even():
    x = _boundary_values(7)
    assert np.array_equal(_apply(x, 2).astype(np.float64), _rounded(x, 7, "even"))


# ---- the overflow bound's (2 + γ)/τ gap
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_overflow_bound_counts_the_factor_two(backend):
    # each image antiparallel to its own caption and parallel to the other: the gap Z_ij − Z_ii is
    # 2/τ = (2/3)·float32.max, finite, but a pair's two rows sum to (4/3)·max: inf without the check
    img = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    txt = -img
    tau = 3.0 / torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match="tau"):
        out = hn_clip_loss(img, txt, tau, gamma=0.0, reduction="none", backend=backend)
        pytest.fail(f"returned {out} instead of raising")


# ---- lost_positive_rows_fp32 counts both directions
def _lost_rows(z: torch.Tensor) -> int:
    leaf = z.detach().float().requires_grad_(True)
    (grad,) = torch.autograd.grad(F.cross_entropy(leaf, torch.arange(z.shape[0]), reduction="sum"), leaf)
    return int((grad.diagonal() == 0).sum())


def test_lost_positive_rows_counts_both_directions():
    # a few images pulled toward one shared caption, γ = 0, τ = 0.03: 5 of the 8 image→text rows
    # have lost their positive, 4 of the text→image rows
    gen = torch.Generator().manual_seed(1)
    n, d, tau = 8, 16, 0.03
    txt = F.normalize(torch.randn(n, d, generator=gen), dim=1)
    img = txt + 0.01 * torch.randn(n, d, generator=gen)
    img[1:4] = txt[0] + 0.6 * txt[1:4]
    v, t = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    z = v @ t.T / tau
    lost_i2t, lost_t2i = _lost_rows(z), _lost_rows(z.T)
    assert lost_i2t != lost_t2i, (lost_i2t, lost_t2i)  # the batch tells the directions apart
    report = saturation_report(img, txt, tau, gamma=0.0, backend="torch")
    assert report.lost_positive_rows_fp32 == pytest.approx((lost_i2t + lost_t2i) / (2 * n), abs=1e-12)
