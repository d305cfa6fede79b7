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
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import epilogue, softmax
from ..outputs import DirectionalOut, row_stats, schema
from .backward import directional_shares
from .forward import directional_stats
from .outputs import Grads, smoothing_shifts
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
) -> schema(DirectionalOut):
    """Per-row losses (M,) of one direction and what the backward needs (``DirectionalOut``;
    ``kept`` (0,) without a threshold or ids)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    family, _ = _family_inputs(mask_query, mask_key, query_groups, key_groups, masked)
    thr = _threshold(threshold, a, b, norms[2:], family, normalize) if masked else None
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision, thr, family)
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, sc.inv_tau)
    stats = directional_stats((q, k, a, b), norms, pos, sc, offset)
    loss = softmax.row_losses(stats, k.shape[0], label_smoothing if smoothing else 0.0)
    return DirectionalOut.of(loss, norms, stats)


def _directional_nll_fake(q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, offset, normalize, masked, *rest):
    return DirectionalOut.fake(q, k, masked or kg.shape[0] > 0, torch.float32)


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
    d_q_in, d_k_in, dz_z = softmax.finish_directional(
        stats, g, q, k, rq, rk, d_q, d_k, offset, sc.inv_tau, eps, normalize
    )
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _directional_grads_fake(grad, q, k, a, b, mq, mk, qg, kg, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)
