"""Backward: the negatives' shares of dL/dq̂ and dL/dk̂, one chunk of dS at a time.

``_dscore_kernel`` forms each tile of Z once more and writes W = diag(r_q) · dS · diag(r_k)
(dS = dL/dZ times τ, negatives only) to a float32 workspace; ``_grad_gemm_kernel`` then
adds (W k) / r_q to dq̂ and (Wᵀ q) / r_k to dk̂. ``backward_shares`` launches them chunk by
chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import epilogue
from . import config as cfg
from .launch import launch, strides, wrap_triton
from .precision import _dot
from .tiles import _block, _load2, _load_gamma, _logits_tile


@triton.jit
def _dscore_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr, gamma_ptr,
    nll_c_ptr, g_c_ptr, wq_ptr, wk_ptr,
    w_ptr, stride_wm, stride_wn,
    row0, row_end, col0, col_end, D, offset,
    SYMMETRIC: tl.constexpr, HAS_MARGIN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[i − row0, k − col0] = r_q,i · dS_ik · r_k,k over one chunk [row0, row_end) × [col0, col_end).

    dS_ik = g_i P_ik over the negatives (P = exp(d − nll)); with SYMMETRIC (M = N,
    offset 0) plus g'_k P'_ki, the softmax of column k, so one tile serves i2t and t2i.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of the chunk.

    Features and per-row inputs: as ``forward._fwd_kernel`` (q_ptr, k_ptr, mq_ptr, mk_ptr,
        their strides, rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, tau_ptr, gamma_ptr).
    Per-row inputs of the backward (float32):
        nll_ptr (M): each row's LSE of the gaps (P's normaliser); g_ptr (M): upstream gradient;
        nll_c_ptr, g_c_ptr (N): the same of the key direction (read only with SYMMETRIC);
        wq_ptr, wk_ptr: 1-element powers of two that bring the inverse norms near 1 in W
        (see ``backward._pow2_unit``).
    Output: w_ptr, the float32 chunk (row_end − row0, col_end − col0), strides stride_wm, stride_wn.
    Shapes and scalars: the chunk's bounds row0, row_end (≤ M), col0, col_end (≤ N); D;
        offset (row i's positive is column offset + i).
    Constexprs: SYMMETRIC (also the key direction's share), HAS_MARGIN (γ ≠ 0), PREC
        (``precision._dot``), BLOCK_M × BLOCK_N tiles, BLOCK_K the reduction step (the
        forward's: the same tiles to the bit).
    """
    offs_m, mask_m = _block(row0 + tl.program_id(0) * BLOCK_M, row_end, BLOCK_M)
    offs_n, mask_n = _block(col0 + tl.program_id(1) * BLOCK_N, col_end, BLOCK_N)
    rq, r_mq = _load2(rq_ptr, r_mq_ptr, offs_m, mask_m)
    rk, r_mk = _load2(rk_ptr, r_mk_ptr, offs_n, mask_n)
    inv_tau = 1.0 / tl.load(tau_ptr)
    gamma = _load_gamma(gamma_ptr, HAS_MARGIN)
    z = _logits_tile((q_ptr, stride_qm, stride_qd), (k_ptr, stride_kn, stride_kd),
                     (mq_ptr, stride_mqm, stride_mqd), (mk_ptr, stride_mkn, stride_mkd),
                     (offs_m, mask_m, rq, r_mq), (offs_n, mask_n, rk, r_mk),
                     D, gamma, inv_tau, HAS_MARGIN, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
    g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
    # mask before exp: the positive's tile entry carries a margin and may overflow
    dscore = tl.exp(tl.where(neg, z - pos[:, None] - nll[:, None], float("-inf"))) * g[:, None]
    if SYMMETRIC:
        pos_c = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
        nll_c = tl.load(nll_c_ptr + offs_n, mask=mask_n, other=0.0)
        g_c = tl.load(g_c_ptr + offs_n, mask=mask_n, other=0.0)
        dscore += tl.exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf"))) * g_c[None, :]
    # W_ik = dS_ik · r_q,i · r_k,k, the norms first brought near 1 by exact powers of two: with
    # ‖q‖‖k‖ ~ 1e36, r_q·r_k·dS would otherwise fall below float32's normal range
    w = dscore * (rq * tl.load(wq_ptr))[:, None] * (rk * tl.load(wk_ptr))[None, :]
    tl.store(w_ptr + (offs_m - row0)[:, None] * stride_wm + (offs_n - col0)[None, :] * stride_wn, w,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grad_gemm_kernel(
    a_ptr, b_ptr, c_ptr, r_ptr,
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACCUMULATE: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C (+)= (A @ B) / r[:, None], float32 C and accumulation. Grid: ⌈M / BLOCK_M⌉ · ⌈N / BLOCK_N⌉.

    Data: a_ptr (M, K) float32, the dS workspace W (or its transpose, through strides);
        b_ptr (K, N) the raw features; c_ptr (M, N) float32, the gradient (read with
        ACCUMULATE, written); r_ptr (M) float32, what 1/r undoes of W's row scaling.
    Shapes and strides: M, N, K; stride_<matrix><axis>.
    Constexprs: ACCUMULATE (add to C), PREC (``precision._dot``: "bf16x2"/"tf32x2" for
        16-bit features), BLOCK_M × BLOCK_N × BLOCK_K tiles, GROUP_M row blocks per group.
    """
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks share each column block of B while it is in L2
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_size
    pid_n = (pid % (GROUP_M * grid_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, PREC)
    r = tl.load(r_ptr + offs_m, mask=mask_m, other=1.0)
    acc = acc / r[:, None]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc, mask=mask)


# autotuned twins (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
_dscore_tuned = triton.autotune(cfg.all_candidates("dscore"), key=["D", "HAS_MARGIN", "PREC", "SYMMETRIC"],
                                prune_configs_by={"early_config_prune": cfg.pruner("dscore", "q_ptr")})(_dscore_kernel)
_gemm_tuned = triton.autotune(cfg.all_candidates("gemm"), key=["N", "PREC", "ACCUMULATE"], restore_value=["c_ptr"],
                              prune_configs_by={"early_config_prune": cfg.pruner("gemm", "b_ptr")})(_grad_gemm_kernel)


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("dscore", "gemm"), its autotuned twin when ``tuned``, through ``wrap_triton``;
    spelled out kernel by kernel (see :func:`.launch.launch`)."""
    if name == "dscore":
        return wrap_triton(_dscore_tuned) if tuned else wrap_triton(_dscore_kernel)
    return wrap_triton(_gemm_tuned) if tuned else wrap_triton(_grad_gemm_kernel)


# ------------------------------------------------------------------ host launcher
def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _gemm(a, b, c, r, accumulate: bool, precision: str):
    """c (+)= (a @ b) / r[:, None] (a may be a transposed view of the workspace)."""
    m, kk = a.shape
    n = b.shape[1]
    args = (a, b, c, r, m, n, kk, *a.stride(), *b.stride(), *c.stride())
    launch(lambda tuned: _kernel("gemm", tuned), "gemm", b.element_size(),
           lambda t: (triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"]),), args,
           ACCUMULATE=accumulate, PREC=precision, GROUP_M=8)


def _rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """x[start:end], or x itself when that is all of it (a traced operator then writes the
    tensor, not a view of it: no scatter back into a base)."""
    return x if (start, end) == (0, x.shape[0]) else x[start:end]


def backward_shares(ops, norms, stats, g, tau32, gamma32, has_margin: bool, offset: int, precision, key_side=None):
    """Negatives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``ops``, ``norms``, ``tau32``, ``gamma32``, ``has_margin``: as :func:`.forward.forward_stats`;
    ``stats``: its row statistics, ``g`` the upstream gradient of each row.
    ``key_side = (stats, g)`` of the transposed direction makes it symmetric (M = N, offset 0).
    dS is materialised one R × C chunk at a time (R·C·elem ≤ ``cfg.BWD_WORKSPACE_BYTES``: e.g.
    11520 × 11648 for bf16, 8192 × 8192 for float32, 256 MiB); square chunks keep both GEMMs'
    grids full and their reductions long. Chunks run in a fixed order: deterministic.
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    wq, wk = _pow2_unit(norms[0]), _pow2_unit(norms[1])
    # what each GEMM divides out of W = diag(r_q wq) dS diag(r_k wk): its own side's scale and
    # the other side's power of two (all exact: powers of two)
    rq, rk = norms[0] * wq * wk, norms[1] * wk * wq
    width = q.element_size()
    nll = epilogue.row_nll(stats)
    nll_c, g_c = (epilogue.row_nll(key_side[0]), key_side[1]) if key_side else (nll, g)
    rows, cols = cfg.chunk_shape(m, n)
    d_q = torch.empty(m, d, device=q.device, dtype=torch.float32)
    d_k = torch.empty(n, d, device=q.device, dtype=torch.float32)
    prec, grad_prec = cfg.dot_precision(q.dtype, precision), cfg.grad_precision(q.dtype, precision)
    for row0 in range(0, m, rows):
        row_end = min(row0 + rows, m)
        for col0 in range(0, n, cols):
            col_end = min(col0 + cols, n)
            # a fresh workspace per chunk, the previous one freed first (the allocator hands its
            # memory back): never a view into a shared buffer, which a traced operator would
            # write through a scatter
            w = torch.empty(row_end - row0, col_end - col0, device=q.device, dtype=torch.float32)
            args = (*ops, *strides(*ops), *norms, stats.pos, nll, g, tau32, gamma32, nll_c, g_c, wq, wk, w,
                    *w.stride(), row0, row_end, col0, col_end, d, offset)
            launch(lambda tuned: _kernel("dscore", tuned), "dscore", width,
                   lambda t, rows=row_end - row0, cols=col_end - col0: (triton.cdiv(rows, t["BLOCK_M"]),
                                                                       triton.cdiv(cols, t["BLOCK_N"])),
                   args, SYMMETRIC=key_side is not None, HAS_MARGIN=has_margin, PREC=prec,
                   BLOCK_K=cfg.score_block_k(width))
            _gemm(w, _rows(k, col0, col_end), _rows(d_q, row0, row_end), _rows(rq, row0, row_end), col0 > 0,
                  grad_prec)
            _gemm(w.t(), _rows(q, row0, row_end), _rows(d_k, col0, col_end), _rows(rk, col0, col_end), row0 > 0,
                  grad_prec)
            del w
    return d_q, d_k
