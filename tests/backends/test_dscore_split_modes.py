"""The 16-bit backward's split modes at kernel level: what ``_dscore_kernel`` writes for the GEMMs.

The dS kernel writes W = diag(a)·dS·diag(b) (dS = g·P over the negatives) once, in the type the
torch GEMMs read (``backends/triton/dscore.py``):

* ROUND16 without TAIL (bf16 features): W̃ = float16(W), rounded to nearest;
* ROUND16 with TAIL (fp16 features): W̃ and the tail W̃_lo = float16(W − W̃), W ≈ W̃ + W̃_lo to ~22 bits;
* neither (float32 features): W in float32.

With ROUND16 it also writes the residual slice sums: per row and per 32-column slice (and per
column and 32-row slice) Σ (W − W̃ [− W̃_lo]) / (a_i b_k), which the epilogue adds back anchored at
the positive. Each is checked here against W evaluated in float64 from the same inputs, on one
chunk of 64 × 96 (two row slices, three column slices) in the interpreter, in about 2 s. A
truncating conversion, a dropped tail or a residual of the wrong sign fails these checks.
"""

import pytest
import torch

from hnclip_kernels.backends import epilogue
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton.dscore import _dscore_kernel

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter checks (CPU tensors)")

M, N, D, OFFSET, GAMMA, TAU = 64, 96, 16, 20, 0.5, 0.1
SLICE = cfg.RESIDUAL_SLICE


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, D, generator=g).to(dtype)
    k = torch.randn(N, D, generator=g).to(dtype)
    a_txt = k[OFFSET : OFFSET + M].clone()  # the margin's factors: the rows' own captions and all captions
    norms = tuple(epilogue.inv_norms(x, True) for x in (q, k, a_txt, k))
    inv_tau = 1.0 / TAU
    q64, k64, m64 = (x.double() * r.double()[:, None] for x, r in zip((q, k, a_txt), norms))
    z = (q64 @ k64.T + GAMMA * (m64 @ k64.T)) * inv_tau
    pos = (q64 * k64[OFFSET : OFFSET + M]).sum(1) * inv_tau
    neg = torch.ones(M, N, dtype=torch.bool)
    neg[torch.arange(M), OFFSET + torch.arange(M)] = False
    gaps = torch.where(neg, z - pos[:, None], -torch.inf)
    nll = torch.logsumexp(gaps, 1).clamp_min(-80.0)
    nll = torch.nn.functional.softplus(nll)  # LSE_all − Z_pos, as epilogue.row_nll gives it
    grad = torch.linspace(0.5, 1.5, M, dtype=torch.float64)
    # W's scales: powers of two times the inverse norms (any positive a, b serve the check)
    a = (norms[0].double() * 2.0**12).float()
    b = norms[1].double().float()
    w64 = a.double()[:, None] * (grad[:, None] * torch.exp(gaps - nll[:, None])) * b.double()[None, :]
    f32 = lambda x: x.float().contiguous()  # noqa: E731
    return (q, k, a_txt, k), norms, f32(pos), f32(nll), f32(grad), a, b, w64


def _run(dtype):
    ops, norms, pos, nll, grad, a, b, w64 = _inputs(dtype)
    round16, tail = dtype != torch.float32, dtype == torch.float16
    w = torch.empty(M * N, dtype=torch.float16 if round16 else torch.float32)
    lo = torch.empty_like(w) if tail else None
    sr, sc = M // SLICE, N // SLICE
    res_r = torch.full((sc * M,), float("nan")) if round16 else None
    res_c = torch.full((sr * N,), float("nan")) if round16 else None
    inv_tau, gamma32 = 1.0 / torch.tensor([TAU]), torch.tensor([GAMMA])
    # no false-negative masking: no threshold, no shifts (MASK and SHIFT derive from the Nones);
    # ROUND16 and TAIL derive from res_r and lo
    rows = (*ops, *[s for x in ops for s in x.stride()], *norms, pos, nll, grad)
    outputs = (w, lo, N, res_r, M, res_c, N)  # the chunk buffers and their row strides
    args = (*rows, inv_tau, gamma32, a, b, None, None, *outputs, 0, M, 0, N, D, OFFSET)
    tile = cfg.INTERPRET_TILE
    _dscore_kernel[(M // tile, N // tile)](
        *args,
        HAS_MARGIN=True,
        PREC="ieee",
        SLICE=SLICE,
        BLOCK_M=tile,
        BLOCK_N=tile,
        BLOCK_K=tile,
        num_warps=1,
        num_stages=1,
    )
    return (
        w.view(M, N),
        lo.view(M, N) if tail else None,
        res_r.view(sc, M) if round16 else None,
        res_c.view(sr, N) if round16 else None,
        a,
        b,
        w64,
    )


def _ulp16(x):
    """The spacing of float16 at |x| (normal range)."""
    _, e = torch.frexp(x.abs().clamp_min(2.0**-14))
    return torch.ldexp(torch.ones_like(x), e - 11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_is_w_rounded_to_nearest_float16(dtype):
    w, _, _, _, _, _, w64 = _run(dtype)
    assert w.dtype == torch.float16
    err = (w.double() - w64).abs()
    # to nearest: within half a float16 ulp (plus W's own float32 error); truncation reaches a whole ulp
    assert (err <= 0.5 * _ulp16(w64) + 1e-6 * w64.abs() + 1e-30).all(), err.max()
    big = w64.abs() > 2.0**-10
    assert (err[big] > 0.25 * _ulp16(w64)[big]).any()  # W is not already a float16 value: the check can fail


def test_fp16_tail_carries_the_rest():
    w, lo, _, _, _, _, w64 = _run(torch.float16)
    # where the tail is a normal float16 (|W| ≥ 2^-2; below, its bits go to float16's subnormals,
    # and the residual sums carry them)
    big = w64.abs() >= 0.25
    assert big.sum() > 100
    rel = ((w.double() + lo.double() - w64).abs() / w64.abs())[big].max()
    # head + tail hold ~22 bits of the kernel's float32 W, itself ~1e-6 from the float64 W (float32
    # exp and products); the head alone is 2^-12 off
    assert rel < 2.0**-18, rel
    assert ((w.double() - w64).abs() / w64.abs())[big].max() > 2.0**-14


def _residual_case(dtype):
    w, lo, res_r, res_c, a, b, w64 = _run(dtype)
    assert torch.isfinite(res_r).all() and torch.isfinite(res_c).all()  # every slot written
    seen = w.double() + (lo.double() if lo is not None else 0.0)
    ab = a.double()[:, None] * b.double()[None, :]
    resid = (w64 - seen) / ab  # ε_ik dS_ik in dS's units (from the float64 W)
    terms = (w64 / ab).abs()
    sums = lambda x: (x.view(M, N // SLICE, SLICE).sum(2).T, x.view(M // SLICE, SLICE, N).sum(1))  # noqa: E731
    return (res_r.double(), res_c.double()), sums(resid), sums(terms)


def test_bf16_residual_slice_sums_are_what_the_gemm_operand_misses():
    # one float16 rounding: residuals ~2^-12 of dS, far above the kernel's own float32 error in W
    # (~2^-20, which the float64 reference cannot see): the sums must match to that
    got, want, scale = _residual_case(torch.bfloat16)
    tol = 2.0**-17
    for g, w, s in zip(got, want, scale):
        assert ((g - w).abs() <= tol * s).all(), ((g - w).abs() / s).max()
        assert (w.abs() > 8 * tol * s).any()  # not negligible: a residual of the wrong sign fails


def test_fp16_residual_slice_sums_carry_only_what_head_and_tail_miss():
    # head + tail leave ~2^-22 of dS, below the float32 W's own error: the sums must be that small
    # (without the tail subtracted they would be ~2^-12 of dS)
    got, _, scale = _residual_case(torch.float16)
    for g, s in zip(got, scale):
        assert (g.abs() <= 2.0**-19 * s).all(), (g.abs() / s).max()
        assert (g != 0).any()


def test_float32_w_is_float32():
    w, lo, res_r, res_c, _, _, w64 = _run(torch.float32)
    assert w.dtype == torch.float32 and lo is None and res_r is None
    assert ((w.double() - w64).abs() <= 1e-5 * w64.abs() + 1e-30).all()
