"""Backward: the negatives' shares of dL/dq̂ and dL/dk̂, one chunk of dS at a time.

``_dscore_kernel`` forms each tile of Z once more and writes W = diag(a) · dS · diag(b)
(dS = dL/dZ times τ, negatives only; a, b the inverse norms times exact powers of two) to the
workspace, once, in the type the GEMMs read:

* bf16 features: W̃ = float16(W), one pass. cuBLAS multiplies operands of one type, so each
  chunk's feature rows are copied to float16 exactly: bf16's 8-bit significand fits float16's
  11 bits once a row is scaled by an exact power of two s (every |x·s| < 1; 1/s folded into W's
  scales). Entries below 2⁻¹⁷ of their row lose bits to float16's subnormals, below 2⁻²⁵ flush:
  at most 2⁻²⁵ absolute an entry. 2 GEMMs a chunk (float16 × float16 → float32).
* fp16 features: a float16 head W̃ and tail W̃_lo = float16(W − W̃), 4 GEMMs a chunk (a single
  float16 pass measured 1.12–1.17× the two-pass error here: fp16 gradients are fine enough that
  the dS rounding shows).
* float32 features: float32 W and an IEEE-float32 GEMM (TF32 off), 2 GEMMs a chunk.

The GEMMs are torch's (cuBLAS on CUDA, float32 results from 16-bit operands), accumulated over
chunks; the O(N·D) epilogue divides the scales back out. ``backward_shares`` launches them
chunk by chunk.

The single-process loss (SYMMETRIC) walks chunk pairs instead (``_dscore_pair_kernel``), as the
forward walks tile pairs: square chunks, pairs (a, b ≥ a); each program forms a tile Z_IJ of
chunk (a, b) and its mirror Z_JIᵀ from 3 products sharing the margin's G_IJ = t_I t_Jᵀ
(``tiles._pair_tiles``, 2 without the margin) and writes W_IJ into chunk buffer ab and W_JI into
buffer ba; a diagonal chunk pairs its tiles across its diagonal super-tiles. dS with the margin
then costs 1.5 products a logit away from the diagonal instead of 2, and two chunk buffers are
alive at once (``workspace_bytes``).

Compensation. Let dS̃ be what the GEMMs see (W̃, or W̃ + W̃_lo, over a_i b_k), dS_ik = dS̃_ik + ε_ik dS_ik.
Row i's share is Σ_k dS_ik k̂_k = Σ_k dS̃_ik k̂_k + Σ_k ε_ik dS_ik k̂_k. The kernel also writes,
per row, ρ_i = Σ_k ε_ik dS_ik (= r_i − r̃_i, the row sums of dS and dS̃), summed in float32 from
the exact per-element residuals (W − W̃, or W − W̃ − W̃_lo; not as a difference of the two sums, which would
cancel), and the epilogue adds ρ_i k̂_p(i), p(i) = offset + i the row's positive. Then
    GEMM + ρ_i k̂_p(i) − exact = −Σ_k ε_ik dS_ik (k̂_k − k̂_p(i)):
the rounding error of dS enters only through the keys' differences from the row's positive,
and vanishes as the captions a row confuses approach each other (the near-duplicates the
margin is for, where the share, Σ_k dS_ik (k̂_k − k̂_p(i)) with the positive's term, is small
against its terms). The column side is the same with σ_k = Σ_i ε_ik dS_ik and q̂ of the
column's positive row (k − offset, when that row is local; a column without a local positive
row, only in the directional op, is uncompensated). Residual sums are taken per 32-column
(32-row) slice of a tile into per-chunk partial buffers (each slot written by one program) and
merged by ``torch.sum`` in a fixed order: no atomics, bit-reproducible.

Why float16 for bf16. A bf16 dS alone (2⁻⁹ relative) was measured: with the compensation the
image gradient on near-duplicate captions keeps its accuracy, but the text gradient (whose rows,
the images, are not near-duplicates) and any row with few negatives keep the 2⁻⁹ error: d txt
1.9e-3 against 1.7e-3 on tests/backends/test_near_duplicates.py's clusters, and the README
bound failed at N = 2 (3.75e-3 > 3.7e-3). float16's 2⁻¹² is 8× finer: the same clusters give
the two-pass errors to within 0.4% (d img 1.58–1.72e-3, d txt 1.63–1.71e-3), far below the
final rounding to bf16. The float32 gradient before that rounding is then accurate to about
1e-4 (not 1e-6): a few % of bf16 gradient elements round to the neighbouring value.

Scales. W's norms are first brought near 1 by exact powers of two (``_pow2_unit``): with
‖q‖‖k‖ ~ 1e36 the plain r_q·r_k·dS falls below float32's normal range. For 16-bit W one more
power of two c (``_pow2_fit``) brings B ≥ |W_ik| into [2¹², 2¹³): float16 (max 65504) never
overflows. B holds in every regime: |dS_ik| ≤ |g_i|·μ_i (+ |g'_k|·μ'_k), μ_i the row's negative
mass Σ_k P_ik = 1 − e^(−nll_i) (or ε/n_i if larger) rounded up to a power of two, at most 1
(B = max|g| put a saturated batch's W, P_ik ~ 1e-13, below float16's subnormals, all of dS then
compensated along the positive). Rows of mass > ½ keep B = max|g| (+ max|g'|), bit for bit. One
c serves all of W: a row whose |g_i|·μ_i is below ~2⁻²⁵ of the largest still flushes (its absolute
error below ~2⁻²⁵ of the largest row's share). All scales are exact powers of two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import autocast_disabled, ieee_float32
from .. import epilogue
from . import config as cfg
from .launch import launch, strides, wrap_triton
from .tiles import (
    _block,
    _kept,
    _load2,
    _load_scalars,
    _logits_masked_tile,
    _pair_masked_tiles,
    _rank_tiles,
)

# the residual sums' slice: every dS tile (32, 64 or 128 wide) holds whole slices, so the
# partial buffers' layout does not depend on the tile an autotuner picks
RESIDUAL_SLICE = 32


@triton.jit
def _chunk_tile(row0, row_end, col0, col_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of a dS chunk [row0, row_end) × [col0, col_end) (grid: the chunk's
    tiles): its rows and columns ``(offsets, mask)`` and the chunk's sides R and C. No pointer
    goes in (see ``tiles._block``): the offsets reach the stores."""
    offs_m, mask_m = _block(row0 + tl.program_id(0) * BLOCK_M, row_end, BLOCK_M)
    offs_n, mask_n = _block(col0 + tl.program_id(1) * BLOCK_N, col_end, BLOCK_N)
    return (offs_m, mask_m), (offs_n, mask_n), row_end - row0, col_end - col0


@triton.jit
def _dscore_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr, gamma_ptr,
    nll_c_ptr, g_c_ptr, a_ptr, b_ptr, thr_ptr, s_ptr, s_c_ptr,
    w_ptr, lo_ptr, stride_wm, stride_wn, res_r_ptr, stride_rr, res_c_ptr, stride_rc,
    row0, row_end, col0, col_end, D, offset,
    SYMMETRIC: tl.constexpr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, SHIFT: tl.constexpr, PREC: tl.constexpr,
    ROUND16: tl.constexpr, TAIL: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[i − row0, k − col0] = a_i · dS_ik · b_k over one chunk [row0, row_end) × [col0, col_end);
    with ROUND16 rounded to float16 (with TAIL also a float16 tail), and the residuals' slice
    sums written.

    dS_ik = g_i P_ik over the negatives (P = exp(d − nll)); with SYMMETRIC (M = N,
    offset 0) plus g'_k P'_ki, the softmax of column k, so one tile serves i2t and t2i.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of the chunk.

    Features and per-row inputs: as ``forward._fwd_kernel`` (q_ptr, k_ptr, mq_ptr, mk_ptr,
        their strides, rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, tau_ptr, gamma_ptr).
    Per-row inputs of the backward (float32):
        nll_ptr (M): each row's LSE of the gaps (P's normaliser); g_ptr (M): upstream gradient;
        nll_c_ptr, g_c_ptr (N): the same of the key direction (read only with SYMMETRIC);
        a_ptr (M), b_ptr (N): W's row and column scales (see the module docstring: the inverse
        norms, over the exact float16 conversion's powers of two for bf16 features, times
        powers of two that bring them near 1, and for 16-bit W the fit c in a).
    False-negative masking (MASK): thr_ptr the 1-element threshold; s_ptr (M), s_c_ptr (N,
        with SYMMETRIC) each row's ε/n_i (read with SHIFT: MASK and label smoothing):
        dS_ik = g_i (P_ik − s_i) (+ g'_k (P'_ki − s'_k)) on the entries kept (caption cosine <
        thr), 0 on the masked ones.
    Outputs: w_ptr, the chunk (row_end − row0, col_end − col0), float32 or float16, strides
        stride_wm, stride_wn; with TAIL lo_ptr, the tail, alike. With ROUND16,
        E_ik = (W_ik − W̃_ik − W̃_lo,ik) / (a_i b_k) (= ε_ik dS_ik; no W̃_lo without TAIL)
        summed over SLICE columns into res_r_ptr[slice, i − row0] (stride_rr between slices)
        and over SLICE rows into res_c_ptr[slice, k − col0] (stride_rc).
    Shapes and scalars: the chunk's bounds row0, row_end (≤ M), col0, col_end (≤ N); D;
        offset (row i's positive is column offset + i).
    Constexprs: SYMMETRIC (also the key direction's share), HAS_MARGIN (γ ≠ 0), MASK, PREC
        (``precision._dot``), ROUND16 ("" or "fp16": W rounded to float16), TAIL (and a
        float16 tail written: fp16 features), SLICE (the residual
        sums' slice, dividing both tile sides), BLOCK_M × BLOCK_N tiles, BLOCK_K the
        reduction step (the forward's: the same tiles to the bit).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    (offs_m, mask_m), (offs_n, mask_n), _, _ = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    inv_tau, gamma, thr = _load_scalars(tau_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    rk, r_mk = _load2(rk_ptr, r_mk_ptr, offs_n, mask_n)
    z = _logits_masked_tile((q_ptr, stride_qm, stride_qd), (k_ptr, stride_kn, stride_kd),
                            (mq_ptr, stride_mqm, stride_mqd), (mk_ptr, stride_mkn, stride_mkd),
                            (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                            D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    w, a, b, mask = _w_tile(z, offs_m, mask_m, offs_n, mask_n, offset, pos_ptr, nll_ptr, g_ptr, nll_c_ptr, g_c_ptr,
                            a_ptr, b_ptr, SYMMETRIC, s_ptr, s_c_ptr, MASK, SHIFT)
    _store_w(w, a, b, mask, (offs_m, mask_m, row0, row_end, pid_m * (BLOCK_M // SLICE)),
             (offs_n, mask_n, col0, col_end, pid_n * (BLOCK_N // SLICE)),
             w_ptr, lo_ptr, stride_wm, stride_wn, res_r_ptr, stride_rr, res_c_ptr, stride_rc,
             ROUND16, TAIL, SLICE, BLOCK_M, BLOCK_N)


@triton.jit
def _w_tile(z, offs_m, mask_m, offs_n, mask_n, offset, pos_ptr, nll_ptr, g_ptr, nll_c_ptr, g_c_ptr, a_ptr, b_ptr,
            SYMMETRIC: tl.constexpr, s_ptr, s_c_ptr, MASK: tl.constexpr, SHIFT: tl.constexpr):
    """W = a_i · dS_ik · b_k (float32) of a tile z of logits (rows ``offs_m``, columns ``offs_n``;
    row i's positive is column offset + i), with the row scales a, column scales b and the
    tile's bounds mask (see ``_dscore_kernel``). With MASK (false-negative masking: z from
    ``tiles._logits_masked_tile``, masked entries −inf) only the kept entries are negatives, each
    less its row's (and column's) smoothing share s = ε/n (``s_ptr``, ``s_c_ptr``; only with
    SHIFT, label smoothing: without it a masked tile costs what an unmasked one does, the
    fp16 128x64 dS is at 255 registers). Loads only: no pointer here is written."""
    neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
    g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
    if MASK:
        neg = neg & _kept(z)
    if SHIFT:
        s = tl.load(s_ptr + offs_m, mask=mask_m, other=0.0)
        p = tl.exp(tl.where(neg, z - pos[:, None] - nll[:, None], float("-inf")))
        dscore = tl.where(neg, p - s[:, None], 0.0) * g[:, None]
    else:
        # mask before exp: the positive's tile entry carries a margin and may overflow
        dscore = tl.exp(tl.where(neg, z - pos[:, None] - nll[:, None], float("-inf"))) * g[:, None]
    if SYMMETRIC:
        pos_c = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
        nll_c = tl.load(nll_c_ptr + offs_n, mask=mask_n, other=0.0)
        g_c = tl.load(g_c_ptr + offs_n, mask=mask_n, other=0.0)
        if SHIFT:
            s_c = tl.load(s_c_ptr + offs_n, mask=mask_n, other=0.0)
            p_c = tl.exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf")))
            dscore += tl.where(neg, p_c - s_c[None, :], 0.0) * g_c[None, :]
        else:
            dscore += tl.exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf"))) * g_c[None, :]
    # W_ik = a_i · dS_ik · b_k (a, b: the products' scales, see the module docstring)
    a = tl.load(a_ptr + offs_m, mask=mask_m, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)
    w = dscore * a[:, None] * b[None, :]
    return w, a, b, mask_m[:, None] & mask_n[None, :]


@triton.jit
def _store_w(w, a, b, mask, rows, cols, w_ptr, lo_ptr, stride_wm, stride_wn, res_r_ptr, stride_rr, res_c_ptr, stride_rc,
             ROUND16: tl.constexpr, TAIL: tl.constexpr, SLICE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a W tile (``_w_tile``) at rows ``rows`` = (offsets, mask, the chunk's first row, its end,
    the tile's first row slice) and columns ``cols`` alike of a chunk buffer: with ROUND16 rounded
    to float16 (with TAIL also the tail), and the residuals' slice sums (see ``_dscore_kernel``)."""
    offs_m, mask_m, row0, row_end, first_m = rows
    offs_n, mask_n, col0, col_end, first_n = cols
    if ROUND16 != "":
        w16 = w.to(tl.float16).to(tl.float32)  # round to nearest even
        if TAIL:
            lo16 = (w - w16).to(tl.float16).to(tl.float32)  # the tail: W ≈ W̃ + W̃_lo to ~22 bits
            rest = (w - w16) - lo16
        else:
            rest = w - w16
        # ε_ik dS_ik, exact residual of the rounding(s), in dS's units; 0 off the chunk (a, b are 0 there)
        err = tl.where(mask, rest / b[None, :] / a[:, None], 0.0)
        row_part = tl.sum(tl.reshape(err, (BLOCK_M, BLOCK_N // SLICE, SLICE)), axis=2)  # (BLOCK_M, slices)
        col_part = tl.sum(tl.reshape(err, (BLOCK_M // SLICE, SLICE, BLOCK_N)), axis=1)  # (slices, BLOCK_N)
        slices_n = tl.arange(0, BLOCK_N // SLICE)
        slices_m = tl.arange(0, BLOCK_M // SLICE)
        tl.store(res_r_ptr + (first_n + slices_n)[None, :] * stride_rr + (offs_m - row0)[:, None], row_part,
                 mask=mask_m[:, None] & (col0 + (first_n + slices_n) * SLICE < col_end)[None, :])
        tl.store(res_c_ptr + (first_m + slices_m)[:, None] * stride_rc + (offs_n - col0)[None, :], col_part,
                 mask=(row0 + (first_m + slices_m) * SLICE < row_end)[:, None] & mask_n[None, :])
        if TAIL:
            tl.store(lo_ptr + (offs_m - row0)[:, None] * stride_wm + (offs_n - col0)[None, :] * stride_wn,
                     lo16.to(lo_ptr.dtype.element_ty), mask=mask)
        w = w16
    tl.store(w_ptr + (offs_m - row0)[:, None] * stride_wm + (offs_n - col0)[None, :] * stride_wn,
             w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dscore_pair_kernel(
    v_ptr, t_ptr, stride_vm, stride_vd, stride_tm, stride_td,
    rv_ptr, rt_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr, gamma_ptr, nll_c_ptr, g_c_ptr, a_ptr, b_ptr,
    thr_ptr, s_ptr, s_c_ptr,
    w_ptr, lo_ptr, res_r_ptr, res_c_ptr, mirror_w, mirror_r, mirror_c,
    row0, row_end, col0, col_end, D,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, SHIFT: tl.constexpr, PREC: tl.constexpr, ROUND16: tl.constexpr,
    TAIL: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The symmetric loss's dS over a chunk pair: chunk (a, b) = [row0, row_end) × [col0, col_end)
    and its mirror (b, a), both W's (``_dscore_kernel`` with SYMMETRIC, offset 0) from the tile
    pairs of ``tiles._pair_tiles`` (3 products a pair sharing the margin's G_IJ = t_I t_Jᵀ).

    Program (I, J) takes the tile of rows I (BLOCK_M) and columns J (BLOCK_N) of chunk (a, b),
    forms Z_IJ and Z_JIᵀ, and writes W_IJ into buffer ab and W_JI (transposed back) into buffer ba,
    with the residual slice sums of both. A diagonal chunk (row0 = col0, a square chunk) is its
    own mirror (mirror offsets 0): there tile rows I pair with the columns J right of their
    diagonal super-tile (BLOCK_M × BLOCK_M), the super-tile's tiles are formed alone (the
    positives; ``_logits_tile``), and programs left of it write nothing (their tiles are
    mirrors). Every logit is formed as the forward forms it (the same BLOCK_K): bit-identical.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of chunk (a, b).

    Inputs: v_ptr, t_ptr (N, D) features (strides ``stride_<v|t><m|d>``), rv_ptr, rt_ptr (N)
        inverse norms, and pos_ptr … b_ptr, thr_ptr, s_ptr, s_c_ptr as ``_dscore_kernel`` (q = v,
        k = t; MASK: the pair tiles' one caption tile masks W_IJ and W_JI alike).
    Outputs: w_ptr, one flat buffer: W_ab (R × C, row-major) at 0, W_ba (C × R) at mirror_w;
        with TAIL lo_ptr alike; with ROUND16 res_r_ptr: ab's row slice sums (⌈C / SLICE⌉, R)
        at 0, ba's (⌈R / SLICE⌉, C) at mirror_r; res_c_ptr: ab's column slice sums
        (⌈R / SLICE⌉, C) at 0, ba's (⌈C / SLICE⌉, R) at mirror_c (R = row_end − row0,
        C = col_end − col0). Diagonal chunk: the mirror offsets 0 (one buffer each).
    Constexprs: as ``_dscore_kernel``; BLOCK_N divides BLOCK_M; chunk sides multiples of BLOCK_M.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    (offs_m, mask_m), (offs_n, mask_n), rows_c, cols_c = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    inv_tau, gamma, thr = _load_scalars(tau_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    rv_m, rt_m = _load2(rv_ptr, rt_ptr, offs_m, mask_m)
    rv_n, rt_n = _load2(rv_ptr, rt_ptr, offs_n, mask_n)
    v = (v_ptr, stride_vm, stride_vd)
    t = (t_ptr, stride_tm, stride_td)
    rows = (offs_m, mask_m, row0, row_end, pid_m * (BLOCK_M // SLICE))
    cols = (offs_n, mask_n, col0, col_end, pid_n * (BLOCK_N // SLICE))
    local_m = pid_m * BLOCK_M
    local_n = pid_n * BLOCK_N
    diagonal = row0 == col0
    if diagonal & (local_n >= local_m) & (local_n < local_m + BLOCK_M):
        # the diagonal super-tile: its tiles hold the positives and are formed alone, as the forward forms them
        z = _logits_masked_tile(v, t, t, t, (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rt_n, rt_n),
                                D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        w, a, b, mask = _w_tile(z, offs_m, mask_m, offs_n, mask_n, 0, pos_ptr, nll_ptr, g_ptr, nll_c_ptr, g_c_ptr,
                                a_ptr, b_ptr, True, s_ptr, s_c_ptr, MASK, SHIFT)
        _store_w(w, a, b, mask, rows, cols, w_ptr, lo_ptr, cols_c, 1, res_r_ptr, rows_c, res_c_ptr, cols_c,
                 ROUND16, TAIL, SLICE, BLOCK_M, BLOCK_N)
    elif (row0 != col0) | (local_n >= local_m + BLOCK_M):
        z, zm = _pair_masked_tiles(v, t, (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                                   D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        w, a, b, mask = _w_tile(z, offs_m, mask_m, offs_n, mask_n, 0, pos_ptr, nll_ptr, g_ptr, nll_c_ptr, g_c_ptr,
                                a_ptr, b_ptr, True, s_ptr, s_c_ptr, MASK, SHIFT)
        _store_w(w, a, b, mask, rows, cols, w_ptr, lo_ptr, cols_c, 1, res_r_ptr, rows_c, res_c_ptr, cols_c,
                 ROUND16, TAIL, SLICE, BLOCK_M, BLOCK_N)
        # the mirror: rows J, columns I of chunk (b, a), a C × R buffer
        wm, am, bm, maskm = _w_tile(tl.trans(zm), offs_n, mask_n, offs_m, mask_m, 0, pos_ptr, nll_ptr, g_ptr,
                                    nll_c_ptr, g_c_ptr, a_ptr, b_ptr, True, s_ptr, s_c_ptr, MASK, SHIFT)
        _store_w(wm, am, bm, maskm, cols, rows, w_ptr + mirror_w, lo_ptr + mirror_w, rows_c, 1,
                 res_r_ptr + mirror_r, cols_c, res_c_ptr + mirror_c, rows_c, ROUND16, TAIL, SLICE, BLOCK_N, BLOCK_M)


@triton.jit
def _dscore_rank_kernel(
    v_ptr, t_ptr, va_ptr, ta_ptr,
    stride_vm, stride_vd, stride_tm, stride_td, stride_van, stride_vad, stride_tan, stride_tad,
    rv_ptr, rt_ptr, rva_ptr, rta_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr, gamma_ptr, a_ptr, b_ptr, thr_ptr, s_ptr,
    w_ptr, lo_ptr, res_r_ptr, res_c_ptr, second_w, second_r, second_c,
    M, N, row0, row_end, col0, col_end, D, offset,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, SHIFT: tl.constexpr, PREC: tl.constexpr,
    ROUND16: tl.constexpr, TAIL: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A distributed rank's dS of both directions over one chunk [row0, row_end) × [col0, col_end)
    of its M local rows against the N gathered columns: each program forms the i2t and t2i
    tiles from 3 products sharing G (``tiles._rank_tiles``) and writes both W's
    (``_dscore_kernel`` without SYMMETRIC, one per direction), with their residual slice sums.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of the chunk.

    Inputs: the features and inverse norms as ``forward._fwd_rank_kernel``; per line (2M: i2t
        rows, then t2i rows) pos_ptr, nll_ptr, g_ptr and the row scales a_ptr; per direction's
        columns (2N: i2t's keys t_all, then t2i's keys v_all) the column scales b_ptr.
        False-negative masking (MASK): thr_ptr the 1-element threshold, s_ptr (2M) each line's
        ε/n_i (read with SHIFT), as ``_dscore_kernel``.
    Outputs: w_ptr, one flat buffer: the i2t W (R × C, row-major) at 0 and the t2i W at
        second_w; with TAIL lo_ptr alike; with ROUND16 res_r_ptr (⌈C / SLICE⌉, R) and res_c_ptr
        (⌈R / SLICE⌉, C), the t2i direction's at second_r / second_c (R = row_end − row0,
        C = col_end − col0).
    Scalars and constexprs: M, N; the rest as ``_dscore_kernel``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    (offs_m, mask_m), (offs_n, mask_n), rows_c, cols_c = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    inv_tau, gamma, thr = _load_scalars(tau_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    rv_m, rt_m = _load2(rv_ptr, rt_ptr, offs_m, mask_m)
    rv_n, rt_n = _load2(rva_ptr, rta_ptr, offs_n, mask_n)
    z, zt = _rank_tiles((v_ptr, stride_vm, stride_vd), (t_ptr, stride_tm, stride_td),
                        (va_ptr, stride_van, stride_vad), (ta_ptr, stride_tan, stride_tad),
                        (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                        D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    rows = (offs_m, mask_m, row0, row_end, pid_m * (BLOCK_M // SLICE))
    cols = (offs_n, mask_n, col0, col_end, pid_n * (BLOCK_N // SLICE))
    w, a, b, mask = _w_tile(z, offs_m, mask_m, offs_n, mask_n, offset, pos_ptr, nll_ptr, g_ptr, nll_ptr, g_ptr,
                            a_ptr, b_ptr, False, s_ptr, s_ptr, MASK, SHIFT)
    _store_w(w, a, b, mask, rows, cols, w_ptr, lo_ptr, cols_c, 1, res_r_ptr, rows_c, res_c_ptr, cols_c,
             ROUND16, TAIL, SLICE, BLOCK_M, BLOCK_N)
    w, a, b, mask = _w_tile(zt, offs_m, mask_m, offs_n, mask_n, offset, pos_ptr + M, nll_ptr + M, g_ptr + M,
                            nll_ptr + M, g_ptr + M, a_ptr + M, b_ptr + N, False, s_ptr + M, s_ptr + M, MASK, SHIFT)
    _store_w(w, a, b, mask, rows, cols, w_ptr + second_w, lo_ptr + second_w, cols_c, 1, res_r_ptr + second_r, rows_c,
             res_c_ptr + second_c, cols_c, ROUND16, TAIL, SLICE, BLOCK_M, BLOCK_N)


# autotuned twin (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
_dscore_tuned = triton.autotune(cfg.all_candidates("dscore"), key=["D", "HAS_MARGIN", "MASK", "SHIFT", "PREC", "SYMMETRIC", "ROUND16", "TAIL"],
                                prune_configs_by={"early_config_prune": cfg.pruner("dscore", "q_ptr")})(_dscore_kernel)
# the symmetric loss's chunk pairs: key D, HAS_MARGIN, MASK, SHIFT, PREC, ROUND16, TAIL
_dscore_pair_tuned = triton.autotune(cfg.all_candidates("dscore_pair"), key=["D", "HAS_MARGIN", "MASK", "SHIFT", "PREC", "ROUND16", "TAIL"],
                                     prune_configs_by={"early_config_prune": cfg.pruner("dscore_pair", "v_ptr")}
                                     )(_dscore_pair_kernel)


# a rank's two directions: key D, HAS_MARGIN, MASK, SHIFT, PREC, ROUND16, TAIL
_dscore_rank_tuned = triton.autotune(cfg.all_candidates("dscore_rank"),
                                     key=["D", "HAS_MARGIN", "MASK", "SHIFT", "PREC", "ROUND16", "TAIL"],
                                     prune_configs_by={"early_config_prune": cfg.pruner("dscore_rank", "v_ptr")}
                                     )(_dscore_rank_kernel)


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("dscore", "dscore_pair", "dscore_rank"), its autotuned twin when ``tuned``, through
    ``wrap_triton``; spelled out kernel by kernel (see :func:`.launch.launch`)."""
    if name == "dscore_pair":
        return wrap_triton(_dscore_pair_tuned) if tuned else wrap_triton(_dscore_pair_kernel)
    if name == "dscore_rank":
        return wrap_triton(_dscore_rank_tuned) if tuned else wrap_triton(_dscore_rank_kernel)
    assert name == "dscore", name
    return wrap_triton(_dscore_tuned) if tuned else wrap_triton(_dscore_kernel)


# ------------------------------------------------------------------ host launcher
def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _pow2_fit(sides, w: torch.Tensor) -> torch.Tensor:
    """The power of two c (1-element float32, no host sync) with c·B in [2¹², 2¹³), B ≥ |dS| from each
    side's rows (g, nll, ε/n_i or None; module docstring, Scales), and c ≤ 2¹²⁰ / w (w ≥ 1: the
    other powers of two in a·wk, b·wq; they stay finite when B is tiny)."""
    bound = 0.0
    for g, nll, s in sides:
        mass = -torch.expm1(-nll) if s is None else torch.maximum(-torch.expm1(-nll), s)
        bound = bound + (g.abs() * torch.ldexp(torch.ones_like(mass), torch.frexp(mass)[1]).clamp_max(1.0)).max()
    _, exponent = torch.frexp(bound.reshape(1))
    return torch.minimum(torch.ldexp(torch.ones(1, device=w.device), 13 - exponent), 2.0 ** 120 / w)


def _f16_scales(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per row of bf16 ``x`` (inverse norms ``r``) the power of two s (float32) with x·s exact in
    float16: s = min(2^e_r, 2^−e_x), r ∈ [2^(e_r−1), 2^e_r), max|x_j| ∈ [2^(e_x−1), 2^e_x)
    (2^e_r for a zero row). Every |x_j s| < 1, and r/s ∈ [½, 1) for a normalised row
    (‖x‖·r = 1 ⇒ max|x_j| ≤ 1/r, so 2^e_r ≤ 2^−e_x)."""
    _, e_r = torch.frexp(r)
    s_r = torch.ldexp(torch.ones_like(r), e_r)
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, dtype=torch.float32)  # max|x_j|, no |x| temporary
    _, e_x = torch.frexp(amax)
    return torch.where(amax > 0, torch.minimum(s_r, torch.ldexp(torch.ones_like(r), -e_x)), s_r)


def _to_f16(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x · s[:, None] in float16, exact (``_f16_scales``; entries below 2^−17 lose bits to
    float16's subnormals, below 2^−25 flush), in a buffer of the backward's workspace."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.float16)
    torch.mul(x, s[:, None], out=out)
    return out


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    """(acc +) a @ b with a float32 result. 16-bit operands on CUDA: cuBLAS's float32-output
    GEMM (``out_dtype``); elsewhere (CPU, the interpreter) upcast first, the same products
    (two 16-bit values multiply exactly in float32) and float32 accumulation."""
    if a.dtype != torch.float32 and a.device.type == "cuda":
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    a, b = a.float(), b.float()
    return torch.mm(a, b) if acc is None else torch.addmm(acc, a, b)


def _chunk_bytes(rows: int, cols: int, d: int, dtype: torch.dtype, buffers: int, copies: int | None = None) -> int:
    """Bytes of ``buffers`` R × C dS buffers of ``dtype`` features with their residual slice
    sums, and for bf16 the float16 copies of the feature rows they meet: ``copies`` (default
    ``buffers``) blocks of R rows and as many of C columns (q and k of both chunks for a pair:
    2·(R + C)·D; a rank's two directions keep both row blocks and one column block: 2·R·D + C·D)."""
    if dtype == torch.float32:
        return 4 * rows * cols * buffers
    residuals = 4 * (triton.cdiv(cols, RESIDUAL_SLICE) * rows + triton.cdiv(rows, RESIDUAL_SLICE) * cols) * buffers
    if dtype == torch.float16:
        return 4 * rows * cols * buffers + residuals
    if copies is None:
        return 2 * rows * cols * buffers + residuals + 2 * (rows + cols) * d * buffers
    return 2 * rows * cols * buffers + residuals + 2 * copies


def workspace_bytes(m: int, n: int, d: int, dtype: torch.dtype, symmetric: bool = False, rank: bool = False) -> int:
    """Bytes :func:`backward_shares` (or :func:`rank_shares`) allocates at its peak for M rows
    against N columns of ``dtype`` features of width D: one chunk of ``config.chunk_shape`` (the
    first, the largest): float32 dS (float32 features), a float16 head and tail (fp16) or one
    float16 W (bf16), for 16-bit features the residual slice sums, and for bf16 the chunk's rows
    and columns of the features in float16 (R·D + C·D). ``symmetric`` (the single-process loss,
    M = N, square chunks): a chunk pair (a, b > a) holds two chunk buffers (W_ab and W_ba) at
    once, the largest pair the first: R × min(R, N − R); a single chunk (N ≤ R) one. ``rank`` (a
    rank's two directions): two chunk buffers, both directions' row blocks in float16 and one
    column block at a time."""
    if symmetric:
        rows, _ = cfg.chunk_shape(m, n, square=True)
        single = _chunk_bytes(rows, rows, d, dtype, 1)
        return single if n <= rows else max(single, _chunk_bytes(rows, min(rows, n - rows), d, dtype, 2))
    rows, cols = cfg.chunk_shape(m, n)
    if rank:
        return _chunk_bytes(rows, cols, d, dtype, 2, copies=(2 * rows + cols) * d)
    return _chunk_bytes(rows, cols, d, dtype, 1)


def _rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """x[start:end], or x itself when that is all of it (a traced operator then writes the
    tensor, not a view of it: no scatter back into a base)."""
    return x if (start, end) == (0, x.shape[0]) else x[start:end]


def _w_scales(q, k, r_q, r_k, sides, round16: bool, tail: bool):
    """W = diag(a) dS diag(b)'s scales for rows ``q`` against columns ``k`` (inverse norms r_q,
    r_k; ``sides`` what bounds |dS|, see ``_pow2_fit``):
    (a, b, rq, rk, f16): rq, rk what the products divide out (W's own side's scale and the other
    side's power of two: a GEMM against x·s gives a_i·wk·Σ_k dS_ik k̂_k; the power-of-two
    products are exact), f16 the exact float16 conversions' scales (s_q, s_k) of bf16 features
    (None otherwise; W's scales then carry 1/s, t = r/s exactly)."""
    if round16 and not tail:
        f16 = _f16_scales(q, r_q), _f16_scales(k, r_k)
        t_q, t_k = r_q / f16[0], r_k / f16[1]
    else:
        f16, t_q, t_k = None, r_q, r_k
    wq, wk = _pow2_unit(t_q), _pow2_unit(t_k)
    if round16:
        wq = wq * _pow2_fit(sides, torch.maximum(wq, wk).clamp_min(1.0))
    a, b = t_q * wq, t_k * wk
    return a, b, a * wk, b * wq, f16


def backward_shares(ops, norms, stats, g, tau32, gamma32, has_margin: bool, offset: int, precision, key_side=None,
                    thr32=None, shifts=None, smoothing: bool = False):
    """Negatives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``ops``, ``norms``, ``tau32``, ``gamma32``, ``has_margin``: as :func:`.forward.forward_stats`;
    ``stats``: its row statistics, ``g`` the upstream gradient of each row.
    ``key_side = (stats, g)`` of the transposed direction makes it symmetric (M = N, offset 0).
    ``thr32`` (false-negative masking: a 1-element float32 threshold, or None) with ``shifts``
    = (ε/n_i of the rows, of the key side's rows; ``epilogue.smoothing_shift``): the masked
    entries get no dS, the kept ones dS_ik = g_i (P_ik − ε/n_i) (the shifts read only with
    ``smoothing``, ε ≠ 0).
    dS is materialised one R × C chunk at a time (``cfg.chunk_shape``: 4·R·C ≤
    ``cfg.BWD_WORKSPACE_BYTES``, e.g. 8192 × 8192 for 256 MiB; with ``key_side`` one square chunk
    pair at a time, W_ab and W_ba from the same tile pairs, ``_symmetric_shares``) and multiplied by the features in
    torch GEMMs (two per chunk for float32 and bf16 features, four, head and tail, for fp16; see
    the module docstring), each accumulated in float32 over the chunks (``torch.addmm``).
    Chunks run in a fixed order and cuBLAS runs a given GEMM the same way every time on one
    GPU (no split-K atomics in its default mode; with several streams, set
    CUBLAS_WORKSPACE_CONFIG=:4096:8 as ``torch.use_deterministic_algorithms`` asks):
    deterministic.
    """
    q, k, _, _ = ops
    round16 = q.dtype in (torch.bfloat16, torch.float16)
    tail = q.dtype == torch.float16  # bf16: one float16 W against float16 copies of the features
    nll = epilogue.row_nll(stats)
    prec = cfg.dot_precision(q.dtype, precision)
    masked = thr32 is not None
    shift = masked and smoothing
    # the kernels' masking pointers: read only with MASK (τ's tensor stands in for them otherwise)
    masking = (thr32, shifts[0], shifts[1]) if masked else (tau32, tau32, tau32)
    if key_side is None:
        (d_q, d_k), = _chunked_shares(ops, norms, ((q, k, norms[0], norms[1]),), stats.pos, nll, g, tau32, gamma32,
                                      has_margin, offset, prec, masking, masked, shift)
        return d_q, d_k
    nll_c, g_c = epilogue.row_nll(key_side[0]), key_side[1]
    s = (masking[1], masking[2]) if shift else (None, None)
    a, b, rq, rk, f16 = _w_scales(q, k, norms[0], norms[1], ((g, nll, s[0]), (g_c, nll_c, s[1])), round16, tail)
    w_dtype = torch.float16 if round16 else torch.float32
    d_q, d_k, rho, sigma = _symmetric_shares(ops, norms, stats.pos, nll, g, tau32, gamma32, nll_c, g_c, a, b, f16,
                                             has_margin, prec, w_dtype, round16, tail, masking, masked, shift)
    d_q.div_(rq[:, None])
    d_k.div_(rk[:, None])
    if round16:
        epilogue.add_rounding_compensation(d_q, d_k, rho, sigma, q, k, norms[0], norms[1], offset)
    return d_q, d_k


def rank_shares(ops, norms, stats, g, tau32, gamma32, has_margin: bool, offset: int, precision, thr32=None,
                shifts=None, smoothing: bool = False):
    """A distributed rank's two directions' negatives' shares (times τ), float32:
    ((dL/dv̂ (M, D), dL/dt̂_all (N, D)) of i2t, (dL/dt̂ (M, D), dL/dv̂_all (N, D)) of t2i).

    ``ops`` = (v, t, v_all, t_all) and ``norms`` as :func:`.forward.rank_stats`, ``stats`` = (i2t,
    t2i) its statistics of each direction's M rows, ``g`` (M) the rows' upstream gradient (each
    direction's); ``thr32``, ``shifts`` (each direction's ε/n_i), ``smoothing``: false-negative
    masking as :func:`backward_shares`.
    One ``_dscore_rank_kernel`` launch per chunk writes both directions' W (the margin's G formed
    once per tile), then each direction's GEMMs run as :func:`backward_shares` runs them, on the
    same chunks: each direction's shares are the directional op's to the bit (the tiles' own
    shapes aside)."""
    v, t, v_all, t_all = ops
    dirs = ((v, t_all, norms[0], norms[3]), (t, v_all, norms[1], norms[2]))
    prec = cfg.dot_precision(v.dtype, precision)
    # per direction, as its directional op forms them (torch's vectorised softplus rounds a loop's tail apart)
    pos, nll = (torch.cat(pair) for pair in zip(*((s.pos, epilogue.row_nll(s)) for s in stats)))
    masked = thr32 is not None
    masking = (thr32, torch.cat(shifts)) if masked else (tau32, tau32)
    return _chunked_shares(ops, norms, dirs, pos, nll, torch.cat((g, g)), tau32, gamma32, has_margin, offset, prec,
                           masking, masked, masked and smoothing)


def _chunked_shares(ops, norms, dirs, pos, nll, g, tau32, gamma32, has_margin: bool, offset: int, prec: str,
                    masking, masked: bool, shift: bool):
    """The chunk walk of the directional op (one direction, ``_dscore_kernel``) and of a rank's
    pair (two, ``_dscore_rank_kernel``): ``dirs`` holds each direction's (rows q (M, D), columns
    k (N, D), their inverse norms); ``pos``, ``nll``, ``g`` hold M lines per direction; ``masking``
    the kernel's masking pointers (threshold, shifts; τ stands in without MASK), ``masked`` and
    ``shift`` its MASK and SHIFT. Chunks of
    ``cfg.chunk_shape(M, N)``, row blocks outer, each chunk's buffers holding every direction's W;
    per direction two GEMMs a chunk (four with fp16's tail), accumulated in chunk order.
    Returns each direction's (d_q, d_k), scaled back, with the rounding compensation."""
    q0 = dirs[0][0]
    m, d = q0.shape
    n = dirs[0][1].shape[0]
    dev = q0.device
    round16 = q0.dtype in (torch.bfloat16, torch.float16)
    tail = q0.dtype == torch.float16
    w_dtype = torch.float16 if round16 else torch.float32
    lines = [slice(i * m, (i + 1) * m) for i in range(len(dirs))]  # each direction's rows' bound on |dS|
    scales = [_w_scales(*d, ((g[sl], nll[sl], masking[1][sl] if shift else None),), round16, tail)
              for d, sl in zip(dirs, lines)]
    a = scales[0][0] if len(dirs) == 1 else torch.cat([sc[0] for sc in scales])
    b = scales[0][1] if len(dirs) == 1 else torch.cat([sc[1] for sc in scales])
    rows, cols = cfg.chunk_shape(m, n)
    n_dirs, col_chunks = len(dirs), triton.cdiv(n, cols)
    d_q_parts = [[] for _ in dirs]
    d_k_parts = [[None] * col_chunks for _ in dirs]
    rho_parts = [[] for _ in dirs]
    sigma_parts = [[None] * col_chunks for _ in dirs]
    # the GEMMs accumulate in float32 whatever autocast region the backward runs in
    with ieee_float32(dev), autocast_disabled(dev):
        for row0 in range(0, m, rows):
            row_end = min(row0 + rows, m)
            acc_q, rho = [None] * n_dirs, [None] * n_dirs
            q_rows = []
            for (q, _, _, _), sc in zip(dirs, scales):
                q_rows.append(_rows(q, row0, row_end) if sc[4] is None else _to_f16(_rows(q, row0, row_end),
                                                                                     sc[4][0][row0:row_end]))
            for j, col0 in enumerate(range(0, n, cols)):
                col_end = min(col0 + cols, n)
                r, c = row_end - row0, col_end - col0
                sr, sc_ = triton.cdiv(r, RESIDUAL_SLICE), triton.cdiv(c, RESIDUAL_SLICE)
                # a fresh workspace per chunk, the previous one freed first (the allocator hands its
                # memory back): never a view into a shared buffer, which a traced operator would
                # write through a scatter. Direction i's W at i·R·C.
                # each direction's row slice sums (sc, r) and column slice sums (sr, c)
                w, lo, res_r, res_c = _w_buffers(n_dirs * r * c, n_dirs * sc_ * r, n_dirs * sr * c, w_dtype, round16,
                                                 tail, dev)
                consts = dict(HAS_MARGIN=has_margin, MASK=masked, SHIFT=shift, PREC=prec,
                              ROUND16="fp16" if round16 else "", TAIL=tail, SLICE=RESIDUAL_SLICE,
                              BLOCK_K=cfg.score_block_k(q0.element_size()))
                if n_dirs == 1:
                    args = (*ops, *strides(*ops), *norms, pos, nll, g, tau32, gamma32, nll, g, a, b, *masking, w, lo,
                            c, 1, res_r, r, res_c, c, row0, row_end, col0, col_end, d, offset)
                    name, consts = "dscore", dict(consts, SYMMETRIC=False)
                else:
                    second = (r * c, sc_ * r, sr * c) if round16 else (r * c, 0, 0)
                    args = (*ops, *strides(*ops), *norms, pos, nll, g, tau32, gamma32, a, b, *masking, w, lo, res_r,
                            res_c, *second, m, n, row0, row_end, col0, col_end, d, offset)
                    name = "dscore_rank"
                launch(lambda tuned, name=name: _kernel(name, tuned), name, q0.element_size(),
                       lambda t_, r=r, c=c: (triton.cdiv(r, t_["BLOCK_M"]), triton.cdiv(c, t_["BLOCK_N"])),
                       args, **consts)
                for i, (_, k, _, _) in enumerate(dirs):
                    k_cols = _rows(k, col0, col_end)
                    if scales[i][4] is not None:
                        k_cols = _to_f16(k_cols, scales[i][4][1][col0:col_end])  # this column block's float16 copy
                    for buf in [w, lo] if tail else [w]:  # the head, then the tail's products
                        w_i = buf[i * r * c:(i + 1) * r * c].view(r, c)
                        acc_q[i] = _mm(w_i, k_cols, acc_q[i])
                        d_k_parts[i][j] = _mm(w_i.t(), q_rows[i], d_k_parts[i][j])
                    if round16:  # slice sums merged in a fixed order, then over chunks in chunk order
                        s = res_r[i * sc_ * r:(i + 1) * sc_ * r].view(sc_, r).sum(0)
                        rho[i] = s if rho[i] is None else rho[i] + s
                        s = res_c[i * sr * c:(i + 1) * sr * c].view(sr, c).sum(0)
                        sigma_parts[i][j] = s if sigma_parts[i][j] is None else sigma_parts[i][j] + s
                    del k_cols, buf, w_i
                del w, lo, res_r, res_c, args  # one chunk alive at a time
            del q_rows
            for i in range(n_dirs):
                d_q_parts[i].append(acc_q[i])
                rho_parts[i].append(rho[i])
    out = []
    for i, (q, k, r_q, r_k) in enumerate(dirs):
        d_q = _cat(d_q_parts[i]).div_(scales[i][2][:, None])
        d_k = _cat(d_k_parts[i]).div_(scales[i][3][:, None])
        if round16:
            epilogue.add_rounding_compensation(d_q, d_k, _cat(rho_parts[i]), _cat(sigma_parts[i]), q, k, r_q, r_k,
                                               offset)
        out.append((d_q, d_k))
    return out


def _w_buffers(w_len: int, res_r_len: int, res_c_len: int, w_dtype, round16: bool, tail: bool, dev):
    """One chunk's fresh dS buffers (w, lo, res_r, res_c): W, fp16's tail (``w`` itself without a
    tail), the float32 row and column residual slice sums; without ROUND16 only W, which stands
    in for the pointers the kernel does not write."""
    w = torch.empty(w_len, device=dev, dtype=w_dtype)
    if not round16:
        return w, w, w, w
    lo = torch.empty(w.shape, device=dev, dtype=w_dtype) if tail else w
    return (w, lo, torch.empty(res_r_len, device=dev, dtype=torch.float32),
            torch.empty(res_c_len, device=dev, dtype=torch.float32))


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _symmetric_shares(ops, norms, pos, nll, g, tau32, gamma32, nll_c, g_c, a, b, f16_scales, has_margin, prec,
                      w_dtype, round16, tail, masking, masked, shift):
    """The symmetric loss's shares over chunk pairs (``_dscore_pair_kernel``): square chunks
    (``cfg.chunk_shape(square=True)``), pairs (a, b ≥ a) in order; a pair b > a writes W_ab and
    W_ba from the same tile pairs, a diagonal pair W_aa. Then the GEMMs of each buffer (as
    ``backward_shares``), accumulated per chunk in pair order. Returns the unscaled float32
    (d_q, d_k) and the residual sums (ρ, σ) (None without 16-bit features)."""
    v, t = ops[0], ops[1]
    n, d = v.shape
    rows, _ = cfg.chunk_shape(n, n, square=True)
    bounds = [(c0, min(c0 + rows, n)) for c0 in range(0, n, rows)]
    d_q, d_k = [None] * len(bounds), [None] * len(bounds)
    rho, sigma = [None] * len(bounds), [None] * len(bounds)
    dev = v.device

    def copies(start, end):  # the features of one chunk: float16 copies for bf16 (exact, see _f16_scales)
        vr, tr = _rows(v, start, end), _rows(t, start, end)
        if f16_scales is None:
            return vr, tr
        return _to_f16(vr, f16_scales[0][start:end]), _to_f16(tr, f16_scales[1][start:end])

    def add(parts, i, x):
        parts[i] = x if parts[i] is None else parts[i] + x

    with ieee_float32(dev), autocast_disabled(dev):
        for ia, (row0, row_end) in enumerate(bounds):
            q_a, k_a = copies(row0, row_end)
            r = row_end - row0
            for ib in range(ia, len(bounds)):
                col0, col_end = bounds[ib]
                c = col_end - col0
                pair = ib > ia
                q_b, k_b = copies(col0, col_end) if pair else (q_a, k_a)
                # fresh buffers per chunk pair (the previous ones freed first): W_ab then W_ba, flat
                sr, sc = (triton.cdiv(r, RESIDUAL_SLICE), triton.cdiv(c, RESIDUAL_SLICE)) if round16 else (0, 0)
                # ab's row sums (sc, r) then ba's (sr, c); ab's column sums (sr, c) then ba's (sc, r)
                w, lo, res_r, res_c = _w_buffers((2 if pair else 1) * r * c, sc * r + (sr * c if pair else 0),
                                                 sr * c + (sc * r if pair else 0), w_dtype, round16, tail, dev)
                mirror = (r * c, sc * r, sr * c) if pair else (0, 0, 0)
                args = (v, t, *strides(v, t), norms[0], norms[1], pos, nll, g, tau32, gamma32, nll_c, g_c, a, b,
                        *masking, w, lo, res_r, res_c, *mirror, row0, row_end, col0, col_end, d)
                launch(lambda tuned: _kernel("dscore_pair", tuned), "dscore_pair", v.element_size(),
                       lambda tl_, r=r, c=c: (triton.cdiv(r, tl_["BLOCK_M"]), triton.cdiv(c, tl_["BLOCK_N"])),
                       args, HAS_MARGIN=has_margin, MASK=masked, SHIFT=shift, PREC=prec,
                       ROUND16="fp16" if round16 else "", TAIL=tail, SLICE=RESIDUAL_SLICE,
                       BLOCK_K=cfg.score_block_k(v.element_size()))
                for buf in [w, lo] if tail else [w]:  # W_ab (and its tail): rows a against columns b
                    d_q[ia] = _mm(buf[:r * c].view(r, c), k_b, d_q[ia])
                    d_k[ib] = _mm(buf[:r * c].view(r, c).t(), q_a, d_k[ib])
                    if pair:  # W_ba: rows b against columns a
                        d_q[ib] = _mm(buf[r * c:].view(c, r), k_a, d_q[ib])
                        d_k[ia] = _mm(buf[r * c:].view(c, r).t(), q_b, d_k[ia])
                del buf
                if round16:  # slice sums merged in a fixed order, then over pairs in pair order
                    add(rho, ia, res_r[:sc * r].view(sc, r).sum(0))
                    add(sigma, ib, res_c[:sr * c].view(sr, c).sum(0))
                    if pair:
                        add(rho, ib, res_r[sc * r:].view(sr, c).sum(0))
                        add(sigma, ia, res_c[sr * c:].view(sc, r).sum(0))
                del w, lo, res_r, res_c, args, q_b, k_b  # one chunk pair alive at a time
            del q_a, k_a
    return _cat(d_q), _cat(d_k), (_cat(rho) if round16 else None), (_cat(sigma) if round16 else None)
