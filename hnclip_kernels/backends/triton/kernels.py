"""Triton kernels of the fused loss (device code only; launched by :mod:`.launch`)."""
from __future__ import annotations

import triton
import triton.language as tl


# ------------------------------------------------------------------ device helpers
@triton.jit
def _round_tf32(x, NEAREST: tl.constexpr):
    """x rounded to tf32 (10-bit mantissa): truncated, as a tensor core reads float32
    registers, or to nearest (ties away), as Triton's tf32x3 split does."""
    bits = x.to(tl.uint32, bitcast=True)
    if NEAREST:
        bits = bits + 0x1000
    return (bits & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(x):
    """x rounded to bfloat16, to nearest even (the GPU's conversion; the interpreter's
    own conversion truncates), returned as float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _head(x, BF16: tl.constexpr):
    """The leading part of a multi-pass split: bf16 to nearest even, or tf32 to nearest."""
    if BF16:
        return _round_bf16(x)
    return _round_tf32(x, True)


@triton.jit
def _tail(x, BF16: tl.constexpr):
    """A remainder as the tensor core reads it: bf16 to nearest even, or tf32 truncated."""
    if BF16:
        return _round_bf16(x)
    return _round_tf32(x, False)


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b with float32 accumulation. On a GPU, ``input_precision=PREC`` (used for
    float32 operands only). Under the interpreter, which multiplies exactly in float32
    (and mis-multiplies bf16), the operands are upcast and rounded as the tensor cores
    round them, and multi-pass modes are spelled out, so CPU runs compute what a GPU does."""
    if PREC == "bf16x2" or PREC == "tf32x2":
        # float32 a (the dS workspace) against b whose values the narrow type holds exactly
        # (bf16, or fp16 in tf32): only a is split, into head and tail, 2 passes
        acc = _dot_split_a(a, b, acc, PREC == "bf16x2", INTERPRET)
    elif INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if PREC == "tf32":
            acc = tl.dot(_round_tf32(a, False), _round_tf32(b, False), acc)
        elif PREC == "tf32x3" or PREC == "bf16x3":
            # Σ of three products: tail·head + head·tail + head·head (the tails' product dropped)
            a_hi = _head(a, PREC == "bf16x3")
            b_hi = _head(b, PREC == "bf16x3")
            acc = tl.dot(_tail(a - a_hi, PREC == "bf16x3"), b_hi, acc)
            acc = tl.dot(a_hi, _tail(b - b_hi, PREC == "bf16x3"), acc)
            acc = tl.dot(a_hi, b_hi, acc)
        elif PREC == "bf16x6":
            a1 = _round_bf16(a)
            b1 = _round_bf16(b)
            a2 = _round_bf16(a - a1)
            b2 = _round_bf16(b - b1)
            a3 = _round_bf16(a - a1 - a2)
            b3 = _round_bf16(b - b1 - b2)
            acc = tl.dot(a1, b3, acc)
            acc = tl.dot(a2, b2, acc)
            acc = tl.dot(a3, b1, acc)
            acc = tl.dot(a1, b2, acc)
            acc = tl.dot(a2, b1, acc)
            acc = tl.dot(a1, b1, acc)
        else:
            acc = tl.dot(a, b, acc)
    else:
        if a.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dot_split_a(a, b, acc, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    b = b.to(tl.float32) if INTERPRET or not BF16 else b
    if INTERPRET:
        a_hi = _head(a, BF16)
        a_lo = _tail(a - a_hi, BF16)
    elif BF16:
        a_hi = a.to(tl.bfloat16).to(tl.float32)
        a_lo = (a - a_hi).to(tl.bfloat16).to(tl.float32)
    else:
        a_hi = _round_tf32(a, True)
        a_lo = a - a_hi  # the MMA reads it truncated to tf32
    if INTERPRET:
        acc = tl.dot(a_lo, b, acc)
        acc = tl.dot(a_hi, b, acc)
    elif BF16:
        acc = tl.dot(a_lo.to(tl.bfloat16), b, acc)
        acc = tl.dot(a_hi.to(tl.bfloat16), b, acc)
    else:
        acc = tl.dot(a_lo, b, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b, acc, input_precision="tf32")
    return acc


@triton.jit
def _logits_tile(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq, rk, ra, rb,  # float32 inverse norms of this tile's rows / columns
    offs_m, offs_n, M, N, D, gamma, inv_tau,
    HAS_MARGIN: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr,
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
        acc = _dot(q, k, acc, PREC, INTERPRET)
        if HAS_MARGIN:
            a = tl.load(a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ad,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptr + offs_k[:, None] * s_bd + offs_n[None, :] * s_bn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_margin = _dot(a, b, acc_margin, PREC, INTERPRET)
    # the norms scale float32 tiles: the normalised vectors are never rounded to bf16
    z = acc * rq[:, None] * rk[None, :]
    if HAS_MARGIN:
        z += gamma * (acc_margin * ra[:, None] * rb[None, :])
    return z * inv_tau


@triton.jit
def _load_gamma(gamma_ptr, HAS_MARGIN: tl.constexpr):
    """The margin scale γ, float32, read from device memory like τ (never a float argument:
    Inductor passes Python-float arguments of user kernels as fp64, which would turn the
    float32 tiles and loop-carried statistics into fp64; and a tensor γ lets a compiled graph
    take a new value without recompiling). Not read without the margin."""
    gamma = 0.0
    if HAS_MARGIN:
        gamma = tl.load(gamma_ptr).to(tl.float32)
    return gamma


@triton.jit
def _block(start, size, BLOCK: tl.constexpr):
    """Offsets and bounds mask of one block of rows (or columns). No pointer goes in: torch's
    mutation analysis of a traced kernel follows a store's address back through the helper
    calls it came from and takes every pointer argument of those calls as written."""
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < size


@triton.jit
def _load2(ptr1, ptr2, offs, mask):
    """Two vectors (a block's inverse norms) at ``offs``, 0 outside ``mask``."""
    return tl.load(ptr1 + offs, mask=mask, other=0.0), tl.load(ptr2 + offs, mask=mask, other=0.0)


@triton.jit
def _tile_stats(d, neg, AXIS: tl.constexpr):
    """Max, Σexp(d − max), Σexp(d − max)·d and Σd of a tile of gaps along AXIS
    (d is −inf off the negatives; so is the max of a line without negatives)."""
    top = tl.max(d, axis=AXIS)
    safe = tl.where(top == float("-inf"), 0.0, top)  # no -inf - -inf
    if AXIS == 1:
        p = tl.exp(d - safe[:, None])
    else:
        p = tl.exp(d - safe[None, :])
    d0 = tl.where(neg, d, 0.0)
    return top, tl.sum(p, axis=AXIS), tl.sum(p * d0, axis=AXIS), tl.sum(d0, axis=AXIS)


@triton.jit
def _combine(m1, s1, w1, m2, s2, w2):
    """Merge two (max, Σexp, Σexp·d) summaries, each relative to its own max (−inf: empty).
    Rescaling to the joint max keeps tiny sums (a saturated row's exp(−90)) representable."""
    m = tl.maximum(m1, m2)
    safe = tl.where(m == float("-inf"), 0.0, m)  # no -inf - -inf
    e1 = tl.exp(m1 - safe)
    e2 = tl.exp(m2 - safe)
    return m, s1 * e1 + s2 * e2, w1 * e1 + w2 * e2


@triton.jit
def _store_partial(ptr, plane, offs, mask, m, s, w, ds, SMOOTHING: tl.constexpr):
    tl.store(ptr + offs, m, mask=mask)
    tl.store(ptr + plane + offs, s, mask=mask)
    tl.store(ptr + 2 * plane + offs, w, mask=mask)
    if SMOOTHING:
        tl.store(ptr + 3 * plane + offs, ds, mask=mask)


# ------------------------------------------------------------------ forward
@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq_ptr, rk_ptr, ra_ptr, rb_ptr, pos_ptr, tau_ptr, gamma_ptr,
    row_part_ptr,  # (splits, planes, M): this split's summary of each row
    col_part_ptr,  # (row blocks, planes, N): this row block's summary of each column (COL_STATS)
    M, N, D, offset, cols_per_split,
    COL_STATS: tl.constexpr, SMOOTHING: tl.constexpr,
    HAS_MARGIN: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One walk over the tiles of Z: each tile formed once serves the rows and the columns.

    For the gaps d = Z − Z_pos over the negatives, a row's summary is (max, Σexp, Σexp·d,
    Σd) over this program's column split; a column's is the same over this row block.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    inv_tau = 1.0 / tl.load(tau_ptr)
    gamma = _load_gamma(gamma_ptr, HAS_MARGIN)
    offs_m, mask_m = _block(pid_m * BLOCK_M, M, BLOCK_M)
    rq, ra = _load2(rq_ptr, ra_ptr, offs_m, mask_m)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M,), tl.float32)
    run_wsum = tl.zeros((BLOCK_M,), tl.float32)
    run_dsum = tl.zeros((BLOCK_M,), tl.float32)
    n_start = pid_s * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n, mask_n = _block(n0, n_end, BLOCK_N)
        rk, rb = _load2(rk_ptr, rb_ptr, offs_n, mask_n)
        z = _logits_tile(q_ptr, k_ptr, a_ptr, b_ptr, s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
                         rq, rk, ra, rb, offs_m, offs_n, M, N, D, gamma, inv_tau,
                         HAS_MARGIN, INTERPRET, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
        d = tl.where(neg, z - pos[:, None], float("-inf"))
        t_max, t_sum, t_wsum, t_dsum = _tile_stats(d, neg, 1)
        run_max, run_sum, run_wsum = _combine(run_max, run_sum, run_wsum, t_max, t_sum, t_wsum)
        run_dsum += t_dsum
        if COL_STATS:  # symmetric loss (M = N, offset 0): column j's positive is Z_jj = pos_j
            pos_c = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
            d_c = tl.where(neg, z - pos_c[None, :], float("-inf"))
            c_max, c_sum, c_wsum, c_dsum = _tile_stats(d_c, neg, 0)
            _store_partial(col_part_ptr + pid_m.to(tl.int64) * (3 + SMOOTHING) * N, N, offs_n, mask_n,
                           c_max, c_sum, c_wsum, c_dsum, SMOOTHING)
    _store_partial(row_part_ptr + pid_s.to(tl.int64) * (3 + SMOOTHING) * M, M, offs_m, mask_m,
                   run_max, run_sum, run_wsum, run_dsum, SMOOTHING)


@triton.jit
def _merge_kernel(part_ptr, n_parts, L, delta_ptr, mean_neg_ptr, dsum_ptr,
                  SMOOTHING: tl.constexpr, BLOCK: tl.constexpr):
    """Combine ``n_parts`` summaries (n_parts, planes, L) of each line, in order, into
    delta = LSE(d) (−inf without negatives), mean_neg = E_softmax[d] and Σd."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    w = tl.zeros((BLOCK,), tl.float32)
    ds = tl.zeros((BLOCK,), tl.float32)
    planes = 3 + SMOOTHING
    base = part_ptr + offs
    for _ in range(0, n_parts):
        m, s, w = _combine(m, s, w, tl.load(base, mask=mask, other=0.0), tl.load(base + L, mask=mask, other=0.0),
                           tl.load(base + 2 * L, mask=mask, other=0.0))
        if SMOOTHING:
            ds += tl.load(base + 3 * L, mask=mask, other=0.0)
        base += planes * L  # pointer steps: the workspace passes 2^31 entries near N = 2^18
    has_neg = s > 0.0
    delta = tl.where(has_neg, m + tl.log(tl.where(has_neg, s, 1.0)), float("-inf"))
    delta = tl.where(s != s, s, delta)  # a NaN anywhere in the line stays visible in the loss
    tl.store(delta_ptr + offs, delta, mask=mask)
    tl.store(mean_neg_ptr + offs, tl.where(has_neg, w / tl.where(has_neg, s, 1.0), 0.0), mask=mask)
    tl.store(dsum_ptr + offs, ds, mask=mask)


# ------------------------------------------------------------------ backward
@triton.jit
def _dscore_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr,
    s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
    rq_ptr, rk_ptr, ra_ptr, rb_ptr, pos_ptr, nll_ptr, g_ptr, tau_ptr, gamma_ptr,
    nll_c_ptr, g_c_ptr,  # SYMMETRIC only: the key direction's NLL and upstream gradient
    wq_ptr, wk_ptr,  # powers of two that bring the inverse norms near 1 in W (see _pow2_unit)
    w_ptr, s_wm, s_wn,
    row0, row_end, col0, col_end, D, offset,
    SYMMETRIC: tl.constexpr,
    HAS_MARGIN: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[i − row0, k − col0] = r_q,i · dS_ik · r_k,k over one chunk [row0, row_end) × [col0, col_end).

    dS_ik = g_i P_ik over the negatives (P = exp(d − nll)); with SYMMETRIC (M = N,
    offset 0) plus g'_k P'_ki, the softmax of column k, so one tile serves i2t and t2i.
    """
    offs_m, mask_m = _block(row0 + tl.program_id(0) * BLOCK_M, row_end, BLOCK_M)
    offs_n, mask_n = _block(col0 + tl.program_id(1) * BLOCK_N, col_end, BLOCK_N)
    rq, ra = _load2(rq_ptr, ra_ptr, offs_m, mask_m)
    rk, rb = _load2(rk_ptr, rb_ptr, offs_n, mask_n)
    inv_tau = 1.0 / tl.load(tau_ptr)
    gamma = _load_gamma(gamma_ptr, HAS_MARGIN)
    z = _logits_tile(q_ptr, k_ptr, a_ptr, b_ptr, s_qm, s_qd, s_kn, s_kd, s_am, s_ad, s_bn, s_bd,
                     rq, rk, ra, rb, offs_m, offs_n, row_end, col_end, D, gamma, inv_tau,
                     HAS_MARGIN, INTERPRET, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
    g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
    # mask before exp: the positive's tile entry carries a margin and may overflow
    ds = tl.exp(tl.where(neg, z - pos[:, None] - nll[:, None], float("-inf"))) * g[:, None]
    if SYMMETRIC:
        pos_c = tl.load(pos_ptr + offs_n, mask=mask_n, other=0.0)
        nll_c = tl.load(nll_c_ptr + offs_n, mask=mask_n, other=0.0)
        g_c = tl.load(g_c_ptr + offs_n, mask=mask_n, other=0.0)
        ds += tl.exp(tl.where(neg, z - pos_c[None, :] - nll_c[None, :], float("-inf"))) * g_c[None, :]
    # W_ik = dS_ik · r_q,i · r_k,k, the norms first brought near 1 by exact powers of two: with
    # ‖q‖‖k‖ ~ 1e36, r_q·r_k·dS would otherwise fall below float32's normal range
    w = ds * (rq * tl.load(wq_ptr))[:, None] * (rk * tl.load(wk_ptr))[None, :]
    tl.store(w_ptr + (offs_m - row0)[:, None] * s_wm + (offs_n - col0)[None, :] * s_wn, w,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grad_gemm_kernel(
    a_ptr, b_ptr, c_ptr, r_ptr,
    M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
    ACCUMULATE: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C (+)= (A @ B) / r[:, None], float32 C and accumulation. A is the dS workspace (or
    its transpose, through strides), B the raw features; 1/r undoes W's row scaling."""
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
        a = tl.load(a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, PREC, INTERPRET)
    r = tl.load(r_ptr + offs_m, mask=mask_m, other=1.0)
    acc = acc / r[:, None]
    c_ptrs = c_ptr + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc, mask=mask)
