"""dS kernels: one chunk of W = diag(a) · dS · diag(b) at a time (a, b: :mod:`.scales`), float32:
the W the GEMMs read for float32 features, a staging W with |W|'s slice maxima for 16-bit ones
(:mod:`.round16` rounds it per line). ``_dscore_kernel``: the directional op; ``_dscore_pair_kernel``:
the single-process loss, W_ab and W_ba from the same tile pairs; ``_dscore_rank_kernel``: a rank's
two directions. ``dscore_args`` builds ``_dscore_kernel``'s arguments; the launchers, the autotuned
twins and the other builders are in :mod:`.dscore_launch`, the walks in :mod:`.backward`.
Design, measurements and the rounding compensation: docs/triton.md ("Backward").
"""
from __future__ import annotations

import triton
import triton.language as tl

from .family_tiles import _drop_same_group, _family_tile
from .launch import derived
from .params import Scalars
from .softmax import _row_dscore, _weighted_exp
from .tiles import _block, _load2, _load_scalars, _logits_tile, _pair_tiles, _rank_tiles


@triton.jit
def _chunk_tile(row0, row_end, col0, col_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of a dS chunk [row0, row_end) × [col0, col_end) (grid: the chunk's
    tiles): its rows' offsets and mask, its columns' and the chunk's sides R and C, flat (triton
    3.6 cannot hash a kernel that unpacks nested tuples). No pointer goes in (see
    ``tiles._block``): the offsets reach the stores."""
    offs_m, mask_m = _block(row0 + tl.program_id(0) * BLOCK_M, row_end, BLOCK_M)
    offs_n, mask_n = _block(col0 + tl.program_id(1) * BLOCK_N, col_end, BLOCK_N)
    return offs_m, mask_m, offs_n, mask_n, row_end - row0, col_end - col0


@derived("dscore", "MASK", "COSINE", "CAPTIONS", "GROUPS", "SHIFT", "ROUND16")
@triton.jit
def _dscore_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, nll_ptr, g_ptr, a_ptr, b_ptr, s_ptr,
    logit_scale_ptr, gamma_ptr, thr_ptr,
    cq_ptr, ck_ptr, gq_ptr, gk_ptr, K,
    w_ptr, stride_w, res_r_ptr, stride_rr, res_c_ptr, stride_rc,
    row0, row_end, col0, col_end, D, offset,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, SHIFT: tl.constexpr, PREC: tl.constexpr,
    ROUND16: tl.constexpr, COSINE: tl.constexpr, CAPTIONS: tl.constexpr, GROUPS: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The directional op's W[i − row0, k − col0] = a_i · dS_ik · b_k over one chunk
    [row0, row_end) × [col0, col_end) (dS_ik = g_i P_ik over the negatives, g_i P_ik =
    exp(d − nll_i)·g_i, ``backends.softmax.row_factors``), in float32; with ROUND16 the staging W and its
    slice maxima. Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of the chunk.

    Features: as ``forward_kernels._fwd_kernel`` (q_ptr … mk_ptr, their strides).
    Per-row inputs (float32): rq_ptr … r_mk_ptr, pos_ptr as ``_fwd_kernel``'s;
        nll_ptr (M): what each row's gaps lose (P's normaliser, softplus δ or δ); g_ptr (M): the
        row's weight (the upstream gradient, or g·σ(δ): ``backends.softmax.row_factors``);
        a_ptr (M), b_ptr (N): W's row and column scales (:func:`.scales.w_scales`).
        s_ptr (M): each row's ε/n_i with masking and label smoothing, else None (SHIFT):
        dS_ik = g_i (P_ik − s_i) on the entries kept (caption cosine not ≥ thr: a NaN cosine is
        kept, ``tiles._caption_keep``), 0 on the masked ones.
    Scalars: logit_scale_ptr, gamma_ptr, thr_ptr as ``_fwd_kernel``'s (``params.Scalars.pointers``).
    The family's masking: cq_ptr, ck_ptr, gq_ptr, gk_ptr, K as ``_fwd_kernel``'s (the same tile).
    Outputs, the chunk's R × C (R = row_end − row0, C = col_end − col0), row-major: w_ptr, W in
        float32; with ROUND16 |W|'s maxima over SLICE columns into res_r_ptr (⌈C / SLICE⌉, R) and
        over SLICE rows into res_c_ptr (⌈R / SLICE⌉, C) (None without ROUND16; :mod:`.round16`
        later writes the residuals' slice sums there). Their row strides stride_w = C, stride_rr = R,
        stride_rc = C come as arguments, not from the bounds: an argument costs no register, and
        the masked 16-bit 128 × 64 dS with the margin is at 255 (sm_90a spills 4 B otherwise).
    Shapes: the chunk's bounds row0, row_end (≤ M), col0, col_end (≤ N); D;
        offset (row i's positive is column offset + i).
    Constexprs: HAS_MARGIN (``Scalars.margin_tile``), PREC (``precision._dot``), SLICE (``cfg.RESIDUAL_SLICE``,
        dividing both tile sides), BLOCK_M × BLOCK_N tiles, BLOCK_K the reduction step (the
        forward's: the same tiles to the bit). Derived (``launch.derived``): MASK (thr_ptr or
        gk_ptr), COSINE (thr_ptr), CAPTIONS (cq_ptr), GROUPS (gk_ptr), SHIFT (s_ptr), ROUND16 (res_r_ptr).
    """
    offs_m, mask_m, offs_n, mask_n, _, _ = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    logit_scale, gamma, thr = _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, COSINE)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    rk, r_mk = _load2(rk_ptr, r_mk_ptr, offs_n, mask_n)
    if CAPTIONS or GROUPS:  # the family's masking (``family_tiles``)
        z = _family_tile((q_ptr, stride_qm, stride_qd), (k_ptr, stride_kn, stride_kd),
                         (mq_ptr, stride_mqm, stride_mqd), (mk_ptr, stride_mkn, stride_mkd),
                         ((cq_ptr, D, 1), (ck_ptr, D, 1)), (gq_ptr, gk_ptr, K),
                         (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                         D, gamma, logit_scale, thr,
                         HAS_MARGIN, COSINE, CAPTIONS, GROUPS, PREC,
                         BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        z = _logits_tile((q_ptr, stride_qm, stride_qd), (k_ptr, stride_kn, stride_kd),
                         (mq_ptr, stride_mqm, stride_mqd), (mk_ptr, stride_mkn, stride_mkd),
                         (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                         D, gamma, logit_scale, thr,
                         HAS_MARGIN, MASK, PREC,
                         BLOCK_M, BLOCK_N, BLOCK_K)
    w, mask = _w_tile_directional(z, (offs_m, mask_m), (offs_n, mask_n), offset,
                                  (pos_ptr, nll_ptr, g_ptr, s_ptr),
                                  (a_ptr, b_ptr),
                                  MASK, SHIFT, ROUND16)
    _store_w(w, mask, (offs_m, mask_m, row0, row_end, tl.program_id(0) * (BLOCK_M // SLICE)),
             (offs_n, mask_n, col0, col_end, tl.program_id(1) * (BLOCK_N // SLICE)),
             w_ptr, 0, stride_w, res_r_ptr, 0, stride_rr, res_c_ptr, 0, stride_rc,
             ROUND16, SLICE, BLOCK_M, BLOCK_N)


@triton.jit
def _scaled_w(dscore, rows, cols, scales):
    """(W_ik = a_i · dS_ik · b_k in float32, the tile's bounds mask): ``scales`` = (a_ptr, b_ptr),
    the products' row and column scales (see ``scales.w_scales``)."""
    offs_m, mask_m = rows
    offs_n, mask_n = cols
    a_ptr, b_ptr = scales
    a = tl.load(a_ptr + offs_m, mask=mask_m, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)
    w = dscore * a[:, None] * b[None, :]
    return w, mask_m[:, None] & mask_n[None, :]


@triton.jit
def _w_tile_directional(z, rows, cols, offset, factors, scales,
                        MASK: tl.constexpr, SHIFT: tl.constexpr, FOLD: tl.constexpr):
    """W = a_i · dS_ik · b_k (float32) of one direction's tile z of logits (``_row_dscore``'s rows,
    columns, offset and row ``factors``; ``_scaled_w``'s ``scales``), and the tile's bounds mask."""
    _, dscore = _row_dscore(z, rows, cols, offset, factors, MASK, SHIFT, FOLD)
    return _scaled_w(dscore, rows, cols, scales)


@triton.jit
def _w_tile_symmetric(z, rows, cols, factors, col_factors, scales,
                      MASK: tl.constexpr, SHIFT: tl.constexpr, FOLD: tl.constexpr):
    """W of the single-process loss's tile z (offset 0): ``_w_tile_directional``'s dS of the rows'
    softmax plus g'_k P'_ki, the softmax of column k (t2i row k), so one tile serves i2t and t2i.
    ``col_factors`` = (nll_c_ptr, g_c_ptr, s_c_ptr) of the columns (their positives are pos_ptr's,
    the same diagonal; s_c_ptr read with SHIFT only)."""
    offs_n, mask_n = cols
    pos_ptr, _, _, _ = factors
    nll_c_ptr, g_c_ptr, s_c_ptr = col_factors
    neg, dscore = _row_dscore(z, rows, cols, 0, factors, MASK, SHIFT, FOLD)
    pos_c = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
    nll_c = tl.load(nll_c_ptr + offs_n, mask=mask_n, other=0.0)
    g_c = tl.load(g_c_ptr + offs_n, mask=mask_n, other=0.0)
    if SHIFT:
        s_c = tl.load(s_c_ptr + offs_n, mask=mask_n, other=0.0)
        p_c = tl.exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf")))
        dscore += tl.where(neg, p_c - s_c[None, :], 0.0) * g_c[None, :]
    else:
        dscore += _weighted_exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf")), g_c[None, :],
                                FOLD)
    return _scaled_w(dscore, rows, cols, scales)


@triton.jit
def _store_w(w, mask, rows, cols, w_ptr, w0, stride_w, res_r_ptr, r0, stride_rr, res_c_ptr, c0, stride_rc,
             ROUND16: tl.constexpr, SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a W tile (``_w_tile_directional`` / ``_w_tile_symmetric``) at rows ``rows`` = (offsets,
    mask, the chunk's first row, its end, the tile's first row slice) and columns ``cols`` alike of a row-major chunk buffer at entry w0
    of ``w_ptr`` (row stride ``stride_w``), in float32. With ROUND16 (16-bit features: the buffer
    is the staging W that :mod:`.round16` rounds with each line's own scale) also |W|'s maxima
    over each SLICE columns at entry r0 of ``res_r_ptr`` (stride ``stride_rr`` between slices) and
    over each SLICE rows at c0 of ``res_c_ptr`` (``stride_rc``); see ``_dscore_kernel``. The offsets
    are added here, under the flags: unread pointers are None."""
    offs_m, mask_m, row0, row_end, first_m = rows
    offs_n, mask_n, col0, col_end, first_n = cols
    if ROUND16:
        mag = tl.where(mask, tl.abs(w), 0.0)
        row_part = tl.max(tl.reshape(mag, (BLOCK_M, BLOCK_N // SLICE, SLICE)), axis=2)  # (BLOCK_M, slices)
        col_part = tl.max(tl.reshape(mag, (BLOCK_M // SLICE, SLICE, BLOCK_N)), axis=1)  # (slices, BLOCK_N)
        slices_n = tl.arange(0, BLOCK_N // SLICE)
        slices_m = tl.arange(0, BLOCK_M // SLICE)
        tl.store(res_r_ptr + r0 + (first_n + slices_n)[None, :] * stride_rr + (offs_m - row0)[:, None], row_part,
                 mask=mask_m[:, None] & (col0 + (first_n + slices_n) * SLICE < col_end)[None, :])
        tl.store(res_c_ptr + c0 + (first_m + slices_m)[:, None] * stride_rc + (offs_n - col0)[None, :], col_part,
                 mask=(row0 + (first_m + slices_m) * SLICE < row_end)[:, None] & mask_n[None, :])
    tl.store(w_ptr + w0 + (offs_m - row0)[:, None] * stride_w + (offs_n - col0)[None, :],
             w.to(w_ptr.dtype.element_ty), mask=mask)


@derived("dscore_pair", "MASK", "COSINE", "GROUPS", "SHIFT", "ROUND16")
@triton.jit
def _dscore_pair_kernel(
    v_ptr, t_ptr, stride_vm, stride_vd, stride_tm, stride_td,
    rv_ptr, rt_ptr, pos_ptr, nll_ptr, g_ptr, nll_c_ptr, g_c_ptr, a_ptr, b_ptr, s_ptr, s_c_ptr,
    logit_scale_ptr, gamma_ptr, thr_ptr, gk_ptr, K,
    w_ptr, res_r_ptr, res_c_ptr, mirror_w, mirror_r, mirror_c,
    row0, row_end, col0, col_end, D,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, SHIFT: tl.constexpr, PREC: tl.constexpr, ROUND16: tl.constexpr,
    COSINE: tl.constexpr, GROUPS: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The symmetric loss's dS over a chunk pair: chunk (a, b) = [row0, row_end) × [col0, col_end)
    and its mirror (b, a), both W's (``_w_tile_symmetric``, offset 0) from the tile pairs of
    ``tiles._pair_tiles`` (3 products a pair sharing the margin's G_IJ = t_I t_Jᵀ).

    Program (I, J) takes the tile of rows I (BLOCK_M) and columns J (BLOCK_N) of chunk (a, b),
    forms Z_IJ and Z_JIᵀ, and writes W_IJ into buffer ab and W_JI (transposed back) into buffer ba,
    with the residual slice sums of both. A diagonal chunk (row0 = col0, a square chunk) is its
    own mirror (mirror offsets 0): there tile rows I pair with the columns J right of their
    diagonal super-tile (BLOCK_M × BLOCK_M), the super-tile's tiles are formed alone (the
    positives; ``_logits_tile``), and programs left of it write nothing (their tiles are
    mirrors). Every logit is formed as the forward forms it (the same BLOCK_K): bit-identical.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of chunk (a, b).

    Features: v_ptr, t_ptr (N, D) (strides ``stride_<v|t><m|d>``).
    Per-row inputs: rv_ptr, rt_ptr (N) inverse norms; pos_ptr, nll_ptr, g_ptr, a_ptr, b_ptr, s_ptr
        as ``_dscore_kernel``'s (q = v, k = t); nll_c_ptr, g_c_ptr (N) the columns' (t2i rows') LSE
        and upstream gradient, s_c_ptr their ε/n (None without SHIFT).
    Scalars: as ``_dscore_kernel``'s. MASK (derived: COSINE or GROUPS): the pair tiles' one caption
        tile masks W_IJ and W_JI alike; gk_ptr (K = N) the family's group ids as
        ``forward_kernels._fwd_pair_kernel``'s (None without, GROUPS).
    Outputs: w_ptr, one flat buffer: W_ab (R × C, row-major) at 0, W_ba (C × R) at mirror_w;
        with ROUND16 res_r_ptr: ab's row slice maxima (⌈C / SLICE⌉, R)
        at 0, ba's (⌈R / SLICE⌉, C) at mirror_r; res_c_ptr: ab's column slice maxima
        (⌈R / SLICE⌉, C) at 0, ba's (⌈C / SLICE⌉, R) at mirror_c (R = row_end − row0,
        C = col_end − col0). Diagonal chunk: the mirror offsets 0 (one buffer each).
    Shapes: the chunk's bounds row0, row_end, col0, col_end (≤ N); D.
    Constexprs: as ``_dscore_kernel``; BLOCK_N divides BLOCK_M; chunk sides multiples of BLOCK_M.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, mask_m, offs_n, mask_n, rows_c, cols_c = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    logit_scale, gamma, thr = _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, COSINE)
    rv_m, rt_m = _load2(rv_ptr, rt_ptr, offs_m, mask_m)
    rv_n, rt_n = _load2(rv_ptr, rt_ptr, offs_n, mask_n)
    v = (v_ptr, stride_vm, stride_vd)
    t = (t_ptr, stride_tm, stride_td)
    factors = (pos_ptr, nll_ptr, g_ptr, s_ptr)  # the rows' (i2t), then the columns' (t2i) softmax
    col_factors = (nll_c_ptr, g_c_ptr, s_c_ptr)
    rows = (offs_m, mask_m, row0, row_end, pid_m * (BLOCK_M // SLICE))
    cols = (offs_n, mask_n, col0, col_end, pid_n * (BLOCK_N // SLICE))
    local_m = pid_m * BLOCK_M
    local_n = pid_n * BLOCK_N
    diagonal = row0 == col0
    if diagonal & (local_n >= local_m) & (local_n < local_m + BLOCK_M):
        # the diagonal super-tile: its tiles hold the positives and are formed alone, as the forward forms them
        z = _logits_tile(v, t, t, t,
                         (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rt_n, rt_n),
                         D, gamma, logit_scale, thr,
                         HAS_MARGIN, COSINE, PREC,
                         BLOCK_M, BLOCK_N, BLOCK_K)
        if GROUPS:
            z = _drop_same_group(z, gk_ptr, K, offs_m, mask_m, offs_n)
        w, mask = _w_tile_symmetric(z, (offs_m, mask_m), (offs_n, mask_n),
                                    factors, col_factors,
                                    (a_ptr, b_ptr),
                                    MASK, SHIFT, ROUND16)
        _store_w(w, mask, rows, cols, w_ptr, 0, cols_c, res_r_ptr, 0, rows_c, res_c_ptr, 0, cols_c,
                 ROUND16, SLICE, BLOCK_M, BLOCK_N)
    elif (row0 != col0) | (local_n >= local_m + BLOCK_M):
        z, zm = _pair_tiles(v, t,
                            (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                            D, gamma, logit_scale, thr,
                            HAS_MARGIN, COSINE, PREC,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        if GROUPS:  # as the forward: (i, j) and (j, i) alike
            z = _drop_same_group(z, gk_ptr, K, offs_m, mask_m, offs_n)
            zm = _drop_same_group(zm, gk_ptr, K, offs_m, mask_m, offs_n)
        w, mask = _w_tile_symmetric(z, (offs_m, mask_m), (offs_n, mask_n),
                                    factors, col_factors,
                                    (a_ptr, b_ptr),
                                    MASK, SHIFT, ROUND16)
        _store_w(w, mask, rows, cols, w_ptr, 0, cols_c, res_r_ptr, 0, rows_c, res_c_ptr, 0, cols_c,
                 ROUND16, SLICE, BLOCK_M, BLOCK_N)
        # the mirror: rows J, columns I of chunk (b, a), a C × R buffer
        wm, maskm = _w_tile_symmetric(tl.trans(zm), (offs_n, mask_n), (offs_m, mask_m),
                                      factors, col_factors,
                                      (a_ptr, b_ptr),
                                      MASK, SHIFT, ROUND16)
        _store_w(wm, maskm, cols, rows, w_ptr, mirror_w, rows_c, res_r_ptr, mirror_r, cols_c,
                 res_c_ptr, mirror_c, rows_c, ROUND16, SLICE, BLOCK_N, BLOCK_M)


@derived("dscore_rank", "MASK", "SHIFT", "ROUND16")
@triton.jit
def _dscore_rank_kernel(
    v_ptr, t_ptr, va_ptr, ta_ptr,
    stride_vm, stride_vd, stride_tm, stride_td, stride_van, stride_vad, stride_tan, stride_tad,
    rv_ptr, rt_ptr, rva_ptr, rta_ptr, pos_ptr, nll_ptr, g_ptr, a_ptr, b_ptr, s_ptr,
    logit_scale_ptr, gamma_ptr, thr_ptr,
    w_ptr, res_r_ptr, res_c_ptr, second_w, second_r, second_c,
    M, N, row0, row_end, col0, col_end, D, offset,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, SHIFT: tl.constexpr, PREC: tl.constexpr,
    ROUND16: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A distributed rank's dS of both directions over one chunk [row0, row_end) × [col0, col_end)
    of its M local rows against the N gathered columns: each program forms the i2t and t2i
    tiles from 3 products sharing G (``tiles._rank_tiles``) and writes both W's (each as
    ``_dscore_kernel`` writes its direction's), with their residual slice sums.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of the chunk.

    Features: as ``forward_kernels._fwd_rank_kernel``'s.
    Per-row inputs: the inverse norms rv_ptr … rta_ptr as ``_fwd_rank_kernel``'s; per line (2M:
        i2t rows, then t2i rows) pos_ptr, nll_ptr, g_ptr, the row scales a_ptr and (SHIFT) each
        line's ε/n_i s_ptr; per direction's columns (2N: i2t's keys t_all, then t2i's keys
        v_all) the column scales b_ptr.
    Scalars: as ``_dscore_kernel``'s.
    Outputs: w_ptr, one flat buffer: the i2t W (R × C, row-major) at 0 and the t2i W at
        second_w; with ROUND16 the slice maxima res_r_ptr (⌈C / SLICE⌉, R) and res_c_ptr
        (⌈R / SLICE⌉, C), the t2i direction's at second_r / second_c (R = row_end − row0,
        C = col_end − col0).
    Shapes: M, N; the chunk's bounds, D and offset as ``_dscore_kernel``'s. Constexprs: as its.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, mask_m, offs_n, mask_n, rows_c, cols_c = _chunk_tile(row0, row_end, col0, col_end, BLOCK_M, BLOCK_N)
    logit_scale, gamma, thr = _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN, MASK)
    rv_m, rt_m = _load2(rv_ptr, rt_ptr, offs_m, mask_m)
    rv_n, rt_n = _load2(rva_ptr, rta_ptr, offs_n, mask_n)
    z, zt = _rank_tiles((v_ptr, stride_vm, stride_vd), (t_ptr, stride_tm, stride_td),
                        (va_ptr, stride_van, stride_vad), (ta_ptr, stride_tan, stride_tad),
                        (offs_m, mask_m, rv_m, rt_m), (offs_n, mask_n, rv_n, rt_n),
                        D, gamma, logit_scale, thr,
                        HAS_MARGIN, MASK, PREC,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    rows = (offs_m, mask_m, row0, row_end, pid_m * (BLOCK_M // SLICE))
    cols = (offs_n, mask_n, col0, col_end, pid_n * (BLOCK_N // SLICE))
    w, mask = _w_tile_directional(z, (offs_m, mask_m), (offs_n, mask_n), offset,
                                  (pos_ptr, nll_ptr, g_ptr, s_ptr),
                                  (a_ptr, b_ptr),
                                  MASK, SHIFT, ROUND16)
    _store_w(w, mask, rows, cols, w_ptr, 0, cols_c, res_r_ptr, 0, rows_c, res_c_ptr, 0, cols_c,
             ROUND16, SLICE, BLOCK_M, BLOCK_N)
    # s_ptr is None without SHIFT (the t2i lines' shifts only exist with it); a local bound to None
    # inside the tuple breaks torch's TTIR mutation analysis (every input then counts as written)
    t2i_factors = (pos_ptr + M, nll_ptr + M, g_ptr + M, s_ptr)
    if SHIFT:
        t2i_factors = (pos_ptr + M, nll_ptr + M, g_ptr + M, s_ptr + M)
    w, mask = _w_tile_directional(zt, (offs_m, mask_m), (offs_n, mask_n), offset,
                                  t2i_factors,
                                  (a_ptr + M, b_ptr + N),
                                  MASK, SHIFT, ROUND16)
    _store_w(w, mask, rows, cols, w_ptr, second_w, cols_c, res_r_ptr, second_r, rows_c, res_c_ptr,
             second_c, cols_c, ROUND16, SLICE, BLOCK_M, BLOCK_N)


def dscore_args(features, per_row, sc: Scalars, outputs, shapes) -> dict:
    """``_dscore_kernel``'s arguments by name, group by group as its docstring lists them:
    ``features`` = (q, k, margin_q, margin_k); ``per_row`` = (rq, rk, r_mq, r_mk, pos, nll, g, a,
    b, s); the scalars ``sc.pointers`` and ``sc.family``'s; ``outputs`` = (w, res_r, res_c), the chunk's buffers
    (their row strides follow from the bounds); ``shapes`` = (row0, row_end, col0, col_end, D, offset)."""
    q, k, mq, mk = features
    rq, rk, r_mq, r_mk, pos, nll, g, a, b, s = per_row
    logit_scale, gamma, thr = sc.pointers
    w, res_r, res_c = outputs
    row0, row_end, col0, col_end, d, offset = shapes
    r, c = row_end - row0, col_end - col0  # the buffers' row strides: C, R, C
    return dict(
        q_ptr=q, k_ptr=k, mq_ptr=mq, mk_ptr=mk,
        stride_qm=q.stride(0), stride_qd=q.stride(1), stride_kn=k.stride(0), stride_kd=k.stride(1),
        stride_mqm=mq.stride(0), stride_mqd=mq.stride(1), stride_mkn=mk.stride(0), stride_mkd=mk.stride(1),
        rq_ptr=rq, rk_ptr=rk, r_mq_ptr=r_mq, r_mk_ptr=r_mk, pos_ptr=pos, nll_ptr=nll, g_ptr=g,
        a_ptr=a, b_ptr=b, s_ptr=s,
        logit_scale_ptr=logit_scale, gamma_ptr=gamma, thr_ptr=thr, **sc.family.pointers(),
        w_ptr=w, stride_w=c, res_r_ptr=res_r, stride_rr=r, res_c_ptr=res_c, stride_rc=c,
        row0=row0, row_end=row_end, col0=col0, col_end=col_end, D=d, offset=offset,
    )
