"""The 16-bit backward's two stages at kernel level: what the dS kernel stages and what the GEMMs read.

For 16-bit features ``_dscore_kernel`` writes W = diag(a)·dS·diag(b) (dS = g·P over the negatives)
in float32, with |W|'s maxima over each 32-column slice of a row and each 32-row slice of a
column; ``round16._round16_kernel`` then rounds the chunk to float16 once per side, each row (or
column) times its own power of two (``scales.fit16`` of the line's maximum):

* without TAIL (bf16 features): W̃ = float16(line · W), rounded to nearest;
* with TAIL (fp16 features): also the tail W̃_lo = float16(line · W − W̃), ~22 bits together;
* and the residuals' slice sums, Σ (line · W − W̃ [− W̃_lo]) / (line · a_i b_k), which the
  epilogue adds back anchored at the positive.

Each is checked against W evaluated in float64 from the same inputs (or the kernel's own float32
W, where the check is of the rounding alone), on one chunk of 64 × 96 (two row slices, three
column slices) in the interpreter, in seconds. The rows' upstream gradients span 2⁻¹²⁰ … 1, as a
saturated batch's rows do: a scale shared by the chunk (the old design) flushes the small rows,
and the per-line checks below fail on it. A truncating conversion, a dropped tail or a residual
of the wrong sign fails them too.
"""

import pytest
import torch

from hnclip_kernels.backends import epilogue
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton.dscore import _dscore_kernel, dscore_args
from hnclip_kernels.backends.triton.launch import derived_flags
from hnclip_kernels.backends.triton.params import Scalars
from hnclip_kernels.backends.triton.round16 import _round16_kernel, round16_args
from hnclip_kernels.backends.triton.scales import fit16

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter checks (CPU tensors)")

M, N, D, OFFSET, GAMMA, TAU = 64, 96, 16, 20, 0.5, 0.1
SLICE = cfg.RESIDUAL_SLICE
TILE = cfg.INTERPRET_TILE


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
    nll = torch.nn.functional.softplus(nll)  # LSE_all − Z_pos, as softmax.row_nll gives it
    # upstream gradients from 2^-120 to 1 (float32's normal range; P spreads the lines further)
    grad = torch.linspace(0.5, 1.5, M, dtype=torch.float64) * torch.pow(2.0, -120.0 * torch.rand(M, generator=g))
    # W's scales: powers of two times the inverse norms, the largest |W| near 2^100 as ``scales._pow2_stage`` puts it
    a = (norms[0].double() * 2.0**99).float()
    b = norms[1].double().float()
    w64 = a.double()[:, None] * (grad[:, None] * torch.exp(gaps - nll[:, None])) * b.double()[None, :]
    f32 = lambda x: x.float().contiguous()  # noqa: E731
    return (q, k, a_txt, k), norms, f32(pos), f32(nll), f32(grad), a, b, w64


def _stage(dtype):
    """The dS kernel's float32 W (M, N) and |W|'s slice maxima ((N/SLICE, M) per row, (M/SLICE, N) per column)."""
    ops, norms, pos, nll, grad, a, b, w64 = _inputs(dtype)
    round16 = dtype != torch.float32
    w = torch.full((M * N,), float("nan"))
    res_r = torch.full(((N // SLICE) * M,), float("nan")) if round16 else None
    res_c = torch.full(((M // SLICE) * N,), float("nan")) if round16 else None
    inv_tau = 1.0 / torch.tensor([TAU])
    sc = Scalars(inv_tau, inv_tau, torch.tensor([GAMMA]), None, True, False, "ieee")  # the kernels scale by 1/τ
    args = dscore_args(ops, (*norms, pos, nll, grad, a, b, None), sc, (w, res_r, res_c), (0, M, 0, N, D, OFFSET))
    _dscore_kernel[(M // TILE, N // TILE)](
        **args, **derived_flags("dscore", args), HAS_MARGIN=True, PREC="ieee", SLICE=SLICE, BLOCK_M=TILE, BLOCK_N=TILE, BLOCK_K=TILE,
        num_warps=1, num_stages=1,
    )  # fmt: skip
    maxima = (res_r.view(N // SLICE, M), res_c.view(M // SLICE, N)) if round16 else None
    return w.view(M, N), maxima, a, b, w64


def _round(w32, a, b, rows: bool, tail: bool):
    """``_round16_kernel`` over the staged chunk: (head, tail or None, residual slice sums, the line scales)."""
    line = fit16(w32.abs().amax(1 if rows else 0))
    head = torch.empty(M * N, dtype=torch.float16)
    lo = torch.empty_like(head) if tail else None
    res = torch.full(((N // SLICE) * M if rows else (M // SLICE) * N,), float("nan"))
    _round16_kernel[(M // TILE, N // TILE)](
        **(r16 := round16_args(rows, (w32.reshape(-1), (a, b), line), (head, lo, res), (M, N))),
        **derived_flags("round16", r16),
        ROWS=rows, SLICE=SLICE, BLOCK_M=TILE, BLOCK_N=TILE, num_warps=1, num_stages=1,
    )  # fmt: skip
    res = res.view(N // SLICE, M) if rows else res.view(M // SLICE, N)
    return head.view(M, N), lo.view(M, N) if tail else None, res, line


def _close(w, w64, a, b) -> bool:
    """W within 1e-5 of float64 where dS = g·P is a normal float32 (the kernel forms it before the
    scales; the rows below that are below what bf16 gradients hold)."""
    normal = (w64 / (a.double()[:, None] * b.double()[None, :])).abs() >= 2.0**-126
    return bool(((w.double() - w64).abs() <= 1e-5 * w64.abs())[normal].all()) and normal.float().mean() > 0.8


def _ulp16(x):
    """The spacing of float16 at |x| (normal range)."""
    _, e = torch.frexp(x.abs().clamp_min(2.0**-14))
    return torch.ldexp(torch.ones_like(x), e - 11)


def _scaled(x, line, rows):
    return x * (line[:, None] if rows else line[None, :])


def test_stage_is_float32_w_and_its_slice_maxima():
    w, (row_max, col_max), a, b, w64 = _stage(torch.bfloat16)
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    assert _close(w, w64, a, b)
    assert (w64.abs().amax(1) < 2.0**-10).any() and (w64.abs().amax(1) > 2.0**80).any()  # the lines span 2^90
    # the maxima are the staged W's own, exactly (every slot written)
    assert torch.equal(row_max, w.abs().view(M, N // SLICE, SLICE).amax(2).T)
    assert torch.equal(col_max, w.abs().view(M // SLICE, SLICE, N).amax(1))


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_line_rounded_to_nearest_at_its_own_scale(dtype, rows):
    w, _, a, b, _ = _stage(dtype)
    head, _, _, line = _round(w, a, b, rows, tail=dtype == torch.float16)
    want = _scaled(w.double(), line.double(), rows)
    err = (head.double() - want).abs()
    assert (err <= 0.5 * _ulp16(want)).all(), err.max()  # to nearest: within half an ulp, truncation a whole one
    assert (err[want.abs() > 1.0] > 0.25 * _ulp16(want)[want.abs() > 1.0]).any()  # W is not float16 already
    # every line's largest entry sits in [2^12, 2^13]: no line is flushed by another line's size
    line_max = head.double().abs().amax(1 if rows else 0)
    assert ((line_max >= 2.0**12) & (line_max <= 2.0**13)).all(), line_max.min()
    # so each line keeps float16's 11 bits against its own largest entry, 2^-120 rows included
    rel = (head.double() / _scaled(torch.ones_like(want), line.double(), rows) - w.double()).abs()
    assert (rel.amax(1 if rows else 0) <= 2.0**-11 * w.double().abs().amax(1 if rows else 0)).all()


def test_fp16_tail_carries_the_rest():
    w, _, a, b, _ = _stage(torch.float16)
    head, lo, _, line = _round(w, a, b, rows=True, tail=True)
    want = _scaled(w.double(), line.double(), True)
    big = want.abs() >= 0.25  # the tail a normal float16 (below, its bits go to the residual sums)
    assert big.sum() > 1000
    rel = ((head.double() + lo.double() - want).abs() / want.abs())[big].max()
    assert rel < 2.0**-21, rel  # ~22 bits together; the head alone is 2^-12 off
    assert ((head.double() - want).abs() / want.abs())[big].max() > 2.0**-14


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_slice_sums_are_what_the_gemm_operand_misses(dtype, rows):
    tail = dtype == torch.float16
    w, _, a, b, _ = _stage(dtype)
    head, lo, res, line = _round(w, a, b, rows, tail)
    assert torch.isfinite(res).all()  # every slot written
    seen = head.double() + (lo.double() if tail else 0.0)
    ab = a.double()[:, None] * b.double()[None, :]
    scaled = _scaled(w.double(), line.double(), rows)
    resid = (scaled - seen) / _scaled(ab, line.double(), rows)  # ε_ik dS_ik in dS's units, exact in float64
    terms = (w.double() / ab).abs()
    if rows:
        want, scale = (x.view(M, N // SLICE, SLICE).sum(2).T for x in (resid, terms))
    else:
        want, scale = (x.view(M // SLICE, SLICE, N).sum(1) for x in (resid, terms))
    # the float32 sums of exact residuals: to float32's rounding of the sum
    assert ((res.double() - want).abs() <= 2.0**-20 * scale.clamp_min(1e-300) + 1e-300).all()
    assert (want.abs() > 2.0 ** (-24 if tail else -14) * scale).any()  # not negligible: a wrong sign fails


def test_float32_w_is_float32():
    w, maxima, a, b, w64 = _stage(torch.float32)
    assert w.dtype == torch.float32 and maxima is None
    assert _close(w, w64, a, b)
