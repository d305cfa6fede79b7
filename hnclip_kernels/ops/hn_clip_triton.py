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
def _fwd_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq_ptr, rk_ptr, ra_ptr, rb_ptr, pos_ptr, tau_ptr,
    delta_ptr, mean_neg_ptr, dsum_ptr,
    M, N, D, offset, gamma,
    HAS_MARGIN: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    inv_tau = 1.0 / tl.load(tau_ptr)
    rq = tl.load(rq_ptr + offs_m, mask=mask_m, other=0.0)
    ra = tl.load(ra_ptr + offs_m, mask=mask_m, other=0.0)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    # online LSE of d = Z - Z_pos over the negatives: running max, Σexp, Σexp·d, Σd
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M,), tl.float32)
    run_wsum = tl.zeros((BLOCK_M,), tl.float32)
    run_dsum = tl.zeros((BLOCK_M,), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
        rb = tl.load(rb_ptr + offs_n, mask=mask_n, other=0.0)
        z = _logits_tile(q_ptr, k_ptr, a_ptr, b_ptr, s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
                         rq, rk, ra, rb, offs_m, offs_n, M, N, D, gamma, inv_tau,
                         HAS_MARGIN, UPCAST, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        d = tl.where(neg, z - pos[:, None], float("-inf"))
        new_max = tl.maximum(run_max, tl.max(d, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no -inf - -inf
        rescale = tl.exp(run_max - safe_max)
        p = tl.exp(d - safe_max[:, None])
        d0 = tl.where(neg, d, 0.0)
        run_sum = run_sum * rescale + tl.sum(p, axis=1)
        run_wsum = run_wsum * rescale + tl.sum(p * d0, axis=1)
        run_dsum += tl.sum(d0, axis=1)
        run_max = new_max
    has_neg = run_sum > 0.0
    delta = tl.where(has_neg, run_max + tl.log(tl.where(has_neg, run_sum, 1.0)), float("-inf"))
    # a NaN anywhere in the row poisons run_sum; keep it visible in the loss
    delta = tl.where(run_sum != run_sum, run_sum, delta)
    mean_neg = tl.where(has_neg, run_wsum / tl.where(has_neg, run_sum, 1.0), 0.0)
    tl.store(delta_ptr + offs_m, delta, mask=mask_m)
    tl.store(mean_neg_ptr + offs_m, mean_neg, mask=mask_m)
    tl.store(dsum_ptr + offs_m, run_dsum, mask=mask_m)


@triton.jit
def _bwd_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq_ptr, rk_ptr, ra_ptr, rb_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr,
    out_ptr, s_om, s_od,
    M, N, D, offset, gamma,
    FOR_KEYS: tl.constexpr,  # False: program owns query rows, out = Σ_k ds_ik k_k; True: owns key columns, out = Σ_i ds_ik q_i
    HAS_MARGIN: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, GRAD_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Negatives' share of dL/dq̂ (or dL/dk̂) times τ, for one block of rows and a slice of D."""
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    inv_tau = 1.0 / tl.load(tau_ptr)
    if FOR_KEYS:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
        rb = tl.load(rb_ptr + offs_n, mask=mask_n, other=0.0)
        acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        n_outer = M
    else:
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rq = tl.load(rq_ptr + offs_m, mask=mask_m, other=0.0)
        ra = tl.load(ra_ptr + offs_m, mask=mask_m, other=0.0)
        pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
        row_nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
        g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        n_outer = N
    step = BLOCK_M if FOR_KEYS else BLOCK_N
    for j0 in range(0, n_outer, step):
        if FOR_KEYS:
            offs_m = j0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            rq = tl.load(rq_ptr + offs_m, mask=mask_m, other=0.0)
            ra = tl.load(ra_ptr + offs_m, mask=mask_m, other=0.0)
            pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
            row_nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
            g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
        else:
            offs_n = j0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
            rb = tl.load(rb_ptr + offs_n, mask=mask_n, other=0.0)
        z = _logits_tile(q_ptr, k_ptr, a_ptr, b_ptr, s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
                         rq, rk, ra, rb, offs_m, offs_n, M, N, D, gamma, inv_tau,
                         HAS_MARGIN, UPCAST, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        # P_ik = exp(Z_ik − LSE_i) = exp(d_ik − nll_i); tiny P stay representable in float32
        # mask before exp: the positive's tile entry carries a margin and may overflow
        prob = tl.exp(tl.where(neg, z - pos[:, None] - row_nll[:, None], float("-inf")))
        ds = prob * g[:, None]
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


class HNClipDirectionalTriton(torch.autograd.Function):
    """One direction of the HN-CLIP loss: per-row losses (M,) float32; grads for q, k, τ.

    ``a``/``b`` (the margin's text factors) are stop-gradient by definition of the loss.
    """

    @staticmethod
    def forward(ctx, q, k, a, b, tau, offset: int, gamma: float, label_smoothing: float, normalize: bool):
        m, d = q.shape
        n = k.shape[0]
        rq, rk = _inv_norms(q, normalize), _inv_norms(k, normalize)
        ra, rb = _inv_norms(a, normalize), _inv_norms(b, normalize)
        tau32 = tau.detach().to(device=q.device, dtype=torch.float32).reshape(1)
        inv_tau = 1.0 / tau32
        q_hat = q.float() * rq[:, None]
        k_hat = k.float() * rk[:, None]
        pos = epilogue.positive_logits(q_hat, k_hat, offset, inv_tau)
        delta = torch.empty(m, device=q.device, dtype=torch.float32)
        mean_neg, dsum = torch.empty_like(delta), torch.empty_like(delta)
        cfg = _launch_config(m, n, d, q.dtype)
        has_margin = gamma != 0.0
        grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
        _fwd_kernel[grid](
            q, k, a, b, *_strides(q, k, a, b), rq, rk, ra, rb, pos, tau32,
            delta, mean_neg, dsum, m, n, d, offset, float(gamma),
            HAS_MARGIN=has_margin, UPCAST=cfg["UPCAST"], DOT_PREC=cfg["DOT_PREC"],
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        )
        stats = epilogue.RowStats(pos, delta, mean_neg, dsum)
        ctx.save_for_backward(q, k, a, b, rq, rk, ra, rb, tau32, *stats)
        ctx.cfg = (offset, float(gamma), label_smoothing, normalize, has_margin, cfg)
        ctx.tau_meta = (tau.dtype, tau.shape)
        return epilogue.row_losses(stats, n, label_smoothing)

    @staticmethod
    def backward(ctx, grad_rows):
        q, k, a, b, rq, rk, ra, rb, tau32, *stats = ctx.saved_tensors
        stats = epilogue.RowStats(*stats)
        offset, gamma, eps, normalize, has_margin, cfg = ctx.cfg
        m, d = q.shape
        n = k.shape[0]
        g = grad_rows.detach().float().contiguous()
        nll = epilogue.row_nll(stats)
        d_q = torch.empty(m, d, device=q.device, dtype=torch.float32)
        d_k = torch.empty(n, d, device=q.device, dtype=torch.float32)
        block_d = _pow2(d, 16, 128)
        common = dict(
            HAS_MARGIN=has_margin, UPCAST=cfg["UPCAST"], DOT_PREC=cfg["DOT_PREC"], GRAD_FP32=cfg["GRAD_FP32"],
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_D=block_d,
        )
        args = (q, k, a, b, *_strides(q, k, a, b), rq, rk, ra, rb, stats.pos, nll, g, tau32)
        for out, for_keys, rows, block in ((d_q, False, m, "BLOCK_M"), (d_k, True, n, "BLOCK_N")):
            grid = (triton.cdiv(rows, cfg[block]), triton.cdiv(d, block_d))
            _bwd_kernel[grid](*args, out, *out.stride(), m, n, d, offset, gamma, FOR_KEYS=for_keys, **common)
        inv_tau = 1.0 / tau32
        q_hat = q.float() * rq[:, None]
        k_hat = k.float() * rk[:, None]
        d_q_hat, d_k_hat, d_tau_scaled = epilogue.grads_outside_kernel(
            stats, g, q_hat, k_hat, d_q, d_k, offset, inv_tau, eps)
        d_q_in = epilogue.unnormalize_grad(q, rq, d_q_hat, normalize).to(q.dtype)
        d_k_in = epilogue.unnormalize_grad(k, rk, d_k_hat, normalize).to(k.dtype)
        d_tau = None
        if ctx.needs_input_grad[4]:
            tau_dtype, tau_shape = ctx.tau_meta
            d_tau = (d_tau_scaled * inv_tau).to(tau_dtype).reshape(tau_shape)
        return d_q_in, d_k_in, None, None, d_tau, None, None, None, None


def directional_nll_triton(q, k, a, b, tau, offset, gamma, label_smoothing, normalize):
    """Triton counterpart of :func:`hnclip_kernels.reference.directional_nll_torch`."""
    return HNClipDirectionalTriton.apply(q, k, a, b, tau, offset, gamma, label_smoothing, normalize)
