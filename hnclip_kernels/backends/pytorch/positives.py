"""The reference's multi-positive rows: ``group_mode="supcon"`` and ``"mil_nce"``
(:class:`~hnclip_kernels.group_mode.GroupMode`, ``docs/hard_negatives.md#multi-positive-targets``).

A row i has positives P(i) (its own positive and the columns of its group), kept negatives K(i)
(the other columns the false-negative threshold keeps) and n_i = |P(i)| + |K(i)| classes. With
L_P = LSE_{p∈P(i)} Z_ip and L_K = LSE_{k∈K(i)} Z_ik::

    mil_nce:  LSE_i − L_P                              = softplus(L_K − L_P)
    supcon:   LSE_i − mean_{p∈P(i)} Z_ip               = softplus(L_K − L_P) + (L_P − mean_P Z)
    with ε:   (1 − ε)·(the above) + ε·(LSE_i − mean_{k∈P(i)∪K(i)} Z_ik)

Both terms of each are ≥ 0 and formed from gaps to the diagonal positive, so a loss far below
float32's epsilon keeps its value and gradient (as the single-positive softplus form does).
"""

from __future__ import annotations

import torch

from ...group_mode import GroupMode
from ...numerics import softplus
from ..softmax import smooths


def positive_rows(delta, positives, masked, label_smoothing, group_mode: GroupMode, lse_of_kept):
    """(M,) row losses of ``group_mode`` from the gaps ``delta`` (M, N) = Z − Z_pos, the positives
    ``positives`` (M, N) bool (each row's own positive included), the ``masked`` (M, N) bool
    entries (no class of the row; ignored on positives) and ε; ``lse_of_kept(delta, dropped)`` is
    the reference's LSE over a row's entries not dropped (−inf for none)."""
    negative_out = positives | masked  # what the negatives' LSE leaves out
    lse_neg = lse_of_kept(delta, negative_out)
    lse_pos = torch.logsumexp(delta.masked_fill(~positives, float("-inf")), dim=1)  # never empty
    any_positive = softplus(lse_neg - lse_pos)  # −log Σ_P softmax: MIL-NCE's row
    rows = any_positive
    if group_mode is GroupMode.SUPCON:
        count = positives.sum(dim=1).to(delta.dtype)
        rows = rows + (lse_pos - delta.masked_fill(~positives, 0.0).sum(dim=1) / count)
    elif group_mode is not GroupMode.MIL_NCE:
        raise NotImplementedError(f"group_mode {group_mode!r} has no multi-positive rows")
    if not smooths(label_smoothing):
        return rows
    classes = positives | ~masked
    kept_mean = delta.masked_fill(~classes, 0.0).sum(dim=1) / classes.sum(dim=1).to(delta.dtype)
    uniform = lse_pos + any_positive - kept_mean  # LSE_i − mean over the row's classes
    return (1.0 - label_smoothing) * rows + label_smoothing * uniform
