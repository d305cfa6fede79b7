"""Backward host walks: the negatives' shares of dL/dq̂ and dL/dk̂, one chunk of dS at a time.

Each walk launches a dS kernel (:mod:`.dscore`) per chunk, which writes W = diag(a) · dS · diag(b)
in float32 (scales: :mod:`.scales`), and multiplies it by the features in torch GEMMs (two per
chunk for float32 and bf16 features, four, head and tail, for fp16), accumulated in float32 over
the chunks. For 16-bit features each GEMM reads a float16 rounding of the chunk with each of its
output lines' own power of two (:mod:`.round16`, ``_add_products``), divided back out per
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
from .. import epilogue, softmax
from . import config as cfg
from .dscore_launch import launch_dscore, launch_dscore_pair, launch_dscore_rank
from .params import Scalars
from .round16 import launch_round16
from .scales import fit16, to_f16, w_scales


def _modes(x: torch.Tensor):
    """(round16, tail) for features like ``x``: 16-bit W (staged in float32, rounded per line by
    :mod:`.round16`), fp16's tail (bf16: one float16 W against float16 copies of the features)."""
    return x.dtype in (torch.bfloat16, torch.float16), x.dtype == torch.float16


def directional_shares(ops, norms, stats, g, sc: Scalars, offset: int, shifts=None, positives=None):
    """Negatives' shares (times τ) of the directional op: dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``ops`` = (q, k, margin_q, margin_k), ``norms`` their inverse norms, ``stats`` the forward's
    row statistics, ``g`` (M) each row's upstream gradient, ``sc`` the operator's scalars (with
    ``sc.thr`` the masked entries get no dS); ``shifts`` = (ε/n_i of the rows,) with masking
    and label smoothing (``backends.softmax.smoothing_shift``), else None: the kept entries get
    dS_ik = g_i (P_ik − ε/n_i). ``positives`` = (the rows' positive keys (M, D), their inverse
    norms) where they are not among k (the family's negative block, ``offset`` past k): 16-bit
    rounding compensation refers each row to them (the columns keep their error)."""
    q, k, _, _ = ops
    s = None if shifts is None else shifts[0]
    round16, tail = _modes(q)
    scale = w_scales(q, k, norms[0], norms[1], (g,), round16, tail)
    lse, weight = softmax.row_factors(stats, g, shifted=s is not None)  # g_i P_ik = exp(d_ik − lse_i) weight_i
    per_row = (*norms, stats.pos, lse, weight, scale.a, scale.b, s)  # every chunk's alike

    def launch_chunk(bounds, buffers):
        launch_dscore(sc, ops, per_row, buffers, (*bounds, q.shape[1], offset))

    ((d_q, d_k),) = _walk(((q, k, norms[0], norms[1]),), [scale], offset, launch_chunk, positives)
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
    factors = [(x.pos, *softmax.row_factors(x, g, shifted=s is not None)) for x in stats]
    pos, lse, weight = (torch.cat(parts) for parts in zip(*factors))
    round16, tail = _modes(v)
    scales = [w_scales(*d, (g,), round16, tail) for d in dirs]  # the rows' upstream gradient bounds |dS|
    a, b = torch.cat([x.a for x in scales]), torch.cat([x.b for x in scales])
    per_row = (*norms, pos, lse, weight, a, b, s)  # every chunk's alike

    def launch_chunk(bounds, buffers):
        r, c = bounds[1] - bounds[0], bounds[3] - bounds[2]
        row_slices, col_slices = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
        second = (r * c, col_slices * r, row_slices * c) if round16 else (r * c, 0, 0)  # the t2i W and its maxima
        launch_dscore_rank(sc, ops, per_row, (*buffers, second), (m, n, *bounds, v.shape[1], offset))

    return _walk(dirs, scales, offset, launch_chunk)


def _walk(dirs, scales, offset: int, launch_chunk, positives=None):
    """The chunk walk of the directional op (one direction) and of a rank's pair (two): ``dirs``
    holds each direction's (rows q (M, D), columns k (N, D), their inverse norms), ``scales``
    each one's :func:`.scales.w_scales`; ``launch_chunk((row0, row_end, col0, col_end), (w, res_r,
    res_c))`` writes every direction's W of one chunk into its fresh buffers (direction i's at
    i·R·C, its slice maxima likewise). Chunks of ``cfg.chunk_shape(M, N)``, row blocks outer; per
    direction two GEMMs a chunk (four with fp16's tail), accumulated in chunk order. Returns each
    direction's (d_q, d_k), scaled back, with the rounding compensation (``positives``: as
    :func:`directional_shares`')."""
    q0 = dirs[0][0]
    m, n, dev = q0.shape[0], dirs[0][1].shape[0], q0.device
    round16, tail = _modes(q0)
    chunk_rows, chunk_cols = cfg.chunk_shape(m, n, dtype=q0.dtype)
    n_dirs, col_chunks = len(dirs), triton.cdiv(n, chunk_cols)
    d_q_parts, rho_parts = [[] for _ in dirs], [[] for _ in dirs]
    d_k_parts, sigma_parts = [[None] * col_chunks for _ in dirs], [[None] * col_chunks for _ in dirs]
    # the GEMMs accumulate in float32 whatever autocast region the backward runs in
    with ieee_float32(dev), autocast_disabled(dev):
        for row0 in range(0, m, chunk_rows):
            row_end = min(row0 + chunk_rows, m)
            acc_q, rho = [None] * n_dirs, [None] * n_dirs
            q_rows = [
                _operand(q, row0, row_end, None if x.f16 is None else x.f16.q) for (q, *_), x in zip(dirs, scales)
            ]
            for j, col0 in enumerate(range(0, n, chunk_cols)):
                col_end = min(col0 + chunk_cols, n)
                r, c = row_end - row0, col_end - col0
                row_slices, col_slices = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
                # a fresh workspace per chunk, the previous one freed first (the allocator hands its
                # memory back): never a view into a shared buffer, which a traced operator would
                # write through a scatter. Each direction's row slice maxima (col_slices, r), column ones (row_slices, c)
                w, res_r, res_c = _w_buffers(
                    n_dirs * r * c, n_dirs * col_slices * r, n_dirs * row_slices * c, round16, dev
                )
                launch_chunk((row0, row_end, col0, col_end), (w, res_r, res_c))
                stage = _stage_buffers(r * c, round16, tail, dev)
                for i, ((_, k, _, _), x) in enumerate(zip(dirs, scales)):
                    # this column block's k as the GEMMs read it (bf16: its float16 copy), direction i's W
                    rounding = None
                    if round16:
                        at = (i * col_slices * r, i * row_slices * c)
                        rounding = (res_r, res_c, at, (x.a[row0:row_end], x.b[col0:col_end]), stage)
                    acc_q[i], d_k_parts[i][j], rho[i], sigma_parts[i][j] = _add_products(
                        (acc_q[i], d_k_parts[i][j], rho[i], sigma_parts[i][j]),
                        w[i * r * c : (i + 1) * r * c],
                        (q_rows[i], _operand(k, col0, col_end, None if x.f16 is None else x.f16.k)),
                        rounding,
                    )
                    del rounding  # it holds this chunk's buffers
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
                d_q, d_k, _cat(rho_parts[i]), _cat(sigma_parts[i]), q, k, r_q, r_k, offset, positives
            )
        out.append((d_q, d_k))
    return out


def _add_products(acc, w, features, rounding):
    """``acc`` plus the products of one R × C buffer ``w`` of W (flat, row-major): ``acc`` = (the
    rows' shares (R, D), the columns' (C, D), ρ (R), σ (C)), None where nothing was added yet;
    ``features`` = (the rows' q (R, D), the columns' k (C, D)) as the GEMMs read them.

    float32 (``rounding`` None): W · k and Wᵀ · q added by ``torch.addmm``, the rows' first.
    16-bit: ``rounding`` = (res_r, res_c, (this buffer's row maxima's offset in res_r, its column
    maxima's in res_c), W's scales (a over its rows, b over its columns), the stage (W̃, W̃_lo or
    None), R·C float16). The staged float32 W is rounded to float16 twice (:mod:`.round16`), with
    each row's and then each column's own power of two, and multiplied: W̃_rows · k and W̃_colsᵀ · q,
    each line divided by its own power of two (so in W's units); |W|'s row slice maxima (⌈C /
    SLICE⌉, R) and column ones (⌈R / SLICE⌉, C) are overwritten by the residuals' slice sums,
    whose line sums add to ρ and σ. (One function, not two: ``triton_op`` follows calls at most
    5 deep from the operator body to find ``launch_round16``.)"""
    d_q, d_k, rho, sigma = acc
    q, k = features
    r, c = q.shape[0], k.shape[0]
    if rounding is None:
        return _mm(w.view(r, c), k, d_q), _mm(w.view(r, c).t(), q, d_k), rho, sigma
    res_r, res_c, (at_r, at_c), line_scales, stage = rounding
    row_slices, col_slices = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
    row_max = res_r[at_r : at_r + col_slices * r].view(col_slices, r)
    col_max = res_c[at_c : at_c + row_slices * c].view(row_slices, c)
    row_scale, col_scale = fit16(row_max.amax(0)), fit16(col_max.amax(0))
    launch_round16(True, w, line_scales, row_scale, (*stage, row_max), (r, c))
    d_q = _add(d_q, _products(stage, (r, c), k, transpose=False).div_(row_scale[:, None]))
    rho = _add(rho, row_max.sum(0))  # slice sums merged in a fixed order; over chunks in chunk order
    launch_round16(False, w, line_scales, col_scale, (*stage, col_max), (r, c))
    d_k = _add(d_k, _products(stage, (r, c), q, transpose=True).div_(col_scale[:, None]))
    return d_q, d_k, rho, _add(sigma, col_max.sum(0))


def _operand(x: torch.Tensor, start: int, end: int, f16_scale) -> torch.Tensor:
    """x's rows [start, end) as the GEMMs read them: as they are, or (bf16, ``f16_scale`` the
    :class:`.scales.F16Scales` part of x) their exact float16 copy, a workspace buffer."""
    rows = _rows(x, start, end)
    return rows if f16_scale is None else to_f16(rows, f16_scale[start:end])


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


def symmetric_shares(ops, norms, i2t, t2i, sc: Scalars, shifts=None):
    """The single-process loss's negatives' shares (times τ), float32: dL/dv̂ (N, D) and dL/dt̂ (N, D)
    of both directions at once (M = N, offset 0).

    ``ops`` = (v, t), ``norms`` their inverse norms; ``i2t`` = (the rows' statistics, g),
    ``t2i`` = (the columns' statistics, g'), each direction's upstream gradient; ``sc`` as
    :func:`directional_shares`; ``shifts`` = (the rows' ε/n_i, the columns') or None. Square
    chunks (``cfg.chunk_shape(square=True)``), pairs (a, b ≥ a) in order
    (``_dscore_pair_kernel``): a pair b > a writes W_ab and W_ba from the same tile pairs, a
    diagonal pair W_aa; then the GEMMs of each buffer, accumulated per chunk in pair order."""
    (stats, g), (_, g_c) = i2t, t2i
    v, t = ops
    s, s_c = (None, None) if shifts is None else shifts
    # g_i P_ik = exp(d_ik − lse_i) weight_i for each direction's rows
    (lse, weight), (lse_c, weight_c) = (softmax.row_factors(x, y, shifted=shifts is not None) for x, y in (i2t, t2i))
    round16, tail = _modes(v)
    scales = w_scales(v, t, norms[0], norms[1], (g, g_c), round16, tail)
    per_row = (*norms, stats.pos, lse, weight, lse_c, weight_c, scales.a, scales.b, s, s_c)  # every pair's alike

    def launch_pair(bounds, outputs):
        launch_dscore_pair(sc, ops, per_row, outputs, (*bounds, v.shape[1]))

    parts = _pair_walk(ops, scales, launch_pair, round16, tail)
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


def _pair_walk(ops, scales, launch_pair, round16: bool, tail: bool) -> PairParts:
    """The chunk pairs (a, b ≥ a) of :func:`symmetric_shares` in order over square chunks of
    ``cfg.chunk_shape(N, N, square=True)``: ``launch_pair((row0, row_end, col0, col_end), (w,
    res_r, res_c, mirror offsets))`` writes a pair's W (``_chunk_pair``)."""
    v, t = ops
    n, dev = v.shape[0], v.device
    side, _ = cfg.chunk_shape(n, n, square=True, dtype=v.dtype)
    bounds = [(c0, min(c0 + side, n)) for c0 in range(0, n, side)]
    parts = PairParts(*([None] * len(bounds) for _ in range(4)))
    s_v, s_t = (None, None) if scales.f16 is None else (scales.f16.q, scales.f16.k)

    def copies(start, end):  # the features of one chunk: float16 copies for bf16 (exact, see scales)
        return _operand(v, start, end, s_v), _operand(t, start, end, s_t)

    with ieee_float32(dev), autocast_disabled(dev):
        for ia, (row0, row_end) in enumerate(bounds):
            chunk_a = (ia, row0, row_end, *copies(row0, row_end))
            for ib in range(ia, len(bounds)):
                col0, col_end = bounds[ib]
                chunk_b = (ib, col0, col_end, *copies(col0, col_end)) if ib > ia else chunk_a
                _chunk_pair(chunk_a, chunk_b, launch_pair, scales, parts, round16, tail)
                del chunk_b  # one chunk pair alive at a time
            del chunk_a
    return parts


def _chunk_pair(chunk_a, chunk_b, launch_pair, scales, parts: PairParts, round16: bool, tail: bool):
    """One chunk pair (a, b ≥ a) of :func:`_pair_walk`: ``chunk_*`` = (index, first row, end,
    v rows, t rows (float16 copies for bf16)). Writes W_ab (and for b > a W_ba) and adds each
    buffer's GEMMs to ``parts``, in pair order."""
    ia, row0, row_end, q_a, k_a = chunk_a
    ib, col0, col_end, q_b, k_b = chunk_b
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
    launch_pair((row0, row_end, col0, col_end), (w, res_r, res_c, mirror))
    stage = _stage_buffers(r * c, round16, tail, q_a.device)

    def add(i_rows, i_cols, buffer, features, at, line_scales):  # one buffer's GEMMs into its chunks' parts
        rounding = (res_r, res_c, at, line_scales, stage) if round16 else None
        acc = (parts.d_q[i_rows], parts.d_k[i_cols], parts.rho[i_rows], parts.sigma[i_cols])
        parts.d_q[i_rows], parts.d_k[i_cols], parts.rho[i_rows], parts.sigma[i_cols] = _add_products(
            acc, buffer, features, rounding
        )

    add(ia, ib, w[: r * c], (q_a, k_b), (0, 0), (scales.a[row0:row_end], scales.b[col0:col_end]))  # W_ab
    if pair:  # W_ba: rows b, columns a
        add(ib, ia, w[r * c :], (q_b, k_a), mirror[1:], (scales.a[col0:col_end], scales.b[row0:row_end]))


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
