"""Global batches across ranks with ``torch.distributed``: gathering and this rank's loss.

Layout: rank r holds n_r image-text pairs; the global batch is the concatenation over
ranks in rank order, N = Σ n_r, and rank r's rows start at the global row
``offset_r = Σ_{r' < r} n_r'``. Every backend's *directional* function
``fn(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize)``
(``backends.directional_fn``) takes M local query rows, N global key columns and that offset,
so the fused kernels (Triton, C++) never hold an n×N or N×N matrix. Where a rank computes
the whole global batch (``local_loss=False``, or one process) it runs the single-process
fused op instead (``backends.symmetric_losses``).

Unequal local batch sizes are exact: every call all-gathers each rank's metadata (sizes,
feature dim, dtype, options) in one small collective, pads each rank's features to the
largest n_r, all-gathers them and strips the padding again (autograd flows through the
pad and the strip, so ``gather_with_grad`` is exact too). Rank r's loss is then
``(W / N) · Σ_{i on r} ½(i2t_i + t2i_i)`` in local mode, whose mean over the W ranks is the
global mean loss; with equal sizes that is the plain mean over the local rows, as in
open_clip's ``ClipLoss``.

Bad input never hangs the job: the metadata collective runs before any feature gather,
and every rank inspects every rank's metadata, so an invalid input on one rank (wrong
shape, dtype, non-finite scale, mismatched feature dim or options across ranks, an
empty local batch) raises on *every* rank: the offending rank raises its own
``TypeError``/``ValueError``, the others a ``ValueError`` naming the offending rank.

The communication is plain ``torch.distributed`` (NCCL on GPUs, gloo on CPU):
a differentiable all_gather when gradients must flow through the gather
(``torch.distributed._functional_collectives.all_gather_single``, which recent torch
recommends over open_clip's deprecated ``torch.distributed.nn.all_gather``; the latter on
older torch; see ``AUTOGRAD_GATHER``), ``torch.distributed.all_gather`` otherwise, as open_clip.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import validation
from ..numerics import autocast_disabled
from ..options import LossOptions
from ..validation_options import check_module_reduction
from .consensus import collective_check, family_checks, local_checks
from .family import family_rank_loss
from .gather import AUTOGRAD_GATHER, HAS_DISTRIBUTED, dist, gather_features, gather_sizes, require_distributed
from .per_rank import rank_hn_clip_loss
from .sigmoid import distributed_siglip_loss, sigmoid_rank_loss

__all__ = [
    "gather_features",
    "gather_sizes",
    "rank_hn_clip_loss",
    "distributed_hn_clip_loss",
    "distributed_siglip_loss",
    "sigmoid_rank_loss",
    "AUTOGRAD_GATHER",
]


def distributed_hn_clip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    tau: Union[float, torch.Tensor],
    *,
    local_loss: bool = True,
    gather_with_grad: bool = True,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group=None,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    backend: str = "auto",
    normalize: bool = True,
    precision: Optional[str] = None,
    return_stats: bool = False,
    false_negative_threshold: Optional[float] = None,
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    margin: str = "text",
    group_mode: str = "mask",
    reduction: str = "mean",
    negatives_mask: Optional[torch.Tensor] = None,
):
    """HN-CLIP loss of this rank's share of the global batch (a collective: call on every rank).

    Checks the inputs of all ranks in one metadata collective (raising on every rank if any
    rank's input is invalid), gathers the features (``gather_features``), then computes
    ``rank_hn_clip_loss`` with this rank's global offset. The defaults
    (``local_loss=True, gather_with_grad=True``) are the exact convention: with DDP's
    gradient averaging every parameter's gradient equals that of the single-process loss on
    the concatenated global batch. See :class:`hnclip_kernels.HNClipLoss` for the other modes.

    ``rank``/``world_size`` default to the process group's; ``world_size == 1`` (or
    torch.distributed not initialised and no ``world_size`` given) is the single-process loss.
    Autocast is disabled inside: the loss accumulates in float32 whatever the feature dtype.
    ``return_stats``: return ``(loss, (i2t, t2i, n_keys))`` with this rank's detached row
    statistics (see :func:`rank_hn_clip_loss`).
    ``false_negative_threshold``: false-negative masking as in :func:`hnclip_kernels.hn_clip_loss`,
    each rank's captions against all gathered captions (a duplicate on another rank is masked
    too); it must be the same on every rank (checked with the other options).
    ``negatives``, ``group_ids``, ``margin``: the hard-negative family (``docs/hard_negatives.md``)
    across ranks on every backend ("auto" as for today's loss; 16-bit features run in float32 from
    the gather on, their gradients summed in float32). ``negatives``: this rank's (M_r, D)
    hard-negative captions, or None (M_r may differ across ranks and be 0); ``group_ids``: this
    rank's (n_r,) integer pair ids, on every rank or on none. They are gathered like the captions
    (:mod:`hnclip_kernels.distributed.family`): the loss is the single-process family loss of the
    concatenated batch (pairs, negatives and ids in rank order), rows and gradients as in the
    modes above. ``margin`` must be the same on every rank. Where no rank passes negatives
    (M_r > 0) or ids and ``margin="text"``, the call is today's, bit for bit.
    ``group_mode``: "mask" (default) or "supcon" / "mil_nce", the ids as positives
    (``docs/hard_negatives.md#multi-positive-targets``), the same on every rank: a row's positives
    are every column of its group, on any rank (the ids are gathered), on every backend,
    ``group_ids`` on every rank, no ``return_stats``.
    ``reduction``: "mean" (the loss above) or "directions": a
    :class:`~hnclip_kernels.DirectionRows` instead, each direction's rows and LSE, unscaled:
    with ``local_loss=True`` (and ``world_size > 1``) this rank's n_r rows against the gathered
    columns, with ``local_loss=False`` all N rows of the gathered batch in rank order (the same on
    every rank); gradients flow through the gather as the scalar loss's do in that mode
    (``docs/api.md``, "Per-direction rows"). The same on every rank (checked); other values raise
    ``ValueError``.
    ``negatives`` (n_r, K_r, D) with ``negatives_mask`` (n_r, K_r) bool: each of this rank's rows'
    own negatives (``docs/hard_negatives.md``, "Each row's own negatives"; K_r may differ across
    ranks and be 0, but no rank may pass shared (M, D) ones then). They extend only their own rows'
    image→text rows, so the loss is the single-process own-negatives loss of the concatenated
    batch. ``local_loss=True``: not gathered, backend "torch" only (the directional reference), or
    every backend with ``reduction="directions"`` (its rows extend themselves, ``backends.directions``);
    ``local_loss=False``: gathered (padded to the largest K_r) on every backend. With a positive
    ``group_mode`` they are extra negatives of those image→text rows, never positives (the same
    backends).
    """

    def options():  # built inside the checks, so a bad option on one rank raises on every rank
        check_module_reduction(reduction, "distributed_hn_clip_loss")
        return LossOptions(
            reduction=reduction,
            gamma=gamma,
            label_smoothing=label_smoothing,
            normalize=normalize,
            backend=backend,
            precision=precision,
            false_negative_threshold=false_negative_threshold,
            margin=margin,
            group_mode=group_mode,
        )

    tau = validation.plain_number(tau)
    return rank_loss(
        image_features,
        text_features,
        tau,
        options,
        local_loss=local_loss,
        gather_with_grad=gather_with_grad,
        rank=rank,
        world_size=world_size,
        group=group,
        return_stats=return_stats,
        negatives=negatives,
        group_ids=group_ids,
        negatives_mask=negatives_mask,
    )


def rank_loss(
    image_features,
    text_features,
    tau,
    options,
    *,
    local_loss: bool,
    gather_with_grad: bool,
    rank: Optional[int],
    world_size: Optional[int],
    group=None,
    return_stats: bool = False,
    tau_value: Optional[float] = None,
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    negatives_mask: Optional[torch.Tensor] = None,
):
    """:func:`distributed_hn_clip_loss` with its options as a :class:`LossOptions` (or a function
    building one, whose error then raises on every rank), and ``tau_value``, τ already read by
    the caller (:class:`hnclip_kernels.HNClipLoss` reads ``logit_scale`` once). ``negatives`` and
    ``group_ids``: this rank's (see :func:`distributed_hn_clip_loss`); where no rank passes any
    (and the margin is "text") the call is today's, on today's path."""
    given = negatives is not None or group_ids is not None or negatives_mask is not None
    family = (negatives, group_ids, negatives_mask) if given else None
    if world_size is None:
        world_size = dist.get_world_size(group=group) if HAS_DISTRIBUTED and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank(group=group) if world_size > 1 else 0
    if world_size > 1:
        require_distributed()
        flags = int(bool(local_loss)) | (int(bool(gather_with_grad)) << 1)  # normalize: bit 2, added with the options
        sizes, bound, family = collective_check(
            image_features, text_features, tau, options, flags, rank, world_size, group, tau_value, family=family
        )
    else:
        sizes, bound, family = _single_checks(
            image_features, text_features, tau, options, rank, group, tau_value, family
        )
    if family is not None:
        return family_rank_loss(
            image_features, text_features, tau, bound, sizes, family, local_loss=local_loss,
            gather_with_grad=gather_with_grad, rank=rank, world_size=world_size, group=group,
            return_stats=return_stats,
        )  # fmt: skip
    all_img, all_txt = gather_features(
        image_features, text_features, local_loss, gather_with_grad, rank, world_size, sizes=sizes, group=group
    )
    offset = sum(sizes[:rank])
    with autocast_disabled(image_features.device):
        return rank_hn_clip_loss(
            image_features,
            text_features,
            all_img,
            all_txt,
            tau,
            offset,
            bound,
            local_loss=local_loss,
            world_size=world_size,
            return_stats=return_stats,
        )


def _single_checks(image_features, text_features, tau, options, rank, group, tau_value, family):
    """:func:`collective_check`'s result on one process, raising here."""
    status, exc, _, bound = local_checks(image_features, text_features, tau, options, rank, 1, group, tau_value)
    checked = None
    if exc is None and (family is not None or bound.group_mode.positives):  # positives need ids: checked there
        family = (None, None, None) if family is None else family
        status, exc, checked = family_checks(image_features, text_features, *family[:2], bound, tau, family[2])
    if exc is not None:
        raise exc
    sizes = [image_features.shape[0]]
    if checked is None:  # as family_of decided: today's loss
        return sizes, bound, None
    m = 0 if checked.negatives is None else checked.negatives.shape[0]
    k = 0 if checked.own_negatives is None else checked.own_negatives.shape[1]
    return sizes, bound, ([m], checked, [k])
