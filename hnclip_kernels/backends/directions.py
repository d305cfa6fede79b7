"""Each direction's per-row loss and log-partition: the ``reduction="directions"`` output.

FastCLIP/NeuCLIP-style training (small batches with per-sample estimators of the global
normaliser, arXiv 2407.01445) weights each direction's row loss and its log-partition (LSE)
separately. With row i's logits Z_i· over the columns it keeps (its positive, the negatives not
masked by ``false_negative_threshold`` or ``group_ids``; i2t rows also the M ``negatives``)::

    LSE_i  = log Σ_{k kept ∪ {pos}} exp(Z_ik)
    loss_i = LSE_i − Z_i,pos − ε·mean_{k kept ∪ {pos}} (Z_ik − Z_i,pos)

so d LSE_i / dZ_ik = P_ik (row i's softmax) and d loss_i / dZ_ik = P_ik − y_ik, with the
smoothed target y_ik = (1 − ε)·[k = pos] + ε/n_i over the n_i kept classes.

How the rows are formed (every backend, the same code): each direction is one call of the
backend's directional op (its rows ``nll_i``, differentiable; the keyword-only protocol of
:func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`), and
LSE_i = nll⁰_i + Z_i,pos, with nll⁰ the unsmoothed row (softplus of the negatives' gap LSE, so
exact also where nll⁰ is far below float32's epsilon next to Z_pos) and Z_i,pos = q̂_i·k̂_pos/τ
formed here by autograd (O(N·D), the positive carries no margin). With ε > 0 the unsmoothed rows
take a second call of each direction. Work: 2 directional calls (4 with ε > 0) where the
symmetric operator of ``reduction="none"`` makes one walk of shared tiles, so about twice the
forward's products (4× with ε > 0); nothing is materialised beyond the directional ops' own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..numerics import compute_dtype, normalized


class DirectionRows(NamedTuple):
    """Each direction's per-row loss and log-partition, (R,) each, float32 (float64 for float64
    features), all differentiable (R: the rows computed, N on one process).

    ``i2t[i]``: image i's cross-entropy over its caption columns (and the M negatives);
    ``t2i[i]``: caption i's over the image columns; ``lse_i2t[i]``, ``lse_t2i[i]``: the
    log-sum-exp of the same rows' logits over the columns they keep (positive included), so
    ``i2t = lse_i2t − Z_pos`` without label smoothing. ``½(i2t + t2i)`` is ``reduction="none"``'s
    row (up to float32 rounding: a different operator)."""

    i2t: torch.Tensor
    t2i: torch.Tensor
    lse_i2t: torch.Tensor
    lse_t2i: torch.Tensor


def positive_logits(queries, keys, offset: int, tau, normalize: bool) -> torch.Tensor:
    """Z_i,pos = q̂_i·k̂_{offset+i}/τ (M,), differentiable in both features and τ, in the compute
    dtype; q̂ normalised as the ops normalise (``normalized``, F.normalize's clamp) when
    ``normalize``. The positive carries no margin (the logits' (1 − I))."""
    dt = compute_dtype(queries.dtype)
    m = queries.shape[0]
    q, k = queries.to(dt), keys[offset : offset + m].to(dt)
    if normalize:
        q, k = normalized(q), normalized(k)
    return (q * k).sum(dim=1) / tau.to(dt)


def assemble(losses, unsmoothed, positives) -> DirectionRows:
    """:class:`DirectionRows` from each direction's rows (i2t, t2i), its unsmoothed rows and its
    positive logits."""
    (i2t, t2i), (nll_i2t, nll_t2i), (pos_i2t, pos_t2i) = losses, unsmoothed, positives
    return DirectionRows(i2t, t2i, nll_i2t + pos_i2t, nll_t2i + pos_t2i)
