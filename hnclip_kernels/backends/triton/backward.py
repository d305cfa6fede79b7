"""Backward host walks: the negatives' shares of dL/dq̂ and dL/dk̂, one chunk of dS at a time.

Each walk launches a dS kernel (:mod:`.dscore`) per chunk, which writes W = diag(a) · dS · diag(b)
in the type the GEMMs read (scales: :mod:`.scales`), and multiplies it by the features in torch
GEMMs (two per chunk for float32 and bf16 features, four, head and tail, for fp16), each
accumulated in float32 over the chunks (``torch.addmm``); the epilogue divides the scales back
out and adds the rounding compensation (``epilogue.add_rounding_compensation``).

* :func:`directional_shares`: one direction, R × C chunks of ``cfg.chunk_shape`` (4·R·C ≤
  ``cfg.BWD_WORKSPACE_BYTES``, e.g. 8192 × 8192 for 256 MiB), row blocks outer;
* :func:`rank_shares`: a rank's two directions on the same chunks, both W's from one launch;
* :func:`symmetric_shares`: the single-process loss, square chunk pairs (a, b ≥ a), W_ab and
  W_ba from the same tile pairs.

Chunks run in a fixed order and cuBLAS runs a given GEMM the same way every time on one GPU (no
split-K atomics in its default mode; with several streams, set CUBLAS_WORKSPACE_CONFIG=:4096:8
as ``torch.use_deterministic_algorithms`` asks): deterministic. ``workspace.backward_bytes``
states the peak.
"""

from __future__ import annotations

import torch
import triton

from ...numerics import autocast_disabled, ieee_float32
from .. import epilogue
from . import config as cfg
from .dscore import launch_dscore, launch_dscore_pair, launch_dscore_rank
from .launch import strides
from .params import Scalars
from .scales import to_f16, w_scales


def _modes(x: torch.Tensor):
    """(round16, tail, W's dtype) for features like ``x``: 16-bit W, fp16's tail (bf16: one
    float16 W against float16 copies of the features)."""
    round16 = x.dtype in (torch.bfloat16, torch.float16)
    return round16, x.dtype == torch.float16, torch.float16 if round16 else torch.float32


def directional_shares(ops, norms, stats, g, sc: Scalars, offset: int, shifts=None):
    """Negatives' shares (times τ) of the directional op: dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``ops`` = (q, k, margin_q, margin_k), ``norms`` their inverse norms, ``stats`` the forward's
    row statistics, ``g`` (M) each row's upstream gradient, ``sc`` the operator's scalars (with
    ``sc.thr`` the masked entries get no dS); ``shifts`` = (ε/n_i of the rows,) with masking
    and label smoothing (``epilogue.smoothing_shift``), else None: the kept entries get
    dS_ik = g_i (P_ik − ε/n_i)."""
    q, k, _, _ = ops
    nll = epilogue.row_nll(stats)
    s = None if shifts is None else shifts[0]
    round16, tail, _ = _modes(q)
    scales = [w_scales(q, k, norms[0], norms[1], ((g, nll, s),), round16, tail)]
    a, b = scales[0][0], scales[0][1]

    rows = (*ops, *strides(*ops), *norms, stats.pos, nll, g)  # the kernel's argument groups that every chunk shares
    scalars_and_scales = (sc.inv_tau, sc.gamma, a, b, sc.thr, s)

    def launch_chunk(row0, row_end, col0, col_end, w, lo, res_r, res_c):
        r, c = row_end - row0, col_end - col0
        outputs = (w, lo, c, res_r, r, res_c, c)  # the chunk buffers and their row strides
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
    # per direction, as its directional op forms them (torch's vectorised softplus rounds a loop's tail apart)
    pos, nll = (torch.cat(pair) for pair in zip(*((x.pos, epilogue.row_nll(x)) for x in stats)))
    g = torch.cat((g, g))
    s = None if shifts is None else torch.cat(shifts)
    round16, tail, _ = _modes(v)
    lines = (slice(0, m), slice(m, 2 * m))  # each direction's rows' bound on |dS|
    scales = [
        w_scales(*d, ((g[sl], nll[sl], None if s is None else s[sl]),), round16, tail) for d, sl in zip(dirs, lines)
    ]
    a, b = torch.cat([x[0] for x in scales]), torch.cat([x[1] for x in scales])

    rows = (*ops, *strides(*ops), *norms, pos, nll, g)  # the kernel's argument groups that every chunk shares
    scalars_and_scales = (sc.inv_tau, sc.gamma, a, b, sc.thr, s)

    def launch_chunk(row0, row_end, col0, col_end, w, lo, res_r, res_c):
        r, c = row_end - row0, col_end - col0
        sr, sc_ = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
        second = (r * c, sc_ * r, sr * c) if round16 else (r * c, 0, 0)  # the t2i W and its sums
        shapes = (m, n, row0, row_end, col0, col_end, v.shape[1], offset)
        args = (*rows, *scalars_and_scales, w, lo, res_r, res_c, *second, *shapes)
        launch_dscore_rank(sc, v.element_size(), r, c, args)

    return _walk(dirs, scales, offset, launch_chunk)


def _walk(dirs, scales, offset: int, launch_chunk):
    """The chunk walk of the directional op (one direction) and of a rank's pair (two): ``dirs``
    holds each direction's (rows q (M, D), columns k (N, D), their inverse norms), ``scales``
    each one's :func:`.scales.w_scales`; ``launch_chunk(row0, row_end, col0, col_end, w, lo,
    res_r, res_c)`` writes every direction's W of one chunk into its fresh buffers (direction i's
    at i·R·C). Chunks of ``cfg.chunk_shape(M, N)``, row blocks outer; per direction two GEMMs a
    chunk (four with fp16's tail), accumulated in chunk order. Returns each direction's (d_q,
    d_k), scaled back, with the rounding compensation."""
    q0 = dirs[0][0]
    m, n, dev = q0.shape[0], dirs[0][1].shape[0], q0.device
    round16, tail, w_dtype = _modes(q0)
    rows, cols = cfg.chunk_shape(m, n)
    n_dirs, col_chunks = len(dirs), triton.cdiv(n, cols)
    d_q_parts, rho_parts = [[] for _ in dirs], [[] for _ in dirs]
    d_k_parts, sigma_parts = [[None] * col_chunks for _ in dirs], [[None] * col_chunks for _ in dirs]
    # the GEMMs accumulate in float32 whatever autocast region the backward runs in
    with ieee_float32(dev), autocast_disabled(dev):
        for row0 in range(0, m, rows):
            row_end = min(row0 + rows, m)
            acc_q, rho = [None] * n_dirs, [None] * n_dirs
            q_rows = [
                _rows(q, row0, row_end) if sc[4] is None else to_f16(_rows(q, row0, row_end), sc[4][0][row0:row_end])
                for (q, _, _, _), sc in zip(dirs, scales)
            ]
            for j, col0 in enumerate(range(0, n, cols)):
                col_end = min(col0 + cols, n)
                r, c = row_end - row0, col_end - col0
                sr, sc_ = triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)
                # a fresh workspace per chunk, the previous one freed first (the allocator hands its
                # memory back): never a view into a shared buffer, which a traced operator would
                # write through a scatter. Each direction's row slice sums (sc, r), column ones (sr, c)
                w, lo, res_r, res_c = _w_buffers(
                    n_dirs * r * c, n_dirs * sc_ * r, n_dirs * sr * c, w_dtype, round16, tail, dev
                )
                launch_chunk(row0, row_end, col0, col_end, w, lo, res_r, res_c)
                for i, (_, k, _, _) in enumerate(dirs):
                    k_cols = _rows(k, col0, col_end)
                    if scales[i][4] is not None:
                        k_cols = to_f16(k_cols, scales[i][4][1][col0:col_end])  # this column block's float16 copy
                    for buf in [w, lo] if tail else [w]:  # the head, then the tail's products
                        w_i = buf[i * r * c : (i + 1) * r * c].view(r, c)
                        acc_q[i] = _mm(w_i, k_cols, acc_q[i])
                        d_k_parts[i][j] = _mm(w_i.t(), q_rows[i], d_k_parts[i][j])
                    if round16:  # slice sums merged in a fixed order, then over chunks in chunk order
                        s = res_r[i * sc_ * r : (i + 1) * sc_ * r].view(sc_, r).sum(0)
                        rho[i] = s if rho[i] is None else rho[i] + s
                        s = res_c[i * sr * c : (i + 1) * sr * c].view(sr, c).sum(0)
                        sigma_parts[i][j] = s if sigma_parts[i][j] is None else sigma_parts[i][j] + s
                    del k_cols, buf, w_i
                del w, lo, res_r, res_c  # one chunk alive at a time
            del q_rows
            for i in range(n_dirs):
                d_q_parts[i].append(acc_q[i])
                rho_parts[i].append(rho[i])
    out = []
    for i, (q, k, r_q, r_k) in enumerate(dirs):
        d_q = _cat(d_q_parts[i]).div_(scales[i][2][:, None])
        d_k = _cat(d_k_parts[i]).div_(scales[i][3][:, None])
        if round16:
            epilogue.add_rounding_compensation(
                d_q, d_k, _cat(rho_parts[i]), _cat(sigma_parts[i]), q, k, r_q, r_k, offset
            )
        out.append((d_q, d_k))
    return out


def symmetric_shares(ops, norms, rows, cols, sc: Scalars, shifts=None):
    """The single-process loss's negatives' shares (times τ), float32: dL/dv̂ (N, D) and dL/dt̂ (N, D)
    of both directions at once (M = N, offset 0).

    ``ops`` = (v, t, t, t), ``norms`` their inverse norms; ``rows`` = (i2t statistics, g),
    ``cols`` = (t2i statistics, g'), each direction's upstream gradient; ``sc`` as
    :func:`directional_shares`; ``shifts`` = (the rows' ε/n_i, the columns') or None. Square
    chunks (``cfg.chunk_shape(square=True)``), pairs (a, b ≥ a) in order
    (``_dscore_pair_kernel``): a pair b > a writes W_ab and W_ba from the same tile pairs, a
    diagonal pair W_aa; then the GEMMs of each buffer, accumulated per chunk in pair order."""
    (stats, g), (key_stats, g_c) = rows, cols
    v, t = ops[0], ops[1]
    n, d = v.shape
    nll, nll_c = epilogue.row_nll(stats), epilogue.row_nll(key_stats)
    s = (None, None) if shifts is None else shifts
    round16, tail, w_dtype = _modes(v)
    a, b, rq, rk, f16 = w_scales(v, t, norms[0], norms[1], ((g, nll, s[0]), (g_c, nll_c, s[1])), round16, tail)
    side, _ = cfg.chunk_shape(n, n, square=True)
    bounds = [(c0, min(c0 + side, n)) for c0 in range(0, n, side)]
    d_q, d_k = [None] * len(bounds), [None] * len(bounds)
    rho, sigma = [None] * len(bounds), [None] * len(bounds)
    dev = v.device

    def copies(start, end):  # the features of one chunk: float16 copies for bf16 (exact, see scales)
        vr, tr = _rows(v, start, end), _rows(t, start, end)
        if f16 is None:
            return vr, tr
        return to_f16(vr, f16[0][start:end]), to_f16(tr, f16[1][start:end])

    def add(parts, i, x):
        parts[i] = x if parts[i] is None else parts[i] + x

    # the kernel's argument groups that every chunk pair shares
    rows = (v, t, *strides(v, t), norms[0], norms[1], stats.pos, nll, g, sc.inv_tau, sc.gamma)
    columns_and_scales = (nll_c, g_c, a, b, sc.thr, s[0], s[1])
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
                sr, sc_ = (
                    (triton.cdiv(r, cfg.RESIDUAL_SLICE), triton.cdiv(c, cfg.RESIDUAL_SLICE)) if round16 else (0, 0)
                )
                # ab's row sums (sc, r) then ba's (sr, c); ab's column sums (sr, c) then ba's (sc, r)
                w, lo, res_r, res_c = _w_buffers(
                    (2 if pair else 1) * r * c,
                    sc_ * r + (sr * c if pair else 0),
                    sr * c + (sc_ * r if pair else 0),
                    w_dtype,
                    round16,
                    tail,
                    dev,
                )
                mirror = (r * c, sc_ * r, sr * c) if pair else (0, 0, 0)
                outputs = (w, lo, res_r, res_c, *mirror)
                args = (*rows, *columns_and_scales, *outputs, row0, row_end, col0, col_end, d)
                launch_dscore_pair(sc, v.element_size(), r, c, args)
                for buf in [w, lo] if tail else [w]:  # W_ab (and its tail): rows a against columns b
                    d_q[ia] = _mm(buf[: r * c].view(r, c), k_b, d_q[ia])
                    d_k[ib] = _mm(buf[: r * c].view(r, c).t(), q_a, d_k[ib])
                    if pair:  # W_ba: rows b against columns a
                        d_q[ib] = _mm(buf[r * c :].view(c, r), k_a, d_q[ib])
                        d_k[ia] = _mm(buf[r * c :].view(c, r).t(), q_b, d_k[ia])
                del buf
                if round16:  # slice sums merged in a fixed order, then over pairs in pair order
                    add(rho, ia, res_r[: sc_ * r].view(sc_, r).sum(0))
                    add(sigma, ib, res_c[: sr * c].view(sr, c).sum(0))
                    if pair:
                        add(rho, ib, res_r[sc_ * r :].view(sr, c).sum(0))
                        add(sigma, ia, res_c[sr * c :].view(sc_, r).sum(0))
                del w, lo, res_r, res_c, outputs, args, q_b, k_b  # one chunk pair alive at a time
            del q_a, k_a
    d_v, d_t = _cat(d_q).div_(rq[:, None]), _cat(d_k).div_(rk[:, None])
    if round16:
        epilogue.add_rounding_compensation(d_v, d_t, _cat(rho), _cat(sigma), v, t, norms[0], norms[1], 0)
    return d_v, d_t


def _w_buffers(w_len: int, res_r_len: int, res_c_len: int, w_dtype, round16: bool, tail: bool, dev):
    """One chunk's fresh dS buffers (w, lo, res_r, res_c): W, fp16's tail, the float32 row and
    column residual slice sums; None for those the kernel does not write (no tail without TAIL,
    no sums without ROUND16: the kernels' flags derive from that)."""
    w = torch.empty(w_len, device=dev, dtype=w_dtype)
    if not round16:
        return w, None, None, None
    lo = torch.empty(w.shape, device=dev, dtype=w_dtype) if tail else None
    return (
        w,
        lo,
        torch.empty(res_r_len, device=dev, dtype=torch.float32),
        torch.empty(res_c_len, device=dev, dtype=torch.float32),
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
