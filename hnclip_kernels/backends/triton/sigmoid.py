"""The sigmoid (SigLIP) loss kind on Triton: what its kernels do after the logit tile (docs/layout.md,
"Where a new loss kind goes"; the softmax kind's counterpart is :mod:`.softmax`).

A pair's loss is softplus(w), w = −y·z, and its score gradient σ(z) − [y = 1] = −y·σ(w): both from
one e = exp(−|w|), so neither cancels (a positive at z = 20 keeps −σ(−20) ≈ −2e-9, which a float32
σ(z) − 1 rounds to 0).

* a tile's logits from its scores (``_sigmoid_logits``: the margin on the negatives only);
* forward: a tile's per-row sums of softplus(−y z) and of the score gradient's two factors for
  dL/ds, dL/db (``_tile_row_sums``);
* backward: W = a_i·dS_ij·b_j of a tile, dS = g_i (σ(z) − [y = 1]) (``_w_tile``).

The kernels (:mod:`.sigmoid_kernels`) form the score tiles with ``tiles._logits_tile`` and the
labels with ``family_tiles._same_group``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _log1p(e):
    """log(1 + e) for e in [0, 1], to float32's rounding (Goldberg's correction: log(u)·e / (u − 1),
    u = 1 + e, exact where u rounds to 1): a saturated pair's e = 1e-9 keeps its loss."""
    u = 1.0 + e
    return tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _sigmoid_logits(x, h, positive, logit_scale, logit_bias, HAS_MARGIN: tl.constexpr, OWN_SCORE: tl.constexpr):
    """(z = s·x̃ + b, x̃) of a tile: x the float32 scores v̂·k̂, x̃ = x on the positives and
    x + γ·h on the negatives; ``h`` the margin tile already times γ (ignored without HAS_MARGIN;
    with OWN_SCORE, ``margin="image_text"``, the margin is γ·x itself and ``h`` holds γ)."""
    xm = x
    if HAS_MARGIN:
        if OWN_SCORE:
            xm = tl.where(positive, x, x + h * x)
        else:
            xm = tl.where(positive, x, x + h)
    return xm * logit_scale + logit_bias, xm


@triton.jit
def _pair_terms(z, positive):
    """(softplus(−y z), σ(−y z)) of a tile of logits, y = +1 on ``positive``, −1 elsewhere: the
    pairs' losses and the magnitude of their score gradients (σ(z) − [y = 1] = −y·σ(−y z))."""
    w = tl.where(positive, -z, z)
    e = tl.exp(-tl.abs(w))
    loss = tl.maximum(w, 0.0) + _log1p(e)
    sig = tl.where(w >= 0, 1.0, e) / (1.0 + e)
    return loss, sig


@triton.jit
def _tile_row_sums(z, xm, positive, live):
    """Per row of a tile: (Σ softplus(−y z), Σ u·x̃, Σ u) over the ``live`` entries (in bounds and not
    masked), u = σ(z) − [y = 1] (so dL/ds = Σ_i g_i Σ u·x̃, dL/db = Σ_i g_i Σ u)."""
    loss, sig = _pair_terms(z, positive)
    u = tl.where(live, tl.where(positive, -sig, sig), 0.0)
    return tl.sum(tl.where(live, loss, 0.0), axis=1), tl.sum(u * tl.where(live, xm, 0.0), axis=1), tl.sum(u, axis=1)


@triton.jit
def _w_tile(z, positive, live, ga, b):
    """W_ij = a_i·dS_ij·b_j of a tile, dS = g_i·(σ(z) − [y = 1]) (−σ(−z) on the positives), 0 off
    ``live``; ``ga`` the rows' g_i·a_i, ``b`` the columns' b_j (float32). An entry whose σ is near or
    below float32's normal range (w < −80) is formed as exp(w + log|g_i a_i|) instead: under a loss
    scale (and the 16-bit staging's 2¹⁰⁰) a saturated pair's W is a normal number that σ·g_i a_i
    would flush or round to a subnormal's few bits (σ(w) = e^w there to float32's rounding)."""
    w = tl.where(positive, -z, z)
    e = tl.exp(-tl.abs(w))
    sig = tl.where(w >= 0, 1.0, e) / (1.0 + e)
    tiny = w < -80.0
    # (a row with g_i = 0 keeps its zeros: exp(w + log 2⁻¹²⁶) is 0 for w < −80)
    folded = tl.exp(tl.where(tiny, w, 0.0) + tl.log(tl.maximum(tl.abs(ga), 2.0**-126))[:, None])
    dscore = tl.where(tiny, tl.where(ga[:, None] < 0, -folded, folded), sig * ga[:, None])
    dscore = tl.where(positive, -dscore, dscore)
    return tl.where(live, dscore * b[None, :], 0.0)
