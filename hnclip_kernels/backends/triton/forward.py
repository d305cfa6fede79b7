"""Forward: the logits' row (and column) statistics in one walk over the tiles of Z.

``_fwd_kernel`` folds each tile it forms into partial summaries of its rows (over one
column split) and, for the symmetric loss, of its columns (over one group of row blocks);
``_merge_kernel`` combines the partials of each line in a fixed order (no atomics).
``forward_stats`` launches both.
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
    _load2,
    _load_gamma,
    _load_partial,
    _logits_tile,
    _merge_stats,
    _store_partial,
    _tile_stats,
)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, tau_ptr, gamma_ptr,
    row_part_ptr, col_part_ptr,
    M, N, D, offset, block0, cols_per_split, N_BUCKET,
    COL_STATS: tl.constexpr, SMOOTHING: tl.constexpr, HAS_MARGIN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One walk over the tiles of Z: each tile formed once serves the rows and the columns.

    For the gaps d = Z − Z_pos over the negatives, a row's summary is (max, Σexp, Σexp·d,
    Σd) over this program's column split; a column's is the same over this row block.
    Grid: (row blocks of one slab, column splits); program (b, s) walks row block block0 + b.

    Features (raw, any float dtype, row-major or strided):
        q_ptr (M, D) queries, k_ptr (N, D) keys, mq_ptr (M, D) / mk_ptr (N, D) the margin
        factors (read only with HAS_MARGIN); their strides ``stride_<matrix><axis>``
        (m, n: rows; d: features).
    Per-row inputs (float32):
        rq_ptr (M), rk_ptr (N), r_mq_ptr (M), r_mk_ptr (N): inverse row norms;
        pos_ptr (M): the positive logit Z[i, offset + i]; tau_ptr, gamma_ptr: 1-element τ, γ.
    Outputs (float32, planes = 3 + SMOOTHING: max, Σexp, Σexp·d[, Σd]):
        row_part_ptr (splits, planes, M): each split's summary of each row;
        col_part_ptr (slab row blocks, planes, N): each row block's summary of each column
        (written only with COL_STATS; ``forward_stats`` folds a slab's into the running ones).
    Shapes and scalars: M, N, D; offset (row i's positive is column offset + i);
        block0 (the slab's first row block); cols_per_split (columns per program along axis 1,
        a multiple of BLOCK_N); N_BUCKET (``config.n_bucket(N)``: read by nothing, a key of the
        autotuner).
    Constexprs: COL_STATS (symmetric loss, M = N, offset 0: also the columns' statistics),
        SMOOTHING (label smoothing: also Σd), HAS_MARGIN (γ ≠ 0), PREC (``precision._dot``),
        BLOCK_M × BLOCK_N tiles, BLOCK_K the reduction step over D.
    """
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    inv_tau = 1.0 / tl.load(tau_ptr)
    gamma = _load_gamma(gamma_ptr, HAS_MARGIN)
    q = (q_ptr, stride_qm, stride_qd)
    k = (k_ptr, stride_kn, stride_kd)
    margin_q = (mq_ptr, stride_mqm, stride_mqd)
    margin_k = (mk_ptr, stride_mkn, stride_mkd)
    offs_m, mask_m = _block((block0 + pid_b) * BLOCK_M, M, BLOCK_M)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M,), tl.float32)
    run_wsum = tl.zeros((BLOCK_M,), tl.float32)
    run_dsum = tl.zeros((BLOCK_M,), tl.float32)
    n_start = pid_s * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rk, r_mk = _load2(rk_ptr, r_mk_ptr, offs_n, mask_n)
        z = _logits_tile(q, k, margin_q, margin_k, (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                         D, gamma, inv_tau, HAS_MARGIN, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        d = tl.where(neg, z - pos[:, None], float("-inf"))
        t_max, t_sum, t_wsum, t_dsum = _tile_stats(d, neg, 1)
        run_max, run_sum, run_wsum = _combine((run_max, run_sum, run_wsum), (t_max, t_sum, t_wsum))
        run_dsum += t_dsum
        if COL_STATS:  # symmetric loss (M = N, offset 0): column j's positive is Z_jj = pos_j
            pos_c = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
            d_c = tl.where(neg, z - pos_c[None, :], float("-inf"))
            _store_partial(col_part_ptr + pid_b.to(tl.int64) * (3 + SMOOTHING) * N, N, offs_n, mask_n,
                           _tile_stats(d_c, neg, 0), SMOOTHING)
    _store_partial(row_part_ptr + pid_s.to(tl.int64) * (3 + SMOOTHING) * M, M, offs_m, mask_m,
                   (run_max, run_sum, run_wsum, run_dsum), SMOOTHING)


@triton.jit
def _fold_kernel(part_ptr, n_parts, L, acc_ptr, FIRST: tl.constexpr, SMOOTHING: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Fold ``n_parts`` summaries of each of L lines into the running summary, in order.
    Grid: ⌈L / BLOCK⌉.

    part_ptr (n_parts, planes, L) float32, a slab's column partials as ``_fwd_kernel`` stores
    them; acc_ptr (planes, L) float32, the running summary: read (unless FIRST, the first slab)
    and written. planes = 3 + SMOOTHING. No line is touched by two programs: no atomics.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    acc = _load_partial(acc_ptr, L, offs, mask & (not FIRST), SMOOTHING)
    base = part_ptr
    for _ in range(0, n_parts):
        acc = _merge_stats(acc, _load_partial(base, L, offs, mask, SMOOTHING))
        base += (3 + SMOOTHING) * L  # pointer steps: no int32 product overflows
    _store_partial(acc_ptr, L, offs, mask, acc, SMOOTHING)


@triton.jit
def _merge_kernel(part_ptr, n_parts, L, delta_ptr, mean_neg_ptr, dsum_ptr,
                  SMOOTHING: tl.constexpr, BLOCK: tl.constexpr):
    """Combine ``n_parts`` summaries of each of L lines, in order. Grid: ⌈L / BLOCK⌉.

    Input: part_ptr (n_parts, 3 + SMOOTHING, L) float32, as ``_fwd_kernel`` stores them.
    Outputs (L each, float32): delta_ptr = LSE(d) (−inf without negatives), mean_neg_ptr =
        E_softmax[d], dsum_ptr = Σd (0 without SMOOTHING).
    Constexprs: SMOOTHING (the partials carry Σd), BLOCK lines per program.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    sum_exp = tl.zeros((BLOCK,), tl.float32)
    wsum = tl.zeros((BLOCK,), tl.float32)
    dsum = tl.zeros((BLOCK,), tl.float32)
    planes = 3 + SMOOTHING
    base = part_ptr + offs
    for _ in range(0, n_parts):
        part = (tl.load(base, mask=mask, other=0.0), tl.load(base + L, mask=mask, other=0.0),
                tl.load(base + 2 * L, mask=mask, other=0.0))
        top, sum_exp, wsum = _combine((top, sum_exp, wsum), part)
        if SMOOTHING:
            dsum += tl.load(base + 3 * L, mask=mask, other=0.0)
        base += planes * L  # pointer steps: the workspace passes 2^31 entries near N = 2^18
    has_neg = sum_exp > 0.0
    delta = tl.where(has_neg, top + tl.log(tl.where(has_neg, sum_exp, 1.0)), float("-inf"))
    delta = tl.where(sum_exp != sum_exp, sum_exp, delta)  # a NaN anywhere in the line stays visible in the loss
    tl.store(delta_ptr + offs, delta, mask=mask)
    tl.store(mean_neg_ptr + offs, tl.where(has_neg, wsum / tl.where(has_neg, sum_exp, 1.0), 0.0), mask=mask)
    tl.store(dsum_ptr + offs, dsum, mask=mask)


# autotuned twin (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
# key: D, the N bucket (``cfg.n_bucket``), HAS_MARGIN, PREC, COL_STATS, SMOOTHING (and, through
# the pruner, the operand width); every rerun rewrites the partials whole, so no restore_value
_fwd_tuned = triton.autotune(cfg.all_candidates("fwd"), key=["D", "N_BUCKET", "HAS_MARGIN", "PREC", "COL_STATS", "SMOOTHING"],
                             prune_configs_by={"early_config_prune": cfg.pruner("fwd", "q_ptr")})(_fwd_kernel)


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("fwd", "fold", "merge"), its autotuned twin when ``tuned``, through
    ``wrap_triton``; spelled out kernel by kernel (see :func:`.launch.launch`)."""
    if name == "fwd":
        return wrap_triton(_fwd_tuned) if tuned else wrap_triton(_fwd_kernel)
    if name == "fold":
        return wrap_triton(_fold_kernel)
    return wrap_triton(_merge_kernel)


# ------------------------------------------------------------------ host launcher
def _merge(part: torch.Tensor, smoothing: bool):
    """(delta, mean_neg, dsum) of each line from its partial summaries (n_parts, planes, L):
    three separate tensors (an operator's outputs may not alias each other)."""
    n_parts, _, length = part.shape
    delta, mean_neg, dsum = (torch.empty(length, device=part.device, dtype=torch.float32) for _ in range(3))
    block = 128 if cfg.launch_mode() != "interpret" else 64
    _kernel("merge", False)[(triton.cdiv(length, block),)](part, n_parts, length, delta, mean_neg, dsum,
                                                           SMOOTHING=smoothing, BLOCK=block)
    return delta, mean_neg, dsum


def forward_stats(ops, norms, pos, tau32, gamma32, has_margin: bool, offset: int, smoothing: bool, precision,
                  columns: bool = False):
    """Statistics of Z's rows (``epilogue.RowStats``), and with ``columns`` also of Zᵀ's rows
    (M = N, offset 0), from one walk over the tiles.

    ``ops`` = (q, k, margin_q, margin_k) features, ``norms`` their float32 inverse row norms,
    ``pos`` the positive logits; ``tau32``/``gamma32``: 1-element float32 tensors on the
    features' device; ``has_margin``: γ ≠ 0 (the kernels skip the margin product without it).

    The row blocks are walked in slabs (``cfg.fwd_grid``: every row block at once for the
    directional op; ≈ √(2 · SMs) row blocks per slab with column statistics, 12 on 132 SMs).
    After each slab ``_fold_kernel`` folds its column partials into the running column
    summaries, slab after slab in order: deterministic, and the workspace is O(N).

    Workspace (float32, planes = 3, or 4 with label smoothing): row partials (splits, planes, M),
    and with ``columns`` one slab's column partials (slab row blocks, planes, N) plus the running
    summaries (planes, N); :func:`.workspace.forward_bytes` states it, e.g. 102 MiB at N = 262144
    with 16-bit features on 132 SMs. Nothing of size N × N or N² / BLOCK.
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    width = q.element_size()
    row_blocks, slab, splits, per_split = cfg.fwd_grid(m, n, width, columns, q.device)
    planes = 4 if smoothing else 3
    row_part = torch.empty(splits, planes, m, device=q.device, dtype=torch.float32)
    col_acc = torch.empty(1, planes, n, device=q.device, dtype=torch.float32) if columns else None
    fold_block = 128 if cfg.launch_mode() != "interpret" else 64
    for block0 in range(0, row_blocks, slab):
        blocks = min(slab, row_blocks - block0)
        # a fresh slab workspace each time (the previous one freed first): never a view
        col_part = torch.empty(blocks, planes, n, device=q.device, dtype=torch.float32) if columns else row_part
        args = (*ops, *strides(*ops), *norms, pos, tau32, gamma32, row_part, col_part, m, n, d, offset,
                block0, per_split, cfg.n_bucket(n))
        launch(lambda tuned: _kernel("fwd", tuned), "fwd", width, lambda t, b=blocks: (b, splits), args,
               COL_STATS=columns, SMOOTHING=smoothing, HAS_MARGIN=has_margin,
               PREC=cfg.dot_precision(q.dtype, precision), BLOCK_M=cfg.fwd_block_m(width),
               BLOCK_K=cfg.score_block_k(width))
        if columns:
            _kernel("fold", False)[(triton.cdiv(n, fold_block),)](col_part, blocks, n, col_acc, FIRST=block0 == 0,
                                                                  SMOOTHING=smoothing, BLOCK=fold_block)
        del args, col_part
    rows = epilogue.RowStats(pos, *_merge(row_part, smoothing))
    if not columns:
        return rows
    return rows, epilogue.RowStats(pos, *_merge(col_acc, smoothing))
