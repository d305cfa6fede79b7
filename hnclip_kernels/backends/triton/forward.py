"""Forward: the logits' row (and column) statistics in one walk over the tiles of Z.

``_fwd_kernel`` (a rank's directional op) folds each tile it forms into partial summaries of its
rows over one column split. ``_fwd_pair_kernel`` (the single-process loss) walks tile pairs: a
tile right of the diagonal and its mirror from 3 products sharing the margin's G_IJ, feeding
the rows' and columns' statistics; ``_fold_kernel`` folds each slab's partials into running
summaries. ``_merge_kernel`` combines the partials of each line in a fixed order (no atomics).
``forward_stats`` launches them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import epilogue
from . import config as cfg
from .launch import launch, strides, wrap_triton
from .tiles import (
    _block,
    _combine,
    _count,
    _gap_stats,
    _kept,
    _load2,
    _load_count,
    _load_partial,
    _load_scalars,
    _logits_masked_tile,
    _merge_stats,
    _pair_masked_tiles,
    _rank_tiles,
    _store_count,
    _store_partial,
    _tile_stats,
)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, tau_ptr, gamma_ptr, thr_ptr,
    row_part_ptr,
    M, N, D, offset, cols_per_split, N_BUCKET,
    SMOOTHING: tl.constexpr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One direction's walk over the tiles of Z (a rank's directional op): row statistics.

    For the gaps d = Z − Z_pos over the negatives, a row's summary is (max, Σexp, Σexp·d,
    Σd) over this program's column split. Grid: (row blocks, column splits).

    Features (raw, any float dtype, row-major or strided):
        q_ptr (M, D) queries, k_ptr (N, D) keys, mq_ptr (M, D) / mk_ptr (N, D) the margin
        factors (read only with HAS_MARGIN); their strides ``stride_<matrix><axis>``
        (m, n: rows; d: features).
    Per-row inputs (float32):
        rq_ptr (M), rk_ptr (N), r_mq_ptr (M), r_mk_ptr (N): inverse row norms;
        pos_ptr (M): the positive logit Z[i, offset + i]; tau_ptr, gamma_ptr: 1-element τ, γ;
        thr_ptr: the false-negative masking block (``ops._threshold_block``; read with MASK).
    Outputs (float32, planes = 3 + SMOOTHING + MASK: max, Σexp, Σexp·d[, Σd][, #kept]):
        row_part_ptr (splits, planes, M): each split's summary of each row (with MASK over the
        kept negatives only, and their count).
    Shapes and scalars: M, N, D; offset (row i's positive is column offset + i);
        cols_per_split (columns per program along axis 1,
        a multiple of BLOCK_N); N_BUCKET (``config.n_bucket(N)``: read by nothing, a key of the
        autotuner).
    Constexprs: SMOOTHING (label smoothing: also Σd), HAS_MARGIN (γ ≠ 0), MASK (false-negative
        masking: an entry whose caption cosine m̂_q·m̂_k ≥ thr is no negative), PREC
        (``precision._dot``), BLOCK_M × BLOCK_N tiles, BLOCK_K the reduction step over D.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    inv_tau, gamma, thr = _load_scalars(tau_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    q = (q_ptr, stride_qm, stride_qd)
    k = (k_ptr, stride_kn, stride_kd)
    margin_q = (mq_ptr, stride_mqm, stride_mqd)
    margin_k = (mk_ptr, stride_mkn, stride_mkd)
    offs_m, mask_m = _block(pid_m * BLOCK_M, M, BLOCK_M)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M,), tl.float32)
    run_wsum = tl.zeros((BLOCK_M,), tl.float32)
    run_dsum = tl.zeros((BLOCK_M,), tl.float32)
    run_kept = tl.zeros((BLOCK_M,), tl.float32)
    n_start = pid_s * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rk, r_mk = _load2(rk_ptr, r_mk_ptr, offs_n, mask_n)
        z = _logits_masked_tile(q, k, margin_q, margin_k, (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                                D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        if MASK:
            neg = neg & _kept(z)
            run_kept += _count(neg, 1)
        d = tl.where(neg, z - pos[:, None], float("-inf"))
        t_max, t_sum, t_wsum, t_dsum = _tile_stats(d, neg, 1)
        run_max, run_sum, run_wsum = _combine((run_max, run_sum, run_wsum), (t_max, t_sum, t_wsum))
        run_dsum += t_dsum
    part = row_part_ptr + pid_s.to(tl.int64) * (3 + SMOOTHING + MASK) * M
    _store_partial(part, M, offs_m, mask_m, (run_max, run_sum, run_wsum, run_dsum), SMOOTHING)
    if MASK:
        _store_count(part, M, offs_m, mask_m, run_kept, SMOOTHING)


@triton.jit
def _fwd_rank_kernel(
    v_ptr, t_ptr, va_ptr, ta_ptr,
    stride_vm, stride_vd, stride_tm, stride_td, stride_van, stride_vad, stride_tan, stride_tad,
    rv_ptr, rt_ptr, rva_ptr, rta_ptr, pos_ptr, tau_ptr, gamma_ptr, thr_ptr,
    row_part_ptr,
    M, N, D, offset, cols_per_split, N_BUCKET,
    SMOOTHING: tl.constexpr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A distributed rank's two directions in one walk: the row statistics of i2t
    (Z = (v̂ t̂_allᵀ + γ G) / τ) and t2i (Z' = (t̂ v̂_allᵀ + γ G) / τ), G = t̂ t̂_allᵀ formed once
    per tile (``tiles._rank_tiles``: 3 products for 2 tiles). Grid: (row blocks, column splits),
    as ``_fwd_kernel``; each direction's summaries are ``_fwd_kernel``'s to the bit (on the same
    tiles).

    Features (raw, any float dtype, strided): v_ptr, t_ptr (M, D) the local images and texts,
        va_ptr, ta_ptr (N, D) the gathered ones; strides ``stride_<matrix><axis>``.
    Per-row inputs (float32): rv_ptr, rt_ptr (M), rva_ptr, rta_ptr (N) inverse norms;
        pos_ptr (2M): the positives, i2t rows then t2i rows (Z[i, offset + i]); tau_ptr,
        gamma_ptr 1-element τ, γ; thr_ptr the false-negative masking block (read with MASK).
    Outputs (float32, planes = 3 + SMOOTHING + MASK): row_part_ptr (splits, planes, 2M): line i
        the i2t row i, line M + i the t2i row i (with MASK over the kept negatives, and their
        count: a pair masked in i2t is masked in t2i too, the same caption cosine).
    Scalars and constexprs: as ``_fwd_kernel``.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    inv_tau, gamma, thr = _load_scalars(tau_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    v = (v_ptr, stride_vm, stride_vd)
    t = (t_ptr, stride_tm, stride_td)
    v_all = (va_ptr, stride_van, stride_vad)
    t_all = (ta_ptr, stride_tan, stride_tad)
    offs_m, mask_m = _block(pid_m * BLOCK_M, M, BLOCK_M)
    rv_m, rt_m = _load2(rv_ptr, rt_ptr, offs_m, mask_m)
    pos_i2t, pos_t2i = _load2(pos_ptr, pos_ptr + M, offs_m, mask_m)
    i2t = (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
           tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.float32))
    t2i = i2t
    run_kept = tl.zeros((BLOCK_M,), tl.float32)
    n_start = pid_s * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rv_n, rt_n = _load2(rva_ptr, rta_ptr, offs_n, mask_n)
        z, zt = _rank_tiles(v, t, v_all, t_all, (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                            D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        if MASK:
            neg = neg & _kept(z)
            run_kept += _count(neg, 1)
        i2t = _merge_stats(i2t, _gap_stats(z, pos_i2t, neg, 1))
        t2i = _merge_stats(t2i, _gap_stats(zt, pos_t2i, neg, 1))
    part = row_part_ptr + pid_s.to(tl.int64) * (3 + SMOOTHING + MASK) * 2 * M
    _store_partial(part, 2 * M, offs_m, mask_m, i2t, SMOOTHING)
    _store_partial(part, 2 * M, M + offs_m, mask_m, t2i, SMOOTHING)
    if MASK:
        _store_count(part, 2 * M, offs_m, mask_m, run_kept, SMOOTHING)
        _store_count(part, 2 * M, M + offs_m, mask_m, run_kept, SMOOTHING)


@triton.jit
def _fwd_pair_kernel(
    v_ptr, t_ptr, stride_vm, stride_vd, stride_tm, stride_td,
    rv_ptr, rt_ptr, pos_ptr, tau_ptr, gamma_ptr, thr_ptr,
    row_part_ptr, col_part_ptr,
    N, D, block0, col0, cols_per_split, slab_rows, N_BUCKET,
    SMOOTHING: tl.constexpr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The symmetric loss's walk over tile pairs: Z = (v̂ t̂ᵀ + γ t̂ t̂ᵀ) / τ (N × N), the gaps
    d = Z − Z_pos of every row and every column summarised as (max, Σexp, Σexp·d, Σd).

    Program (b, s) takes row block I = block0 + b (BLOCK_M rows) and walks the column tiles
    (BLOCK_N wide) of split s that lie at or right of I's diagonal super-tile (columns
    I·BLOCK_M on): the diagonal super-tile's tiles Z_IJ are formed alone (2 products each); every
    tile right of it with its mirror Z_JIᵀ (``_pair_tiles``: 3 products for 2 tiles). So each
    entry of Z is formed once: Z[i, j] with block(i) < block(j) as Z_IJ, with block(i) > block(j)
    as the mirror of the program of block(j). Z_IJ serves the rows I (registers) and the columns
    J (partials); Z_JIᵀ serves the rows J (partials, a reduction over axis 0) and the columns I
    (registers, a reduction over axis 1). Positives Z_ii lie in the diagonal super-tiles only.

    Lines: line c < N stands for column c's statistics, line N + r for row r's.
    Inputs: v_ptr, t_ptr (N, D) features (strides ``stride_<v|t><m|d>``), rv_ptr, rt_ptr (N)
        float32 inverse norms, pos_ptr (N) the positives Z_ii, tau_ptr/gamma_ptr 1-element τ, γ,
        thr_ptr the false-negative masking block (read with MASK: the entries whose caption cosine
        is ≥ it leave their row's and their column's summaries, which then count their kept
        entries in one more plane).
    Outputs (float32, planes = 3 + SMOOTHING + MASK):
        col_part_ptr (slab row blocks, planes, 2N): row block b's summary of the columns
        c ≥ (block0 + b)·BLOCK_M (lines c) and of the rows c ≥ (block0 + b + 1)·BLOCK_M (lines
        N + c) its tiles reach (the rest unwritten; the fold skips them);
        row_part_ptr (splits, planes, 2·slab_rows): split s's summary of the slab's own lines,
        local line l < slab_rows for column col0 + l, slab_rows + l for row col0 + l.
    Scalars: N, D; block0 (the slab's first row block), col0 = block0·BLOCK_M (the slab's first
        row and the first column its programs reach), cols_per_split (a multiple of BLOCK_N;
        split s walks columns col0 + s·cols_per_split on), slab_rows (the slab's rows, within N),
        N_BUCKET (an autotune key only).
    Constexprs: as ``_fwd_kernel``; BLOCK_N divides BLOCK_M.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    planes = 3 + SMOOTHING + MASK
    inv_tau, gamma, thr = _load_scalars(tau_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    v = (v_ptr, stride_vm, stride_vd)
    t = (t_ptr, stride_tm, stride_td)
    row0 = (block0 + pid_b) * BLOCK_M
    offs_m, mask_m = _block(row0, N, BLOCK_M)
    rv_m, rt_m = _load2(rv_ptr, rt_ptr, offs_m, mask_m)
    pos_m = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    rows = (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.float32))
    cols = rows
    rows_kept = tl.zeros((BLOCK_M,), tl.float32)
    cols_kept = tl.zeros((BLOCK_M,), tl.float32)
    n_start = col0 + pid_s * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    part = col_part_ptr + pid_b.to(tl.int64) * planes * 2 * N
    # the diagonal super-tile: its tiles hold the positives and are formed once each
    for n0 in range(tl.maximum(n_start, row0), tl.minimum(n_end, row0 + BLOCK_M), BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rt_n = tl.load(rt_ptr + offs_n, mask=mask_n, other=0.0)
        pos_n = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
        z = _logits_masked_tile(v, t, t, t, (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rt_n, rt_n),
                                D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None])
        if MASK:
            neg = neg & _kept(z)
            rows_kept += _count(neg, 1)
            _store_count(part, 2 * N, offs_n, mask_n, _count(neg, 0), SMOOTHING)
        rows = _merge_stats(rows, _gap_stats(z, pos_m, neg, 1))
        _store_partial(part, 2 * N, offs_n, mask_n, _gap_stats(z, pos_n, neg, 0), SMOOTHING)
    # right of it: tile pairs (no positives there)
    for n0 in range(tl.maximum(n_start, row0 + BLOCK_M), n_end, BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rv_n, rt_n = _load2(rv_ptr, rt_ptr, offs_n, mask_n)
        pos_n = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
        z, zm = _pair_masked_tiles(v, t, (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                                   D, gamma, inv_tau, thr, HAS_MARGIN, MASK, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :]
        if MASK:  # one caption pair for z and zm: the same entries leave both
            neg = neg & _kept(z)
            rows_kept += _count(neg, 1)  # rows I (in z)
            cols_kept += _count(neg, 1)  # columns I (in zm)
            _store_count(part, 2 * N, offs_n, mask_n, _count(neg, 0), SMOOTHING)  # columns J
            _store_count(part, 2 * N, N + offs_n, mask_n, _count(neg, 0), SMOOTHING)  # rows J
        rows = _merge_stats(rows, _gap_stats(z, pos_m, neg, 1))  # rows I
        _store_partial(part, 2 * N, offs_n, mask_n, _gap_stats(z, pos_n, neg, 0), SMOOTHING)  # columns J
        cols = _merge_stats(cols, _gap_stats(zm, pos_m, neg, 1))  # columns I
        _store_partial(part, 2 * N, N + offs_n, mask_n, _gap_stats(zm, pos_n, neg, 0), SMOOTHING)  # rows J
    own = row_part_ptr + pid_s.to(tl.int64) * planes * 2 * slab_rows
    _store_partial(own, 2 * slab_rows, offs_m - col0, mask_m, cols, SMOOTHING)
    _store_partial(own, 2 * slab_rows, slab_rows + offs_m - col0, mask_m, rows, SMOOTHING)
    if MASK:
        _store_count(own, 2 * slab_rows, offs_m - col0, mask_m, cols_kept, SMOOTHING)
        _store_count(own, 2 * slab_rows, slab_rows + offs_m - col0, mask_m, rows_kept, SMOOTHING)


@triton.jit
def _fold_kernel(part_ptr, n_parts, H, acc_ptr, N, acc0, block0, block_rows, FIRST: tl.constexpr,
                 SMOOTHING: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Fold ``n_parts`` summaries of 2H lines into the running summaries of 2N lines, in order.
    Grid: ⌈2H / BLOCK⌉.

    part_ptr (n_parts, planes, 2H) float32 (as ``_fwd_pair_kernel`` stores them): local line
    l < H is line acc0 + l of acc_ptr, line H + l is line N + acc0 + l; acc_ptr (planes, 2N)
    float32, the running summaries (line c: column c, line N + c: row c), read (unless FIRST)
    and written. Part p covers only the lines of columns c ≥ (block0 + p)·block_rows and of rows
    c ≥ (block0 + p + 1)·block_rows (those its row block's tiles reach; the others are left out:
    the empty summary, which changes nothing to the bit). planes =
    3 + SMOOTHING + MASK (MASK: the kept-negative counts, summed). No line is touched by two
    programs: no atomics.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < 2 * H
    upper = offs >= H
    c = acc0 + tl.where(upper, offs - H, offs)
    line = c + tl.where(upper, N, 0)
    acc = _load_partial(acc_ptr, 2 * N, line, mask & (not FIRST), SMOOTHING)
    kept = tl.zeros((BLOCK,), tl.float32)
    if MASK:
        kept = _load_count(acc_ptr, 2 * N, line, mask & (not FIRST), SMOOTHING)
    base = part_ptr
    for p in range(0, n_parts):
        covered = mask & (c >= (block0 + p + upper.to(tl.int32)) * block_rows)
        acc = _merge_stats(acc, _load_partial(base, 2 * H, offs, covered, SMOOTHING))
        if MASK:
            kept += _load_count(base, 2 * H, offs, covered, SMOOTHING)
        base += (3 + SMOOTHING + MASK) * 2 * H  # pointer steps: no int32 product overflows
    _store_partial(acc_ptr, 2 * N, line, mask, acc, SMOOTHING)
    if MASK:
        _store_count(acc_ptr, 2 * N, line, mask, kept, SMOOTHING)


@triton.jit
def _merge_kernel(part_ptr, n_parts, L, line0, plane_stride, delta_ptr, mean_neg_ptr, dsum_ptr, kept_ptr,
                  SMOOTHING: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Combine ``n_parts`` summaries of each of L lines, in order. Grid: ⌈L / BLOCK⌉.

    Input: part_ptr float32, n_parts summaries of planes = 3 + SMOOTHING planes, ``plane_stride``
        entries apart (a part: planes · plane_stride), line l of a plane at line0 + l: the row
        partials (n_parts, planes, L) of ``_fwd_kernel`` (line0 0, plane_stride L), or one half of
        the symmetric walk's summaries (1, planes, 2N) (line0 0 for the columns, N for the rows).
    Outputs (L each, float32): delta_ptr = LSE(d) (−inf without negatives), mean_neg_ptr =
        E_softmax[d], dsum_ptr = Σd (0 without SMOOTHING); with MASK kept_ptr = the kept negatives.
    Constexprs: SMOOTHING (the partials carry Σd), MASK (and the counts), BLOCK lines per program.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    sum_exp = tl.zeros((BLOCK,), tl.float32)
    wsum = tl.zeros((BLOCK,), tl.float32)
    dsum = tl.zeros((BLOCK,), tl.float32)
    kept = tl.zeros((BLOCK,), tl.float32)
    planes = 3 + SMOOTHING + MASK
    base = part_ptr + line0 + offs
    for _ in range(0, n_parts):
        part = (tl.load(base, mask=mask, other=0.0), tl.load(base + plane_stride, mask=mask, other=0.0),
                tl.load(base + 2 * plane_stride, mask=mask, other=0.0))
        top, sum_exp, wsum = _combine((top, sum_exp, wsum), part)
        if SMOOTHING:
            dsum += tl.load(base + 3 * plane_stride, mask=mask, other=0.0)
        if MASK:
            kept += tl.load(base + (3 + SMOOTHING) * plane_stride, mask=mask, other=0.0)
        base += planes * plane_stride  # pointer steps: the workspace passes 2^31 entries near N = 2^18
    has_neg = sum_exp > 0.0
    delta = tl.where(has_neg, top + tl.log(tl.where(has_neg, sum_exp, 1.0)), float("-inf"))
    delta = tl.where(sum_exp != sum_exp, sum_exp, delta)  # a NaN anywhere in the line stays visible in the loss
    tl.store(delta_ptr + offs, delta, mask=mask)
    tl.store(mean_neg_ptr + offs, tl.where(has_neg, wsum / tl.where(has_neg, sum_exp, 1.0), 0.0), mask=mask)
    tl.store(dsum_ptr + offs, dsum, mask=mask)
    if MASK:
        tl.store(kept_ptr + offs, kept, mask=mask)


# autotuned twin (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
# key: D, the N bucket (``cfg.n_bucket``), HAS_MARGIN, PREC, SMOOTHING (and, through
# the pruner, the operand width); every rerun rewrites the partials whole, so no restore_value
_fwd_tuned = triton.autotune(cfg.all_candidates("fwd"), key=["D", "N_BUCKET", "HAS_MARGIN", "MASK", "PREC", "SMOOTHING"],
                             prune_configs_by={"early_config_prune": cfg.pruner("fwd", "q_ptr")})(_fwd_kernel)
# a rank's two directions: key D, N bucket, HAS_MARGIN, MASK, PREC, SMOOTHING
_fwd_rank_tuned = triton.autotune(cfg.all_candidates("rank"), key=["D", "N_BUCKET", "HAS_MARGIN", "MASK", "PREC", "SMOOTHING"],
                                  prune_configs_by={"early_config_prune": cfg.pruner("rank", "v_ptr")})(_fwd_rank_kernel)
# the symmetric walk's twin: key D, N bucket, HAS_MARGIN, PREC, SMOOTHING (the same candidates)
_fwd_pair_tuned = triton.autotune(cfg.all_candidates("pair"),
                                  key=["D", "N_BUCKET", "HAS_MARGIN", "MASK", "PREC", "SMOOTHING"],
                                  prune_configs_by={"early_config_prune": cfg.pruner("pair", "v_ptr")})(_fwd_pair_kernel)


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("fwd", "rank", "pair", "fold", "merge"), its autotuned twin when ``tuned``, through
    ``wrap_triton``; spelled out kernel by kernel (see :func:`.launch.launch`)."""
    if name == "fwd":
        return wrap_triton(_fwd_tuned) if tuned else wrap_triton(_fwd_kernel)
    if name == "rank":
        return wrap_triton(_fwd_rank_tuned) if tuned else wrap_triton(_fwd_rank_kernel)
    if name == "pair":
        return wrap_triton(_fwd_pair_tuned) if tuned else wrap_triton(_fwd_pair_kernel)
    if name == "fold":
        return wrap_triton(_fold_kernel)
    return wrap_triton(_merge_kernel)


# ------------------------------------------------------------------ host launcher
def _merge(part: torch.Tensor, smoothing: bool, line0: int = 0, length: int | None = None, masked: bool = False):
    """(delta, mean_neg, dsum, kept) of lines line0 … line0 + length of the partial summaries
    (n_parts, planes, L) (default: all L): separate tensors (an operator's outputs may not alias
    each other); ``kept`` the kept-negative counts with ``masked``, else None."""
    n_parts, _, plane = part.shape
    length = plane if length is None else length
    delta, mean_neg, dsum = (torch.empty(length, device=part.device, dtype=torch.float32) for _ in range(3))
    kept = torch.empty(length, device=part.device, dtype=torch.float32) if masked else None
    block = 128 if cfg.launch_mode() != "interpret" else 64
    _kernel("merge", False)[(triton.cdiv(length, block),)](part, n_parts, length, line0, plane, delta, mean_neg,
                                                           dsum, kept if masked else dsum, SMOOTHING=smoothing,
                                                           MASK=masked, BLOCK=block)
    return delta, mean_neg, dsum, kept


def _symmetric_stats(ops, norms, pos, tau32, gamma32, has_margin: bool, smoothing: bool, precision, thr32=None):
    """(rows, columns) ``epilogue.RowStats`` of the symmetric loss from ``_fwd_pair_kernel``'s
    walk over tile pairs (see ``forward_stats``)."""
    v, t = ops[0], ops[1]
    n, d = v.shape
    width = v.element_size()
    block_m = cfg.fwd_block_m(width)
    row_blocks, slab, splits, _ = cfg.fwd_grid(n, n, width, True, v.device)
    masked = thr32 is not None
    planes = (4 if smoothing else 3) + masked
    # running summaries: line c column c, line N + c row c
    acc = torch.empty(1, planes, 2 * n, device=v.device, dtype=torch.float32)
    fold_block = 128 if cfg.launch_mode() != "interpret" else 64
    fold = _kernel("fold", False)
    for block0 in range(0, row_blocks, slab):
        blocks = min(slab, row_blocks - block0)
        col0 = block0 * block_m
        slab_rows = min(blocks * block_m, n - col0)
        per_split = cfg.split_width(n - col0, splits)  # the slab's columns right of col0 among the splits
        # fresh slab workspaces each time (the previous ones freed first): never views
        col_part = torch.empty(blocks, planes, 2 * n, device=v.device, dtype=torch.float32)
        row_part = torch.empty(splits, planes, 2 * slab_rows, device=v.device, dtype=torch.float32)
        args = (v, t, *strides(v, t), norms[0], norms[1], pos, tau32, gamma32, thr32 if masked else tau32, row_part,
                col_part, n, d, block0, col0, per_split, slab_rows, cfg.n_bucket(n))
        launch(lambda tuned: _kernel("pair", tuned), "pair", width, lambda _, b=blocks: (b, splits), args,
               SMOOTHING=smoothing, HAS_MARGIN=has_margin, MASK=masked, PREC=cfg.dot_precision(v.dtype, precision),
               BLOCK_M=block_m, BLOCK_K=cfg.score_block_k(width))
        # in order: the slab's row blocks' partials (columns and rows right of col0), then its splits'
        fold[(triton.cdiv(2 * n, fold_block),)](col_part, blocks, n, acc, n, 0, block0, block_m, FIRST=block0 == 0,
                                                SMOOTHING=smoothing, MASK=masked, BLOCK=fold_block)
        fold[(triton.cdiv(2 * slab_rows, fold_block),)](row_part, splits, slab_rows, acc, n, col0, 0, 0, FIRST=False,
                                                        SMOOTHING=smoothing, MASK=masked, BLOCK=fold_block)
        del args, col_part, row_part
    return (epilogue.RowStats(pos, *_merge(acc, smoothing, n, n, masked)),
            epilogue.RowStats(pos, *_merge(acc, smoothing, 0, n, masked)))


def forward_stats(ops, norms, pos, tau32, gamma32, has_margin: bool, offset: int, smoothing: bool, precision,
                  columns: bool = False, thr32=None):
    """Statistics of Z's rows (``epilogue.RowStats``), and with ``columns`` also of Zᵀ's rows
    (M = N, offset 0), from one walk over the tiles.

    ``ops`` = (q, k, margin_q, margin_k) features, ``norms`` their float32 inverse row norms,
    ``pos`` the positive logits; ``tau32``/``gamma32``: 1-element float32 tensors on the
    features' device; ``has_margin``: γ ≠ 0 (the kernels skip the margin product without it);
    ``thr32``: None, or the false-negative masking block (``ops._threshold_block``): the entries
    whose caption cosine (``tiles._caption_keep``, also with normalize=False) is ≥ the threshold
    are no negatives, and the statistics gain ``kept``, each line's kept negatives.

    The directional op (no ``columns``): ``_fwd_kernel`` over (row blocks × column splits),
    row partials (splits, planes, M) merged by ``_merge_kernel``.

    The symmetric loss (``columns``; ops (v, t, t, t)): ``_fwd_pair_kernel`` walks the tile pairs
    (Z_IJ and Z_JIᵀ from 3 products sharing G_IJ = t_I t_Jᵀ; the diagonal super-tiles 2 per tile)
    over the row blocks in slabs (``cfg.fwd_grid``: ≈ √(2 · SMs) row blocks, 12 × 22 programs on
    132 SMs); each slab splits the columns right of its first row among the splits anew
    (``cfg.split_width``). After each slab ``_fold_kernel`` folds its row blocks' partials and
    then its splits' partials into running summaries of 2N lines (columns, then rows), slab
    after slab in order: deterministic, no atomics, and the workspace is O(N).

    Workspace (float32, planes = 3, or 4 with label smoothing): directional, the row partials;
    symmetric, the running summaries (planes, 2N) and one slab's partials (slab row blocks,
    planes, 2N) + (splits, planes, 2 · slab rows); :func:`.workspace.forward_bytes` states it,
    e.g. 79 MiB at N = 262144 with 16-bit features on 132 SMs. Nothing of size N × N or N² / BLOCK.
    """
    if columns:
        return _symmetric_stats(ops, norms, pos, tau32, gamma32, has_margin, smoothing, precision, thr32)
    return _row_walk("fwd", 1, ops, norms, pos, tau32, gamma32, has_margin, offset, smoothing, precision, thr32)


def rank_stats(ops, norms, pos, tau32, gamma32, has_margin: bool, offset: int, smoothing: bool, precision,
               thr32=None):
    """A distributed rank's i2t and t2i row statistics, one ``epilogue.RowStats`` of 2M lines
    (i2t rows, then t2i rows), from one walk (``_fwd_rank_kernel``: the margin's G formed once
    per tile for both).

    ``ops`` = (v, t, v_all, t_all): the local (M, D) and gathered (N, D) features, ``norms`` their
    float32 inverse row norms, ``pos`` (2M) the positives (i2t rows, then t2i rows); ``thr32``
    the false-negative threshold (1-element float32; None: no masking, and no ``kept``); the
    rest as :func:`forward_stats`. Grid and workspace: the directional op's (row partials of 2M
    lines: (splits, planes, 2M))."""
    return _row_walk("rank", 2, ops, norms, pos, tau32, gamma32, has_margin, offset, smoothing, precision, thr32)


def _row_walk(kind: str, directions: int, ops, norms, pos, tau32, gamma32, has_margin: bool, offset: int,
              smoothing: bool, precision, thr32):
    """The walk of ``_fwd_kernel`` (``kind`` "fwd", one direction) or ``_fwd_rank_kernel`` ("rank",
    two): (row blocks × column splits) programs write row partials (splits, planes,
    directions · M), which ``_merge_kernel`` merges into the lines' statistics."""
    q = ops[0]
    m, d = q.shape
    n = ops[3].shape[0]  # the key side's rows (k's margin factor; a rank's t_all)
    width = q.element_size()
    _, row_blocks, splits, per_split = cfg.fwd_grid(m, n, width, False, q.device)
    masked = thr32 is not None
    planes = (4 if smoothing else 3) + masked
    row_part = torch.empty(splits, planes, directions * m, device=q.device, dtype=torch.float32)
    args = (*ops, *strides(*ops), *norms, pos, tau32, gamma32, thr32 if masked else tau32, row_part, m, n, d, offset,
            per_split, cfg.n_bucket(n))
    launch(lambda tuned: _kernel(kind, tuned), kind, width, lambda t: (row_blocks, splits), args,
           SMOOTHING=smoothing, HAS_MARGIN=has_margin, MASK=masked, PREC=cfg.dot_precision(q.dtype, precision),
           BLOCK_M=cfg.fwd_block_m(width), BLOCK_K=cfg.score_block_k(width))
    return epilogue.RowStats(pos, *_merge(row_part, smoothing, masked=masked))
