"""The computation behind :mod:`hnclip_kernels.integrations.sentence_transformers`: the checks of
sentence-transformers' MultipleNegativesRankingLoss arguments (``check_mnrl_arguments``) and the
loss of a batch's column embeddings (``columns_loss``), one fused call per batch.

MNRL's terms in HN-CLIP's (anchors = images v, positives = captions t, negative_1…n = the shared
extra caption columns, s = ``scale`` = 1/τ):

* ``("query_to_doc",)``: the image→text rows alone, i2t_i = LSE_j Z_ij − Z_ii over the N
  positives and the n·N negatives, mean over i: one call of the backend's *directional* op
  (``backends.directional_fn``; the fused symmetric op would form both directions). With one
  direction ``partition_mode`` "joint" and "per_direction" are the same softmax.
* ``("query_to_doc", "doc_to_query")`` with ``partition_mode="per_direction"``: MNRL's
  −(pos − ½(LSE_q2d + LSE_d2q)) averaged over the rows is ½(i2t_i + t2i_i): exactly
  :func:`hnclip_kernels.hn_clip_loss` (the negatives are columns of the i2t rows only, as MNRL's
  hard negatives are documents of the query rows only).

At γ = 0 both are MNRL itself; γ > 0 adds γ·sg(t_i·x)/τ (``margin="text"``) or γ·sg(v_i·x)/τ
(``margin="image_text"``) to every negative logit of both directions.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..backends import directional_fn
from ..distributed import distributed_hn_clip_loss
from ..distributed.consensus import collective_check, family_checks, local_checks
from ..distributed.gather import HAS_DISTRIBUTED, dist, gather_rows
from ..loss import hn_clip_loss
from ..margin import margin_operands
from ..numerics import autocast_disabled
from ..options import LossOptions, as_tau_tensor

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
SYMMETRIC = frozenset({"query_to_doc", "doc_to_query"})


def check_mnrl_arguments(scale, similarity_fct, directions, partition_mode, cos_sim) -> tuple:
    """MNRL's ``scale``, ``similarity_fct``, ``directions`` and ``partition_mode`` checked as
    sentence-transformers 6.2 checks them, then refused by name where HN-CLIP's loss cannot express
    them exactly. Returns ``directions`` as a tuple. ``cos_sim``: ``sentence_transformers.util.cos_sim``.

    Raises:
        TypeError: ``scale`` not a real number, ``similarity_fct`` not callable, ``directions`` a string.
        ValueError: ``scale`` ≤ 0 or not finite; a ``similarity_fct`` other than ``cos_sim``; no
            direction, an unknown one, no "query_to_doc", "query_to_query" or "doc_to_doc";
            ``partition_mode`` not "joint"/"per_direction", or "joint" with both directions.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number s = 1/τ > 0 (MNRL's default 20.0), got {type(scale).__name__}")
    if not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a positive finite value s = 1/τ, got {scale!r}")
    if not callable(similarity_fct):
        raise TypeError(f"similarity_fct must be callable (sentence_transformers.util.cos_sim), got {similarity_fct!r}")
    if similarity_fct is not cos_sim:
        name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
        raise ValueError(
            f"similarity_fct={name} is not supported: HN-CLIP's logits and margin are cosine similarities "
            "(the loss normalises the embeddings inside); use similarity_fct=sentence_transformers.util.cos_sim "
            "(for a dot product of normalised embeddings, cos_sim is the same), or MultipleNegativesRankingLoss"
        )
    if isinstance(directions, str):
        raise TypeError(f"directions must be a tuple of direction names, got the string {directions!r}")
    directions = tuple(directions)
    if not directions:
        raise ValueError("At least one direction must be specified.")
    unknown = set(directions) - set(DIRECTIONS)
    if unknown:
        raise ValueError(f"Invalid directions: {unknown}. Valid: {set(DIRECTIONS)}")
    if "query_to_doc" not in directions:
        raise ValueError("'query_to_doc' direction is required (contains the positive pair).")
    same_type = set(directions) & {"query_to_query", "doc_to_doc"}
    if same_type:
        raise ValueError(
            f"directions {sorted(same_type)} are not supported: HN-CLIP's loss has image→text and text→image "
            "rows only (no same-type softmax terms); use directions=('query_to_doc',) or "
            "('query_to_doc', 'doc_to_query') with partition_mode='per_direction', or MultipleNegativesRankingLoss "
            "for GTE's joint four-direction loss"
        )
    if partition_mode not in PARTITION_MODES:
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "joint" and set(directions) == SYMMETRIC:
        raise ValueError(
            "partition_mode='joint' with directions ('query_to_doc', 'doc_to_query') is one softmax over both "
            "directions' scores, which HN-CLIP's symmetric loss does not compute; use "
            "partition_mode='per_direction' (½(i2t + t2i), CLIP's and HN-CLIP's symmetric InfoNCE)"
        )
    return directions


def check_hardness(hardness_mode, hardness_strength) -> None:
    """MNRL's ``hardness_mode``: refused by name (the margin is this loss's own hardness term)."""
    if hardness_mode is None and hardness_strength == 0.0:
        return
    raise ValueError(
        f"hardness_mode={hardness_mode!r} (hardness_strength={hardness_strength!r}) is not supported: the margin is "
        "this loss's hardness term. MNRL's hardness_mode='all_negatives' with strength α is margin='image_text' "
        "with gamma=α/scale and directions=('query_to_doc',); 'in_batch_negatives' and 'hard_negatives' (a "
        "penalty on part of the negatives) have no equivalent: use MultipleNegativesRankingLoss for them"
    )


def columns_loss(
    embeddings: List[torch.Tensor], scale: float, options: LossOptions, symmetric: bool, gather: bool
) -> torch.Tensor:
    """The mean loss of one batch's column embeddings ``[anchor (N, D), positive (N, D),
    negative_1 (N, D), …]`` (their negatives stacked into one (n·N, D) block of shared caption
    columns), τ = 1/``scale``, with ``options`` (γ, margin, backend). ``symmetric``: ½(i2t + t2i)
    through :func:`hnclip_kernels.hn_clip_loss` (``gather``: :func:`distributed_hn_clip_loss`,
    this rank's rows against the gathered batch); else the i2t rows alone (:func:`query_to_doc_loss`).
    A float32 scalar (float64 for float64 embeddings)."""
    if len(embeddings) < 2:
        raise ValueError(
            f"Expected at least 2 embeddings (anchor, positive, negative_1…n columns), got {len(embeddings)}"
        )
    anchors, positives = embeddings[0], embeddings[1]
    negatives = torch.cat(embeddings[2:]) if len(embeddings) > 2 else None
    tau = 1.0 / scale
    if not symmetric:
        return query_to_doc_loss(anchors, positives, negatives, tau, options, gather=gather)
    kwargs = dict(
        gamma=options.gamma, backend=options.backend, precision=options.precision, negatives=negatives,
        margin=options.margin.value,
    )  # fmt: skip
    if gather:  # local rows against the gathered batch, gradients through the gather (MNRL's convention)
        return distributed_hn_clip_loss(anchors, positives, tau, local_loss=True, gather_with_grad=True, **kwargs)
    return hn_clip_loss(anchors, positives, tau, **kwargs)


def layout(gather: bool):
    """(rank, world size) of the default process group with ``gather``; (0, 1) otherwise."""
    if gather and HAS_DISTRIBUTED and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def query_to_doc_loss(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    negatives: Optional[torch.Tensor],
    tau: float,
    options: LossOptions,
    *,
    gather: bool,
) -> torch.Tensor:
    """MNRL's one-direction loss: the mean over this process's (rank's) anchors of the image→text
    row over all positives and negatives (with ``gather`` under ``torch.distributed``: every rank's,
    gathered with gradients), positive of local row i at column offset + i; one directional op.
    The inputs are checked as ``distributed_hn_clip_loss`` checks them (on every rank at once)."""
    rank, world = layout(gather)
    family = None if negatives is None else (negatives, None, None)  # (negatives, group_ids, negatives_mask)
    if world > 1:  # flags: local_loss, gather_with_grad (bits 0, 1)
        sizes, bound, family = collective_check(
            anchors, positives, tau, options, 0b11, rank, world, None, family=family
        )
        neg_sizes, negatives = ([0] * world, None) if family is None else (family[0], family[1].negatives)
    else:
        sizes, bound, negatives = _single_checks(anchors, positives, negatives, tau, options)
    if world > 1:
        all_pos = gather_rows(positives, sizes, rank, with_grad=True, keep_local=False, like=positives)
        if any(neg_sizes):
            negatives = gather_rows(negatives, neg_sizes, rank, with_grad=True, keep_local=False, like=positives)
    else:
        all_pos = positives
    keys = all_pos if negatives is None else torch.cat([all_pos, negatives])
    a, b, mask_a, mask_b = margin_operands(bound.margin, anchors, keys, positives, keys)
    masks = {} if mask_a is None else dict(mask_query=mask_a, mask_key=mask_b)
    fn = directional_fn(bound.backend, bound.precision)
    with autocast_disabled(anchors.device):
        rows = fn(
            anchors, keys, query_txt=a, key_txt=b, **masks, tau=as_tau_tensor(tau, anchors), offset=sum(sizes[:rank]),
            gamma=bound.gamma, label_smoothing=bound.label_smoothing, normalize=bound.normalize,
        )  # fmt: skip
    n_total = sum(sizes)
    # (W/N)·Σ over this rank's rows: the mean over ranks is the global mean (equal sizes: the local mean)
    return rows.mean() if n_total == world * anchors.shape[0] else rows.sum() / (n_total / world)


def _single_checks(anchors, positives, negatives, tau, options):
    """One process's checks: (sizes, bound options, the checked negatives or None)."""
    _, exc, _, bound = local_checks(anchors, positives, tau, options, 0, 1, None)
    if exc is None and negatives is not None:
        _, exc, family = family_checks(anchors, positives, negatives, None, bound, tau)
        negatives = None if family is None else family.negatives
    if exc is not None:
        raise exc
    return [anchors.shape[0]], bound, negatives
