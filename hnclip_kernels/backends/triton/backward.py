"""Backward host walks: the negatives' shares of dL/dq̂ and dL/dk̂, one chunk of dS at a time.

Each walk launches a dS kernel (:mod:`.dscore`) per chunk, which writes W = diag(a) · dS · diag(b)
in float32 (scales: :mod:`.scales`), and multiplies it by the features in torch GEMMs (two per
chunk for float32 and bf16 features, four, head and tail, for fp16), accumulated in float32 over
the chunks. For 16-bit features each GEMM reads a float16 rounding of the chunk with each of its
output lines' own power of two (:mod:`.round16`, ``_rounded_products``), divided back out per
line. The epilogue divides the scales back out and adds the rounding compensation
(``epilogue.add_rounding_compensation``).

* :func:`directional_shares`: one direction, R × C chunks of ``cfg.chunk_shape`` (e·R·C ≤
  ``cfg.BWD_WORKSPACE_BYTES``, e.g. 8192 × 8192 for 256 MiB of float32), row blocks outer;
* :func:`rank_shares`: a rank's two directions on the same chunks, both W's from one launch;
* :func:`symmetric_shares`: the single-process loss, square chunk pairs (a, b ≥ a), W_ab and
  W_ba from the same tile pairs.

Chunks run in a fixed order and cuBLAS runs a given GEMM the same way every time on one GPU (no
split-K atomics in its default mode; with several streams, set CUBLAS_WORKSPACE_CONFIG=:4096:8
as ``torch.use_deterministic_algorithms`` asks): deterministic. ``workspace.backward_bytes``
states the peak.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from ...numerics import autocast_disabled, ieee_float32
from .. import epilogue
from . import config as cfg
from .dscore import launch_dscore, launch_dscore_pair, launch_dscore_rank
from .launch import strides
from .params import Scalars
from .round16 import launch_round16
from .scales import fit16, to_f16, w_scales


def _modes(x: torch.Tensor):
    """(round16, tail) for features like ``x``: 16-bit W (staged in float32, rounded per line by
    :mod:`.round16`), fp16's tail (bf16: one float16 W against float16 copies of the features)."""
    return x.dtype in (torch.bfloat16, torch.float16), x.dtype == torch.float16


def directional_shares(ops, norms, stats, g, sc: Scalars, offset: int, shifts=None):
    """Negatives' shares (times τ) of the directional op: dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``ops`` = (q, k, margin_q, margin_k), ``norms`` their inverse norms, ``stats`` the forward's
    row statistics, ``g`` (M) each row's upstream gradient, ``sc`` the operator's scalars (with
    ``sc.thr`` the masked entries get no dS); ``shifts`` = (ε/n_i of the rows,) with masking
    and label smoothing (``epilogue.smoothing_shift``), else None: the kept entries get
    dS_ik = g_i (P_ik − ε/n_i)."""
    q, k, _, _ = ops
    s = None if shifts is None else shifts[0]
    round16, tail = _modes(q)
    scales = [w_scales(q, k, norms[0], norms[1], (g,), round16, tail)]
    lse, weight = epilogue.row_factors(stats, g, shifted=s is not None)  # g_i P_ik = exp(d_ik − lse_i) weight_i

    # the kernel's argument groups that every chunk shares
    rows = (*ops, *strides(*ops), *norms, stats.pos, lse, weight)
    scalars_and_scales = (sc.inv_tau, sc.gamma, scales[0].a, scales[0].b, sc.thr, s)

    def launch_chunk(row0, row_end, col0, col_end, w, res_r, res_c):
        r, c = row_end - row0, col_end - col0
        outputs = (w, c, res_r, r, res_c, c)  # the chunk buffers and their row strides
        args = (*rows, *scalars_and_scales, *outputs, row0, row_end, col0, col_end, q.shape[1], offset)
        launch_dscore(sc, q.element_size(), r, c, args)

    ((d_q, d_k),) = _walk(((q, k, norms[0], norms[1]),), scales, offset, launch_chunk)
    return d_q, d_k


def rank_shares(ops, norms, stats, g, sc: Scalars, offset: int, shifts=None):
    """A distributed rank's two directions' negatives' shares (times τ), float32:
    ((dL/dv̂ (M, D), dL/dt̂_all (N, D)) of i2t, (dL/dt̂ (M, D), dL/dv̂_all (N, D)) of t2i).

    ``ops`` = (v, t, v_all, t_all) and ``norms`` as :func:`.forward.rank_stats`, ``stats`` = (i2t,
    t2i) its statistics of each direction's M rows, ``g`` (M) the rows' upstream gradient (each
    direction's); ``sc``, ``shifts`` (each direction's ε/n_i): as :func:`directional_shares`.
    One ``_dscore_rank_kernel`` launch per chunk writes both directions' W (the margin's G formed
    once per tile), then each direction's GEMMs run as the directional op's on the same chunks:
    each direction's shares are the directional op's to the bit (the tiles' own shapes aside)."""
    v, t, v_all, t_all = ops
    m, n = v.shape[0], v_all.shape[0]
    dirs = ((v, t_all, norms[0], norms[3]), (t, v_all, norms[1], norms[2]))
    s = None if shifts is None else torch.cat(shifts)
    # per direction, as its directional op forms them (torch's vectorised softplus rounds a loop's tail apart)
    factors = [(x.pos, *epilogue.row_factors(x, g, shifted=s is not None)) for x in stats]
    pos, lse, weight = (torch.cat(parts) for parts in zip(*factors))
    round16, tail = _modes(v)
    scales = [w_scales(*d, (g,), round16, tail) for d in dirs]  # the rows' upstream gradient bounds |dS|
    a, b = torch.cat([x.a for x in scales]), torch.cat([x.b for x in scales])

    rows = (*ops, *strides(*ops), *norms, pos, lse, weight)  # the kernel's argument groups that every chunk shares
    scalars_and_scales = (sc.inv_tau, sc.gamma, a, b, sc.thr, s)

    def launch_chunk(row0, row_end, col0, col_end, w, res_r, res_c):
        r, c = row_end - row0, col_end - col0
        row_slices, col_slices = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
        second = (r * c, col_slices * r, row_slices * c) if round16 else (r * c, 0, 0)  # the t2i W and its maxima
        shapes = (m, n, row0, row_end, col0, col_end, v.shape[1], offset)
        args = (*rows, *scalars_and_scales, w, res_r, res_c, *second, *shapes)
        launch_dscore_rank(sc, v.element_size(), r, c, args)

    return _walk(dirs, scales, offset, launch_chunk)


def _walk(dirs, scales, offset: int, launch_chunk):
    """The chunk walk of the directional op (one direction) and of a rank's pair (two): ``dirs``
    holds each direction's (rows q (M, D), columns k (N, D), their inverse norms), ``scales``
    each one's :func:`.scales.w_scales`; ``launch_chunk(row0, row_end, col0, col_end, w, res_r,
    res_c)`` writes every direction's W of one chunk into its fresh buffers (direction i's at
    i·R·C, its slice maxima likewise). Chunks of ``cfg.chunk_shape(M, N)``, row blocks outer; per
    direction two GEMMs a chunk (four with fp16's tail), accumulated in chunk order. Returns each
    direction's (d_q, d_k), scaled back, with the rounding compensation."""
    q0 = dirs[0][0]
    m, n, dev = q0.shape[0], dirs[0][1].shape[0], q0.device
    round16, tail = _modes(q0)
    rows, cols = cfg.chunk_shape(m, n, dtype=q0.dtype)
    n_dirs, col_chunks = len(dirs), triton.cdiv(n, cols)
    d_q_parts, rho_parts = [[] for _ in dirs], [[] for _ in dirs]
    d_k_parts, sigma_parts = [[None] * col_chunks for _ in dirs], [[None] * col_chunks for _ in dirs]
    # the GEMMs accumulate in float32 whatever autocast region the backward runs in
    with ieee_float32(dev), autocast_disabled(dev):
        for row0 in range(0, m, rows):
            row_end = min(row0 + rows, m)
            acc_q, rho = [None] * n_dirs, [None] * n_dirs
            q_rows = [
                _rows(q, row0, row_end) if sc.f16 is None else to_f16(_rows(q, row0, row_end), sc.f16[0][row0:row_end])
                for (q, _, _, _), sc in zip(dirs, scales)
            ]
            for j, col0 in enumerate(range(0, n, cols)):
                col_end = min(col0 + cols, n)
                r, c = row_end - row0, col_end - col0
                row_slices, col_slices = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
                # a fresh workspace per chunk, the previous one freed first (the allocator hands its
                # memory back): never a view into a shared buffer, which a traced operator would
                # write through a scatter. Each direction's row slice maxima (col_slices, r), column ones (row_slices, c)
                w, res_r, res_c = _w_buffers(
                    n_dirs * r * c, n_dirs * col_slices * r, n_dirs * row_slices * c, round16, dev
                )
                launch_chunk(row0, row_end, col0, col_end, w, res_r, res_c)
                stage = _stage_buffers(r * c, round16, tail, dev)
                for i, (_, k, _, _) in enumerate(dirs):
                    k_cols = _rows(k, col0, col_end)
                    if scales[i].f16 is not None:
                        k_cols = to_f16(k_cols, scales[i].f16[1][col0:col_end])  # this column block's float16 copy
                    w_i = w[i * r * c : (i + 1) * r * c]
                    if not round16:
                        acc_q[i] = _mm(w_i.view(r, c), k_cols, acc_q[i])
                        d_k_parts[i][j] = _mm(w_i.view(r, c).t(), q_rows[i], d_k_parts[i][j])
                        del k_cols, w_i  # views: they would keep this chunk's buffers alive
                        continue
                    maxima = (
                        res_r[i * col_slices * r : (i + 1) * col_slices * r].view(col_slices, r),
                        res_c[i * row_slices * c : (i + 1) * row_slices * c].view(row_slices, c),
                    )
                    line_scales = (scales[i].a[row0:row_end], scales[i].b[col0:col_end])
                    d_q, d_k, rho_i, sigma_i = _rounded_products(w_i, line_scales, maxima, (q_rows[i], k_cols), stage)
                    acc_q[i], rho[i] = _add(acc_q[i], d_q), _add(rho[i], rho_i)  # over chunks in chunk order
                    d_k_parts[i][j], sigma_parts[i][j] = _add(d_k_parts[i][j], d_k), _add(sigma_parts[i][j], sigma_i)
                    del k_cols, w_i, maxima  # views: they would keep this chunk's buffers alive
                del w, res_r, res_c, stage  # one chunk alive at a time
            del q_rows
            for i in range(n_dirs):
                d_q_parts[i].append(acc_q[i])
                rho_parts[i].append(rho[i])
    out = []
    for i, (q, k, r_q, r_k) in enumerate(dirs):
        d_q = _cat(d_q_parts[i]).div_(scales[i].rq[:, None])
        d_k = _cat(d_k_parts[i]).div_(scales[i].rk[:, None])
        if round16:
            epilogue.add_rounding_compensation(
                d_q, d_k, _cat(rho_parts[i]), _cat(sigma_parts[i]), q, k, r_q, r_k, offset
            )
        out.append((d_q, d_k))
    return out


def _rounded_products(w32, line_scales, maxima, features, stage):
    """One staged R × C float32 W (``w32``, W's scales ``line_scales`` = (a over its rows, b over its
    columns)) rounded to float16 twice (:mod:`.round16`) and multiplied: (W̃_rows · k (R, D) and
    W̃_colsᵀ · q (C, D), each line divided by its own power of two, so in W's units; ρ (R) and σ (C)
    the residuals' line sums). ``maxima`` = (|W|'s row slice maxima (⌈C / SLICE⌉, R), column slice
    maxima (⌈R / SLICE⌉, C)), overwritten by the residuals' slice sums; ``features`` = (q rows
    (R, D), k columns (C, D)) as the GEMMs read them; ``stage`` = (W̃, W̃_lo or None), R·C float16."""
    row_max, col_max = maxima
    q, k = features
    r, c = row_max.shape[1], col_max.shape[1]
    row_scale, col_scale = fit16(row_max.amax(0)), fit16(col_max.amax(0))
    launch_round16(True, w32, line_scales, row_scale, (*stage, row_max), (r, c))
    d_q = _products(stage, (r, c), k, transpose=False).div_(row_scale[:, None])
    rho = row_max.sum(0)  # slice sums merged in a fixed order
    launch_round16(False, w32, line_scales, col_scale, (*stage, col_max), (r, c))
    d_k = _products(stage, (r, c), q, transpose=True).div_(col_scale[:, None])
    return d_q, d_k, rho, col_max.sum(0)


def _products(stage, shape, x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """W̃ · x (or W̃ᵀ · x) from the staged float16 head (and tail) of shape R × C, float32."""
    out = None
    for buf in stage:
        if buf is not None:
            w = buf.view(shape)
            out = _mm(w.t() if transpose else w, x, out)
    return out


def _add(acc, x):
    return x if acc is None else acc + x


def symmetric_shares(ops, norms, rows, cols, sc: Scalars, shifts=None):
    """The single-process loss's negatives' shares (times τ), float32: dL/dv̂ (N, D) and dL/dt̂ (N, D)
    of both directions at once (M = N, offset 0).

    ``ops`` = (v, t), ``norms`` their inverse norms; ``rows`` = (i2t statistics, g),
    ``cols`` = (t2i statistics, g'), each direction's upstream gradient; ``sc`` as
    :func:`directional_shares`; ``shifts`` = (the rows' ε/n_i, the columns') or None. Square
    chunks (``cfg.chunk_shape(square=True)``), pairs (a, b ≥ a) in order
    (``_dscore_pair_kernel``): a pair b > a writes W_ab and W_ba from the same tile pairs, a
    diagonal pair W_aa; then the GEMMs of each buffer, accumulated per chunk in pair order."""
    (stats, g), (_, g_c) = rows, cols
    v, t = ops
    n, d = v.shape
    s = (None, None) if shifts is None else shifts
    # g_i P_ik = exp(d_ik − lse_i) weight_i for each direction's rows
    (lse, weight), (lse_c, weight_c) = (epilogue.row_factors(x, y, shifted=shifts is not None) for x, y in (rows, cols))
    round16, tail = _modes(v)
    scales = w_scales(v, t, norms[0], norms[1], (g, g_c), round16, tail)
    side, _ = cfg.chunk_shape(n, n, square=True, dtype=v.dtype)
    bounds = [(c0, min(c0 + side, n)) for c0 in range(0, n, side)]
    parts = PairParts(*([None] * len(bounds) for _ in range(4)))
    dev = v.device

    def copies(start, end):  # the features of one chunk: float16 copies for bf16 (exact, see scales)
        vr, tr = _rows(v, start, end), _rows(t, start, end)
        if scales.f16 is None:
            return vr, tr
        return to_f16(vr, scales.f16[0][start:end]), to_f16(tr, scales.f16[1][start:end])

    # the kernel's argument groups that every chunk pair shares
    row_args = (v, t, *strides(v, t), *norms, stats.pos, lse, weight, sc.inv_tau, sc.gamma)
    columns_and_scales = (lse_c, weight_c, scales.a, scales.b, sc.thr, s[0], s[1])
    with ieee_float32(dev), autocast_disabled(dev):
        for ia, (row0, row_end) in enumerate(bounds):
            chunk_a = (ia, row0, row_end, *copies(row0, row_end))
            for ib in range(ia, len(bounds)):
                col0, col_end = bounds[ib]
                chunk_b = (ib, col0, col_end, *copies(col0, col_end)) if ib > ia else chunk_a
                _chunk_pair(chunk_a, chunk_b, (row_args, columns_and_scales, d), sc, scales, parts, round16, tail)
                del chunk_b  # one chunk pair alive at a time
            del chunk_a
    d_v, d_t = _cat(parts.d_q).div_(scales.rq[:, None]), _cat(parts.d_k).div_(scales.rk[:, None])
    if round16:
        epilogue.add_rounding_compensation(d_v, d_t, _cat(parts.rho), _cat(parts.sigma), v, t, norms[0], norms[1], 0)
    return d_v, d_t


class PairParts(NamedTuple):
    """The symmetric walk's per-chunk accumulators (lists, one entry a chunk, None until written):
    the rows' and columns' shares (in W's units) and their residual sums."""

    d_q: list
    d_k: list
    rho: list
    sigma: list


def _chunk_pair(chunk_a, chunk_b, args, sc: Scalars, scales, parts: PairParts, round16: bool, tail: bool):
    """One chunk pair (a, b ≥ a) of :func:`symmetric_shares`: ``chunk_*`` = (index, first row, end,
    v rows, t rows (float16 copies for bf16)); ``args`` = (the row groups, the columns' groups and
    scales, D) of ``_dscore_pair_kernel``. Writes W_ab (and for b > a W_ba) and adds each buffer's
    GEMMs to ``parts``, in pair order."""
    ia, row0, row_end, q_a, k_a = chunk_a
    ib, col0, col_end, q_b, k_b = chunk_b
    row_args, columns_and_scales, d = args
    r, c, pair = row_end - row0, col_end - col0, ib > ia
    row_slices, col_slices = (
        (triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)) if round16 else (0, 0)
    )
    # fresh buffers per chunk pair (the previous ones freed first): W_ab then W_ba, flat;
    # ab's row maxima (col_slices, r) then ba's (row_slices, c); ab's column maxima (row_slices, c) then ba's (col_slices, r)
    w, res_r, res_c = _w_buffers(
        (2 if pair else 1) * r * c,
        col_slices * r + (row_slices * c if pair else 0),
        row_slices * c + (col_slices * r if pair else 0),
        round16,
        dev=q_a.device,
    )
    mirror = (r * c, col_slices * r, row_slices * c) if pair else (0, 0, 0)
    launch_dscore_pair(
        sc,
        q_a.element_size(),
        r,
        c,
        (*row_args, *columns_and_scales, w, res_r, res_c, *mirror, row0, row_end, col0, col_end, d),
    )
    # (rows chunk, columns chunk, W, its rows' q, its columns' k, the maxima's slices): W_ab, then W_ba
    buffers = [(ia, ib, row0, row_end, col0, col_end, w[: r * c], q_a, k_b, (col_slices, r), (row_slices, c), 0, 0)]
    if pair:
        rest = (col_slices * r, row_slices * c)
        buffers.append(
            (ib, ia, col0, col_end, row0, row_end, w[r * c :], q_b, k_a, (row_slices, c), (col_slices, r), *rest)
        )
    stage = _stage_buffers(r * c, round16, tail, q_a.device)
    for i_rows, i_cols, lo_r, hi_r, lo_c, hi_c, w_x, q_x, k_x, rows_shape, cols_shape, at_r, at_c in buffers:
        n_rows, n_cols = rows_shape[1], cols_shape[1]
        if not round16:
            parts.d_q[i_rows] = _mm(w_x.view(n_rows, n_cols), k_x, parts.d_q[i_rows])
            parts.d_k[i_cols] = _mm(w_x.view(n_rows, n_cols).t(), q_x, parts.d_k[i_cols])
            continue
        maxima = (
            res_r[at_r : at_r + rows_shape[0] * n_rows].view(rows_shape),
            res_c[at_c : at_c + cols_shape[0] * n_cols].view(cols_shape),
        )
        line_scales = (scales.a[lo_r:hi_r], scales.b[lo_c:hi_c])
        d_q, d_k, rho, sigma = _rounded_products(w_x, line_scales, maxima, (q_x, k_x), stage)
        parts.d_q[i_rows], parts.rho[i_rows] = _add(parts.d_q[i_rows], d_q), _add(parts.rho[i_rows], rho)
        parts.d_k[i_cols], parts.sigma[i_cols] = _add(parts.d_k[i_cols], d_k), _add(parts.sigma[i_cols], sigma)
    del w, res_r, res_c, stage, buffers


def _w_buffers(w_len: int, res_r_len: int, res_c_len: int, round16: bool, dev):
    """One chunk's fresh dS buffers (w, res_r, res_c): W in float32 (for 16-bit features the staging
    buffer :mod:`.round16` rounds), the float32 row and column slice maxima (16-bit only, None
    otherwise: ROUND16 derives from that), later the residuals' slice sums."""
    w = torch.empty(w_len, device=dev, dtype=torch.float32)
    if not round16:
        return w, None, None
    return (
        w,
        torch.empty(res_r_len, device=dev, dtype=torch.float32),
        torch.empty(res_c_len, device=dev, dtype=torch.float32),
    )


def _stage_buffers(length: int, round16: bool, tail: bool, dev):
    """The rounded float16 W (and fp16's tail) of one R × C chunk, reused by each rounding; None for float32."""
    if not round16:
        return None
    return (
        torch.empty(length, device=dev, dtype=torch.float16),
        torch.empty(length, device=dev, dtype=torch.float16) if tail else None,
    )


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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


def _rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """x[start:end], or x itself when that is all of it (a traced operator then writes the
    tensor, not a view of it: no scatter back into a base)."""
    return x if (start, end) == (0, x.shape[0]) else x[start:end]
