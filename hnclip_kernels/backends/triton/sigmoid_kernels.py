"""The sigmoid (SigLIP) loss's kernels and their launchers: R image rows against C + M key columns
(captions, then hard negatives), row i's positive at column offset + i.

* ``_sig_fwd_kernel``: per row, over one column split, Σ softplus(−y z) and the two factors of
  dL/ds and dL/db (Σ u·x̃, Σ u; u = σ(z) − [y = 1]: they do not depend on the upstream gradient).
  Grid (row blocks, column splits), partials (splits, 3, R) that the host adds in split order.
* ``_sig_dscore_kernel``: one chunk of W = diag(a)·dS·diag(b) (the InfoNCE dS kernels' buffers and
  16-bit staging: ``dscore._store_w``, :mod:`.round16`), which :func:`.backward._walk` multiplies by
  the features in torch GEMMs: 3 products of R × (C + M) × D at γ = 0 or ``margin="image_text"``
  (the forward's tile, the backward's recomputed tile, and the two GEMMs: 4), 6 with the text margin.

Each tile is ``tiles._logits_tile``'s scores (and with the text margin its margin product), the
labels from the offset and the group ids (``family_tiles._same_group``), then the kind's helpers
(:mod:`.sigmoid`). The launchers are the only callers of ``wrap_triton`` (see :mod:`.launch`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import config as cfg
from .dscore import _chunk_tile, _store_w
from .family_tiles import _same_group
from .launch import derived, launch, wrap_triton
from .sigmoid import _sigmoid_logits, _tile_row_sums, _w_tile
from .tiles import _block, _load2, _load_gamma, _logits_tile


@triton.jit
def _sigmoid_tile(
    q, k, margin_q, groups,
    rows, cols,
    D, offset, scalars,
    HAS_MARGIN: tl.constexpr, OWN_SCORE: tl.constexpr, GROUPS: tl.constexpr, GROUPS_POSITIVE: tl.constexpr,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(z, x̃, positive, live) of one (BLOCK_M, BLOCK_N) tile: the float32 logits z = s·x̃ + b, the
    scores with the margin x̃ (``sigmoid._sigmoid_logits``), the positives (column offset + i, and
    with GROUPS_POSITIVE the row's group's caption columns) and the live entries (in bounds, and
    without GROUPS_POSITIVE not another caption of the row's group).

    Matrices ``(ptr, stride along rows, stride along D)``: q the images (R, D), k the keys (C + M, D),
    margin_q the rows' own captions (R, D) (read with HAS_MARGIN and not OWN_SCORE). ``groups`` =
    (row ids, column ids, C) (read with GROUPS). Blocks: rows = (offsets, mask, r_q, r_margin),
    cols = (offsets, mask, r_k), the inverse norms. ``scalars`` = (s, b, γ) float32."""
    offs_m, mask_m, rq, r_mq = rows
    offs_n, mask_n, rk = cols
    logit_scale, logit_bias, gamma = scalars
    # the raw scores, unscaled (×1.0 is exact): the margin goes on the negatives only
    x = _logits_tile(q, k, q, k,
                     (offs_m, mask_m, rq, rq), (offs_n, mask_n, rk, rk),
                     D, 0.0, 1.0, 0.0,
                     False, False, PREC,
                     BLOCK_M, BLOCK_N, BLOCK_K)
    h = gamma
    if HAS_MARGIN and not OWN_SCORE:
        h = gamma * _logits_tile(margin_q, k, margin_q, k,
                                 (offs_m, mask_m, r_mq, r_mq), (offs_n, mask_n, rk, rk),
                                 D, 0.0, 1.0, 0.0,
                                 False, False, PREC,
                                 BLOCK_M, BLOCK_N, BLOCK_K)
    positive = offs_n[None, :] == offs_m[:, None] + offset
    live = mask_m[:, None] & mask_n[None, :]
    if GROUPS:
        same = _same_group(groups, offs_m, mask_m, offs_n)
        if GROUPS_POSITIVE:
            positive = positive | same
        else:
            live = live & (positive | ~same)
    z, xm = _sigmoid_logits(x, h, positive, logit_scale, logit_bias, HAS_MARGIN, OWN_SCORE)
    return z, xm, positive, live


@triton.jit
def _load_sigmoid_scalars(sb_ptr, gamma_ptr, HAS_MARGIN: tl.constexpr):
    """(s, b, γ) float32 from device memory: ``sb_ptr`` holds (s, b), γ is read with HAS_MARGIN only."""
    return tl.load(sb_ptr), tl.load(sb_ptr + 1), _load_gamma(gamma_ptr, HAS_MARGIN)


@derived("sig_fwd", "GROUPS")
@triton.jit
def _sig_fwd_kernel(
    q_ptr, k_ptr, mq_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd,
    rq_ptr, rk_ptr, r_mq_ptr, sb_ptr, gamma_ptr,
    gq_ptr, gk_ptr, K,
    part_ptr,
    M, N, D, offset, cols_per_split, N_BUCKET,
    HAS_MARGIN: tl.constexpr, OWN_SCORE: tl.constexpr, GROUPS_POSITIVE: tl.constexpr, PREC: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The sigmoid loss's row sums over one column split. Grid: (row blocks, column splits).

    Features (raw, any float dtype, strided): q_ptr (M, D) the images, k_ptr (N, D) the keys
        [captions; negatives], mq_ptr (M, D) the rows' own captions (the text margin's factor, read
        with HAS_MARGIN and not OWN_SCORE); strides ``stride_<matrix><axis>``.
    Per-row inputs (float32): rq_ptr (M), rk_ptr (N), r_mq_ptr (M) inverse norms (ones without
        normalisation).
    Scalars: sb_ptr (2,) float32 (s, b); gamma_ptr (1,) float32 γ (None without HAS_MARGIN).
    Group ids: gq_ptr (M,), gk_ptr (K,) of the rows and of the first K columns (the captions), one
        integer dtype; None without (GROUPS derives from gk_ptr).
    Output: part_ptr (splits, 3, M) float32: this split's Σ softplus(−y z), Σ u·x̃, Σ u per row.
    Shapes: M, N, D; offset (row i's positive is column offset + i); cols_per_split (a multiple of
        BLOCK_N); N_BUCKET (an autotune key only).
    Constexprs: HAS_MARGIN (γ ≠ 0), OWN_SCORE (``margin="image_text"``: the margin is γ·x), GROUPS_POSITIVE
        (same-group captions are positives, else masked), PREC (``precision._dot``), tiles.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    scalars = _load_sigmoid_scalars(sb_ptr, gamma_ptr, HAS_MARGIN)
    offs_m, mask_m = _block(pid_m * BLOCK_M, M, BLOCK_M)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    run_loss = tl.zeros((BLOCK_M,), tl.float32)
    run_ux = tl.zeros((BLOCK_M,), tl.float32)
    run_u = tl.zeros((BLOCK_M,), tl.float32)
    n_start = pid_s * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
        z, xm, positive, live = _sigmoid_tile((q_ptr, stride_qm, stride_qd), (k_ptr, stride_kn, stride_kd),
                                              (mq_ptr, stride_mqm, stride_mqd), (gq_ptr, gk_ptr, K),
                                              (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk),
                                              D, offset, scalars,
                                              HAS_MARGIN, OWN_SCORE, GROUPS, GROUPS_POSITIVE,
                                              PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        t_loss, t_ux, t_u = _tile_row_sums(z, xm, positive, live)
        run_loss += t_loss
        run_ux += t_ux
        run_u += t_u
    part = part_ptr + pid_s.to(tl.int64) * 3 * M
    tl.store(part + offs_m, run_loss, mask=mask_m)
    tl.store(part + M + offs_m, run_ux, mask=mask_m)
    tl.store(part + 2 * M + offs_m, run_u, mask=mask_m)


@derived("sig_dscore", "GROUPS", "ROUND16")
@triton.jit
def _sig_dscore_kernel(
    q_ptr, k_ptr, mq_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd,
    rq_ptr, rk_ptr, r_mq_ptr, ga_ptr, b_ptr, sb_ptr, gamma_ptr,
    gq_ptr, gk_ptr, K,
    w_ptr, stride_w, res_r_ptr, stride_rr, res_c_ptr, stride_rc,
    row0, row_end, col0, col_end, D, offset,
    HAS_MARGIN: tl.constexpr, OWN_SCORE: tl.constexpr, GROUPS_POSITIVE: tl.constexpr, PREC: tl.constexpr,
    GROUPS: tl.constexpr, ROUND16: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The sigmoid loss's W[i − row0, j − col0] = a_i·dS_ij·b_j over one chunk [row0, row_end) ×
    [col0, col_end), dS = g_i·(σ(z) − [y = 1]) (``sigmoid._w_tile``), float32; with ROUND16 the
    staging W and its slice maxima (as ``dscore._dscore_kernel``'s). Grid: the chunk's tiles.

    Features, per-row norms, scalars and group ids: as ``_sig_fwd_kernel``'s (the same tiles, BLOCK_K
    the forward's). ga_ptr (M): each row's g_i·a_i; b_ptr (N): W's column scales
    (:func:`.scales.w_scales`). Outputs and their strides: ``dscore._dscore_kernel``'s w_ptr …
    stride_rc. Shapes: the chunk's bounds, D, offset. Constexprs: ``_sig_fwd_kernel``'s, ROUND16
    (derived from res_r_ptr), SLICE
    (``cfg.RESIDUAL_SLICE``).
    """
    offs_m, mask_m, offs_n, mask_n, _, _ = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    scalars = _load_sigmoid_scalars(sb_ptr, gamma_ptr, HAS_MARGIN)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    rk, bk = _load2(rk_ptr, b_ptr, offs_n, mask_n)
    z, xm, positive, live = _sigmoid_tile((q_ptr, stride_qm, stride_qd), (k_ptr, stride_kn, stride_kd),
                                          (mq_ptr, stride_mqm, stride_mqd), (gq_ptr, gk_ptr, K),
                                          (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk),
                                          D, offset, scalars,
                                          HAS_MARGIN, OWN_SCORE, GROUPS, GROUPS_POSITIVE,
                                          PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    ga = tl.load(ga_ptr + offs_m, mask=mask_m, other=0.0)
    w = _w_tile(z, positive, live, ga, bk)
    _store_w(w, mask_m[:, None] & mask_n[None, :],
             (offs_m, mask_m, row0, row_end, tl.program_id(0) * (BLOCK_M // SLICE)),
             (offs_n, mask_n, col0, col_end, tl.program_id(1) * (BLOCK_N // SLICE)),
             w_ptr, 0, stride_w, res_r_ptr, 0, stride_rr, res_c_ptr, 0, stride_rc,
             ROUND16, SLICE, BLOCK_M, BLOCK_N)


# autotuned twins (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic); GROUPS and
# ROUND16 derive from their pointers (``launch.derived``), which key the autotuner already
_sig_fwd_tuned = triton.autotune(cfg.all_candidates("sig_fwd"), key=["D", "N_BUCKET", "HAS_MARGIN", "PREC"],
                                 prune_configs_by={"early_config_prune": cfg.pruner("sig_fwd", "q_ptr")}
                                 )(_sig_fwd_kernel)
_sig_dscore_tuned = triton.autotune(cfg.all_candidates("sig_dscore"), key=["D", "HAS_MARGIN", "PREC"],
                                    prune_configs_by={"early_config_prune": cfg.pruner("sig_dscore", "q_ptr")}
                                    )(_sig_dscore_kernel)


def _features(features) -> dict:
    """The kernels' feature pointers and strides: ``features`` = (q, k, margin_q)."""
    q, k, mq = features
    return dict(q_ptr=q, k_ptr=k, mq_ptr=mq,
                stride_qm=q.stride(0), stride_qd=q.stride(1), stride_kn=k.stride(0), stride_kd=k.stride(1),
                stride_mqm=mq.stride(0), stride_mqd=mq.stride(1))


def _groups(groups) -> dict:
    """``groups`` = (row ids, column ids) or None as the kernels' gq_ptr, gk_ptr, K."""
    gq, gk = groups if groups is not None else (None, None)
    return dict(gq_ptr=gq, gk_ptr=gk, K=0 if gk is None else gk.shape[0])


def _constexprs(flags, width: int) -> dict:
    """``flags`` = (HAS_MARGIN, OWN_SCORE, GROUPS_POSITIVE, PREC) as the kernels' constexprs."""
    has_margin, own_score, groups_positive, prec = flags
    return dict(HAS_MARGIN=has_margin, OWN_SCORE=own_score, GROUPS_POSITIVE=groups_positive, PREC=prec,
                BLOCK_K=cfg.score_block_k(width))


def sig_fwd_args(features, per_row, scalars, groups, part, shapes) -> dict:
    """``_sig_fwd_kernel``'s arguments by name: ``features`` = (q, k, margin_q); ``per_row`` = (rq, rk,
    r_mq); ``scalars`` = (sb, γ or None); ``groups`` (row ids, column ids) or None; ``part`` the
    partials; ``shapes`` = (M, N, D, offset, cols_per_split, N_BUCKET)."""
    rq, rk, r_mq = per_row
    sb, gamma = scalars
    m, n, d, offset, cols_per_split, n_bucket = shapes
    return dict(**_features(features), rq_ptr=rq, rk_ptr=rk, r_mq_ptr=r_mq, sb_ptr=sb, gamma_ptr=gamma,
                **_groups(groups), part_ptr=part,
                M=m, N=n, D=d, offset=offset, cols_per_split=cols_per_split, N_BUCKET=n_bucket)


def launch_sig_fwd(flags, grid, features, per_row, scalars, groups, part, shapes):
    """Launch ``_sig_fwd_kernel`` on ``grid`` (arguments: :func:`sig_fwd_args`; ``flags`` as
    :func:`_constexprs`; autotuned, or ``cfg.heuristic("sig_fwd", width)``)."""
    width = features[0].element_size()
    launch(lambda tuned: wrap_triton(_sig_fwd_tuned) if tuned else wrap_triton(_sig_fwd_kernel), "sig_fwd", width,
           grid, sig_fwd_args(features, per_row, scalars, groups, part, shapes),
           BLOCK_M=cfg.fwd_block_m(width), **_constexprs(flags, width))


def sig_dscore_args(features, per_row, scalars, groups, outputs, shapes) -> dict:
    """``_sig_dscore_kernel``'s arguments by name: ``features``, ``scalars``, ``groups`` as
    :func:`sig_fwd_args`; ``per_row`` = (rq, rk, r_mq, g·a, b); ``outputs`` = (w, res_r, res_c), the
    chunk's buffers; ``shapes`` = (row0, row_end, col0, col_end, D, offset)."""
    rq, rk, r_mq, ga, b = per_row
    sb, gamma = scalars
    w, res_r, res_c = outputs
    row0, row_end, col0, col_end, d, offset = shapes
    r, c = row_end - row0, col_end - col0  # the buffers' row strides: C, R, C
    return dict(**_features(features), rq_ptr=rq, rk_ptr=rk, r_mq_ptr=r_mq, ga_ptr=ga, b_ptr=b,
                sb_ptr=sb, gamma_ptr=gamma, **_groups(groups),
                w_ptr=w, stride_w=c, res_r_ptr=res_r, stride_rr=r, res_c_ptr=res_c, stride_rc=c,
                row0=row0, row_end=row_end, col0=col0, col_end=col_end, D=d, offset=offset)


def launch_sig_dscore(flags, features, per_row, scalars, groups, outputs, shapes):
    """Launch ``_sig_dscore_kernel`` over one chunk (arguments: :func:`sig_dscore_args`)."""
    width = features[0].element_size()
    args = sig_dscore_args(features, per_row, scalars, groups, outputs, shapes)
    rows, cols = args["row_end"] - args["row0"], args["col_end"] - args["col0"]
    launch(lambda tuned: wrap_triton(_sig_dscore_tuned) if tuned else wrap_triton(_sig_dscore_kernel), "sig_dscore",
           width, lambda tiles: (triton.cdiv(rows, tiles["BLOCK_M"]), triton.cdiv(cols, tiles["BLOCK_N"])), args,
           SLICE=cfg.RESIDUAL_SLICE, **_constexprs(flags, width))
