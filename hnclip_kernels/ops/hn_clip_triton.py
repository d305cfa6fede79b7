"""Fused HN-CLIP loss in Triton: forward kernel, backward kernels and their autograd.Function.

Design (after Triton's fused-attention tutorial): a tile of logits
``Z = (q̂ k̂ᵀ + γ · stopgrad(â b̂ᵀ)) / τ`` is computed on the fly from the raw inputs and
their float32 inverse row norms; an online LSE runs along each query row over the
negatives only; three float32 numbers per row are saved and the backward recomputes
the tiles. Nothing of size M×N is ever stored, and every output element is written by
exactly one program (no atomics), so results are bit-reproducible.

One direction at a time: M query rows vs N key columns, positive of row i at column
``offset + i``. i2t is (q, k, a, b) = (img, txt, txt, txt); t2i is (txt, img, txt, txt).
"""
from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable
import triton.language as tl

from . import epilogue


def _is_interpreting() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at import
    return "Interpreted" in type(_fwd_kernel).__name__


@triton.jit
def _logits_tile(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq, rk, ra, rb,  # float32 inverse norms of this tile's rows / columns
    offs_m, offs_n, M, N, D, gamma, inv_tau,
    HAS_MARGIN: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) float32 tile of Z, dots accumulated in float32 over D."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_margin = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        q = tl.load(q_ptr + offs_m[:, None] * s_qm + offs_k[None, :] * s_qd,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        k = tl.load(k_ptr + offs_k[:, None] * s_kd + offs_n[None, :] * s_kn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # interpreter: tl.dot on bf16 multiplies raw bits (triton#11584)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        acc = tl.dot(q, k, acc, input_precision=DOT_PREC)
        if HAS_MARGIN:
            a = tl.load(a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ad,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptr + offs_k[:, None] * s_bd + offs_n[None, :] * s_bn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc_margin = tl.dot(a, b, acc_margin, input_precision=DOT_PREC)
    # the norms scale float32 tiles: the normalised vectors are never rounded to bf16
    z = acc * rq[:, None] * rk[None, :]
    if HAS_MARGIN:
        z += gamma * (acc_margin * ra[:, None] * rb[None, :])
    return z * inv_tau


@triton.jit
def _block(start, size, norm1_ptr, norm2_ptr, BLOCK: tl.constexpr):
    """Offsets, bounds mask and the two inverse-norm vectors of one block of rows (or columns)."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < size
    return offs, mask, tl.load(norm1_ptr + offs, mask=mask, other=0.0), tl.load(norm2_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _online_lse_step(d, neg, run_max, run_sum, run_wsum, run_dsum, AXIS: tl.constexpr):
    """Fold one tile of gaps d = Z − Z_pos (−inf off the negatives) into the running
    max, Σexp, Σexp·d and Σd along AXIS (1: rows of the tile, 0: its columns)."""
    new_max = tl.maximum(run_max, tl.max(d, axis=AXIS))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no -inf - -inf
    rescale = tl.exp(run_max - safe_max)
    if AXIS == 1:
        p = tl.exp(d - safe_max[:, None])
    else:
        p = tl.exp(d - safe_max[None, :])
    d0 = tl.where(neg, d, 0.0)
    run_sum = run_sum * rescale + tl.sum(p, axis=AXIS)
    run_wsum = run_wsum * rescale + tl.sum(p * d0, axis=AXIS)
    run_dsum += tl.sum(d0, axis=AXIS)
    return new_max, run_sum, run_wsum, run_dsum


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq_ptr, rk_ptr, ra_ptr, rb_ptr, pos_ptr, tau_ptr,
    delta_ptr, mean_neg_ptr, dsum_ptr,
    M, N, D, offset, gamma,
    COLUMNS: tl.constexpr,  # False: a program owns query rows (LSE of Z's rows); True: key columns (of Zᵀ's rows)
    HAS_MARGIN: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Per-row statistics over the negatives: delta = LSE(d), mean_neg = E_softmax[d], dsum = Σd.

    The column pass walks the very same (query × key) tiles as the row pass and the backward,
    so the t2i statistics and the recomputed tiles agree to the bit, whatever the logits' size.
    """
    pid = tl.program_id(0)
    inv_tau = 1.0 / tl.load(tau_ptr)
    if COLUMNS:
        offs_n, mask_n, rk, rb = _block(pid * BLOCK_N, N, rk_ptr, rb_ptr, BLOCK_N)
        pos = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)  # column j's positive: Z[j - offset, j]
        run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        n_inner = M
        step = BLOCK_M
    else:
        offs_m, mask_m, rq, ra = _block(pid * BLOCK_M, M, rq_ptr, ra_ptr, BLOCK_M)
        pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
        run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        n_inner = N
        step = BLOCK_N
    # online LSE of d = Z - Z_pos over the negatives: running max, Σexp, Σexp·d, Σd
    run_sum = tl.zeros_like(run_max)
    run_wsum = tl.zeros_like(run_max)
    run_dsum = tl.zeros_like(run_max)
    for j0 in range(0, n_inner, step):
        if COLUMNS:
            offs_m, mask_m, rq, ra = _block(j0, M, rq_ptr, ra_ptr, BLOCK_M)
        else:
            offs_n, mask_n, rk, rb = _block(j0, N, rk_ptr, rb_ptr, BLOCK_N)
        z = _logits_tile(q_ptr, k_ptr, a_ptr, b_ptr, s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
                         rq, rk, ra, rb, offs_m, offs_n, M, N, D, gamma, inv_tau,
                         HAS_MARGIN, UPCAST, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        if COLUMNS:
            d = tl.where(neg, z - pos[None, :], float("-inf"))
            run_max, run_sum, run_wsum, run_dsum = _online_lse_step(d, neg, run_max, run_sum, run_wsum, run_dsum, 0)
        else:
            d = tl.where(neg, z - pos[:, None], float("-inf"))
            run_max, run_sum, run_wsum, run_dsum = _online_lse_step(d, neg, run_max, run_sum, run_wsum, run_dsum, 1)
    has_neg = run_sum > 0.0
    delta = tl.where(has_neg, run_max + tl.log(tl.where(has_neg, run_sum, 1.0)), float("-inf"))
    # a NaN anywhere in the row poisons run_sum; keep it visible in the loss
    delta = tl.where(run_sum != run_sum, run_sum, delta)
    mean_neg = tl.where(has_neg, run_wsum / tl.where(has_neg, run_sum, 1.0), 0.0)
    offs = offs_n if COLUMNS else offs_m
    mask = mask_n if COLUMNS else mask_m
    tl.store(delta_ptr + offs, delta, mask=mask)
    tl.store(mean_neg_ptr + offs, mean_neg, mask=mask)
    tl.store(dsum_ptr + offs, run_dsum, mask=mask)


@triton.jit
def _bwd_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq_ptr, rk_ptr, ra_ptr, rb_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr,
    pos_c_ptr, nll_c_ptr, g_c_ptr,  # SYMMETRIC only: the key direction's row statistics
    out_ptr, s_om, s_od,
    M, N, D, offset, gamma,
    FOR_KEYS: tl.constexpr,  # False: program owns query rows, out = Σ_k ds_ik k_k; True: owns key columns, out = Σ_i ds_ik q_i
    SYMMETRIC: tl.constexpr,  # M = N, offset 0: ds also carries the key direction's softmax (Z is shared)
    HAS_MARGIN: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, GRAD_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Negatives' share of dL/dq̂ (or dL/dk̂) times τ, for one block of rows and a slice of D.

    With SYMMETRIC the tile's gradient is ds_ik = g_i P_ik + g'_k P'_ki, where P' is the
    softmax of the other direction (column k of the same Z), so one recomputed tile serves
    both i2t and t2i and the backward costs two kernels instead of four.
    """
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    inv_tau = 1.0 / tl.load(tau_ptr)
    if FOR_KEYS:
        offs_n, mask_n, rk, rb = _block(pid * BLOCK_N, N, rk_ptr, rb_ptr, BLOCK_N)
        if SYMMETRIC:
            pos_c = tl.load(pos_c_ptr + offs_n, mask=mask_n, other=0.0)
            nll_c = tl.load(nll_c_ptr + offs_n, mask=mask_n, other=0.0)
            g_c = tl.load(g_c_ptr + offs_n, mask=mask_n, other=0.0)
        acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        n_outer = M
    else:
        offs_m, mask_m, rq, ra = _block(pid * BLOCK_M, M, rq_ptr, ra_ptr, BLOCK_M)
        pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
        row_nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
        g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        n_outer = N
    step = BLOCK_M if FOR_KEYS else BLOCK_N
    for j0 in range(0, n_outer, step):
        if FOR_KEYS:
            offs_m, mask_m, rq, ra = _block(j0, M, rq_ptr, ra_ptr, BLOCK_M)
            pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
            row_nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
            g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
        else:
            offs_n, mask_n, rk, rb = _block(j0, N, rk_ptr, rb_ptr, BLOCK_N)
            if SYMMETRIC:
                pos_c = tl.load(pos_c_ptr + offs_n, mask=mask_n, other=0.0)
                nll_c = tl.load(nll_c_ptr + offs_n, mask=mask_n, other=0.0)
                g_c = tl.load(g_c_ptr + offs_n, mask=mask_n, other=0.0)
        z = _logits_tile(q_ptr, k_ptr, a_ptr, b_ptr, s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
                         rq, rk, ra, rb, offs_m, offs_n, M, N, D, gamma, inv_tau,
                         HAS_MARGIN, UPCAST, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        # P_ik = exp(Z_ik − LSE_i) = exp(d_ik − nll_i); tiny P stay representable in float32
        # mask before exp: the positive's tile entry carries a margin and may overflow
        prob = tl.exp(tl.where(neg, z - pos[:, None] - row_nll[:, None], float("-inf")))
        ds = prob * g[:, None]
        if SYMMETRIC:
            prob_c = tl.exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf")))
            ds += prob_c * g_c[None, :]
        if FOR_KEYS:
            ds = ds * rq[:, None]  # scale here so the raw q tile feeds the dot
            src = tl.load(q_ptr + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                          mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            ds_t = tl.trans(ds)
            if GRAD_FP32:
                acc = tl.dot(ds_t, src.to(tl.float32), acc, input_precision=DOT_PREC)
            else:
                acc = tl.dot(ds_t.to(src.dtype), src, acc)
        else:
            ds = ds * rk[None, :]
            src = tl.load(k_ptr + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd,
                          mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            if GRAD_FP32:
                acc = tl.dot(ds, src.to(tl.float32), acc, input_precision=DOT_PREC)
            else:
                acc = tl.dot(ds.to(src.dtype), src, acc)
    if FOR_KEYS:
        tl.store(out_ptr + offs_n[:, None] * s_om + offs_d[None, :] * s_od, acc,
                 mask=mask_n[:, None] & mask_d[None, :])
    else:
        tl.store(out_ptr + offs_m[:, None] * s_om + offs_d[None, :] * s_od, acc,
                 mask=mask_m[:, None] & mask_d[None, :])


def _pow2(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(x), 1))))


def _launch_config(m: int, n: int, d: int, dtype: torch.dtype) -> dict:
    interpret = _is_interpreting()
    # the interpreter pays per program, not per flop: take larger tiles when small shapes allow
    block_mn = 32 if interpret else 64
    return dict(
        BLOCK_M=_pow2(m, 16, block_mn),
        BLOCK_N=_pow2(n, 16, block_mn),
        BLOCK_K=_pow2(d, 16, 64),
        UPCAST=interpret,
        DOT_PREC="ieee" if dtype == torch.float32 or interpret else "tf32",
        GRAD_FP32=interpret or dtype in (torch.float32, torch.float16),  # fp16 would flush tiny P·g to 0
    )


def _inv_norms(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    if not normalize:
        return torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
    return 1.0 / torch.linalg.vector_norm(x, dim=1, dtype=torch.float32).clamp_min(1e-12)


def _strides(*xs):
    return [s for x in xs for s in x.stride()]


def _forward_stats(ops, norms, pos, tau32, offset: int, gamma: float, cfg: dict,
                   columns: bool = False) -> epilogue.RowStats:
    """Run the forward kernel on operands ``ops = (q, k, a, b)`` with inverse norms ``norms``:
    statistics of Z's rows, or with ``columns`` of Zᵀ's rows (M = N, offset 0)."""
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    delta = torch.empty(n if columns else m, device=q.device, dtype=torch.float32)
    mean_neg, dsum = torch.empty_like(delta), torch.empty_like(delta)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]) if columns else triton.cdiv(m, cfg["BLOCK_M"]),)
    _fwd_kernel[grid](
        *ops, *_strides(*ops), *norms, pos, tau32, delta, mean_neg, dsum, m, n, d, offset, gamma,
        COLUMNS=columns, HAS_MARGIN=gamma != 0.0, UPCAST=cfg["UPCAST"], DOT_PREC=cfg["DOT_PREC"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
    )
    return epilogue.RowStats(pos, delta, mean_neg, dsum)


def _backward_shares(ops, norms, stats, g, tau32, offset: int, gamma: float, cfg: dict, key_side=None):
    """Negatives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``key_side = (stats, g)`` of the transposed direction makes it symmetric (M = N, offset 0).
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    nll = epilogue.row_nll(stats)
    col = (stats.pos, epilogue.row_nll(key_side[0]), key_side[1]) if key_side else (nll, nll, nll)
    d_q = torch.empty(m, d, device=q.device, dtype=torch.float32)
    d_k = torch.empty(n, d, device=q.device, dtype=torch.float32)
    block_d = _pow2(d, 16, 128)
    for out, for_keys, rows, block in ((d_q, False, m, "BLOCK_M"), (d_k, True, n, "BLOCK_N")):
        _bwd_kernel[(triton.cdiv(rows, cfg[block]), triton.cdiv(d, block_d))](
            *ops, *_strides(*ops), *norms, stats.pos, nll, g, tau32, *col, out, *out.stride(),
            m, n, d, offset, gamma, FOR_KEYS=for_keys, SYMMETRIC=key_side is not None,
            HAS_MARGIN=gamma != 0.0, UPCAST=cfg["UPCAST"], DOT_PREC=cfg["DOT_PREC"], GRAD_FP32=cfg["GRAD_FP32"],
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_D=block_d,
        )
    return d_q, d_k


def _tau_grad(ctx, dz_z: torch.Tensor, inv_tau: torch.Tensor):
    """dL/dτ = −(Σ dZ·Z) / τ, in τ's own dtype and shape; None when τ needs no gradient."""
    if not ctx.needs_input_grad[ctx.tau_index]:
        return None
    tau_dtype, tau_shape = ctx.tau_meta
    return (-dz_z * inv_tau).to(tau_dtype).reshape(tau_shape)


def _save_tau(ctx, tau: torch.Tensor, index: int, like: torch.Tensor) -> torch.Tensor:
    ctx.tau_meta, ctx.tau_index = (tau.dtype, tau.shape), index
    return tau.detach().to(device=like.device, dtype=torch.float32).reshape(1)


class HNClipDirectionalTriton(torch.autograd.Function):
    """One direction of the HN-CLIP loss: per-row losses (M,) float32; grads for q, k, τ.

    M local query rows against N key columns, positive at ``offset + i``: what a rank of a
    distributed job computes. ``a``/``b`` (the margin's text factors) are stop-gradient.
    """

    @staticmethod
    def forward(ctx, q, k, a, b, tau, offset: int, gamma: float, label_smoothing: float, normalize: bool):
        norms = tuple(_inv_norms(x, normalize) for x in (q, k, a, b))
        tau32 = _save_tau(ctx, tau, 4, q)
        inv_tau = 1.0 / tau32
        pos = epilogue.positive_logits(q.float() * norms[0][:, None], k.float() * norms[1][:, None], offset, inv_tau)
        cfg = _launch_config(q.shape[0], k.shape[0], q.shape[1], q.dtype)
        stats = _forward_stats((q, k, a, b), norms, pos, tau32, offset, float(gamma), cfg)
        ctx.save_for_backward(q, k, a, b, *norms, tau32, *stats)
        ctx.cfg = (offset, float(gamma), label_smoothing, normalize, cfg)
        return epilogue.row_losses(stats, k.shape[0], label_smoothing)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming back silently partial
    def backward(ctx, grad_rows):
        q, k, a, b, rq, rk, ra, rb, tau32, *stats = ctx.saved_tensors
        stats = epilogue.RowStats(*stats)
        offset, gamma, eps, normalize, cfg = ctx.cfg
        g = grad_rows.detach().float().contiguous()
        d_q, d_k = _backward_shares((q, k, a, b), (rq, rk, ra, rb), stats, g, tau32, offset, gamma, cfg)
        inv_tau = 1.0 / tau32
        q_hat, k_hat = q.float() * rq[:, None], k.float() * rk[:, None]
        dz_z = epilogue.add_positive_and_smoothing(stats, g, q_hat, k_hat, d_q, d_k, offset, eps)
        d_q_in = epilogue.unnormalize_grad(q, rq, d_q.mul_(inv_tau), normalize).to(q.dtype)
        d_k_in = epilogue.unnormalize_grad(k, rk, d_k.mul_(inv_tau), normalize).to(k.dtype)
        return d_q_in, d_k_in, None, None, _tau_grad(ctx, dz_z, inv_tau), None, None, None, None


class HNClipTriton(torch.autograd.Function):
    """The whole single-process loss: per-pair losses ½(i2t_k + t2i_k), shape (N,), float32.

    Forward: two passes of the forward kernel over the same tiles of Z (its rows for i2t,
    its columns for t2i).
    Backward: one pass over image rows and one over text rows, each recomputed tile
    carrying both directions' softmax, so it costs half of two directional backwards.
    """

    @staticmethod
    def forward(ctx, img, txt, tau, gamma: float, label_smoothing: float, normalize: bool):
        rv, rt = _inv_norms(img, normalize), _inv_norms(txt, normalize)
        tau32 = _save_tau(ctx, tau, 2, img)
        inv_tau = 1.0 / tau32
        pos = epilogue.positive_logits(img.float() * rv[:, None], txt.float() * rt[:, None], 0, inv_tau)
        n, d = img.shape
        cfg = _launch_config(n, n, d, img.dtype)
        ops, norms = (img, txt, txt, txt), (rv, rt, rt, rt)
        i2t = _forward_stats(ops, norms, pos, tau32, 0, float(gamma), cfg)
        t2i = _forward_stats(ops, norms, pos, tau32, 0, float(gamma), cfg, columns=True)
        ctx.save_for_backward(img, txt, rv, rt, tau32, *i2t, *t2i)
        ctx.cfg = (float(gamma), label_smoothing, normalize, cfg)
        return 0.5 * (epilogue.row_losses(i2t, n, label_smoothing) + epilogue.row_losses(t2i, n, label_smoothing))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_pairs):
        img, txt, rv, rt, tau32, *stats = ctx.saved_tensors
        i2t, t2i = epilogue.RowStats(*stats[:4]), epilogue.RowStats(*stats[4:])
        gamma, eps, normalize, cfg = ctx.cfg
        g = 0.5 * grad_pairs.detach().float().contiguous()  # each direction's rows get half
        d_v, d_t = _backward_shares((img, txt, txt, txt), (rv, rt, rt, rt), i2t, g, tau32, 0, gamma, cfg,
                                    key_side=(t2i, g))
        inv_tau = 1.0 / tau32
        v_hat, t_hat = img.float() * rv[:, None], txt.float() * rt[:, None]
        dz_z = epilogue.add_positive_and_smoothing(i2t, g, v_hat, t_hat, d_v, d_t, 0, eps)
        dz_z = dz_z + epilogue.add_positive_and_smoothing(t2i, g, t_hat, v_hat, d_t, d_v, 0, eps)
        d_img = epilogue.unnormalize_grad(img, rv, d_v.mul_(inv_tau), normalize).to(img.dtype)
        d_txt = epilogue.unnormalize_grad(txt, rt, d_t.mul_(inv_tau), normalize).to(txt.dtype)
        return d_img, d_txt, _tau_grad(ctx, dz_z, inv_tau), None, None, None


def directional_nll_triton(q, k, a, b, tau, offset, gamma, label_smoothing, normalize):
    """Triton counterpart of :func:`hnclip_kernels.reference.directional_nll_torch`."""
    return HNClipDirectionalTriton.apply(q, k, a, b, tau, offset, gamma, label_smoothing, normalize)


def hn_clip_pairs_triton(img, txt, tau, gamma, label_smoothing, normalize):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the fused single-process loss."""
    return HNClipTriton.apply(img, txt, tau, gamma, label_smoothing, normalize)
