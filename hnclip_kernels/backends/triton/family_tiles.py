"""The hard-negative family's logit tile (``docs/hard_negatives.md``): ``tiles._logits_tile`` with the
family's masking, for the directional kernels (``forward_kernels._fwd_kernel``, ``dscore._dscore_kernel``).

Two masking inputs beyond the threshold's (each a flag derived from its pointer, ``launch.derived``):

* CAPTIONS: separate masking captions. With ``margin="image_text"`` the margin factors are the
  images and the keys (m_q m_kᵀ = v xᵀ), but the threshold compares captions (t_i·x): the
  caption tile c_q c_kᵀ is one more product, formed only with a threshold (COSINE), in a second
  walk over D after the logits (two float32 accumulators live at a time, as today's masked tile).
* GROUPS: group ids, (M,) for the rows and (K,) for the first K ≤ N columns: an entry whose ids
  agree is masked as the threshold masks (−inf). With ids alone (no threshold) no caption product
  is formed at all.

A kernel calls this tile only with one of them; without both it calls ``_logits_tile`` itself, so
today's kernels compile to the same code. The symmetric walk's tile pairs (``_fwd_pair_kernel``,
``_dscore_pair_kernel``) take group ids alone (``_drop_same_group``): their margin is the captions'
own G, and ``margin="image_text"`` reaches them as a logit scale (``triton.symmetric``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .precision import _dot
from .tiles import _caption_keep, _col_block, _logits_tile, _row_block


@triton.jit
def _family_tile(
    q, k, margin_q, margin_k, captions, groups,
    rows, cols,
    D, gamma, logit_scale, thr,
    HAS_MARGIN: tl.constexpr, COSINE: tl.constexpr, CAPTIONS: tl.constexpr, GROUPS: tl.constexpr,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The (BLOCK_M, BLOCK_N) float32 tile of Z = (q̂ k̂ᵀ + γ · m̂_q m̂_kᵀ) / τ (``_logits_tile``'s,
    the same value to the bit on every kept entry) with the family's masked entries at −inf.

    Matrices ``(ptr, stride along rows, stride along D)``: q, k, margin_q, margin_k as
    ``_logits_tile``'s. ``captions`` = (c_q (M, D), c_k (N, D)): the masking captions (read with
    CAPTIONS and COSINE). ``groups`` = (ids of the rows (M,), ids of the first K columns (K,), K):
    any one integer dtype (read with GROUPS). Blocks ``rows``, ``cols`` and the scalars as
    ``_logits_tile``'s; ``thr`` the threshold (COSINE) from ``_load_threshold``.

    Masked (−inf): with COSINE, an entry whose caption cosine is ≥ the threshold (``_caption_keep``
    of the margin's own product, or with CAPTIONS of c_q c_kᵀ, ρ from the threshold block as
    always); with GROUPS, column k < K whose id equals row i's. The positive's entry comes back
    −inf too where the ids agree (they always do there): the kernels exclude it by index.
    """
    offs_m, mask_m, rq, r_mq = rows
    offs_n, mask_n, rk, r_mk = cols
    # the threshold's cosine on the margin's product, as today's masked tile (CAPTIONS: after it)
    z = _logits_tile(q, k, margin_q, margin_k,
                     rows, cols,
                     D, gamma, logit_scale, thr,
                     HAS_MARGIN, COSINE and not CAPTIONS, PREC,
                     BLOCK_M, BLOCK_N, BLOCK_K)
    if CAPTIONS and COSINE:
        caption_q, caption_k = captions
        product = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_d = k0 + tl.arange(0, BLOCK_K)
            mask_d = offs_d < D
            product = _dot(_row_block(caption_q, offs_m, mask_m, offs_d, mask_d),
                           _col_block(caption_k, offs_n, mask_n, offs_d, mask_d), product, PREC)
        z = tl.where(_caption_keep(product, offs_m, mask_m, offs_n, mask_n, thr), z, float("-inf"))
    if GROUPS:
        z = tl.where(_same_group(groups, offs_m, mask_m, offs_n), float("-inf"), z)
    return z


@triton.jit
def _same_group(groups, offs_m, mask_m, offs_n):
    """The entries of a tile (rows ``offs_m``, columns ``offs_n``) whose group ids agree: ``groups`` =
    (the rows' ids pointer, the columns' ids pointer, K); columns at or past K carry no id."""
    row_ids, col_ids, K = groups
    has_id = offs_n < K
    gq = tl.load(row_ids + offs_m, mask=mask_m, other=0)
    gk = tl.load(col_ids + offs_n, mask=has_id, other=0)
    return (gq[:, None] == gk[None, :]) & has_id[None, :]


@triton.jit
def _drop_same_group(z, ids, n, offs_m, mask_m, offs_n):
    """A tile of logits (rows ``offs_m``, columns ``offs_n`` of one N × N walk) with the entries whose
    group ids agree at −inf: ``ids`` the N pairs' ids (any one integer dtype), ``n`` = N. The
    positive's entry comes back −inf too (its ids agree): the kernels exclude it by index."""
    return tl.where(_same_group((ids, ids, n), offs_m, mask_m, offs_n), float("-inf"), z)
