"""16-bit W: one staged float32 chunk rounded to float16 with each row's (or column's) own scale.

For 16-bit features the dS kernels (:mod:`.dscore`) write a chunk of W = diag(a) · dS · diag(b) in
float32 (the staging buffer) with the slice maxima of |W|; the walks (:mod:`.backward`) reduce those
to each row's and each column's largest |W| in the chunk and ``scales.fit16`` makes them powers of
two. ``_round16_kernel`` then writes the float16 W the GEMMs read, twice per chunk:

* ROWS: W̃ = float16(diag(ρ) · W) for the rows' GEMM (W̃ · keys, each row divided by its ρ_i after),
  with each row's residual slice sums;
* columns: W̃ = float16(W · diag(κ)) for the columns' GEMM (W̃ᵀ · queries, each column by its κ_k),
  with each column's residual slice sums.

A GEMM's output row (column) then mixes only its own line's entries, all scaled by one power of
two: every line keeps float16's 11 bits down to 2⁻²⁶ of its own largest entry, however far its
loss is from the others'. With TAIL (fp16 features) also the tail float16(ρW − W̃). The residual
E = (ρW − W̃ − W̃_lo) / (ρ a_i b_k), exact in float32, is dS's rounding error in dS's units, summed
per SLICE columns (rows) into per-chunk partial buffers (each slot one program's; ``torch.sum``
merges them in a fixed order): the epilogue's rounding compensation (``epilogue.add_rounding_compensation``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import config as cfg
from .launch import derived, launch, wrap_triton
from .tiles import _block


@derived("round16", "TAIL")
@triton.jit
def _round16_kernel(
    w32_ptr, a_ptr, b_ptr, line_ptr,
    w_ptr, lo_ptr, res_ptr,
    R, C, stride_res,
    ROWS: tl.constexpr, TAIL: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Round one staged R × C chunk (row-major float32 ``w32_ptr``) to float16 ``w_ptr`` (and with
    TAIL its tail ``lo_ptr``), scaled per row (ROWS) or per column by ``line_ptr`` (R or C powers
    of two); ``a_ptr`` (R), ``b_ptr`` (C): the chunk's W scales (W = a_i dS_ik b_k), which divide
    the residuals back to dS's units. ``res_ptr``: the residuals' slice sums, (⌈C / SLICE⌉, R) with
    ROWS (row sums over SLICE columns), else (⌈R / SLICE⌉, C); ``stride_res`` its row stride (R, or C).
    Grid: (⌈R / BLOCK_M⌉, ⌈C / BLOCK_N⌉)."""
    offs_m, mask_m = _block(tl.program_id(0) * BLOCK_M, R, BLOCK_M)
    offs_n, mask_n = _block(tl.program_id(1) * BLOCK_N, C, BLOCK_N)
    mask = mask_m[:, None] & mask_n[None, :]
    at = offs_m[:, None] * C + offs_n[None, :]
    w = tl.load(w32_ptr + at, mask=mask, other=0.0)
    a = tl.load(a_ptr + offs_m, mask=mask_m, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)
    if ROWS:
        line = tl.load(line_ptr + offs_m, mask=mask_m, other=1.0)[:, None]
    else:
        line = tl.load(line_ptr + offs_n, mask=mask_n, other=1.0)[None, :]
    w = w * line  # exact: a power of two, the line's largest |W| into [2^12, 2^13)
    w16 = w.to(tl.float16).to(tl.float32)  # round to nearest even
    if TAIL:
        lo16 = (w - w16).to(tl.float16).to(tl.float32)  # W ≈ W̃ + W̃_lo to ~22 bits
        rest = (w - w16) - lo16
        tl.store(lo_ptr + at, lo16.to(lo_ptr.dtype.element_ty), mask=mask)
    else:
        rest = w - w16
    # ε_ik dS_ik: back to W's units first (exact), then to dS's (a·line may overflow float32); 0 off the chunk
    err = tl.where(mask, rest / line / b[None, :] / a[:, None], 0.0)
    if ROWS:
        part = tl.sum(tl.reshape(err, (BLOCK_M, BLOCK_N // SLICE, SLICE)), axis=2)  # (BLOCK_M, slices)
        slices = tl.program_id(1) * (BLOCK_N // SLICE) + tl.arange(0, BLOCK_N // SLICE)
        tl.store(res_ptr + slices[None, :] * stride_res + offs_m[:, None], part,
                 mask=mask_m[:, None] & (slices * SLICE < C)[None, :])
    else:
        part = tl.sum(tl.reshape(err, (BLOCK_M // SLICE, SLICE, BLOCK_N)), axis=1)  # (slices, BLOCK_N)
        slices = tl.program_id(0) * (BLOCK_M // SLICE) + tl.arange(0, BLOCK_M // SLICE)
        tl.store(res_ptr + slices[:, None] * stride_res + offs_n[None, :], part,
                 mask=(slices * SLICE < R)[:, None] & mask_n[None, :])
    tl.store(w_ptr + at, w16.to(w_ptr.dtype.element_ty), mask=mask)


# autotuned twin (GPU only): memory-bound, keyed on nothing but the flags (TAIL derives from lo_ptr)
_round16_tuned = triton.autotune(cfg.all_candidates("round16"), key=["ROWS"])(_round16_kernel)


def round16_args(rows: bool, inputs, outputs, shape) -> dict:
    """``_round16_kernel``'s arguments by name, group by group as its docstring lists them:
    ``inputs`` = (the staged chunk w32, its scales (a, b), the lines' powers of two); ``outputs`` =
    (W̃, W̃_lo or None, the residual slice sums); ``shape`` = (R, C); the residuals' row stride is R
    with ``rows``, else C."""
    w32, (a, b), line = inputs
    w, lo, res = outputs
    r, c = shape
    return dict(w32_ptr=w32, a_ptr=a, b_ptr=b, line_ptr=line, w_ptr=w, lo_ptr=lo, res_ptr=res,
                R=r, C=c, stride_res=r if rows else c)


def launch_round16(rows: bool, w32, scales, line, outputs, shape):
    """Launch ``_round16_kernel`` over one staged chunk: ``w32`` (R·C float32), ``scales`` = (a over
    the chunk's R rows, b over its C columns), ``line`` its rows' (``rows``) or columns' powers of
    two, ``outputs`` = (W̃, W̃_lo or None, the residual slice sums), ``shape`` = (R, C)."""
    r, c = shape
    launch(lambda tuned: wrap_triton(_round16_tuned) if tuned else wrap_triton(_round16_kernel), "round16", 2,
           lambda tiles: (triton.cdiv(r, tiles["BLOCK_M"]), triton.cdiv(c, tiles["BLOCK_N"])),
           round16_args(rows, (w32, scales, line), outputs, shape), ROWS=rows, SLICE=cfg.RESIDUAL_SLICE)
