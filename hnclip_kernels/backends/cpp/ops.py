"""Fused HN-CLIP loss on CPU: the C++ kernels of ``csrc/`` and their autograd.

The backend's two operators wrap the raw C++ kernels (:mod:`.raw`: what they compute, their
argument conventions and fakes), together with the O(N·D) algebra of :mod:`..epilogue`:
``hnclip::cpp_symmetric_nll`` (:mod:`.symmetric`, what ``hn_clip_loss(backend="cpp")`` runs) and
``hnclip::cpp_directional_nll`` (:mod:`.directional`, what the distributed loss runs per rank),
the hard-negative family's inputs optional in both. Each has a ``*_backward`` operator,
registered with their autograd formulas, fakes and vmap rules by :func:`..glue.fused_op` (the
same glue as the Triton backend's ``hnclip::triton_*``). This module holds their public entries
and registers their FLOP formulas (and those of the sigmoid loss's ``hnclip::cpp_sigmoid_nll``,
whose body and public entry ``sigmoid_pairs_cpp`` are in :mod:`.sigmoid_pairs`). Being
registered operators they compose with ``torch.compile(fullgraph=True)`` (no graph break) and
``torch.autograd.gradcheck``.
γ and ε reach the operators as 0-dim float64 tensors, not ``float`` arguments, so a γ
schedule under ``torch.compile`` reuses one graph instead of recompiling per value.
The ``*_backward`` operators' own autograd formula raises: a second derivative through
this backend is one clear error naming backend="torch" (:mod:`hnclip_kernels.backends.first_order`).

``torch.func``: the wrappers :func:`directional_nll_cpp` and :func:`hn_clip_pairs_cpp` (and so
``hn_clip_loss``) work under ``grad``, ``grad_and_value``, ``vjp``, ``jacrev`` and ``vmap``,
nested too (``vmap(grad(...))``, per-example gradients), with the eager results; under
``vmap`` the kernels run once per batch entry (a loop). The operators called directly
(``torch.ops.hnclip.cpp_*``) support autograd and ``vmap`` but not ``torch.func.grad``: the
autograd.Function that ``torch.library.register_autograd`` builds has no ``setup_context``,
which functorch requires (pytorch/pytorch#168393). Forward mode (``jvp``, ``jacfwd``,
``hessian``) raises a clear error.

Importing this module raises ImportError when the extension was not built (:mod:`.raw`);
:mod:`hnclip_kernels.backends` treats that as "C++ backend unavailable".
"""

from __future__ import annotations

import math

import torch

from ...group_mode import GroupMode
from ...margin import Margin
from ...validation import check_directional
from ...validation_family import check_family_directional
from .. import glue
from ..outputs import CppDirectionalOut, FamilyOut
from ..positives import check_positives
from . import flops
from .directional import DirectionalNLL
from .sigmoid_pairs import sigmoid_pairs_cpp  # noqa: F401  (registers hnclip::cpp_sigmoid_nll; its public entry)
from .symmetric import SymmetricNLL

flops.register()  # FlopCounterMode's formulas of the operators and the raw kernels


# ---- public entries
def directional_nll_cpp(
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
    group_mode: GroupMode = GroupMode.MASK,
):
    """C++ counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch` (same
    keyword-only protocol and result).

    Per-row losses (M,) of query rows ``queries`` (M, D) against key rows ``keys`` (N, D), the
    positive of row i at column ``offset + i``; margin factors ``query_txt`` (M, D), ``key_txt``
    (N, D) are stop-gradient. float32 result (float64 for float64 inputs); gradients reach
    ``queries``, ``keys`` and ``tau`` (a 0-dim tensor). ``return_stats``: also the detached
    ``backends.softmax.RowStats`` the backward uses. ``gamma`` and ``label_smoothing``: Python floats
    (or 0-dim tensors, which get no gradient); under ``torch.compile`` a new value does not
    recompile. Works under ``torch.func.grad``/``vjp``/``vmap`` (vmap: one kernel call per batch
    entry); second derivatives raise the ``RuntimeError`` naming backend="torch".
    ``false_negative_threshold``: as the reference's (the kernels compare the cosine of the
    normalised captions' product â_i·b̂_k as BLAS forms it on each tile, in the compute dtype).

    The hard-negative family's keywords (``docs/hard_negatives.md``; all None: the plain call):
    ``mask_query`` (M, D), ``mask_key`` (N, D): the captions the threshold compares (detached;
    their cosine whatever ``normalize`` says), read only with ``false_negative_threshold``.
    ``query_groups`` (M,), ``key_groups`` (K,), K ≤ N: integer ids (any integer dtype, CPU),
    column k < K masked in row i when they agree (k ≠ offset + i). ``group_mode`` (a
    :class:`~hnclip_kernels.group_mode.GroupMode`): "supcon"/"mil_nce" make those columns positives
    of row i instead (``docs/hard_negatives.md#multi-positive-targets``; the ids required, no
    ``return_stats``).

    Raises:
        ValueError: shapes that do not fit (``check_directional``, ``check_family_directional``);
        a positive ``group_mode`` without ids or with ``return_stats``.
    """
    check_directional(queries, keys, query_txt, key_txt, offset)
    check_family_directional(queries.shape[0], keys.shape[0], mask_query, mask_key, query_groups, key_groups)
    check_positives(group_mode, query_groups, return_stats)
    # the forward also produces the gradient shares only when a backward can follow (not under a positive
    # group_mode: the shares' P would be normalised over the negatives alone)
    need_grad = torch.is_grad_enabled() and bool(queries.requires_grad or keys.requires_grad)
    need_grad = need_grad and not group_mode.positives
    ids = query_groups is not None
    thr_t, masked = glue.threshold_args(_threshold(false_negative_threshold, ids), queries)
    empty = queries.new_empty((0,))
    cosine = false_negative_threshold is not None and mask_query is not None
    out = CppDirectionalOut._make(
        glue.call(
            DirectionalNLL,
            torch.ops.hnclip.cpp_directional_nll,
            queries,
            keys,
            query_txt,
            key_txt,
            mask_query.detach() if cosine else empty,
            mask_key.detach() if cosine else empty,
            _ids(query_groups, queries),
            _ids(key_groups, queries),
            tau,
            glue.hyperparameter(gamma, queries),
            glue.hyperparameter(label_smoothing, queries),
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            need_grad,
            group_mode.code,
        )
    )
    return (out.loss, out.stats(masked)) if return_stats else out.loss


def hn_clip_pairs_cpp(
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
    group_mode: GroupMode = GroupMode.MASK,
):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the single-process loss in one operator.

    ``img``, ``txt`` (N, D). Each logit tile is computed once for both directions (its rows are
    i2t's, its columns t2i's): one product in the forward, three in the backward, against six
    for two :func:`directional_nll_cpp` calls. float32 result (float64 for float64 inputs);
    gradients reach ``img``, ``txt``, ``negatives`` and ``tau`` (a 0-dim tensor).
    ``return_stats``: also ``(i2t, t2i)``, the detached ``backends.softmax.RowStats`` of both directions
    (i2t's over the N + M columns). ``gamma``, ``label_smoothing``,
    ``false_negative_threshold``, ``torch.compile`` and ``torch.func``: as
    :func:`directional_nll_cpp` (the caption tile t̂_I t̂_Jᵀ is formed beside each logit tile).

    The hard-negative family (``docs/hard_negatives.md``; the defaults: today's loss):
    ``negatives`` (M, D), the i2t rows' extra caption columns; ``group_ids`` (N,) integer, pairs
    with equal ids masked in both directions, or with a positive ``group_mode`` (a
    :class:`~hnclip_kernels.group_mode.GroupMode`) positives in both directions
    (``docs/hard_negatives.md#multi-positive-targets``; no ``return_stats``); ``margin`` a
    :class:`~hnclip_kernels.margin.Margin` (or its value); ``own_negatives`` (N, K, D) with
    ``own_mask`` (N, K) bool or None (all real): each i2t row's own extra columns
    (:mod:`hnclip_kernels.backends.own_negatives`), never with ``negatives``.
    """
    check_positives(group_mode, group_ids, return_stats)
    if negatives is None:
        negatives = img.new_empty((0, img.shape[1]))
    if own_negatives is None:
        own_negatives = img.new_empty((0, 0, img.shape[1]))
    if own_mask is None:
        own_mask = torch.empty((0, 0), dtype=torch.bool, device=img.device)
    # the forward also keeps the negative block's shares only when a backward can follow (not under a
    # positive group_mode: their P would be normalised over the negatives alone)
    need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (img, txt, negatives, own_negatives))
    need_grad = need_grad and not group_mode.positives
    ids = group_ids is not None
    thr_t, masked = glue.threshold_args(_threshold(false_negative_threshold, ids), img)
    out = FamilyOut._make(
        glue.call(
            SymmetricNLL,
            torch.ops.hnclip.cpp_symmetric_nll,
            img,
            txt,
            negatives,
            own_negatives,
            own_mask,
            _ids(group_ids, img),
            tau,
            glue.hyperparameter(gamma, img),
            glue.hyperparameter(label_smoothing, img),
            thr_t,
            bool(normalize),
            masked,
            Margin(margin).code,
            need_grad,
            group_mode.code,
        )
    )
    return (out.pairs, (out.i2t(masked), out.t2i(masked))) if return_stats else out.pairs


def _threshold(false_negative_threshold, ids: bool):
    """The operators' threshold: masking by ids alone is a threshold of +inf (no cosine reaches
    it; the kernels form no caption tile)."""
    if false_negative_threshold is not None:
        return false_negative_threshold
    return math.inf if ids else None


def _ids(groups, like):
    """Group ids as the operators take them: int64, or an empty int64 tensor when absent."""
    if groups is None:
        return torch.empty((0,), dtype=torch.long, device=like.device)
    return groups.to(torch.long)
