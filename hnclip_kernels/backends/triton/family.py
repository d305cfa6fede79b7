"""The hard-negative family on the Triton kernels: ``hnclip::triton_family_directional_nll``.

The directional operator (``hnclip::triton_directional_nll``, :mod:`.distributed_ops`) with the
family's masking inputs (``docs/hard_negatives.md``), as the C++ backend's
``hnclip::cpp_family_directional_nll``: mask captions (the threshold's cosine compares captions
while ``margin="image_text"`` takes the margin from the images) and group ids (columns k < K whose
id equals the row's are no negatives). :func:`hnclip_kernels.backends.rank_family_losses` runs it
twice per rank on backend="triton": i2t over the keys [all captions; all negatives] (the negatives
carry no id), t2i over all images (one process: :mod:`.family_sym`). A separate operator, so today's directional operator keeps its
schema and its kernels: the same ``_fwd_kernel`` / ``_dscore_kernel``, whose family flags
(CAPTIONS, GROUPS: ``family_tiles``) derive from these inputs being given.

Signature: today's with ``mask_query, mask_key, query_groups, key_groups`` after the margin
factors. ``masked``: a threshold is given (as on today's operator). Absent inputs are empty:
captions (0,) (given, they are 2-D), ids (0,) for the columns (K = 0: no column has an id).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...validation import check_directional
from ...validation_family import check_family_directional
from .. import epilogue, glue
from ..outputs import DirectionalOut, row_stats, schema
from . import flops
from .backward import directional_shares
from .forward import directional_stats
from .launch import USE_TRITON_OP
from .outputs import Grads, smoothing_shifts
from .params import Family, scalar_args, scalars, tamed, threshold_block


def _family_inputs(mask_query: Tensor, mask_key: Tensor, query_groups: Tensor, key_groups: Tensor, masked: bool):
    """(:class:`.params.Family` of the kernels, group ids given). The captions are read only with a
    threshold (contiguous: the kernels step them by D); ids in one integer dtype."""
    captions = (mask_query.contiguous(), mask_key.contiguous()) if masked and mask_query.dim() == 2 else None
    ids = key_groups.shape[0] > 0
    groups = None
    if ids:
        same = query_groups.dtype == key_groups.dtype
        groups = (query_groups, key_groups) if same else (query_groups.long(), key_groups.long())
        groups = tuple(x.contiguous() for x in groups)
    return Family(captions, groups), ids


def _threshold(threshold, a, b, norms, family: Family, normalize: bool):
    """The masking block: the captions' cosine of the margin factors (ρ their norms), or of the
    mask captions (their own inverse norms: :func:`.params.threshold_block` with normalize off)."""
    if family.captions is None:
        return threshold_block(threshold, (a, b), norms, normalize)
    return threshold_block(threshold, family.captions, (None, None), False)


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
    has_margin: bool,
    smoothing: bool,
    precision: str,
) -> schema(DirectionalOut):
    """``hnclip::triton_directional_nll``'s outputs with the family's masking (``kept`` with a
    threshold or ids)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    family, _ = _family_inputs(mask_query, mask_key, query_groups, key_groups, masked)
    thr = _threshold(threshold, a, b, norms[2:], family, normalize) if masked else None
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision, thr, family)
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, sc.inv_tau)
    stats = directional_stats((q, k, a, b), norms, pos, sc, offset)
    loss = epilogue.row_losses(stats, k.shape[0], label_smoothing if smoothing else 0.0)
    return DirectionalOut.of(loss, norms, stats)


def _family_nll_fake(q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, offset, normalize, masked, *rest):
    return DirectionalOut.fake(q, k, masked or kg.shape[0] > 0, torch.float32)


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
    offset: int,
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    need_qk: bool,
) -> Grads:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    family, ids = _family_inputs(mask_query, mask_key, query_groups, key_groups, masked)
    stats = row_stats(pos, delta, mean_neg, dsum, kept, masked or ids)
    thr = _threshold(threshold, a, b, (ra, rb), family, normalize) if masked and need_qk else None
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision, thr, family)
    eps = label_smoothing if smoothing else 0.0
    g = grad.float().contiguous()
    if need_qk:
        shifts = smoothing_shifts(sc, eps, stats, stats)
        d_q, d_k = directional_shares(
            (q, k, a, b), (rq, rk, ra, rb), stats, g, sc, offset, None if shifts is None else shifts[:1]
        )
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q, d_k = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k))
    d_q_in, d_k_in, dz_z = epilogue.finish_directional(
        stats, g, q, k, rq, rk, d_q, d_k, offset, sc.inv_tau, eps, normalize
    )
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _family_grads_fake(grad, q, k, a, b, mq, mk, qg, kg, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


HNClipFamilyTriton = glue.fused_op(
    "triton",
    "triton_family_directional_nll",
    forward=_family_nll,
    forward_fake=_family_nll_fake,
    backward=_family_nll_backward,
    backward_fake=_family_grads_fake,
    tau_input=8,
    use_triton_op=USE_TRITON_OP,
)
flops.register_family()


def family_directional_nll_triton(
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
    precision=None,
    false_negative_threshold=None,
    mask_query=None,
    mask_key=None,
    query_groups=None,
    key_groups=None,
):
    """Triton counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`
    with its family keywords (same protocol and result; see :func:`.ops.directional_nll_triton`).

    ``mask_query`` (M, D), ``mask_key`` (N, D): the captions the threshold compares (detached;
    their cosine whatever ``normalize`` says), read only with ``false_negative_threshold``.
    ``query_groups`` (M,), ``key_groups`` (K,), K ≤ N: integer ids on the features' device, column
    k < K masked in row i when they agree (k ≠ offset + i). With ids alone no caption product is
    formed. Without family inputs it is :func:`.ops.directional_nll_triton`'s call on this operator
    (the same kernels and results, bit for bit). Raises ``ValueError`` as
    :func:`hnclip_kernels.validation_family.check_family_directional` does."""
    check_directional(queries, keys, query_txt, key_txt, offset)
    check_family_directional(queries.shape[0], keys.shape[0], mask_query, mask_key, query_groups, key_groups)
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, queries)
    thr_t, masked = glue.threshold_args(false_negative_threshold, queries)
    cosine = masked and mask_query is not None
    empty = queries.new_empty((0,))
    ids = query_groups is not None and key_groups.shape[0] > 0
    no_id = torch.empty((0,), dtype=torch.long, device=queries.device)
    out = DirectionalOut._make(
        glue.call(
            HNClipFamilyTriton,
            torch.ops.hnclip.triton_family_directional_nll,
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
        )
    )
    return (out.loss, out.stats(masked or ids)) if return_stats else out.loss
