"""Argument checks of the hard-negative family (``negatives``, ``group_ids``, ``margin``).

Split from :mod:`hnclip_kernels.validation` by role: these are the checks of the options that
extend the loss beyond the paper's formula (see ``docs/hard_negatives.md``). Each raises
``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, bad value) naming the
argument and the fix. Every backend runs them, on one process and across ranks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .group_mode import GroupMode
from .margin import Margin
from .plausibility import warn_if_not_unit_norm
from .validation import FLOAT_DTYPES, check_features, finite_limit, largest_intermediate, row_norm_extremes

MARGINS = tuple(m.value for m in Margin)


def check_negatives(negatives, txt: torch.Tensor, txt_name: str = "txt", own: bool = False) -> Optional[torch.Tensor]:
    """``negatives`` (M, D), M ≥ 0: extra caption columns of the image→text direction, in
    ``txt``'s dtype and on its device (``txt`` already checked). Returns it, or None for None or
    M = 0 (no extra columns: the loss without negatives). ``own``: (N, K, D) is accepted too, each
    row's own K negatives (:func:`check_own_mask`; K = 0 is None)."""
    if negatives is None:
        return None
    if not isinstance(negatives, torch.Tensor):
        raise TypeError(f"negatives must be None or a torch.Tensor of shape (M, D), got {type(negatives).__name__}")
    if own and negatives.dim() == 3:
        if negatives.shape[0] != txt.shape[0]:
            raise ValueError(
                f"negatives of shape (N, K, D) must have one row per pair, N = {txt.shape[0]}, got shape "
                f"{tuple(negatives.shape)}; for negatives shared by every row pass (M, D): negatives.reshape(-1, D)"
            )
    elif negatives.dim() != 2:
        also = (
            " or (N, K, D), each row's own K negatives"
            if own
            else "; (N, K, D) negatives, each row's own, are taken by the softmax loss only "
            "(hn_clip_loss, HNClipLoss, distributed_hn_clip_loss)"
        )
        raise ValueError(
            f"negatives must be 2-D (M, D): one row per hard-negative caption embedding{also}, got shape "
            f"{tuple(negatives.shape)}; flatten the leading dimensions (negatives.reshape(-1, D))"
        )
    if negatives.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"negatives has dtype {negatives.dtype}; pass floating embeddings in {txt_name}'s dtype ({txt.dtype})"
        )
    if negatives.shape[-1] != txt.shape[1]:
        raise ValueError(
            f"negatives has D = {negatives.shape[-1]} but {txt_name} has D = {txt.shape[1]}; embed the negative "
            "captions with the same text tower"
        )
    if negatives.dtype != txt.dtype:
        raise TypeError(
            f"negatives ({negatives.dtype}) and {txt_name} ({txt.dtype}) must have the same dtype; cast negatives"
        )
    if negatives.device != txt.device:
        raise ValueError(
            f"negatives ({negatives.device}) and {txt_name} ({txt.device}) must be on the same device; "
            f"move negatives to {txt.device}"
        )
    return None if negatives.shape[-2] == 0 else negatives


def check_own_mask(negatives_mask, negatives: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``negatives_mask`` (N, K) bool, True where row i's k-th own negative is real (the
    tokenizer's attention-mask convention): False entries are no columns at all (no logit, no ε
    share, zero gradient to their embedding). Only with (N, K, D) ``negatives``; None: all real."""
    if negatives_mask is None:
        return None
    if not isinstance(negatives_mask, torch.Tensor) or negatives_mask.dtype != torch.bool:
        kind = negatives_mask.dtype if isinstance(negatives_mask, torch.Tensor) else type(negatives_mask).__name__
        raise TypeError(f"negatives_mask must be a bool torch.Tensor of shape (N, K), got {kind}; e.g. mask.bool()")
    if negatives is None or negatives.dim() != 3:
        raise ValueError(
            "negatives_mask is the mask of per-row negatives of shape (N, K, D); pass it with such "
            "negatives, or drop it (shared (M, D) negatives have no mask)"
        )
    if tuple(negatives_mask.shape) != tuple(negatives.shape[:2]):
        raise ValueError(
            f"negatives_mask must have shape (N, K) = {tuple(negatives.shape[:2])} (negatives' first two "
            f"dimensions), got {tuple(negatives_mask.shape)}"
        )
    if negatives_mask.device != negatives.device:
        raise ValueError(
            f"negatives_mask ({negatives_mask.device}) and negatives ({negatives.device}) must be on the same "
            f"device; move negatives_mask to {negatives.device}"
        )
    return negatives_mask


def check_group_ids(group_ids, txt: torch.Tensor, txt_name: str = "txt") -> Optional[torch.Tensor]:
    """``group_ids`` (N,): an integer id per pair (bool and floating ids rejected), on the
    features' device. Pairs i ≠ k with the same id are no negatives of each other."""
    if group_ids is None:
        return None
    if not isinstance(group_ids, torch.Tensor):
        raise TypeError(
            f"group_ids must be None or a 1-D integer torch.Tensor of shape (N,), got {type(group_ids).__name__}; "
            "e.g. torch.as_tensor(ids)"
        )
    if group_ids.dtype == torch.bool or group_ids.is_floating_point() or group_ids.is_complex():
        raise TypeError(
            f"group_ids must be an integer tensor (one id per pair), got {group_ids.dtype}; "
            "cast with .long() if the values are whole numbers"
        )
    n = txt.shape[0]
    if group_ids.dim() != 1 or group_ids.shape[0] != n:
        raise ValueError(
            f"group_ids must be 1-D of length N = {n} (one id per image-text pair), got shape {tuple(group_ids.shape)}"
        )
    if group_ids.device != txt.device:
        raise ValueError(
            f"group_ids ({group_ids.device}) and {txt_name} ({txt.device}) must be on the same device; "
            f"move group_ids to {txt.device}"
        )
    return group_ids


def family_arguments(img, txt, negatives, group_ids, names=("img", "txt")):
    """(negatives or None, group_ids or None), checked against the checked features."""
    return check_negatives(negatives, txt, names[1]), check_group_ids(group_ids, txt, names[1])


@dataclasses.dataclass(frozen=True)
class Family:
    """The hard-negative family of one call (``docs/hard_negatives.md``), built once at the entry
    by :func:`family_of` and passed down whole; None stands for today's loss.

    Attributes:
        negatives: (M, D), M > 0, extra caption columns shared by every image→text row, or None.
        group_ids: (N,) integer ids (pairs with equal ids are no negatives of each other), or None.
        margin: the margin's kind (:class:`~hnclip_kernels.margin.Margin`).
        own_negatives: (N, K, D), K > 0, each image→text row's own extra caption columns (row i's
            only), or None; never with ``negatives``.
        own_mask: (N, K) bool, True where an own negative is real (None: all are).
    """

    negatives: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None
    margin: Margin = Margin.TEXT
    own_negatives: Optional[torch.Tensor] = None
    own_mask: Optional[torch.Tensor] = None


def family_of(
    img,
    txt,
    negatives,
    group_ids,
    margin: Margin,
    names=("img", "txt"),
    negatives_mask=None,
    own: bool = True,
    group_mode: GroupMode = GroupMode.MASK,
) -> Optional[Family]:
    """The one answer to "is this call the hard-negative family?": a :class:`Family` of the
    checked ``negatives`` (M, D) shared, or (N, K, D) each row's own with ``negatives_mask``
    (N, K) bool, and ``group_ids`` (N,) (``img``/``txt`` checked first), or None where the call is
    today's loss (no negatives or M = 0 or K = 0, no ids, margin TEXT). ``own=False``: (N, K, D)
    refused (the callers across ranks).

    Raises: the ``TypeError``/``ValueError`` of :func:`validation.check_features`,
    :func:`check_negatives`, :func:`check_own_mask` and :func:`check_group_ids`; ``ValueError`` for a
    positive ``group_mode`` (:class:`~hnclip_kernels.group_mode.GroupMode`) without ``group_ids``
    (with (N, K, D) negatives they are extra negative columns of the i2t rows, never positives)."""
    if group_mode.positives and group_ids is None:
        raise ValueError(
            f"group_mode={group_mode.value!r} makes pairs with equal group_ids positives, but no group_ids were "
            "passed; pass group_ids (N,) (torch.arange(N) for one pair per group: the plain loss), or "
            "group_mode='mask'"
        )
    if negatives is None and group_ids is None and margin is Margin.TEXT and negatives_mask is None:
        return None
    check_features(img, txt, *names)
    given = negatives
    negatives = check_negatives(negatives, txt, names[1], own=own)
    own_mask = check_own_mask(negatives_mask, given)  # K = 0 (negatives None now) keeps its mask's check
    group_ids = check_group_ids(group_ids, txt, names[1])
    if negatives is None and group_ids is None and margin is Margin.TEXT:  # M = 0
        return None
    if negatives is not None and negatives.dim() == 3:
        return Family(None, group_ids, margin, negatives, own_mask)
    return Family(negatives, group_ids, margin)


def check_positive_stats(group_mode: GroupMode, return_stats: bool) -> None:
    """``return_stats`` with a positive ``group_mode``: refused (the report's row statistics
    assume one positive per row)."""
    if return_stats and group_mode.positives:
        raise ValueError(
            f"return_stats=True is not supported with group_mode={group_mode.value!r}: the saturation report's "
            "row statistics assume one positive per row; pass return_stats=False (or group_mode='mask')"
        )


def check_family_range(
    img, txt, negatives, margin, tau_value, gamma, label_smoothing, n_rows, tau_grad, names=("img", "txt")
) -> None:
    """With ``normalize=False``: the negatives' norms (and, with margin="image_text", a margin
    γ·v·x of the image norms) enter the logit gaps; raise ``ValueError`` where they would
    overflow the compute dtype (as :func:`validation.check_feature_range` for img/txt), else warn
    once per process if a negative's norm is off 1 by more than 5%
    (:func:`plausibility.warn_if_not_unit_norm`, the features' own rule; from the same norms)."""
    if tau_value is None or torch.compiler.is_compiling() or img.device.type == "meta":
        return
    extremes = row_norm_extremes(img, txt, *(() if negatives is None else (negatives,)))
    img_norm, txt_norm = extremes[0][0], max(norm for norm, _ in extremes[1:])
    if not (math.isfinite(img_norm) and math.isfinite(txt_norm)):
        return
    n_keys = txt.shape[0] + (0 if negatives is None else negatives.shape[0])
    args = (tau_value, gamma, label_smoothing, n_keys)
    largest = largest_intermediate(*args, img_norm, txt_norm, n_rows, tau_grad=tau_grad)
    if margin is not Margin.TEXT:  # the margin γ·v·x: covered by the bound with the two norms swapped
        largest = max(largest, largest_intermediate(*args, txt_norm, img_norm, n_rows, tau_grad=tau_grad))
    if largest >= finite_limit(img.dtype):
        raise ValueError(
            f"with normalize=False, {names[0]} (row norms up to {img_norm:.3g}) and the captions and negatives "
            f"(up to {txt_norm:.3g}) at tau = {tau_value:g} give logit gaps up to {largest:.3g}, beyond "
            f"{'float64' if img.dtype == torch.float64 else 'float32'} range; pass normalize=True or "
            "scale the features down"
        )
    if negatives is not None:  # img/txt: their own check (check_feature_range, the consensus row) warns
        warn_if_not_unit_norm(extremes[2][1], ("negatives",))


def check_family_directional(m: int, n: int, mask_query, mask_key, query_groups, key_groups) -> None:
    """The family keywords of a directional op (M query rows, N key columns): mask captions
    (M, D) and (N, D), passed together; group ids (M,) and (K,), K ≤ N, passed together."""
    if (mask_query is None) != (mask_key is None):
        raise ValueError("mask_query and mask_key must be passed together (the captions whose cosine is masked)")
    if mask_query is not None and (mask_query.shape[0] != m or mask_key.shape[0] != n):
        raise ValueError(
            f"mask_query must have the M = {m} query rows and mask_key the N = {n} key columns, "
            f"got {mask_query.shape[0]} and {mask_key.shape[0]}"
        )
    if (query_groups is None) != (key_groups is None):
        raise ValueError("query_groups and key_groups must be passed together (the ids of rows and columns)")
    if query_groups is not None and (
        query_groups.dim() != 1 or query_groups.shape[0] != m or key_groups.dim() != 1 or key_groups.shape[0] > n
    ):
        raise ValueError(
            f"query_groups must be (M,) = ({m},) and key_groups (K,) with K <= N = {n}, got "
            f"{tuple(query_groups.shape)} and {tuple(key_groups.shape)}"
        )
