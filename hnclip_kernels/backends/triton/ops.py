"""The Triton backend as operators, ``hnclip::triton_symmetric_nll``, ``hnclip::triton_directional_nll``
and ``hnclip::triton_rank_nll`` with their ``*_backward`` operators, and their public wrappers.

The bodies are :mod:`.symmetric`, :mod:`.directional` and :mod:`.rank`, their outputs by name
:class:`.outputs.PairsOut`, :class:`.outputs.DirectionalPositivesOut` and :class:`.outputs.RankOut`;
:func:`..glue.fused_op` registers them (``triton_op``, or ``custom_op`` under the interpreter)
with the glue the C++ operators share. The hard-negative family's inputs are optional tensors of
the symmetric and directional operators, empty when absent. Signatures, flags and registration:
``docs/triton.md``, "The operators".
"""

from __future__ import annotations

import torch

from ...group_mode import GroupMode
from ...margin import Margin
from ...validation import check_directional
from ...validation_family import check_family_directional
from .. import glue
from ..positives import check_positives
from . import flops
from .directional import (
    _directional_grads_fake,
    _directional_nll,
    _directional_nll_backward,
    _directional_nll_fake,
)
from .launch import USE_TRITON_OP
from .outputs import DirectionalPositivesOut, PairsOut, RankOut
from .params import scalar_args, tamed
from .rank import _rank_grads_fake, _rank_nll, _rank_nll_backward, _rank_nll_fake
from .symmetric import _symmetric_grads_fake, _symmetric_nll, _symmetric_nll_backward, _symmetric_nll_fake

HNClipTriton = glue.fused_op(
    "triton",
    "triton_symmetric_nll",
    forward=_symmetric_nll,
    forward_fake=_symmetric_nll_fake,
    backward=_symmetric_nll_backward,
    backward_fake=_symmetric_grads_fake,
    tau_input=6,
    feature_inputs=(0, 1, 2, 3),
    use_triton_op=USE_TRITON_OP,
)
HNClipDirectionalTriton = glue.fused_op(
    "triton",
    "triton_directional_nll",
    forward=_directional_nll,
    forward_fake=_directional_nll_fake,
    backward=_directional_nll_backward,
    backward_fake=_directional_grads_fake,
    tau_input=8,
    use_triton_op=USE_TRITON_OP,
)
HNClipRankTriton = glue.fused_op(
    "triton",
    "triton_rank_nll",
    forward=_rank_nll,
    forward_fake=_rank_nll_fake,
    backward=_rank_nll_backward,
    backward_fake=_rank_grads_fake,
    tau_input=4,
    feature_inputs=(0, 1, 2, 3),
    use_triton_op=USE_TRITON_OP,
)

flops.register()  # FlopCounterMode's formulas of the six operators


# ------------------------------------------------------------------ public wrappers
def directional_nll_triton(
    queries,
    keys,
    *,
    query_txt,
    key_txt,
    mask_query=None,
    mask_key=None,
    query_groups=None,
    key_groups=None,
    tau,
    offset,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    false_negative_threshold=None,
    precision=None,
    group_mode: GroupMode = GroupMode.MASK,
):
    """Triton counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`
    (same keyword-only protocol and result, the family's keywords included). ``precision``:
    tensor-core input precision for float32 features (``validation.FP32_PRECISIONS``; None:
    ``DEFAULT_FP32_PRECISION``); ignored for 16-bit features.

    Runs ``hnclip::triton_directional_nll``; works under ``torch.compile(fullgraph=True)`` (a new
    γ, ε or τ does not recompile), ``torch.export``, ``torch.func.grad``/``vjp`` and
    ``torch.func.vmap`` (one kernel call per batch entry). Second derivatives raise the
    ``RuntimeError`` naming backend="torch". ``false_negative_threshold``: as the reference's; the
    kernels compare the caption cosine (m_q·m_k)·ρ_q·ρ_k, the margin's float32 product on each
    tile times the captions' inverse norms whatever ``normalize`` says (``tiles._caption_keep``),
    with the threshold rounded to float32.

    The hard-negative family's keywords (each absent: the plain op's kernels and results, bit for
    bit): ``mask_query`` (M, D), ``mask_key`` (N, D): the captions the threshold compares
    (detached; their cosine whatever ``normalize`` says), read only with
    ``false_negative_threshold``. ``query_groups`` (M,), ``key_groups`` (K,), K ≤ N: integer ids
    on the features' device, column k < K masked in row i when they agree (k ≠ offset + i); with
    ids alone no caption product is formed. ``group_mode`` (a
    :class:`~hnclip_kernels.group_mode.GroupMode`): "supcon"/"mil_nce" make those columns (and the
    row's own) positives of row i instead (``docs/hard_negatives.md#multi-positive-targets``; the ids
    required, no ``return_stats``; their logits from the host pass :mod:`..positives`). Raises
    ``ValueError``/``TypeError`` as :func:`hnclip_kernels.validation.check_directional`, then
    :func:`hnclip_kernels.validation_family.check_family_directional`, then
    :func:`..positives.check_positives` do."""
    check_directional(queries, keys, query_txt, key_txt, offset)
    check_family_directional(queries.shape[0], keys.shape[0], mask_query, mask_key, query_groups, key_groups)
    check_positives(group_mode, query_groups, return_stats)
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, queries)
    thr_t, masked = glue.threshold_args(false_negative_threshold, queries)
    cosine = masked and mask_query is not None
    empty = queries.new_empty((0,))
    ids = query_groups is not None and key_groups.shape[0] > 0
    no_id = torch.empty((0,), dtype=torch.long, device=queries.device)
    out = DirectionalPositivesOut._make(
        glue.call(
            HNClipDirectionalTriton,
            torch.ops.hnclip.triton_directional_nll,
            *(tamed(x, normalize) for x in (queries, keys, query_txt, key_txt)),
            tamed(mask_query.detach()) if cosine else empty,
            tamed(mask_key.detach()) if cosine else empty,
            query_groups if ids else no_id,
            key_groups if ids else no_id,
            tau,
            gamma_t,
            eps_t,
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
            group_mode.code,
        )
    )
    return (out.loss, out.stats(masked or ids)) if return_stats else out.loss


def hn_clip_pairs_triton(
    img,
    txt,
    *,
    negatives=None,
    group_ids=None,
    margin=Margin.TEXT,
    own_negatives=None,
    own_mask=None,
    tau,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    false_negative_threshold=None,
    precision=None,
    group_mode: GroupMode = GroupMode.MASK,
):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the fused single-process loss
    (``hnclip::triton_symmetric_nll``; composes as :func:`directional_nll_triton` does).

    ``img``, ``txt`` (N, D) float32, bfloat16 or float16 (16-bit stays 16-bit in the kernels). The
    hard-negative family (``docs/hard_negatives.md``): ``negatives`` (M, D) in the features' dtype
    (None: M = 0), i2t columns only; ``group_ids`` (N,) integer (None: no ids), pairs with equal
    ids masked in both directions; ``margin`` a :class:`hnclip_kernels.margin.Margin` (or its
    string). Without them it runs the plain loss's kernels. float32 result; gradients reach
    ``img``, ``txt``, ``negatives`` and ``tau`` (0-dim). ``return_stats``: also ``(i2t, t2i)``,
    the detached ``backends.softmax.RowStats`` of both directions (i2t's over the N + M columns).
    ``false_negative_threshold``: as :func:`directional_nll_triton` (off the diagonal super-tiles
    one caption tile masks Z_IJ and Z_JIᵀ alike: the mask is symmetric to the bit there).
    ``precision``: as :func:`directional_nll_triton`. The public checks are
    :func:`hnclip_kernels.validation_family`'s (``hn_clip_loss``). ``own_negatives`` (N, K, D)
    with ``own_mask`` (N, K) bool or None (all real): each i2t row's own extra columns, formed on
    the host in float32 (:mod:`hnclip_kernels.backends.own_negatives`), never with ``negatives``.
    ``group_mode`` (a :class:`~hnclip_kernels.group_mode.GroupMode`): "supcon"/"mil_nce" make the
    pairs with equal ``group_ids`` positives in both directions
    (``docs/hard_negatives.md#multi-positive-targets``; no ``return_stats``, no ``own_negatives``;
    their logits from the host pass :mod:`..positives`); raises ``ValueError`` as
    :func:`..positives.check_positives`."""
    check_positives(group_mode, group_ids, return_stats)
    if negatives is None:
        negatives = img.new_empty((0, img.shape[1]))
    if own_negatives is None:
        own_negatives = img.new_empty((0, 0, img.shape[1]))
    if own_mask is None:
        own_mask = torch.empty((0, 0), dtype=torch.bool, device=img.device)
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, img)
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    ids = group_ids if group_ids is not None else torch.empty((0,), dtype=torch.long, device=img.device)
    out = PairsOut._make(
        glue.call(
            HNClipTriton,
            torch.ops.hnclip.triton_symmetric_nll,
            *(tamed(x, normalize) for x in (img, txt, negatives)),
            own_negatives,
            own_mask,
            ids.contiguous(),
            tau,
            gamma_t,
            eps_t,
            thr_t,
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
            Margin.parse(margin).code,
            group_mode.code,
        )
    )
    kept = masked or group_ids is not None
    return (out.pairs, (out.i2t(kept), out.t2i(kept))) if return_stats else out.pairs


def rank_nll_triton(
    img,
    txt,
    all_img,
    all_txt,
    *,
    tau,
    offset,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    precision=None,
    false_negative_threshold=None,
):
    """A distributed rank's per-row losses ½(i2t_i + t2i_i), shape (M,), in one fused op
    (``hnclip::triton_rank_nll``; composes as :func:`directional_nll_triton` does).

    ``img``, ``txt`` (M, D): the rank's local features; ``all_img``, ``all_txt`` (N, D): the
    gathered batch, local row i's positive at column ``offset + i``. i2t row i: Z_ij =
    (v̂_i t̂_all,j + γ t̂_i t̂_all,j) / τ; t2i row i: (t̂_i v̂_all,j + γ t̂_i t̂_all,j) / τ (arXiv
    2608.18521, Eq. 2, the margins of the local captions against all captions): the same as
    two calls of :func:`directional_nll_triton` (``0.5 * (i2t + t2i)``), each value to the bit,
    with the margin's product formed once for both. ``return_stats``: also ``(i2t, t2i)``, the
    detached ``backends.softmax.RowStats`` of each direction. ``false_negative_threshold``: as
    :func:`directional_nll_triton` (one caption cosine masks the pair in both directions).
    Raises ``ValueError``/``TypeError`` as :func:`hnclip_kernels.validation.check_directional`
    does for either direction."""
    check_directional(img, all_txt, txt, all_txt, offset)
    check_directional(txt, all_img, txt, all_txt, offset)
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, img)
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    out = RankOut._make(
        glue.call(
            HNClipRankTriton,
            torch.ops.hnclip.triton_rank_nll,
            *(tamed(x, normalize) for x in (img, txt, all_img, all_txt)),
            tau,
            gamma_t,
            eps_t,
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
        )
    )
    return (out.rows, out.directions(masked)) if return_stats else out.rows
