"""Backward: the negatives' shares of dL/dq̂ and dL/dk̂, one chunk of dS at a time.

``_dscore_kernel`` forms each tile of Z once more and writes W = diag(a) · dS · diag(b)
(dS = dL/dZ times τ, negatives only; a, b the inverse norms times exact powers of two) to the
workspace, once: for bf16/fp16 features as a 16-bit head W̃ = round16(W) and a 16-bit tail
W̃_lo = round16(W − W̃) (float32 W for float32 features). The GEMMs are torch's (cuBLAS on
CUDA, float32 results from 16-bit operands): W̃ k + W̃_lo k and their transposes against q,
accumulated over chunks; the O(N·D) epilogue divides the scales back out.
``backward_shares`` launches them chunk by chunk.

Compensation. Let dS̃ be what the GEMMs see (W̃ + W̃_lo over a_i b_k), dS_ik = dS̃_ik + ε_ik dS_ik.
Row i's share is Σ_k dS_ik k̂_k = Σ_k dS̃_ik k̂_k + Σ_k ε_ik dS_ik k̂_k. The kernel also writes,
per row, ρ_i = Σ_k ε_ik dS_ik (= r_i − r̃_i, the row sums of dS and dS̃), summed in float32 from
the exact per-element residuals W − W̃ − W̃_lo (not as a difference of the two sums, which would
cancel), and the epilogue adds ρ_i k̂_p(i), p(i) = offset + i the row's positive. Then
    GEMM + ρ_i k̂_p(i) − exact = −Σ_k ε_ik dS_ik (k̂_k − k̂_p(i)):
the rounding error of dS enters only through the keys' differences from the row's positive,
and vanishes as the captions a row confuses approach each other (the near-duplicates the
margin is for, where the share, Σ_k dS_ik (k̂_k − k̂_p(i)) with the positive's term, is small
against its terms). The column side is the same with σ_k = Σ_i ε_ik dS_ik and q̂ of the
column's positive row (k − offset, when that row is local; a column without a local positive
row, only in the directional op, is uncompensated). Residual sums are taken per 32-column
(32-row) slice of a tile into per-chunk partial buffers (each slot written by one program) and
merged by ``torch.sum`` in a fixed order: no atomics, bit-reproducible.

Why a tail. A head alone (one 16-bit dS, 2 GEMMs instead of 4) was measured: with the
compensation the image gradient on near-duplicate captions improves as they approach, but
the text gradient (whose rows, the images, are not near-duplicates) and any row with few
negatives keep a 2⁻⁹-relative error (bf16): d txt 1.9e-3 against 1.7e-3 on the clusters of
tests/backends/test_near_duplicates.py, and the README bound fails at N = 2 (3.75e-3 > 3.7e-3,
test_triton_launch). The tail keeps today's accuracy; the compensation then only catches
what the tail flushes (float16's range) and costs O(N·D).

Scales. W's norms are first brought near 1 by exact powers of two (``_pow2_unit``): with
‖q‖‖k‖ ~ 1e36 the plain r_q·r_k·dS falls below float32's normal range. For 16-bit W one more
power of two c (``_pow2_fit``) brings the bound |W_ik| ≤ c·(max|g| + max|g'|) into
[2¹², 2¹³): float16 (max 65504) never overflows. All scales are exact powers of two.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ...numerics import autocast_disabled
from .. import epilogue
from . import config as cfg
from .launch import launch, strides, wrap_triton
from .precision import INTERPRET, _round_bf16
from .tiles import _block, _load2, _load_gamma, _logits_tile

# the residual sums' slice: every dS tile (32, 64 or 128 wide) holds whole slices, so the
# partial buffers' layout does not depend on the tile an autotuner picks
RESIDUAL_SLICE = 32


@triton.jit
def _round16(w, FP16: tl.constexpr):
    """w rounded to bf16 (or fp16 with FP16) to nearest even, as float32."""
    if FP16:
        return w.to(tl.float16).to(tl.float32)
    if INTERPRET:  # the interpreter's own float32 → bf16 conversion truncates
        return _round_bf16(w)
    return w.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _dscore_kernel(
    q_ptr, k_ptr, mq_ptr, mk_ptr,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_mqm, stride_mqd, stride_mkn, stride_mkd,
    rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr, gamma_ptr,
    nll_c_ptr, g_c_ptr, wq_ptr, wk_ptr,
    w_ptr, lo_ptr, stride_wm, stride_wn, res_r_ptr, stride_rr, res_c_ptr, stride_rc,
    row0, row_end, col0, col_end, D, offset,
    SYMMETRIC: tl.constexpr, HAS_MARGIN: tl.constexpr, PREC: tl.constexpr, ROUND16: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[i − row0, k − col0] = a_i · dS_ik · b_k over one chunk [row0, row_end) × [col0, col_end),
    a = r_q · wq, b = r_k · wk; with ROUND16 rounded to w_ptr's 16-bit type, and the residuals'
    slice sums written.

    dS_ik = g_i P_ik over the negatives (P = exp(d − nll)); with SYMMETRIC (M = N,
    offset 0) plus g'_k P'_ki, the softmax of column k, so one tile serves i2t and t2i.
    Grid: (⌈rows / BLOCK_M⌉, ⌈columns / BLOCK_N⌉) of the chunk.

    Features and per-row inputs: as ``forward._fwd_kernel`` (q_ptr, k_ptr, mq_ptr, mk_ptr,
        their strides, rq_ptr, rk_ptr, r_mq_ptr, r_mk_ptr, pos_ptr, tau_ptr, gamma_ptr).
    Per-row inputs of the backward (float32):
        nll_ptr (M): each row's LSE of the gaps (P's normaliser); g_ptr (M): upstream gradient;
        nll_c_ptr, g_c_ptr (N): the same of the key direction (read only with SYMMETRIC);
        wq_ptr, wk_ptr: 1-element powers of two (see the module docstring: the norms brought
        near 1, and for 16-bit W the fit c folded into wq).
    Outputs: w_ptr, the chunk (row_end − row0, col_end − col0), float32 or 16-bit, strides
        stride_wm, stride_wn. With ROUND16, E_ik = (W_ik − W̃_ik) / (a_i b_k) (= ε_ik dS_ik)
        summed over SLICE columns into res_r_ptr[slice, i − row0] (stride_rr between slices)
        and over SLICE rows into res_c_ptr[slice, k − col0] (stride_rc).
    Shapes and scalars: the chunk's bounds row0, row_end (≤ M), col0, col_end (≤ N); D;
        offset (row i's positive is column offset + i).
    Constexprs: SYMMETRIC (also the key direction's share), HAS_MARGIN (γ ≠ 0), PREC
        (``precision._dot``), ROUND16 ("", "bf16" or "fp16": W's type), SLICE (the residual
        sums' slice, dividing both tile sides), BLOCK_M × BLOCK_N tiles, BLOCK_K the
        reduction step (the forward's: the same tiles to the bit).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, mask_m = _block(row0 + pid_m * BLOCK_M, row_end, BLOCK_M)
    offs_n, mask_n = _block(col0 + pid_n * BLOCK_N, col_end, BLOCK_N)
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
    # W_ik = a_i · dS_ik · b_k, the norms first brought near 1 by exact powers of two
    a = rq * tl.load(wq_ptr)
    b = rk * tl.load(wk_ptr)
    w = dscore * a[:, None] * b[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ROUND16 != "":
        w16 = _round16(w, ROUND16 == "fp16")
        lo16 = _round16(w - w16, ROUND16 == "fp16")  # the tail: W ≈ W̃ + W̃_lo to ~16 bits
        # ε_ik dS_ik, exact residual of both roundings, in dS's units; 0 off the chunk (a, b are 0 there)
        err = tl.where(mask, ((w - w16) - lo16) / b[None, :] / a[:, None], 0.0)
        row_part = tl.sum(tl.reshape(err, (BLOCK_M, BLOCK_N // SLICE, SLICE)), axis=2)  # (BLOCK_M, slices)
        col_part = tl.sum(tl.reshape(err, (BLOCK_M // SLICE, SLICE, BLOCK_N)), axis=1)  # (slices, BLOCK_N)
        slices_n = tl.arange(0, BLOCK_N // SLICE)
        slices_m = tl.arange(0, BLOCK_M // SLICE)
        first_n = pid_n * (BLOCK_N // SLICE)
        first_m = pid_m * (BLOCK_M // SLICE)
        tl.store(res_r_ptr + (first_n + slices_n)[None, :] * stride_rr + (offs_m - row0)[:, None], row_part,
                 mask=mask_m[:, None] & (col0 + (first_n + slices_n) * SLICE < col_end)[None, :])
        tl.store(res_c_ptr + (first_m + slices_m)[:, None] * stride_rc + (offs_n - col0)[None, :], col_part,
                 mask=(row0 + (first_m + slices_m) * SLICE < row_end)[:, None] & mask_n[None, :])
        tl.store(lo_ptr + (offs_m - row0)[:, None] * stride_wm + (offs_n - col0)[None, :] * stride_wn,
                 lo16.to(lo_ptr.dtype.element_ty), mask=mask)
        w = w16
    tl.store(w_ptr + (offs_m - row0)[:, None] * stride_wm + (offs_n - col0)[None, :] * stride_wn,
             w.to(w_ptr.dtype.element_ty), mask=mask)


# autotuned twin (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
_dscore_tuned = triton.autotune(cfg.all_candidates("dscore"), key=["D", "HAS_MARGIN", "PREC", "SYMMETRIC", "ROUND16"],
                                prune_configs_by={"early_config_prune": cfg.pruner("dscore", "q_ptr")})(_dscore_kernel)


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("dscore"), its autotuned twin when ``tuned``, through ``wrap_triton``;
    spelled out kernel by kernel (see :func:`.launch.launch`)."""
    assert name == "dscore", name
    return wrap_triton(_dscore_tuned) if tuned else wrap_triton(_dscore_kernel)


# ------------------------------------------------------------------ host launcher
def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _pow2_fit(g: torch.Tensor, g_c: torch.Tensor) -> torch.Tensor:
    """The power of two c (1-element float32, no host sync) with c·(max|g| + max|g_c|) in
    [2¹², 2¹³): a 16-bit W = c·a·dS·b (a, b ≤ 1, |dS_ik| ≤ |g_i| + |g_c,k|) then stays below
    2¹³, far from float16's 65504."""
    bound = (g.abs().max() + g_c.abs().max()).reshape(1)
    _, exponent = torch.frexp(bound)
    return torch.ldexp(torch.ones(1, device=g.device), 13 - exponent)


@contextlib.contextmanager
def _ieee_float32(device: torch.device):
    """float32 matmuls in IEEE float32 (never TF32) within the block, on CUDA. The CPU's are."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        saved = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved
    else:
        saved = matmul.allow_tf32
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = saved


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


def workspace_bytes(m: int, n: int, dtype: torch.dtype) -> int:
    """Bytes :func:`backward_shares` allocates at its peak for M rows against N columns of
    ``dtype`` features: one chunk of ``config.chunk_shape`` (the first, the largest), its 16-bit
    head and tail (or float32 dS) and, for 16-bit features, the residual slice sums."""
    rows, cols = cfg.chunk_shape(m, n)
    if dtype == torch.float32:
        return 4 * rows * cols
    return 4 * rows * cols + 4 * (triton.cdiv(cols, RESIDUAL_SLICE) * rows + triton.cdiv(rows, RESIDUAL_SLICE) * cols)


def _rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """x[start:end], or x itself when that is all of it (a traced operator then writes the
    tensor, not a view of it: no scatter back into a base)."""
    return x if (start, end) == (0, x.shape[0]) else x[start:end]


def backward_shares(ops, norms, stats, g, tau32, gamma32, has_margin: bool, offset: int, precision, key_side=None):
    """Negatives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``ops``, ``norms``, ``tau32``, ``gamma32``, ``has_margin``: as :func:`.forward.forward_stats`;
    ``stats``: its row statistics, ``g`` the upstream gradient of each row.
    ``key_side = (stats, g)`` of the transposed direction makes it symmetric (M = N, offset 0).
    dS is materialised one R × C chunk at a time (4·R·C ≤ ``cfg.BWD_WORKSPACE_BYTES``: e.g.
    8192 × 8192 in 256 MiB, a 16-bit head and tail or a float32 dS) and multiplied by the
    features in torch GEMMs (two per chunk for float32 features; four, head and tail, for
    16-bit ones), each accumulated in float32 over the chunks (``torch.addmm``).
    Chunks run in a fixed order and cuBLAS runs a given GEMM the same way every time on one
    GPU (no split-K atomics in its default mode; with several streams, set
    CUBLAS_WORKSPACE_CONFIG=:4096:8 as ``torch.use_deterministic_algorithms`` asks):
    deterministic.
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    round16 = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, "")
    nll = epilogue.row_nll(stats)
    nll_c, g_c = (epilogue.row_nll(key_side[0]), key_side[1]) if key_side else (nll, g)
    wq, wk = _pow2_unit(norms[0]), _pow2_unit(norms[1])
    if round16:
        wq = wq * _pow2_fit(g, g_c if key_side else torch.zeros_like(g[:1]))
    # what the products divide out of W = diag(r_q wq) dS diag(r_k wk): its own side's scale and
    # the other side's power of two (all exact: powers of two)
    rq, rk = norms[0] * wq * wk, norms[1] * wk * wq
    w_dtype = q.dtype if round16 else torch.float32
    rows, cols = cfg.chunk_shape(m, n)
    prec = cfg.dot_precision(q.dtype, precision)
    d_q_parts, d_k_parts = [], [None] * triton.cdiv(n, cols)
    rho_parts, sigma_parts = [], [None] * triton.cdiv(n, cols)
    # the GEMMs accumulate in float32 whatever autocast region the backward runs in
    with _ieee_float32(q.device), autocast_disabled(q.device):
        for row0 in range(0, m, rows):
            row_end = min(row0 + rows, m)
            acc_q = rho = None
            for j, col0 in enumerate(range(0, n, cols)):
                col_end = min(col0 + cols, n)
                r, c = row_end - row0, col_end - col0
                # a fresh workspace per chunk, the previous one freed first (the allocator hands its
                # memory back): never a view into a shared buffer, which a traced operator would
                # write through a scatter
                w = torch.empty(r, c, device=q.device, dtype=w_dtype)
                if round16:
                    lo = torch.empty(r, c, device=q.device, dtype=w_dtype)
                    res_r = torch.empty(triton.cdiv(c, RESIDUAL_SLICE), r, device=q.device, dtype=torch.float32)
                    res_c = torch.empty(triton.cdiv(r, RESIDUAL_SLICE), c, device=q.device, dtype=torch.float32)
                else:  # not written without ROUND16: w stands in for the pointers
                    lo = res_r = res_c = w
                args = (*ops, *strides(*ops), *norms, stats.pos, nll, g, tau32, gamma32, nll_c, g_c, wq, wk, w, lo,
                        *w.stride(), res_r, res_r.stride(0), res_c, res_c.stride(0),
                        row0, row_end, col0, col_end, d, offset)
                launch(lambda tuned: _kernel("dscore", tuned), "dscore", q.element_size(),
                       lambda t, r=r, c=c: (triton.cdiv(r, t["BLOCK_M"]), triton.cdiv(c, t["BLOCK_N"])),
                       args, SYMMETRIC=key_side is not None, HAS_MARGIN=has_margin, PREC=prec, ROUND16=round16,
                       SLICE=RESIDUAL_SLICE, BLOCK_K=cfg.score_block_k(q.element_size()))
                k_cols, q_rows = _rows(k, col0, col_end), _rows(q, row0, row_end)
                acc_q = _mm(w, k_cols, acc_q)
                d_k_parts[j] = _mm(w.t(), q_rows, d_k_parts[j])
                if round16:  # the tail's products (the head's are above)
                    acc_q = _mm(lo, k_cols, acc_q)
                    d_k_parts[j] = _mm(lo.t(), q_rows, d_k_parts[j])  # slice sums merged in a fixed order, then over chunks in chunk order
                    rho = res_r.sum(0) if rho is None else rho + res_r.sum(0)
                    s = res_c.sum(0)
                    sigma_parts[j] = s if sigma_parts[j] is None else sigma_parts[j] + s
                del w, lo, res_r, res_c, args  # one chunk alive at a time
            d_q_parts.append(acc_q)
            rho_parts.append(rho)
    d_q = (d_q_parts[0] if len(d_q_parts) == 1 else torch.cat(d_q_parts)).div_(rq[:, None])
    d_k = (d_k_parts[0] if len(d_k_parts) == 1 else torch.cat(d_k_parts)).div_(rk[:, None])
    if round16:
        rho = rho_parts[0] if len(rho_parts) == 1 else torch.cat(rho_parts)
        sigma = sigma_parts[0] if len(sigma_parts) == 1 else torch.cat(sigma_parts)
        epilogue.add_rounding_compensation(d_q, d_k, rho, sigma, q, k, norms[0], norms[1], offset)
    return d_q, d_k
