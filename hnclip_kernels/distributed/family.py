"""The hard-negative family across ranks (``negatives``, ``group_ids``, ``margin``; see
``docs/hard_negatives.md``): each rank's negatives and ids are gathered like its captions.

Rank r holds n_r pairs and m_r negatives (m_r may differ across ranks and be 0). The global
batch is the concatenation in rank order of the pairs (N = Σ n_r), of the negatives
(K = Σ m_r) and of the ids, so every image sees every rank's negatives, and the loss is the
single-process family loss of that batch; with a positive ``group_mode`` (the ids as positives) a
row's group spans ranks as the gathered ids say. ``local_loss=True``: this rank's rows only, i2t of its
images over [all captions; all negatives], t2i of its captions over all images, scaled as
today's rank loss (``(W/N)·Σ_{i on r} ℓ_i``). Negatives follow the captions' gather semantics:
through the gather with ``gather_with_grad`` (gradients summed into the owner), else this rank's
own (differentiable) negatives in its slot when ``local_loss=False``, and constants with
``local_loss=True`` (the key side is dropped, as for the captions).

Backends "torch", "cpp" and "triton" (``backends.rank_losses`` with the gathered family: two
directional calls per rank). 16-bit features are upcast to float32 *before* the gather, as the
one-process family upcasts them (``backends.symmetric_losses``): a feature's query-side gradient and the key-side
gradients of every rank meet in the gather's backward (a reduce-scatter), so the float32 gather
sums them in float32 and each feature's gradient is rounded to its dtype once (a bf16 gather would
sum bf16 halves). It costs twice the gathered bytes of the 16-bit features.

Each row's own negatives (n_r, K_r, D) with their mask: ``local_loss=True`` needs no gather (they
extend only this rank's own i2t rows; the torch directional reference forms them, or on every
backend ``reduction="directions"``'s host extension, ``backends.directions.own_rows``);
``local_loss=False`` gathers them (padded to the largest K_r, masked) like the captions, so the
one-process operators of every backend run on the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

from ..backends import rank_losses, symmetric_losses
from ..numerics import autocast_disabled
from ..options import LossOptions, as_tau_tensor
from ..validation_family import Family, check_positive_stats
from .gather import gather_features, gather_ids, gather_rows
from .per_rank import rank_direction_rows


def family_rank_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    tau,
    bound: LossOptions,
    sizes: List[int],
    family: Tuple[List[int], Family, List[int]],
    *,
    local_loss: bool,
    gather_with_grad: bool,
    rank: int,
    world_size: int,
    group=None,
    return_stats: bool = False,
):
    """This rank's family loss: a float32 scalar (float64 for float64 features; with
    ``reduction="directions"`` the rows of :func:`~.per_rank.rank_direction_rows`); with
    ``return_stats`` ``(loss, (i2t, t2i, (N + K, N)))``, the detached ``RowStats`` of this rank's
    rows (all N rows with ``local_loss=False``) and the key columns of each direction.

    ``sizes``: every rank's n_r; ``family``: ``(every rank's m_r, this rank's Family, every rank's
    K_r)`` (its negatives (m_r, D) or None, group_ids (n_r,) or None, the margin; or each row's own
    negatives (n_r, K_r, D) and their mask), checked on every rank (``consensus.collective_check``);
    ``bound``: the options bound to these tensors, backend "torch", "cpp" or "triton". float16 and
    bfloat16 features (and negatives) run in float32 from the gather on (module docstring); their
    gradients come back in their dtypes."""
    check_positive_stats(bound.group_mode, return_stats)  # before any gather (options agree on every rank)
    neg_sizes, family, own_sizes = family
    negatives, group_ids = family.negatives, family.group_ids
    if image_features.dtype in (torch.float16, torch.bfloat16):  # one float32 gradient sum per feature
        image_features, text_features = image_features.float(), text_features.float()
        negatives = None if negatives is None else negatives.float()
        if family.own_negatives is not None:
            family = dataclasses.replace(family, own_negatives=family.own_negatives.float())
    all_img, all_txt = gather_features(
        image_features, text_features, local_loss, gather_with_grad, rank, world_size, sizes=sizes, group=group
    )
    all_neg, all_ids = negatives, group_ids
    if world_size > 1:
        if any(neg_sizes):
            keep_local = not local_loss
            all_neg = gather_rows(
                negatives, neg_sizes, rank, with_grad=gather_with_grad, keep_local=keep_local, like=text_features,
                group=group,
            )  # fmt: skip
        if group_ids is not None:
            all_ids = gather_ids(group_ids, sizes, group)
        if any(own_sizes) and not local_loss:  # every rank forms every row: every row's own negatives
            family = _gathered_own(family, own_sizes, sizes, rank, gather_with_grad, text_features, group)
    tau_t = as_tau_tensor(tau, all_img)
    n_total = all_img.shape[0]
    n_keys = (n_total + (0 if all_neg is None else all_neg.shape[0]), n_total)
    if family.own_negatives is not None:  # each i2t row's columns: N + its real own ones (the rows formed here)
        own_mask = family.own_mask
        n_keys = (n_total + (family.own_negatives.shape[1] if own_mask is None else own_mask.sum(dim=1)), n_total)
    with autocast_disabled(image_features.device):
        gathered = dataclasses.replace(family, negatives=all_neg, group_ids=all_ids)
        if bound.reduction == "directions":  # the rows, unscaled (distributed.per_rank)
            out = rank_direction_rows(
                (image_features, text_features), (all_img, all_txt), tau_t, sum(sizes[:rank]), bound,
                local_loss=local_loss, world_size=world_size, return_stats=return_stats, family=gathered,
            )  # fmt: skip
            return (out[0], (*out[1], n_keys)) if return_stats else out
        if not local_loss or world_size == 1:  # the whole global batch: the single-process family loss
            out = symmetric_losses(all_img, all_txt, tau_t, bound, return_stats, gathered)
        else:
            offset = sum(sizes[:rank])
            out = rank_losses(image_features, text_features, all_img, all_txt, tau_t, offset, bound, return_stats,
                              gathered)  # fmt: skip
    rows, stats = out if return_stats else (out, None)
    if not local_loss or world_size == 1 or n_total == world_size * image_features.shape[0]:
        loss = rows.mean()  # equal sizes: the mean of the local rows, as today's rank loss
    else:
        loss = rows.sum() / (n_total / world_size)
    return (loss, (*stats, n_keys)) if return_stats else loss


def _gathered_own(family: Family, own_sizes, sizes, rank, with_grad, like, group) -> Family:
    """``family`` with every rank's rows' own negatives (N, K, D), K = max K_r, and their mask
    (N, K): this rank's (n_r, K_r, D) padded with masked-out zero slots (none: all masked), gathered
    as rows of K·D with the captions' gather semantics (through the gather with ``with_grad``, else
    this rank's own tensor in its slot)."""
    k, n, d = max(own_sizes), like.shape[0], like.shape[1]
    own, mask = family.own_negatives, family.own_mask
    if own is None:
        own, mask = like.new_zeros(n, 0, d), torch.zeros(n, 0, dtype=torch.bool, device=like.device)
    elif mask is None:
        mask = torch.ones(own.shape[:2], dtype=torch.bool, device=own.device)
    own = torch.cat([own, own.new_zeros(n, k - own.shape[1], d)], dim=1)
    mask = torch.cat([mask, mask.new_zeros(n, k - mask.shape[1])], dim=1)
    rows = gather_rows(own.reshape(n, k * d), sizes, rank, with_grad=with_grad, keep_local=True, like=like,
                       group=group)  # fmt: skip
    all_mask = gather_ids(mask.to(torch.int64), sizes, group).bool()
    return dataclasses.replace(family, own_negatives=rows.reshape(-1, k, d), own_mask=all_mask)
