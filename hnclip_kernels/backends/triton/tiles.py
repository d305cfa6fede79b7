"""Tile helpers shared by the forward and backward kernels of every loss kind: forming a tile of
logits, loading γ, block offsets, kept-negative counts (the softmax kind's statistics of a tile
and their online merge are in :mod:`.softmax`).

False-negative masking (MASK, a threshold c): ``_logits_tile`` / ``_pair_tiles``
form the caption tile G = m_q m_kᵀ where the margin is formed (also at γ = 0) and return the
logits with the entries whose float32 caption cosine G_ik·ρ_i·ρ_k is ≥ c (``_caption_keep``; ρ the
captions' inverse norms, whatever ``normalize`` says) at −inf; a kernel
ands ``_kept(z)`` into its negatives (a −inf logit, not a bool tile beside it: registers).
Kept-negative counts travel in one more plane after a summary's (``_store_count`` / ``_load_count``).

Matrices travel as tuples ``(ptr, stride_row, stride_col)``, blocks of rows (or columns)
as ``(offsets, mask, inverse norms, inverse norms of the margin factor)``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .precision import _dot


@triton.jit
def _row_block(mat, offs, mask, offs_d, mask_d):
    """The (rows, BLOCK_K) block of ``mat`` = (ptr, stride along rows, stride along D) at rows
    ``offs`` and features ``offs_d`` (zeros outside the masks): a dot's left operand."""
    ptr, stride_r, stride_d = mat
    return tl.load(ptr + offs[:, None] * stride_r + offs_d[None, :] * stride_d,
                   mask=mask[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _col_block(mat, offs, mask, offs_d, mask_d):
    """The (BLOCK_K, rows) block of ``mat`` read transposed: a dot's right operand."""
    ptr, stride_r, stride_d = mat
    return tl.load(ptr + offs_d[:, None] * stride_d + offs[None, :] * stride_r,
                   mask=mask_d[:, None] & mask[None, :], other=0.0)


@triton.jit
def _logits_tile(
    q, k, margin_q, margin_k,
    rows, cols,
    D, gamma, logit_scale, thr,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The (BLOCK_M, BLOCK_N) float32 tile of Z = (q̂ k̂ᵀ + γ · m̂_q m̂_kᵀ) / τ, dots accumulated in
    float32 over D, with MASK its false negatives at −inf.

    Matrices, each ``(ptr, stride along rows, stride along D)``:
        q, k: the query (M, D) and key (N, D) features;
        margin_q, margin_k: the margin factors (M, D) and (N, D) (read with HAS_MARGIN or MASK).
    Blocks, each ``(offsets, bounds mask, r, r_margin)``, r the float32 inverse norms:
        rows: this tile's query rows; cols: its key rows (Z's columns).
    Scalars: D (feature width), gamma (γ, float32), logit_scale (``params.Scalars.logit_scale``), thr (with MASK, the
        false-negative threshold and its block, from ``_load_threshold``).
    Constexprs: HAS_MARGIN (``Scalars.margin_tile``), MASK (false-negative masking), PREC (see ``precision._dot``),
        tile sizes.

    With MASK an entry whose caption cosine, the margin's own float32 product
    ``(m_q·m_k) · ρ_q · ρ_k`` (``_caption_keep``: ρ the captions' inverse norms, r_margin itself
    when normalising), is at or above the threshold comes back as −inf: a kernel drops it from its negatives with ``_kept`` (no bool tile stays live
    beside the logits: registers). Without the margin (γ = 0) the caption product is formed for
    MASK only. (The positive's entry may come back −inf too: callers exclude it by index.)
    """
    offs_m, mask_m, rq, r_mq = rows
    offs_n, mask_n, rk, r_mk = cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_margin = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_d = k0 + tl.arange(0, BLOCK_K)
        mask_d = offs_d < D
        acc = _dot(_row_block(q, offs_m, mask_m, offs_d, mask_d), _col_block(k, offs_n, mask_n, offs_d, mask_d),
                   acc, PREC)
        if HAS_MARGIN or MASK:
            acc_margin = _dot(_row_block(margin_q, offs_m, mask_m, offs_d, mask_d),
                              _col_block(margin_k, offs_n, mask_n, offs_d, mask_d), acc_margin, PREC)
    # the norms scale float32 tiles: the normalised vectors are never rounded to bf16
    z = acc * rq[:, None] * rk[None, :]
    if HAS_MARGIN:
        z += gamma * (acc_margin * r_mq[:, None] * r_mk[None, :])
    if MASK:
        z = tl.where(_caption_keep(acc_margin, offs_m, mask_m, offs_n, mask_n, thr), z, float("-inf"))
    return z * logit_scale


@triton.jit
def _caption_keep(product, offs_m, mask_m, offs_n, mask_n, thr):
    """Which entries of a caption tile stay negatives under false-negative masking: those whose
    caption cosine ``product · ρ_m · ρ_n`` (float32) is not ≥ c. An entry at or above the
    threshold is masked; a NaN cosine (a NaN or ±inf caption) is kept, so its NaN logit reaches
    the LSE and the loss (``< c`` would drop it from the forward while the backward's products
    with that caption, 0·NaN, still make the gradients NaN); for a finite cosine ``not ≥ c`` is
    ``< c``, the same masking bit for bit. ``product`` the tile's raw float32 caption products over
    D, rows ``offs_m`` and columns ``offs_n`` (with their bounds masks); ``thr`` = (c, the block's
    pointer) from ``_load_threshold``: the block holds c, c, then each column's and each row's
    inverse norm interleaved (``ρ_n`` at 2 + 2n, ``ρ_m`` at 3 + 2m). With ``normalize`` the
    norms are the margin's own, so the cosine is the margin's product to the bit."""
    c, block = thr
    rho_m = tl.load(block + 3 + 2 * offs_m, mask=mask_m, other=0.0)
    rho_n = tl.load(block + 2 + 2 * offs_n, mask=mask_n, other=0.0)
    return ~(product * rho_m[:, None] * rho_n[None, :] >= c)


@triton.jit
def _kept(z):
    """The entries of a tile from ``_logits_tile`` / ``_pair_tiles`` that masking
    kept (not −inf; a NaN logit counts as kept, so it shows in the loss)."""
    return z != float("-inf")


@triton.jit
def _load_threshold(thr_ptr, MASK: tl.constexpr):
    """With MASK, (the false-negative threshold c, float32, read from device memory like γ; the
    masking block's pointer, which ``_caption_keep`` reads the captions' inverse norms from);
    nothing is read without MASK."""
    thr = 0.0
    if MASK:
        thr = (tl.load(thr_ptr).to(tl.float32), thr_ptr)
    return thr


@triton.jit
def _count(neg, AXIS: tl.constexpr):
    """How many entries of a tile each line (rows: AXIS 1, columns: AXIS 0) keeps as negatives."""
    return tl.sum(neg.to(tl.float32), axis=AXIS)


@triton.jit
def _store_count(ptr, plane, offs, mask, count, SMOOTHING: tl.constexpr):
    """Store a block's kept-negative counts in the plane after its summary (``_store_partial``)."""
    tl.store(ptr + (3 + SMOOTHING) * plane + offs, count, mask=mask)


@triton.jit
def _load_count(ptr, plane, offs, mask, SMOOTHING: tl.constexpr):
    """Load the counts stored by ``_store_count`` (0 outside ``mask``)."""
    return tl.load(ptr + (3 + SMOOTHING) * plane + offs, mask=mask, other=0.0)


@triton.jit
def _load_scalars(logit_scale_ptr, gamma_ptr, thr_ptr, HAS_MARGIN: tl.constexpr, MASK: tl.constexpr):
    """(the logit scale, γ, the false-negative threshold as ``_load_threshold`` gives it), read from
    device memory: the host's ``params.Scalars.logit_scale`` (1/τ, the float32 value the positives
    and the epilogue use, or (1 + γ)/τ where the margin is the logit's own score), γ only with
    HAS_MARGIN, the threshold only with MASK (their pointers are None otherwise; see
    ``_load_gamma``). Loads only."""
    return tl.load(logit_scale_ptr), _load_gamma(gamma_ptr, HAS_MARGIN), _load_threshold(thr_ptr, MASK)


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
def _three_products(
    v_rows, t_rows, v_cols, t_cols,
    offs_m, mask_m, offs_n, mask_n,
    D, HAS_MARGIN: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The raw float32 products over D of rows I against columns J that two tiles sharing a
    margin need: (v_I t_Jᵀ, t_I v_Jᵀ, t_I t_Jᵀ), the last only with HAS_MARGIN (else zeros).

    Matrices ``(ptr, stride along rows, stride along D)``: v_rows, t_rows hold rows I, v_cols,
    t_cols columns J (the same matrices for the symmetric loss; a rank's local and gathered
    features for its directional pair). Each product in the operand order of ``_logits_tile``'s
    q kᵀ, so a tile scaled from it is the tile ``_logits_tile`` forms, to the bit."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_mirror = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_margin = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_d = k0 + tl.arange(0, BLOCK_K)
        mask_d = offs_d < D
        v_i = _row_block(v_rows, offs_m, mask_m, offs_d, mask_d)
        t_i = _row_block(t_rows, offs_m, mask_m, offs_d, mask_d)
        t_j = _col_block(t_cols, offs_n, mask_n, offs_d, mask_d)
        v_j = _col_block(v_cols, offs_n, mask_n, offs_d, mask_d)
        acc = _dot(v_i, t_j, acc, PREC)
        acc_mirror = _dot(t_i, v_j, acc_mirror, PREC)
        if HAS_MARGIN:
            acc_margin = _dot(t_i, t_j, acc_margin, PREC)
    return acc, acc_mirror, acc_margin


@triton.jit
def _pair_tiles(
    v, t,
    rows, cols,
    D, gamma, logit_scale, thr,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The tile pair of the symmetric loss (Z = (v̂ t̂ᵀ + γ · t̂ t̂ᵀ) / τ) from 3 products over D
    (2 without the margin and the masking): Z_IJ and Z_JIᵀ share the margin's G_IJ = t_I t_Jᵀ
    (G is symmetric).

    Matrices ``(ptr, stride along rows, stride along D)``: v the images (N, D), t the texts
    (N, D). Blocks ``(offsets, mask, r_v, r_t)``: rows I (BLOCK_M) and columns J (BLOCK_N).
    Returns two (BLOCK_M, BLOCK_N) float32 tiles: z[i, j] = Z[i, j] and zm[i, j] = Z[j, i],
    each scaled in the order of ``_logits_tile`` (the same Z to the bit, as a (J, I) tile
    would form it, for the same reduction over D, with 16-bit or "ieee"/"tf32" operands). The
    split precisions ("tf32x3", "bf16x3", "bf16x6") add the cross terms tail·head and head·tail
    in operand order, so the mirror (t_I v_Jᵀ) may differ from ``_logits_tile``'s v_J t_Iᵀ in the
    last bits: the forward and the backward's ``_dscore_pair_kernel`` therefore form every
    logit in the same role (direct, mirror or diagonal super-tile), bit-identical to each other.

    With MASK (false-negative masking at ``thr``) the entries whose caption cosine
    G_IJ[i, j] · ρ_i · ρ_j (``_caption_keep``; z's margin product when normalising) is at or above
    the threshold come back as −inf in z
    and in zm alike (zm[i, j] is the same caption pair: one comparison for both), so the mask
    off the diagonal super-tiles is symmetric to the bit; ``_kept`` reads it back.
    """
    offs_m, mask_m, rv_m, rt_m = rows
    offs_n, mask_n, rv_n, rt_n = cols
    acc, acc_mirror, acc_margin = _three_products(v, t, v, t,
                                                  offs_m, mask_m, offs_n, mask_n,
                                                  D, HAS_MARGIN or MASK, PREC,
                                                  BLOCK_M, BLOCK_N, BLOCK_K)
    z = acc * rv_m[:, None] * rt_n[None, :]
    zm = acc_mirror * rv_n[None, :] * rt_m[:, None]
    if HAS_MARGIN:
        z += gamma * (acc_margin * rt_m[:, None] * rt_n[None, :])
        zm += gamma * (acc_margin * rt_n[None, :] * rt_m[:, None])
    if MASK:
        keep = _caption_keep(acc_margin, offs_m, mask_m, offs_n, mask_n, thr)
        z = tl.where(keep, z, float("-inf"))
        zm = tl.where(keep, zm, float("-inf"))
    return z * logit_scale, zm * logit_scale


@triton.jit
def _rank_tiles(
    v, t, v_all, t_all,
    rows, cols,
    D, gamma, logit_scale, thr,
    HAS_MARGIN: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A distributed rank's two directions over one tile from 3 products (2 without the
    margin and the masking): i2t Z_IJ = (v̂_I t̂_Jᵀ + γ G_IJ) / τ and t2i Z'_IJ = (t̂_I v̂_Jᵀ + γ G_IJ) / τ
    share G_IJ = t̂_I t̂_Jᵀ, the local captions against the gathered ones.

    Matrices ``(ptr, stride along rows, stride along D)``: v, t the local features (M, D),
    v_all, t_all the gathered ones (N, D). Blocks ``(offsets, mask, r_v, r_t)``: local rows I
    (BLOCK_M), gathered columns J (BLOCK_N). Returns the two (BLOCK_M, BLOCK_N) float32 tiles,
    each as ``_logits_tile`` forms it for that direction's directional op (i2t: q = v,
    k = t_all; t2i: q = t, k = v_all; margin factors t, t_all), to the bit. With MASK (false-negative
    masking at ``thr``) an entry whose caption cosine G_IJ[i, j] · ρ_i · ρ_j (``_caption_keep``) is
    at or above the threshold is −inf in both tiles (one comparison: the same caption pair in
    both directions).
    """
    offs_m, mask_m, rv_m, rt_m = rows
    offs_n, mask_n, rv_n, rt_n = cols
    acc, acc_t2i, acc_margin = _three_products(v, t, v_all, t_all,
                                               offs_m, mask_m, offs_n, mask_n,
                                               D, HAS_MARGIN or MASK, PREC,
                                               BLOCK_M, BLOCK_N, BLOCK_K)
    z = acc * rv_m[:, None] * rt_n[None, :]
    zt = acc_t2i * rt_m[:, None] * rv_n[None, :]
    if HAS_MARGIN:
        margin = gamma * (acc_margin * rt_m[:, None] * rt_n[None, :])
        z += margin
        zt += margin
    if MASK:
        keep = _caption_keep(acc_margin, offs_m, mask_m, offs_n, mask_n, thr)
        z = tl.where(keep, z, float("-inf"))
        zt = tl.where(keep, zt, float("-inf"))
    return z * logit_scale, zt * logit_scale