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

Multi-positive targets (``group_mode="supcon"`` / ``"mil_nce"``, ``docs/hard_negatives.md``): row i
has positives P(i) (no margin) and classes C(i) = P(i) ∪ its kept negatives; its loss is the op's
row (the mode's, exactly), and LSE_i = log Σ_{k∈C(i)} e^Z_ik, over every class. One sum forms it
in every mode: LSE_i = nll⁰_i + mean_{p∈P(i)} Z_ip, nll⁰ the op's unsmoothed *SupCon* row (= LSE_i −
mean_P Z; one positive a row: mean_P Z = Z_pos, the sum above) and mean_P Z from each group's sum of
k̂ (:func:`mean_positive_logits`, O(N·D), autograd). SupCon's unsmoothed rows are its rows at ε = 0;
MIL-NCE's LSE takes a SupCon call of each direction (4 calls). Own negatives with a positive mode
are refused (:func:`own_rows` assumes one positive a row).

Each row's own negatives (``negatives`` (N, K, D), ``negatives_mask``; ``docs/hard_negatives.md``):
i2t row i also keeps its own real K_i columns W_ik (t2i rows are unchanged). No directional op
sees them: the i2t call runs over the N captions (its rows nll_b, nll⁰_b, its statistics), and
:func:`own_rows` extends each row by autograd, O(R·K·D): the gaps d_ik = W_ik − Z_i,pos of
:func:`.own_negatives.block` (the operators' own block, its margin detached), ω_i = LSE_k d_ik and

    nll_i  = nll⁰_b + softplus(ω_i − nll⁰_b)            (= log(1 + e^δ + e^ω), exact for tiny rows)
    loss_i = nll_i − (n_b·(nll⁰_b − nll_b) + ε·Σ_k d_ik) / (n_b + K_i)

since nll⁰_b − nll_b = ε·mean_b(Z − Z_pos) over the op's n_b classes. The op's backward then
carries its softmax times e^(LSE_b − LSE_i), its share of the row's softmax, and autograd the own
columns' P_ik − ε/n_i. ``return_stats``: the i2t statistics merged with the block
(:func:`.own_negatives.merge`, as the symmetric operators save them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..margin import Margin
from ..numerics import compute_dtype, normalized, softplus
from . import own_negatives, softmax


class DirectionRows(NamedTuple):
    """Each direction's per-row loss and log-partition, (R,) each, float32 (float64 for float64
    features), all differentiable (R: the rows computed, N on one process).

    ``i2t[i]``: image i's cross-entropy over its caption columns (and the M negatives, or its own
    real K_i);
    ``t2i[i]``: caption i's over the image columns; ``lse_i2t[i]``, ``lse_t2i[i]``: the
    log-sum-exp of the same rows' logits over the columns they keep (positive included), so
    ``i2t = lse_i2t − Z_pos`` without label smoothing. ``½(i2t + t2i)`` is ``reduction="none"``'s
    row (up to float32 rounding: a different operator). With ``group_mode="supcon"`` / ``"mil_nce"``
    the rows are the mode's and the LSE runs over every class the row keeps, its positives P(i)
    included (``docs/api.md``, "Per-direction rows")."""

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


def mean_positive_logits(queries, keys, offset: int, tau, normalize: bool, key_ids) -> torch.Tensor:
    """mean_{p∈P(i)} Z_ip = q̂_i·(Σ_{p∈P(i)} k̂_p)/(|P(i)|·τ) (M,) of the multi-positive modes, P(i)
    the keys whose id ``key_ids`` (N,) equals row i's (``key_ids[offset + i]``: the rows' ids are
    the keys' slice), differentiable like :func:`positive_logits`: O((N + M)·D) through each group's
    sum of k̂ (no same-group pair is formed, one group for the batch included). No margin."""
    dt = compute_dtype(queries.dtype)
    m = queries.shape[0]
    q, k = queries.to(dt), keys[: key_ids.shape[0]].to(dt)
    if normalize:
        q, k = normalized(q), normalized(k)
    _, group = torch.unique(key_ids, return_inverse=True)
    sums = torch.zeros(int(group.max()) + 1 if group.numel() else 0, k.shape[1], dtype=dt, device=k.device)
    sums = sums.index_add(0, group, k)
    counts = torch.bincount(group, minlength=sums.shape[0]).to(dt)
    mine = group[offset : offset + m]
    return (q * sums[mine]).sum(dim=1) / (counts[mine] * tau.to(dt))


def assemble(losses, unsmoothed, positives) -> DirectionRows:
    """:class:`DirectionRows` from each direction's rows (i2t, t2i), its unsmoothed (SupCon) rows
    and its (mean) positive logits: LSE = unsmoothed + positive (module docstring)."""
    (i2t, t2i), (nll_i2t, nll_t2i), (pos_i2t, pos_t2i) = losses, unsmoothed, positives
    return DirectionRows(i2t, t2i, nll_i2t + pos_i2t, nll_t2i + pos_t2i)


def own_block(img, txt, family, pos, tau, options) -> own_negatives.OwnBlock:
    """The R query rows' own columns (:func:`.own_negatives.block`), differentiable in ``img``,
    ``family.own_negatives`` (R, K, D), ``pos`` (R,) and ``tau``: v̂ as :func:`positive_logits`
    normalises it, the margin's query factor t̂ (or v̂ for "image_text"), the threshold against the
    unit captions t̂ (``options``: bound :class:`~hnclip_kernels.options.LossOptions`)."""
    dt = compute_dtype(img.dtype)
    norm = normalized if options.normalize else (lambda x: x)
    v_hat = norm(img.to(dt))
    a_hat = v_hat if family.margin is Margin.IMAGE_TEXT else norm(txt.detach().to(dt))
    threshold = options.false_negative_threshold
    unit = None if threshold is None else normalized(txt.detach().to(dt))
    own = family.own_negatives
    mask = family.own_mask
    if mask is None:
        mask = torch.zeros(0, 0, dtype=torch.bool, device=own.device)
    gamma = torch.as_tensor(options.gamma, dtype=dt, device=own.device)
    return own_negatives.block(
        v_hat, a_hat, own, mask, pos, 1.0 / tau.to(dt), gamma, options.normalize, threshold, unit
    )


def own_rows(loss, nll0, stats: softmax.RowStats, block: own_negatives.OwnBlock, n_keys: int, eps):
    """(i2t rows, their unsmoothed rows) over the op's columns and each row's own (module docstring),
    from the op's i2t rows ``loss`` (smoothed), ``nll0`` (unsmoothed) and ``stats`` (its
    classes: ``n_keys``, or the kept counts with masking), all (R,)."""
    keep = block.keep
    empty = ~keep.any(dim=1)  # no own column: ω = −inf, formed over a stand-in (a finite backward)
    omega = torch.logsumexp(block.gaps.masked_fill(~keep, float("-inf")).masked_fill(empty[:, None], 0.0), dim=1)
    nll = nll0 + softplus(omega.masked_fill(empty, float("-inf")) - nll0)
    if not softmax.smooths(eps):
        return nll, nll
    n_b = softmax.classes(stats, n_keys)
    n = n_b + keep.sum(dim=1).to(nll.dtype)
    return nll - (n_b * (nll0 - loss) + eps * block.gaps.sum(dim=1)) / n, nll


def merged_stats(stats: softmax.RowStats, block: own_negatives.OwnBlock) -> softmax.RowStats:
    """The op's detached i2t statistics merged with the own columns (:func:`.own_negatives.merge`)."""
    return own_negatives.merge(stats, block._replace(gaps=block.gaps.detach(), n_hat=block.n_hat.detach()))
