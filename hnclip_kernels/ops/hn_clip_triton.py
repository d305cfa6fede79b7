"""Fused HN-CLIP loss in Triton: forward, backward, their operators and autograd.

A tile of logits ``Z = (q̂ k̂ᵀ + γ · stopgrad(â b̂ᵀ)) / τ`` is formed on the fly from the raw
features and their float32 inverse row norms. Nothing of size M×N is stored.

Forward (``_fwd_kernel``, one walk over the tiles): program (row block, column split)
forms each of its tiles once and folds it into an online LSE along its rows (i2t) and,
for the symmetric loss, into complete statistics of the tile's columns (t2i). Both are
partial (the rows' over one column split, the columns' over one row block) and
``_merge_kernel`` combines them in a fixed order: deterministic, no atomics.

Backward, per R × C chunk of Z (R·C·elem ≤ ``BWD_WORKSPACE_BYTES``, 256 MiB): ``_dscore_kernel``
forms each tile once more and writes W = diag(r_q) · dS · diag(r_k) (dS = dL/dZ times τ,
negatives only) to a float32 workspace; ``_grad_gemm_kernel`` then adds (W k) / r_q to dq̂ and
(Wᵀ q) / r_k to dk̂. Why a workspace and not full-D accumulators: at D = 768 a 64-row
float32 accumulator alone is 192 KiB, more than a program's registers, so a fused
backward must slice D and re-form each tile once per slice (6× at D = 768); materialising
dS costs one write and two reads of 2 bytes per logit, and both products become plain
GEMMs with long reductions, whatever D is. Matmul work per step, in N×N×D products:
2 forward + 2 dS + 2 × 2 GEMM passes with the margin (2.67× the 3 useful ones), 1 + 1 + 4
without (2.0×). The GEMMs take two passes because W is kept in float32 and split into a
head and a tail in the features' type: a single bf16 pass would round dS to 8 bits, and
for near-duplicate captions (the hard negatives the margin is for) the gradient
Σ_k dS_ik (t̂_k − t̂_i) is small against its terms, so that rounding reached 2% of it.

Every output element is written by one program, chunks run in order: bit-reproducible.
One direction at a time (M query rows vs N key columns, positive of row i at column
``offset + i``) serves a rank of a distributed job; the symmetric operator is the fused
single-process loss (both directions from the same tiles).

Registration. Four operators, registered once at import:

* ``hnclip::triton_symmetric_nll(img, txt, tau, gamma, has_margin, label_smoothing, normalize,
  precision)`` → (pairs, rv, rt, pos, and the (delta, mean_neg, dsum) of i2t then of t2i), what
  ``hn_clip_loss(backend="triton")`` runs, and ``hnclip::triton_directional_nll(q, k, a, b,
  tau, gamma, offset, has_margin, label_smoothing, normalize, precision)`` → (loss, rq, rk,
  ra, rb, pos, delta, mean_neg, dsum), what a rank of the distributed loss runs;
* their ``*_backward`` operators → (dL/dq, dL/dk, dL/dτ) in the inputs' dtypes.

τ and γ are tensors (γ: shape (1,), float32; ``has_margin`` = γ ≠ 0 is the kernels' HAS_MARGIN),
so a schedule of either reuses a compiled graph; the kernels read both from device memory and
take no float argument at all: Inductor types a Python float fp64 inside a user kernel, and
with γ a float argument the float32 tiles became fp64 and the forward kernel failed to compile
("Loop-carried variable run_max has initial type fp32 but is re-assigned to fp64").
``python -m benchmarks.sm90 --wide-scalars`` compiles the kernels with Inductor's scalar types.
``label_smoothing`` stays a float (a new ε is a new graph); ``precision`` is the tensor-core mode
string (``triton_config.FP32_PRECISIONS``).

With compiled kernels the operators are ``torch.library.triton_op``s launching every kernel
through ``torch.library.wrap_triton`` (:func:`_kernel`): ``torch.compile`` traces them into
one ``triton_kernel_wrapper`` node per launch that Inductor compiles with the rest of the
graph, and the operator function run on fake tensors is its own fake implementation.
Under the interpreter (``TRITON_INTERPRET=1``) ``wrap_triton`` hands back the interpreted
kernel, which cannot run on fake tensors, so the same functions are registered with
``torch.library.custom_op`` and explicit fake implementations: opaque to tracing, the same
kernels run eagerly inside (``torch.compile`` with "eager"/"aot_eager", ``torch.export`` and
``opcheck`` work on CPU tensors; Inductor cannot compile user Triton kernels for CPU tensors).

Autograd: ``torch.library.register_autograd`` on the forward operators (what a compiled or
exported graph uses) and a raising formula on the backward operators (a second derivative is
one ``RuntimeError`` naming backend="torch", ``hnclip_kernels._first_order``). In eager mode
the public wrappers call the operators through :class:`HNClipTriton` /
:class:`HNClipDirectionalTriton`, ``autograd.Function``s with the same ``setup_context`` and
backward, because ``torch.func`` refuses the Function that ``register_autograd`` builds;
``torch.library.register_vmap`` gives every operator a loop over the batch, so
``torch.func.grad``, ``vjp`` and ``vmap`` (and ``vmap`` of ``grad``) work.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._first_order import first_order_call, raising_backward
from .._validation import check_directional
from . import epilogue, registration
from . import triton_config as cfg


def _is_interpreting() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at import
    return "Interpreted" in type(_fwd_kernel).__name__


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


# autotuned twins of the kernels (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
_KEY = ["D", "HAS_MARGIN", "PREC"]
_fwd_tuned = triton.autotune(cfg.all_candidates("fwd"), key=_KEY + ["COL_STATS"],
                             prune_configs_by={"early_config_prune": cfg.pruner("fwd", "q_ptr")})(_fwd_kernel)
_dscore_tuned = triton.autotune(cfg.all_candidates("dscore"), key=_KEY + ["SYMMETRIC"],
                                prune_configs_by={"early_config_prune": cfg.pruner("dscore", "q_ptr")})(_dscore_kernel)
_gemm_tuned = triton.autotune(cfg.all_candidates("gemm"), key=["N", "PREC", "ACCUMULATE"], restore_value=["c_ptr"],
                              prune_configs_by={"early_config_prune": cfg.pruner("gemm", "b_ptr")})(_grad_gemm_kernel)

# How the operators are registered (see the module docstring): triton_op for compiled kernels,
# custom_op under the interpreter (and on a torch without triton_op)
_INTERPRETED = _is_interpreting()
_USE_TRITON_OP = not _INTERPRETED and hasattr(torch.library, "triton_op")
if _USE_TRITON_OP:
    from torch.library import wrap_triton
else:
    def wrap_triton(kernel):
        """Under the interpreter the kernels are launched as they are."""
        return kernel


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("fwd", "merge", "dscore", "gemm"), its autotuned twin when ``tuned``, through
    ``torch.library.wrap_triton``: the kernel itself in an eager call of an operator, a traceable
    wrapper (a ``triton_kernel_wrapper`` node per launch) while ``torch.compile`` traces one.
    Spelled out kernel by kernel so that ``triton_op`` finds every kernel of its operators in
    this source (torch hashes their code into its compile-cache keys)."""
    if name == "fwd":
        return wrap_triton(_fwd_tuned) if tuned else wrap_triton(_fwd_kernel)
    if name == "dscore":
        return wrap_triton(_dscore_tuned) if tuned else wrap_triton(_dscore_kernel)
    if name == "gemm":
        return wrap_triton(_gemm_tuned) if tuned else wrap_triton(_grad_gemm_kernel)
    return wrap_triton(_merge_kernel)


def _traced(kernel) -> bool:
    """Is ``kernel`` (from :func:`_kernel`) a traceable wrapper, i.e. is an operator being traced?"""
    return _USE_TRITON_OP and not isinstance(kernel, (triton.runtime.JITFunction, triton.runtime.Autotuner))


def _launch(name: str, width: int, grid, args, **constexprs):
    """Launch kernel ``name`` (its autotuned twin in mode "autotune"); ``grid(tiles)`` maps the
    chosen constexprs to the launch grid.

    Traced, an accumulating GEMM (ACCUMULATE) takes the fixed configuration: torch re-wraps a
    traced autotuner without its ``restore_value``, so benchmarking the candidates outside
    Inductor (``backend="aot_eager"``) would add the product into the output once per candidate."""
    if cfg.launch_mode() == "autotune":
        tuned = _kernel(name, True)
        if not (constexprs.get("ACCUMULATE") and _traced(tuned)):
            tuned[lambda meta: grid(meta)](*args, **constexprs)
            return
    fixed = cfg.heuristic(name, width)
    tiles = {**constexprs, **fixed.constexprs}
    _kernel(name, False)[grid(tiles)](*args, **tiles, num_warps=fixed.num_warps, num_stages=fixed.num_stages)


# ------------------------------------------------------------------ launchers
def _strides(*xs):
    return [s for x in xs for s in x.stride()]


def _merge(part: torch.Tensor, smoothing: bool):
    """(delta, mean_neg, dsum) of each line from its partial summaries (n_parts, planes, L):
    three separate tensors (an operator's outputs may not alias each other)."""
    n_parts, _, length = part.shape
    delta, mean_neg, dsum = (torch.empty(length, device=part.device, dtype=torch.float32) for _ in range(3))
    block = 128 if cfg.launch_mode() != "interpret" else 64
    _kernel("merge", False)[(triton.cdiv(length, block),)](part, n_parts, length, delta, mean_neg, dsum,
                                                           SMOOTHING=smoothing, BLOCK=block)
    return delta, mean_neg, dsum


def _forward_stats(ops, norms, pos, tau32, gamma32, has_margin: bool, offset: int, smoothing: bool, precision,
                   columns: bool = False):
    """Statistics of Z's rows (``epilogue.RowStats``), and with ``columns`` also of Zᵀ's rows
    (M = N, offset 0), from one walk over the tiles. ``tau32``/``gamma32``: 1-element float32
    tensors on the features' device; ``has_margin``: γ ≠ 0 (the kernels skip â b̂ᵀ without it).

    Workspace: 4 bytes × (3, or 4 with label smoothing) × (M · splits + N · ⌈M / BLOCK_M⌉), e.g.
    384 MiB at N = 65536 with 16-bit features (BLOCK_M = 128), nothing at all of size N × N.
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    width = q.element_size()
    block_m = cfg.fwd_block_m(width)
    row_blocks = triton.cdiv(m, block_m)
    splits, per_split = cfg.column_splits(row_blocks, n, q.device)
    planes = 4 if smoothing else 3
    row_part = torch.empty(splits, planes, m, device=q.device, dtype=torch.float32)
    col_part = (torch.empty(row_blocks, planes, n, device=q.device, dtype=torch.float32) if columns
                else row_part)  # unused without COL_STATS
    args = (*ops, *_strides(*ops), *norms, pos, tau32, gamma32, row_part, col_part, m, n, d, offset, per_split)
    _launch("fwd", width, lambda t: (row_blocks, splits), args,
            COL_STATS=columns, SMOOTHING=smoothing, HAS_MARGIN=has_margin, INTERPRET=cfg.is_interpreting(),
            PREC=cfg.dot_precision(q.dtype, precision), BLOCK_M=block_m, BLOCK_K=cfg.score_block_k(width))
    rows = epilogue.RowStats(pos, *_merge(row_part, smoothing))
    if not columns:
        return rows
    return rows, epilogue.RowStats(pos, *_merge(col_part, smoothing))


def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _gemm(a, b, c, r, accumulate: bool, precision: str):
    """c (+)= (a @ b) / r[:, None] (a may be a transposed view of the workspace)."""
    m, kk = a.shape
    n = b.shape[1]
    args = (a, b, c, r, m, n, kk, *a.stride(), *b.stride(), *c.stride())
    _launch("gemm", b.element_size(), lambda t: (triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"]),), args,
            ACCUMULATE=accumulate, INTERPRET=cfg.is_interpreting(), PREC=precision, GROUP_M=8)


def _rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """x[start:end], or x itself when that is all of it (a traced operator then writes the
    tensor, not a view of it: no scatter back into a base)."""
    return x if (start, end) == (0, x.shape[0]) else x[start:end]


def _backward_shares(ops, norms, stats, g, tau32, gamma32, has_margin: bool, offset: int, precision, key_side=None):
    """Negatives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

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
            args = (*ops, *_strides(*ops), *norms, stats.pos, nll, g, tau32, gamma32, nll_c, g_c, wq, wk, w,
                    *w.stride(), row0, row_end, col0, col_end, d, offset)
            _launch("dscore", width,
                    lambda t: (triton.cdiv(row_end - row0, t["BLOCK_M"]), triton.cdiv(col_end - col0, t["BLOCK_N"])),
                    args, SYMMETRIC=key_side is not None, HAS_MARGIN=has_margin, INTERPRET=cfg.is_interpreting(),
                    PREC=prec, BLOCK_K=cfg.score_block_k(width))
            _gemm(w, _rows(k, col0, col_end), _rows(d_q, row0, row_end), _rows(rq, row0, row_end), col0 > 0,
                  grad_prec)
            _gemm(w.t(), _rows(q, row0, row_end), _rows(d_k, col0, col_end), _rows(rk, col0, col_end), row0 > 0,
                  grad_prec)
            del w
    return d_q, d_k


# ------------------------------------------------------------------ operators
_SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_DirOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_Grads = Tuple[Tensor, Tensor, Tensor]


def _register(name: str, fake):
    """Decorator: the function as the operator ``hnclip::<name>`` (no mutated arguments).

    Compiled kernels: ``torch.library.triton_op``, so ``torch.compile`` sees the kernel launches
    (``wrap_triton``) and Inductor compiles them into its graph; the function itself, run on
    fake tensors, is the fake implementation. Interpreter (or a torch without ``triton_op``):
    ``torch.library.custom_op`` with the explicit ``fake``: ``wrap_triton`` hands back an
    interpreted kernel as it is, and that cannot run on fake tensors, so the operator is
    opaque to tracing there (the same kernels run eagerly inside it)."""

    def wrap(fn):
        if _USE_TRITON_OP:
            return torch.library.triton_op(f"hnclip::{name}", fn, mutates_args=())
        op = torch.library.custom_op(f"hnclip::{name}", fn, mutates_args=())
        op.register_fake(fake)
        return op

    return wrap


def _scalar32(x: Tensor, like: Tensor) -> Tensor:
    """A one-element tensor (τ, γ) as the kernels read it: float32, shape (1,), on ``like``'s device."""
    return x.to(device=like.device, dtype=torch.float32).reshape(1)


def _sym_fake(img, txt, tau, gamma, has_margin, label_smoothing, normalize, precision):
    return tuple(img.new_empty((img.shape[0],), dtype=torch.float32) for _ in range(10))


@_register("triton_symmetric_nll", _sym_fake)
def _symmetric_nll(img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor, has_margin: bool, label_smoothing: float,
                   normalize: bool, precision: str) -> _SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs:
    (pairs, rv, rt, pos, delta_i2t, mean_neg_i2t, dsum_i2t, delta_t2i, mean_neg_t2i, dsum_t2i).

    Forward: one walk over the tiles of Z gives its rows' (i2t) and columns' (t2i) statistics."""
    rv, rt = epilogue.inv_norms(img, normalize), epilogue.inv_norms(txt, normalize)
    tau32, gamma32 = _scalar32(tau, img), _scalar32(gamma, img)
    inv_tau = 1.0 / tau32
    pos = epilogue.positive_logits(epilogue.scaled(img, rv), epilogue.scaled(txt, rt), 0, inv_tau)
    i2t, t2i = _forward_stats((img, txt, txt, txt), (rv, rt, rt, rt), pos, tau32, gamma32, has_margin, 0,
                              label_smoothing != 0.0, precision, columns=True)
    pairs = epilogue.pair_losses(i2t, t2i, img.shape[0], label_smoothing)
    return (pairs, rv, rt, pos, *i2t[1:], *t2i[1:])


def _grads_fake(grad, q, k, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


@_register("triton_symmetric_nll_backward", _grads_fake)
def _symmetric_nll_backward(
    grad: Tensor, img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor,
    rv: Tensor, rt: Tensor, pos: Tensor, delta_r: Tensor, mean_neg_r: Tensor, dsum_r: Tensor,
    delta_c: Tensor, mean_neg_c: Tensor, dsum_c: Tensor,
    has_margin: bool, label_smoothing: float, normalize: bool, precision: str, need_vt: bool,
) -> _Grads:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape). Each
    recomputed tile carries both directions' softmax into one dS workspace."""
    i2t = epilogue.RowStats(pos, delta_r, mean_neg_r, dsum_r)
    t2i = epilogue.RowStats(pos, delta_c, mean_neg_c, dsum_c)
    tau32, gamma32 = _scalar32(tau, img), _scalar32(gamma, img)
    inv_tau = 1.0 / tau32
    g = 0.5 * grad.float().contiguous()  # each direction's rows get half
    if need_vt:
        d_v, d_t = _backward_shares((img, txt, txt, txt), (rv, rt, rt, rt), i2t, g, tau32, gamma32, has_margin, 0,
                                    precision, key_side=(t2i, g))
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    d_img, d_txt, dz_z = epilogue.finish_symmetric(i2t, t2i, g, img, txt, rv, rt, d_v, d_t, inv_tau,
                                                   label_smoothing, normalize)
    return d_img, d_txt, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


def _dir_fake(q, k, a, b, tau, gamma, offset, has_margin, label_smoothing, normalize, precision):
    m, n = q.shape[0], k.shape[0]
    return tuple(q.new_empty((n if i in (2, 4) else m,), dtype=torch.float32) for i in range(9))


@_register("triton_directional_nll", _dir_fake)
def _directional_nll(q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor, gamma: Tensor, offset: int,
                     has_margin: bool, label_smoothing: float, normalize: bool, precision: str) -> _DirOut:
    """Per-row losses (M,) of one direction and what the backward needs:
    (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    tau32, gamma32 = _scalar32(tau, q), _scalar32(gamma, q)
    inv_tau = 1.0 / tau32
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, inv_tau)
    stats = _forward_stats((q, k, a, b), norms, pos, tau32, gamma32, has_margin, offset, label_smoothing != 0.0,
                           precision)
    return (epilogue.row_losses(stats, k.shape[0], label_smoothing), *norms, *stats)


@_register("triton_directional_nll_backward", _grads_fake)
def _directional_nll_backward(
    grad: Tensor, q: Tensor, k: Tensor, tau: Tensor, a: Tensor, b: Tensor, gamma: Tensor,
    rq: Tensor, rk: Tensor, ra: Tensor, rb: Tensor, pos: Tensor, delta: Tensor, mean_neg: Tensor, dsum: Tensor,
    offset: int, has_margin: bool, label_smoothing: float, normalize: bool, precision: str, need_qk: bool,
) -> _Grads:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    stats = epilogue.RowStats(pos, delta, mean_neg, dsum)
    tau32, gamma32 = _scalar32(tau, q), _scalar32(gamma, q)
    inv_tau = 1.0 / tau32
    g = grad.float().contiguous()
    if need_qk:
        d_q, d_k = _backward_shares((q, k, a, b), (rq, rk, ra, rb), stats, g, tau32, gamma32, has_margin, offset,
                                    precision)
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q, d_k = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k))
    d_q_in, d_k_in, dz_z = epilogue.finish_directional(stats, g, q, k, rq, rk, d_q, d_k, offset, inv_tau,
                                                       label_smoothing, normalize)
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


# ------------------------------------------------------------------ autograd
def _sym_setup_context(ctx, inputs, output):
    img, txt, tau, gamma, has_margin, label_smoothing, normalize, precision = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(img, txt, tau, gamma, *saved)
    ctx.options = (bool(has_margin), float(label_smoothing), bool(normalize), str(precision))


def _sym_backward(ctx, grad_pairs, *_stats):
    img, txt, tau, gamma, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_pairs is None:
        grad_pairs = torch.zeros(img.shape[0], dtype=torch.float32, device=img.device)
    need_vt = bool(needs[0] or needs[1])
    d_img, d_txt, d_tau = first_order_call("triton", torch.ops.hnclip.triton_symmetric_nll_backward, grad_pairs,
                                           img, txt, tau, gamma, *saved, *ctx.options, need_vt)
    return (d_img if needs[0] else None, d_txt if needs[1] else None, d_tau if needs[2] else None,
            None, None, None, None, None)


def _dir_setup_context(ctx, inputs, output):
    q, k, a, b, tau, gamma, offset, has_margin, label_smoothing, normalize, precision = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, tau, a, b, gamma, *saved)
    ctx.options = (int(offset), bool(has_margin), float(label_smoothing), bool(normalize), str(precision))


def _dir_backward(ctx, grad_rows, *_stats):
    q, k, tau, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_rows is None:
        grad_rows = torch.zeros(q.shape[0], dtype=torch.float32, device=q.device)
    need_qk = bool(needs[0] or needs[1])
    d_q, d_k, d_tau = first_order_call("triton", torch.ops.hnclip.triton_directional_nll_backward, grad_rows,
                                       q, k, tau, *saved, *ctx.options, need_qk)
    return (d_q if needs[0] else None, d_k if needs[1] else None, None, None, d_tau if needs[4] else None,
            None, None, None, None, None, None)


torch.library.register_autograd("hnclip::triton_symmetric_nll", _sym_backward, setup_context=_sym_setup_context)
torch.library.register_autograd("hnclip::triton_directional_nll", _dir_backward, setup_context=_dir_setup_context)
# the backward operators are not differentiable: a second derivative is one clear error naming backend="torch"
torch.library.register_autograd("hnclip::triton_symmetric_nll_backward", raising_backward("triton"))
torch.library.register_autograd("hnclip::triton_directional_nll_backward", raising_backward("triton"))


# torch.func-capable Functions (see .registration); the class names are the Triton backend's API
HNClipTriton = registration.func_capable(
    "HNClipTriton", torch.ops.hnclip.triton_symmetric_nll, _sym_setup_context, _sym_backward, "triton",
    "``hnclip::triton_symmetric_nll`` with its registered autograd formula, usable under ``torch.func``.")
HNClipDirectionalTriton = registration.func_capable(
    "HNClipDirectionalTriton", torch.ops.hnclip.triton_directional_nll, _dir_setup_context, _dir_backward, "triton",
    "``hnclip::triton_directional_nll`` with its registered autograd formula, usable under ``torch.func``.")
registration.register_looped_vmap(("triton_symmetric_nll", "triton_symmetric_nll_backward", "triton_directional_nll",
                                   "triton_directional_nll_backward"))


# ------------------------------------------------------------------ public wrappers
def _scalar_args(gamma, precision, like: Tensor):
    """(γ as a (1,) float32 tensor on ``like``'s device, has_margin, precision string).

    γ reaches the kernels through device memory, never as a float argument: a ``float``
    argument of an operator is a constant of a compiled graph (each new γ of a schedule would
    recompile), and Inductor types Python floats fp64 inside user kernels. The tensor is
    ``ones · γ``: a product with the float is what AOTAutograd's tensorify pass turns into a
    graph input (``torch.full``/``torch.tensor(γ)`` specialise the graph on γ's value). has_margin
    (γ ≠ 0, the kernels' HAS_MARGIN) stays a bool: under ``torch.compile`` γ = 0 and γ ≠ 0 are
    two graphs, every other new γ reuses the second. A tensor γ is taken to be non-zero."""
    if isinstance(gamma, torch.Tensor):
        gamma_t, has_margin = gamma.detach().to(device=like.device, dtype=torch.float32).reshape(1), True
    else:
        gamma_t, has_margin = torch.ones(1, dtype=torch.float32, device=like.device) * gamma, gamma != 0.0
    return gamma_t, has_margin, precision or cfg.DEFAULT_FP32_PRECISION


def directional_nll_triton(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize,
                           return_stats=False, precision=None):
    """Triton counterpart of :func:`hnclip_kernels.reference.directional_nll_torch` (same keyword-only
    protocol and result). ``precision``: tensor-core input precision for float32 features
    (``triton_config.FP32_PRECISIONS``; None: ``DEFAULT_FP32_PRECISION``); ignored for 16-bit features.

    Runs ``hnclip::triton_directional_nll``; works under ``torch.compile(fullgraph=True)`` (a new
    γ or τ does not recompile), ``torch.export``, ``torch.func.grad``/``vjp`` and ``torch.func.vmap``
    (one kernel call per batch entry). Second derivatives raise the ``RuntimeError`` naming
    backend="torch"."""
    check_directional(queries, keys, query_txt, key_txt, offset)
    gamma_t, has_margin, precision = _scalar_args(gamma, precision, queries)
    out = registration.call(HNClipDirectionalTriton, torch.ops.hnclip.triton_directional_nll, queries, keys,
                            query_txt, key_txt, tau, gamma_t, int(offset), has_margin, float(label_smoothing),
                            bool(normalize), precision)
    return (out[0], epilogue.RowStats(*out[5:9])) if return_stats else out[0]


def hn_clip_pairs_triton(img, txt, *, tau, gamma, label_smoothing, normalize, return_stats=False, precision=None):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the fused single-process loss
    (``hnclip::triton_symmetric_nll``; composes as :func:`directional_nll_triton` does).
    ``return_stats``: also ``(i2t, t2i)``, the detached ``epilogue.RowStats`` of both directions."""
    gamma_t, has_margin, precision = _scalar_args(gamma, precision, img)
    out = registration.call(HNClipTriton, torch.ops.hnclip.triton_symmetric_nll, img, txt, tau, gamma_t,
                            has_margin, float(label_smoothing), bool(normalize), precision)
    if not return_stats:
        return out[0]
    pos = out[3]
    return out[0], (epilogue.RowStats(pos, *out[4:7]), epilogue.RowStats(pos, *out[7:10]))
