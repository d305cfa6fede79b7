"""The hard-negative family on the C++ kernels: ``hnclip::cpp_family_directional_nll``.

The directional operator of :mod:`.ops` with the family's masking inputs (``docs/hard_negatives.md``):
mask captions (the threshold's cosine compares captions while ``margin="image_text"`` takes the
margin from the images) and group ids (columns k < K whose id equals the row's are no negatives).
:func:`hnclip_kernels.backends.family_losses` runs it twice on backend="cpp": i2t over the keys
[t; n] (the N captions, then the M negatives, which carry no id), t2i over the N images. A
separate operator, so ``hnclip::cpp_directional_nll`` (the distributed loss's) keeps its schema
and its code path: without these inputs nothing changes. Same kernels, same fused guarantees:
O((N + M)·D) extra memory, saturation-safe rows, autograd, fakes, vmap, ``torch.compile``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from ...numerics import compute_dtype
from ...validation import check_directional
from ...validation_family import check_family_directional
from .. import glue
from ..outputs import CppDirectionalOut, schema
from . import flops
from .ops import directional_backward, directional_forward
from .raw import FamilyMasks


def _family_nll(
    q: Tensor,
    k: Tensor,
    a: Tensor,
    b: Tensor,
    mask_query: Tensor,
    mask_key: Tensor,
    query_groups: Tensor,
    key_groups: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    offset: int,
    normalize: bool,
    masked: bool,
    need_grad: bool,
) -> schema(CppDirectionalOut):
    """``hnclip::cpp_directional_nll``'s outputs with the family's masking (``masked``: a threshold
    or group ids; with ids alone the threshold is +inf, no cosine test)."""
    family = FamilyMasks(mask_query, mask_key, query_groups, key_groups)
    return directional_forward(
        q, k, a, b, tau, gamma, label_smoothing, threshold, offset, normalize, masked, need_grad, family=family
    )


def _family_nll_fake(q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, offset, normalize, masked, need_grad):
    return CppDirectionalOut.fake(q, k, masked, need_grad, compute_dtype(q.dtype))


def _family_nll_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    a: Tensor,
    b: Tensor,
    mask_query: Tensor,
    mask_key: Tensor,
    query_groups: Tensor,
    key_groups: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    rq: Tensor,
    rk: Tensor,
    ra: Tensor,
    rb: Tensor,
    pos: Tensor,
    delta: Tensor,
    mean_neg: Tensor,
    dsum: Tensor,
    kept: Tensor,
    row_acc: Tensor,
    col_acc: Tensor,
    offset: int,
    normalize: bool,
    masked: bool,
    need_grad: bool,
    need_qk: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    family = FamilyMasks(mask_query, mask_key, query_groups, key_groups)
    stats = (rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept, row_acc, col_acc)
    return directional_backward(
        grad, q, k, a, b, tau, gamma, label_smoothing, threshold, *stats, offset, normalize, masked, need_qk,
        family=family,
    )  # fmt: skip


def _family_grads_fake(grad, q, k, a, b, mq, mk, qg, kg, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


_FamilyNLL = glue.fused_op(
    "cpp",
    "cpp_family_directional_nll",
    forward=_family_nll,
    forward_fake=_family_nll_fake,
    backward=_family_nll_backward,
    backward_fake=_family_grads_fake,
    tau_input=8,
    device_types="cpu",
)
flops.register_family()


def family_directional_nll_cpp(
    queries,
    keys,
    *,
    query_txt,
    key_txt,
    tau,
    offset,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    false_negative_threshold=None,
    mask_query=None,
    mask_key=None,
    query_groups=None,
    key_groups=None,
):
    """C++ counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`
    with its family keywords (same protocol and result; see :func:`.ops.directional_nll_cpp`).

    ``mask_query`` (M, D), ``mask_key`` (N, D): the captions the threshold compares (detached;
    their cosine whatever ``normalize`` says), read only with ``false_negative_threshold``.
    ``query_groups`` (M,), ``key_groups`` (K,), K ≤ N: integer ids (any integer dtype, CPU),
    column k < K masked in row i when they agree (k ≠ offset + i). Without them it is the
    directional op's call on this operator (the same kernels and results).
    """
    check_directional(queries, keys, query_txt, key_txt, offset)
    m, n = queries.shape[0], keys.shape[0]
    check_family_directional(m, n, mask_query, mask_key, query_groups, key_groups)
    need_grad = torch.is_grad_enabled() and bool(queries.requires_grad or keys.requires_grad)
    ids = query_groups is not None
    # masking by ids alone: threshold +inf (no cosine reaches it), the kernels form no caption tile
    threshold = false_negative_threshold if false_negative_threshold is not None else (math.inf if ids else None)
    thr_t, masked = glue.threshold_args(threshold, queries)
    empty = queries.new_empty((0,))
    cosine = false_negative_threshold is not None and mask_query is not None
    no_id = torch.empty((0,), dtype=torch.long, device=queries.device)
    out = CppDirectionalOut._make(
        glue.call(
            _FamilyNLL,
            torch.ops.hnclip.cpp_family_directional_nll,
            queries,
            keys,
            query_txt,
            key_txt,
            mask_query.detach() if cosine else empty,
            mask_key.detach() if cosine else empty,
            query_groups.to(torch.long) if ids else no_id,
            key_groups.to(torch.long) if ids else no_id,
            tau,
            glue.hyperparameter(gamma, queries),
            glue.hyperparameter(label_smoothing, queries),
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            need_grad,
        )
    )
    return (out.loss, out.stats(masked)) if return_stats else out.loss
