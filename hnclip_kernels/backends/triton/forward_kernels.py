"""Forward kernels: the logits' row (and column) statistics in one walk over the tiles of Z.

``_fwd_kernel`` (the directional op) folds each tile it forms into partial summaries of its rows
over one column split; ``_fwd_rank_kernel`` does so for a distributed rank's two directions
from 3 products a tile. ``_fwd_pair_kernel`` (the single-process loss) walks tile pairs: a tile
right of the diagonal and its mirror from 3 products sharing the margin's G_IJ, feeding the
rows' and columns' statistics. Each kernel's launcher is beside it (``launch_*``); the host
walks that call them are in :mod:`.forward`, the merging of their partials in :mod:`.merge`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import config as cfg
from .family_tiles import _drop_same_group, _family_tile
from .launch import derived, launch, wrap_triton
from .params import Scalars
from .softmax import _combine, _gap_stats, _merge_stats, _store_partial, _tile_stats
from .tiles import _block, _count, _kept, _load2, _load_scalars, _logits_tile, _pair_tiles, _rank_tiles, _store_count


@derived("fwd", "MASK", "COSINE", "CAPTIONS", "GROUPS")
@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, logit_scale_ptr, gamma_ptr, thr_ptr,
    cq_ptr, ck_ptr, gq_ptr, gk_ptr, K,
    row_part_ptr,
    M, N, D, offset, cols_per_split, N_BUCKET,
    SMOOTHING: tl.constexpr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    COSINE: tl.constexpr, CAPTIONS: tl.constexpr, GROUPS: tl.constexpr,
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
        pos_ptr (M): the positive logit Z[i, offset + i].
    Scalars (``params.Scalars``): logit_scale_ptr 1-element logit scale (1/τ, or (1 + γ)/τ);
        gamma_ptr 1-element γ (None without HAS_MARGIN); thr_ptr the false-negative masking block
        (``params.threshold_block``; None without a threshold, and COSINE derives from it).
    The hard-negative family's masking (``family_tiles._family_tile``; ``params.Family``): cq_ptr
        (M, D), ck_ptr (N, D) the contiguous masking captions (None: the margin factors'
        product is the cosine; CAPTIONS derives from cq_ptr); gq_ptr (M,), gk_ptr (K,) group ids
        of the rows and of the first K columns (None: none; GROUPS derives from gk_ptr).
    Outputs (float32, planes = 3 + SMOOTHING + MASK: max, Σexp, Σexp·d[, Σd][, #kept]):
        row_part_ptr (splits, planes, M): each split's summary of each row (with MASK over the
        kept negatives only, and their count).
    Shapes and scalars: M, N, D; offset (row i's positive is column offset + i);
        cols_per_split (columns per program along axis 1,
        a multiple of BLOCK_N); N_BUCKET (``config.n_bucket(N)``: read by nothing, a key of the
        autotuner).
    Constexprs: SMOOTHING (label smoothing: also Σd), HAS_MARGIN (``Scalars.margin_tile``), MASK (derived:
        false-negative masking, an entry whose caption cosine m̂_q·m̂_k ≥ thr, COSINE, or whose
        group ids agree, GROUPS, is no negative), PREC (``precision._dot``), BLOCK_M × BLOCK_N
        tiles, BLOCK_K the reduction step over D. Without CAPTIONS and GROUPS the tile is
        ``_logits_tile``'s (today's kernel).
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    logit_scale, gamma, thr = _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, COSINE)
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
        if CAPTIONS or GROUPS:
            z = _family_tile(q, k, margin_q, margin_k,
                             ((cq_ptr, D, 1), (ck_ptr, D, 1)), (gq_ptr, gk_ptr, K),
                             (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                             D, gamma, logit_scale, thr,
                             HAS_MARGIN, COSINE, CAPTIONS, GROUPS, PREC,
                             BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            z = _logits_tile(q, k, margin_q, margin_k,
                             (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                             D, gamma, logit_scale, thr,
                             HAS_MARGIN, MASK, PREC,
                             BLOCK_M, BLOCK_N, BLOCK_K)
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


@derived("rank", "MASK")
@triton.jit
def _fwd_rank_kernel(
    v_ptr, t_ptr, va_ptr, ta_ptr,
    stride_vm, stride_vd, stride_tm, stride_td, stride_van, stride_vad, stride_tan, stride_tad,
    rv_ptr, rt_ptr, rva_ptr, rta_ptr, pos_ptr, logit_scale_ptr, gamma_ptr, thr_ptr,
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
        pos_ptr (2M): the positives, i2t rows then t2i rows (Z[i, offset + i]); logit_scale_ptr,
        gamma_ptr, thr_ptr as ``_fwd_kernel``.
    Outputs (float32, planes = 3 + SMOOTHING + MASK): row_part_ptr (splits, planes, 2M): line i
        the i2t row i, line M + i the t2i row i (with MASK over the kept negatives, and their
        count: a pair masked in i2t is masked in t2i too, the same caption cosine).
    Scalars and constexprs: as ``_fwd_kernel``.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    logit_scale, gamma, thr = _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
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
        z, zt = _rank_tiles(v, t, v_all, t_all,
                            (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                            D, gamma, logit_scale, thr,
                            HAS_MARGIN, MASK, PREC,
                            BLOCK_M, BLOCK_N, BLOCK_K)
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


@derived("pair", "MASK", "COSINE", "GROUPS")
@triton.jit
def _fwd_pair_kernel(
    v_ptr, t_ptr, stride_vm, stride_vd, stride_tm, stride_td,
    rv_ptr, rt_ptr, pos_ptr, logit_scale_ptr, gamma_ptr, thr_ptr, gk_ptr,
    row_part_ptr, col_part_ptr,
    N, D, block0, col0, cols_per_split, slab_rows, N_BUCKET,
    SMOOTHING: tl.constexpr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    COSINE: tl.constexpr, GROUPS: tl.constexpr,
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
        float32 inverse norms, pos_ptr (N) the positives Z_ii, logit_scale_ptr/gamma_ptr as
        ``_fwd_kernel``, thr_ptr the false-negative masking block (COSINE: the entries whose caption
        cosine is ≥ it leave their row's and their column's summaries, which then count their kept
        entries in one more plane); gk_ptr (N) the hard-negative family's group ids (GROUPS: pairs
        whose ids agree leave them alike, ``family_tiles._drop_same_group``), None without.
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
    Constexprs: as ``_fwd_kernel`` (MASK derived: COSINE or GROUPS); BLOCK_N divides BLOCK_M.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    planes = 3 + SMOOTHING + MASK
    logit_scale, gamma, thr = _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, COSINE)
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
        z = _logits_tile(v, t, t, t,
                         (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rt_n, rt_n),
                         D, gamma, logit_scale, thr,
                         HAS_MARGIN, COSINE, PREC,
                         BLOCK_M, BLOCK_N, BLOCK_K)
        if GROUPS:
            z = _drop_same_group(z, gk_ptr, N, offs_m, mask_m, offs_n)
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
        z, zm = _pair_tiles(v, t,
                            (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                            D, gamma, logit_scale, thr,
                            HAS_MARGIN, COSINE, PREC,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        if GROUPS:  # the ids agree for (i, j) and (j, i) alike: z and zm lose the same entries
            z = _drop_same_group(z, gk_ptr, N, offs_m, mask_m, offs_n)
            zm = _drop_same_group(zm, gk_ptr, N, offs_m, mask_m, offs_n)
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


# autotuned twins (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic). Key: D, the
# N bucket (``cfg.n_bucket``), HAS_MARGIN, PREC, SMOOTHING (MASK derives from thr_ptr: see
# ``launch.derived``; the pruner keeps the operand width's candidates); every rerun rewrites the
# partials whole, so no restore_value
_KEY = ["D", "N_BUCKET", "HAS_MARGIN", "PREC", "SMOOTHING"]
_fwd_tuned = triton.autotune(cfg.all_candidates("fwd"), key=_KEY,
                             prune_configs_by={"early_config_prune": cfg.pruner("fwd", "q_ptr")})(_fwd_kernel)
_fwd_rank_tuned = triton.autotune(cfg.all_candidates("rank"), key=_KEY,
                                  prune_configs_by={"early_config_prune": cfg.pruner("rank", "v_ptr")})(_fwd_rank_kernel)
_fwd_pair_tuned = triton.autotune(cfg.all_candidates("pair"), key=_KEY,
                                  prune_configs_by={"early_config_prune": cfg.pruner("pair", "v_ptr")})(_fwd_pair_kernel)


def _constexprs(sc: Scalars, width: int) -> dict:
    """The forward kernels' explicit constexprs (the column tiles BLOCK_N come from the launch)."""
    return dict(SMOOTHING=sc.smoothing, HAS_MARGIN=sc.margin_tile, PREC=sc.prec, BLOCK_M=cfg.fwd_block_m(width),
                BLOCK_K=cfg.score_block_k(width))


def fwd_args(features, per_row, sc: Scalars, outputs, shapes) -> dict:
    """``_fwd_kernel``'s arguments by name, group by group as its docstring lists them: ``features``
    = (q, k, margin_q, margin_k); ``per_row`` = (rq, rk, r_mq, r_mk, pos); the scalars
    ``sc.pointers`` and ``sc.family``'s; ``outputs`` = (row_part,); ``shapes`` = (M, N, D, offset,
    cols_per_split, N_BUCKET)."""
    q, k, mq, mk = features
    rq, rk, r_mq, r_mk, pos = per_row
    logit_scale, gamma, thr = sc.pointers
    (row_part,) = outputs
    m, n, d, offset, cols_per_split, n_bucket = shapes
    return dict(
        q_ptr=q, k_ptr=k, mq_ptr=mq, mk_ptr=mk,
        stride_qm=q.stride(0), stride_qd=q.stride(1), stride_kn=k.stride(0), stride_kd=k.stride(1),
        stride_mqm=mq.stride(0), stride_mqd=mq.stride(1), stride_mkn=mk.stride(0), stride_mkd=mk.stride(1),
        rq_ptr=rq, rk_ptr=rk, r_mq_ptr=r_mq, r_mk_ptr=r_mk, pos_ptr=pos,
        logit_scale_ptr=logit_scale, gamma_ptr=gamma, thr_ptr=thr, **sc.family.pointers(),
        row_part_ptr=row_part,
        M=m, N=n, D=d, offset=offset, cols_per_split=cols_per_split, N_BUCKET=n_bucket,
    )


def fwd_rank_args(features, per_row, sc: Scalars, outputs, shapes) -> dict:
    """``_fwd_rank_kernel``'s arguments by name (as :func:`fwd_args`): ``features`` = (v, t, v_all,
    t_all); ``per_row`` = (rv, rt, rv_all, rt_all, pos); ``outputs`` = (row_part,); ``shapes`` as
    :func:`fwd_args`'."""
    v, t, va, ta = features
    rv, rt, rva, rta, pos = per_row
    logit_scale, gamma, thr = sc.pointers
    (row_part,) = outputs
    m, n, d, offset, cols_per_split, n_bucket = shapes
    return dict(
        v_ptr=v, t_ptr=t, va_ptr=va, ta_ptr=ta,
        stride_vm=v.stride(0), stride_vd=v.stride(1), stride_tm=t.stride(0), stride_td=t.stride(1),
        stride_van=va.stride(0), stride_vad=va.stride(1), stride_tan=ta.stride(0), stride_tad=ta.stride(1),
        rv_ptr=rv, rt_ptr=rt, rva_ptr=rva, rta_ptr=rta, pos_ptr=pos,
        logit_scale_ptr=logit_scale, gamma_ptr=gamma, thr_ptr=thr,
        row_part_ptr=row_part,
        M=m, N=n, D=d, offset=offset, cols_per_split=cols_per_split, N_BUCKET=n_bucket,
    )


def fwd_pair_args(features, per_row, sc: Scalars, outputs, shapes) -> dict:
    """``_fwd_pair_kernel``'s arguments by name (as :func:`fwd_args`): ``features`` = (v, t);
    ``per_row`` = (rv, rt, pos); the scalars and ``sc.family``'s group ids; ``outputs`` = (row_part,
    col_part); ``shapes`` = (N, D, block0, col0, cols_per_split, slab_rows, N_BUCKET)."""
    v, t = features
    rv, rt, pos = per_row
    logit_scale, gamma, thr = sc.pointers
    row_part, col_part = outputs
    n, d, block0, col0, cols_per_split, slab_rows, n_bucket = shapes
    return dict(
        v_ptr=v, t_ptr=t, stride_vm=v.stride(0), stride_vd=v.stride(1), stride_tm=t.stride(0), stride_td=t.stride(1),
        rv_ptr=rv, rt_ptr=rt, pos_ptr=pos,
        logit_scale_ptr=logit_scale, gamma_ptr=gamma, thr_ptr=thr, gk_ptr=sc.family.pair_ids(),
        row_part_ptr=row_part, col_part_ptr=col_part,
        N=n, D=d, block0=block0, col0=col0, cols_per_split=cols_per_split, slab_rows=slab_rows, N_BUCKET=n_bucket,
    )


def launch_fwd(sc: Scalars, grid, features, per_row, outputs, shapes):
    """Launch ``_fwd_kernel`` on ``grid`` (arguments: :func:`fwd_args`; autotuned, or
    ``cfg.heuristic("fwd", width)``, see :func:`.launch.launch`)."""
    args, width = fwd_args(features, per_row, sc, outputs, shapes), features[0].element_size()
    launch(lambda tuned: wrap_triton(_fwd_tuned) if tuned else wrap_triton(_fwd_kernel), "fwd", width, grid, args,
           **_constexprs(sc, width))


def launch_fwd_rank(sc: Scalars, grid, features, per_row, outputs, shapes):
    """Launch ``_fwd_rank_kernel`` (arguments: :func:`fwd_rank_args`; as :func:`launch_fwd`)."""
    args, width = fwd_rank_args(features, per_row, sc, outputs, shapes), features[0].element_size()
    launch(lambda tuned: wrap_triton(_fwd_rank_tuned) if tuned else wrap_triton(_fwd_rank_kernel), "rank", width,
           grid, args, **_constexprs(sc, width))


def launch_fwd_pair(sc: Scalars, grid, features, per_row, outputs, shapes):
    """Launch ``_fwd_pair_kernel`` (arguments: :func:`fwd_pair_args`; as :func:`launch_fwd`)."""
    args, width = fwd_pair_args(features, per_row, sc, outputs, shapes), features[0].element_size()
    launch(lambda tuned: wrap_triton(_fwd_pair_tuned) if tuned else wrap_triton(_fwd_pair_kernel), "pair", width,
           grid, args, **_constexprs(sc, width))
