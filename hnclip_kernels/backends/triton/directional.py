"""The directional operator's body: ``hnclip::triton_directional_nll`` (one direction of a rank:
M queries against N keys, row i's positive at column offset + i) and its backward (registered in
:mod:`.ops`), with their fake implementations.

The hard-negative family's masking (``docs/hard_negatives.md``) arrives as optional inputs, empty
when absent: mask captions (the threshold's cosine compares captions while ``margin="image_text"``
takes the margin from the images) and group ids (columns k < K whose id equals the row's are no
negatives). :func:`hnclip_kernels.backends.rank_losses` runs it twice per rank with the family:
i2t over the keys [all captions; all negatives] (the negatives carry no id), t2i over all images.
The same ``_fwd_kernel`` / ``_dscore_kernel`` either way: their family flags (CAPTIONS, GROUPS:
``family_tiles``) derive from these inputs being given, so without them the kernels compile as
before. Absent inputs: captions (0,) (given, they are 2-D), ids (0,) (K = 0: no column has an id).

A positive ``group_mode`` code (``docs/hard_negatives.md#multi-positive-targets``) makes the ids'
columns and the row's own its positives: the kernels run as under "mask" (their statistics over
the negatives), the host pass :mod:`..positives` adds the positives' statistics in the forward
and their shares in the backward (where the kernels' P is normalised over every class:
:func:`.outputs.positive_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import epilogue, softmax
from ..outputs import DirectionalOut, row_stats, schema
from ..positives import positive_bwd, positive_fwd
from .backward import directional_shares
from .forward import directional_stats
from .outputs import DirectionalPositivesOut, Grads, positive_rows, smoothing_shifts
from .params import Family, scalars, threshold_block


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


def _directional_nll(
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
    group_mode: int = 0,
) -> schema(DirectionalPositivesOut):
    """Per-row losses (M,) of one direction and what the backward needs (``DirectionalPositivesOut``;
    ``kept`` (0,) without a threshold or ids; ``positives`` (4, M) under a positive ``group_mode``
    code, else (0,))."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    family, _ = _family_inputs(mask_query, mask_key, query_groups, key_groups, masked)
    thr = _threshold(threshold, a, b, norms[2:], family, normalize) if masked else None
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision, thr, family)
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, sc.inv_tau)
    stats = directional_stats((q, k, a, b), norms, pos, sc, offset)
    eps = label_smoothing if smoothing else 0.0
    if group_mode == 0:
        loss = softmax.row_losses(stats, k.shape[0], eps)
        return (*DirectionalOut.of(loss, norms, stats), pos.new_empty((0,)))
    q_hat, k_hat = epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1])
    extra = positive_fwd(q_hat, k_hat, pos, sc.inv_tau, offset, query_groups, key_groups)
    loss = softmax.positive_losses(stats, extra, group_mode, eps)
    return (*DirectionalOut.of(loss, norms, stats), extra)


def _directional_nll_fake(
    q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, offset, normalize, masked, *rest, group_mode=0
):
    positives = (rest[-1] if len(rest) == 4 else group_mode) != 0  # the flag given by position or by name
    return DirectionalPositivesOut.fake(q, k, masked or kg.shape[0] > 0, positives)


def _directional_nll_backward(
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
    positives: Tensor,
    offset: int,
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    group_mode: int,
    need_qk: bool,
) -> Grads:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    family, ids = _family_inputs(mask_query, mask_key, query_groups, key_groups, masked)
    stats = row_stats(pos, delta, mean_neg, dsum, kept, masked or ids)
    thr = _threshold(threshold, a, b, (ra, rb), family, normalize) if masked and need_qk else None
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision, thr, family)
    eps = label_smoothing if smoothing else 0.0
    g = grad.float().contiguous()
    kernel_rows, shifts = stats, smoothing_shifts(sc, eps, stats, stats)
    shifts = None if shifts is None else shifts[:1]
    if group_mode != 0:  # the negatives' P over all the row's classes
        kernel_rows, shift, factors = positive_rows(stats, positives, eps, smoothing)
        shifts = None if shift is None else (shift,)
    if need_qk:
        d_q, d_k = directional_shares((q, k, a, b), (rq, rk, ra, rb), kernel_rows, g, sc, offset, shifts)
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q, d_k = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k))
    dz_z = None
    if group_mode != 0:  # the positives' shares and Σ dS·d (the host pass)
        q_hat, k_hat = epilogue.scaled(q, rq), epilogue.scaled(k, rk)
        d_q_pos, d_k_pos, dz_d = positive_bwd(
            q_hat, k_hat, pos, sc.inv_tau, offset, query_groups, key_groups, factors, g, label_smoothing, group_mode
        )
        del q_hat, k_hat
        if need_qk:
            d_q.add_(d_q_pos)
            d_k.add_(d_k_pos)
        dz_z = softmax.positive_dz_z(stats, factors, g, dz_d)
    d_q_in, d_k_in, dz_z = softmax.finish_directional(
        stats, g, q, k, rq, rk, d_q, d_k, offset, sc.inv_tau, eps, normalize, dz_z
    )
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _directional_grads_fake(grad, q, k, a, b, mq, mk, qg, kg, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)
