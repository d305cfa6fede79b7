"""The softmax loss kind on Triton: what its kernels do after the logit tile (docs/layout.md,
"Where a new loss kind goes").

* forward: a tile's row statistics of the gaps d = z − z_pos over the negatives (``_gap_stats``,
  ``_tile_stats``: max, Σexp, Σexp·d, Σd), merged online (``_combine``, ``_merge_stats``: the
  online LSE) and stored as partial summaries per column block (``_store_partial`` /
  ``_load_partial``; :mod:`.merge` folds them into ``backends.softmax.RowStats``);
* backward: dS_ik = g_i P_ik = g_i e^(d_ik − nll_i) of a tile (``_row_dscore``, ``_weighted_exp``),
  which the dS kernels scale into W (:mod:`.dscore`).

A second kind (SigLIP's per-pair softplus sums, dS = g·(σ(z) − y)) provides the same roles in a
module of its own; the logit tiles (:mod:`.tiles`, :mod:`.family_tiles`) are shared.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import _kept


@triton.jit
def _tile_stats(d, neg, AXIS: tl.constexpr):
    """(max, Σexp(d − max), Σexp(d − max)·d, Σd) of a tile of gaps along AXIS
    (d is −inf off the negatives ``neg``; so is the max of a line without negatives)."""
    top = tl.max(d, axis=AXIS)
    safe = tl.where(top == float("-inf"), 0.0, top)  # no -inf - -inf
    if AXIS == 1:
        p = tl.exp(d - safe[:, None])
    else:
        p = tl.exp(d - safe[None, :])
    d0 = tl.where(neg, d, 0.0)
    return top, tl.sum(p, axis=AXIS), tl.sum(p * d0, axis=AXIS), tl.sum(d0, axis=AXIS)


@triton.jit
def _gap_stats(z, pos, neg, AXIS: tl.constexpr):
    """``_tile_stats`` of the gaps d = z − pos over the negatives ``neg``, along AXIS; ``pos``
    the positives of the lines reduced (rows for AXIS 1, columns for AXIS 0)."""
    if AXIS == 1:
        d = tl.where(neg, z - pos[:, None], float("-inf"))
    else:
        d = tl.where(neg, z - pos[None, :], float("-inf"))
    return _tile_stats(d, neg, AXIS)


@triton.jit
def _combine(first, second):
    """Merge two (max, Σexp, Σexp·d) summaries, each relative to its own max (−inf: empty).
    Rescaling to the joint max keeps tiny sums (a saturated row's exp(−90)) representable."""
    m1, s1, w1 = first
    m2, s2, w2 = second
    m = tl.maximum(m1, m2)
    safe = tl.where(m == float("-inf"), 0.0, m)  # no -inf - -inf
    e1 = tl.exp(m1 - safe)
    e2 = tl.exp(m2 - safe)
    return m, s1 * e1 + s2 * e2, w1 * e1 + w2 * e2


@triton.jit
def _merge_stats(first, second):
    """Merge two (max, Σexp, Σexp·d, Σd) summaries (``_combine`` plus the sum of Σd)."""
    m1, s1, w1, d1 = first
    m2, s2, w2, d2 = second
    m, s, w = _combine((m1, s1, w1), (m2, s2, w2))
    return m, s, w, d1 + d2


@triton.jit
def _store_partial(ptr, plane, offs, mask, stats, SMOOTHING: tl.constexpr):
    """Store a block's summary ``stats`` = (max, Σexp, Σexp·d, Σd) at ``ptr + offs``, one
    plane (``plane`` entries apart) per statistic; Σd only with label SMOOTHING."""
    top, sum_exp, wsum, dsum = stats
    tl.store(ptr + offs, top, mask=mask)
    tl.store(ptr + plane + offs, sum_exp, mask=mask)
    tl.store(ptr + 2 * plane + offs, wsum, mask=mask)
    if SMOOTHING:
        tl.store(ptr + 3 * plane + offs, dsum, mask=mask)


@triton.jit
def _load_partial(ptr, plane, offs, mask, SMOOTHING: tl.constexpr):
    """Load a block's summary (max, Σexp, Σexp·d, Σd) stored by ``_store_partial``; outside
    ``mask`` the empty summary (−inf, 0, 0, 0), which ``_merge_stats`` leaves the other
    summary unchanged to the bit."""
    top = tl.load(ptr + offs, mask=mask, other=float("-inf"))
    sum_exp = tl.load(ptr + plane + offs, mask=mask, other=0.0)
    wsum = tl.load(ptr + 2 * plane + offs, mask=mask, other=0.0)
    dsum = tl.zeros_like(wsum)
    if SMOOTHING:
        dsum = tl.load(ptr + 3 * plane + offs, mask=mask, other=0.0)
    return top, sum_exp, wsum, dsum


@triton.jit
def _weighted_exp(x, g, FOLD: tl.constexpr):
    """g·e^x. With FOLD (16-bit features) an entry whose e^x is a float32 subnormal (x < −87) is
    sign(g)·e^(x + log|g|) instead: under a loss scale g·e^x is a normal number that a column of
    saturated rows is made of (its own row's mass is far above it, so the row never sees it)."""
    if FOLD:
        sub = x < -87.0
        e = tl.exp(tl.where(sub, x + tl.log(tl.abs(g)), x))
        return tl.where(sub, tl.where(g < 0, -e, e), e * g)
    return tl.exp(x) * g


@triton.jit
def _row_dscore(z, rows, cols, offset, factors, MASK: tl.constexpr, SHIFT: tl.constexpr, FOLD: tl.constexpr):
    """(the tile's negatives, dS_ik = g_i P_ik of its rows' softmax) of a tile z of logits: ``rows`` =
    (offsets, bounds mask) of its rows, ``cols`` its columns'; row i's positive is column offset + i.
    ``factors`` = (pos_ptr, nll_ptr, g_ptr, s_ptr) of the rows (``_dscore_kernel``'s; s_ptr read with
    SHIFT only). With MASK (z from ``tiles._logits_tile``, masked entries −inf) only the kept entries
    are negatives, each less its row's smoothing share s = ε/n (SHIFT, label smoothing: without it a
    masked tile costs what an unmasked one does, the fp16 128x64 dS is at 255 registers). Loads only."""
    offs_m, mask_m = rows
    offs_n, mask_n = cols
    pos_ptr, nll_ptr, g_ptr, s_ptr = factors
    neg = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] != offs_m[:, None] + offset)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0.0)
    nll = tl.load(nll_ptr + offs_m, mask=mask_m, other=0.0)
    g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
    if MASK:
        neg = neg & _kept(z)
    if SHIFT:
        s = tl.load(s_ptr + offs_m, mask=mask_m, other=0.0)
        p = tl.exp(tl.where(neg, z - pos[:, None] - nll[:, None], float("-inf")))
        dscore = tl.where(neg, p - s[:, None], 0.0) * g[:, None]
    else:
        # mask before exp: the positive's tile entry carries a margin and may overflow
        dscore = _weighted_exp(tl.where(neg, z - pos[:, None] - nll[:, None], float("-inf")), g[:, None], FOLD)
    return neg, dscore
