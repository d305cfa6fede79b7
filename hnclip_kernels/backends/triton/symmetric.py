"""The single-process loss's operator body: ``hnclip::triton_symmetric_nll`` and its backward
(registered in :mod:`.ops`), with their fake implementations.

One walk over the tile pairs of the N×N logits gives both directions' statistics
(``_fwd_pair_kernel`` / ``_dscore_pair_kernel``). The hard-negative family (``docs/hard_negatives.md``)
arrives as optional inputs, empty when absent: group ids (N,) are the pair kernels' GROUPS; M
negative captions (M, D) add one directional walk over the N×M block for the i2t rows only
(``_fwd_kernel`` / ``_dscore_kernel`` with no positive in it: offset M), whose row partials are
merged with the pair walk's i2t summaries in one ``_merge_kernel`` launch, so the i2t statistics
cover all N + M columns; the backward runs both walks with those statistics. Without negatives,
ids and with ``margin="text"`` the body runs the plain loss's kernels and launches, no more.

A positive ``group_mode`` code (``docs/hard_negatives.md#multi-positive-targets``) makes the ids'
pairs positives in both directions: the walks run as under "mask" (their statistics over each row's
negatives), the host pass :mod:`..positives` adds each direction's positives, their statistics in
the forward and their shares in the backward, where the kernels' P is normalised over all of a
row's classes (:func:`.outputs.positive_rows`).

The margin's kind (:class:`hnclip_kernels.margin.Margin`, by its code): where
:func:`~hnclip_kernels.margin.margin_operands` gives the logit's own operands (``"image_text"``),
γ·sg(v̂_i·x̂) makes Z_ix = (1 + γ)·v̂_i·x̂/τ off the positive: the kernels scale by (1 + γ)/τ and form
no margin tile (``params.Scalars.logit_scale``; the positive, from the host, and the gradients keep
1/τ: the margin carries no gradient). The threshold always compares captions (t̂_i·x̂: the pair
kernels' caption tile, and t against n in the block).

Products executed (P = one N×N×D or N×M×D product; ``FlopCounterMode`` states the useful ones,
:mod:`.flops`): the N×N part is the plain loss's to the multiply-add; the block costs (1 + g) P
forward and (1 + g) P + 2 P of GEMMs backward, g = 1 for a margin tile or a threshold (t̂·n̂),
else 0. 16-bit features stay 16-bit (the kernels' own rounding-compensated backward). Workspace:
:func:`.workspace.family_forward_bytes`, and each row's own negatives' :func:`.workspace_host.own_bytes`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...margin import Margin, margin_operands
from .. import epilogue, own_negatives, softmax
from ..outputs import FamilyPairsOut, kept_output, schema
from ..positives import positive_bwd, positive_fwd
from .backward import directional_shares, symmetric_shares
from .forward import directional_partials, symmetric_stats, symmetric_summaries
from .merge import merge_stats
from .outputs import PairsOut, positive_rows, smoothing_shifts
from .params import Family, Scalars, scalars, threshold_block


class _Setup(NamedTuple):
    """What the forward and the backward form alike: the pair walk's scalars, the block's (None:
    M = 0), the block's operands (the negatives' rows, the margin factors the block reads) and
    whether the loss masks (a threshold or ids)."""

    pair: Scalars
    block: Optional[Scalars]
    block_ops: Tuple[Tensor, ...]
    masked: bool


def _setup(features, norms, group_ids, hyper, flags, margin: Margin, need_thr: bool = True) -> _Setup:
    """The scalars of both walks. ``features`` = (img, txt, negatives), ``norms`` their inverse
    norms, ``hyper`` = (τ, γ, threshold), ``flags`` = (normalize, masked, has_margin, smoothing,
    precision). The margin's operands (:func:`margin_operands`): the pair walk's margin tile is the
    captions' G = t tᵀ, unless they are the logit's own (a scale, ``own_score``); the block's
    kernels read the captions' factors (t, n) for the margin or the threshold. The threshold blocks
    compare captions (t against t, t against n); the ids go to the pairs, and against no column id
    to the block (K = 0: its masking is on, so its kept counts merge with the pairs')."""
    img, txt, neg = features
    rv, rt, rn = norms
    tau, gamma, threshold = hyper
    normalize, masked, has_margin, smoothing, precision = flags
    a, b, mask_a, _ = margin_operands(margin, img, txt, txt, txt)
    own_score = mask_a is not None and a is img and b is txt
    base = scalars(img, tau, gamma, has_margin, smoothing, precision, own_score=own_score)
    ids = group_ids if group_ids.shape[0] > 0 else None
    thr = threshold_block(threshold, (txt, txt), (rt, rt), normalize) if masked and need_thr else None
    pair = base._replace(thr=thr, family=Family(None, None if ids is None else (ids, ids)))
    block, block_ops = None, ()
    if neg.shape[0] > 0:
        a, b, mask_a, mask_b = margin_operands(margin, img, neg, txt, neg)
        factors = (a, b) if mask_a is None else (mask_a, mask_b)  # the captions t, n either way
        thr_b = threshold_block(threshold, (txt, neg), (rt, rn), normalize) if masked and need_thr else None
        block = base._replace(thr=thr_b, family=Family(None, None if ids is None else (ids, ids[:0])))
        block_ops = ((img, neg, *factors), (rv, rn, rt, rn))
    return _Setup(pair, block, block_ops, masked or ids is not None)


def _own_block(img, txt, own, own_mask, norms, pos, s: _Setup, gamma, threshold, normalize: bool, margin: int):
    """Each row's own columns (:mod:`..own_negatives`), in float32 on the host: the margin's
    query factor t̂ or v̂, the threshold (with one) against the unit captions."""
    v_hat = epilogue.scaled(img, norms[0])
    a_hat = v_hat if Margin.from_code(margin) is Margin.IMAGE_TEXT else epilogue.scaled(txt, norms[1])
    thr = None if s.pair.thr is None else threshold
    unit = None if thr is None else epilogue.scaled(txt, epilogue.inv_norms(txt, True))
    block = own_negatives.block(v_hat, a_hat, own, own_mask, pos, s.pair.inv_tau, gamma, normalize, thr, unit)
    return block, v_hat


def _own_forward(i2t, n_keys, inputs, norms, pos, s: _Setup, hyper, normalize: bool, margin: int):
    """The kernels' i2t statistics merged with each row's own columns, and the rows' classes:
    ``inputs`` = (img, txt, own, own_mask), ``hyper`` = (γ, threshold). Every O(N·K·D) buffer of
    the block lives and dies here (:func:`.workspace_host.own_bytes` counts them)."""
    block, _ = _own_block(*inputs, norms, pos, s, *hyper, normalize, margin)
    i2t = own_negatives.merge(i2t, block)
    return i2t, own_negatives.classes(i2t, n_keys, block)


def _own_backward(d_v, rows, inputs, norms, pos, s: _Setup, hyper, normalize: bool, margin: int):
    """(dL/down (N, K, D) in its dtype, the rows' own kept counts or None under masking); adds the
    own columns' share into ``d_v`` (None: only τ wants a gradient, dL/down is zeros). ``rows`` =
    (merged i2t statistics, g, ε, the shared keys N + M, the kernels' shifted smoothing, the
    positive modes' ε/|C(i)| or None: :func:`..own_negatives.grads`)."""
    i2t, g, eps, n_keys, shifted, shift = rows
    img, txt, own, _ = inputs
    block, v_hat = _own_block(*inputs, norms, pos, s, *hyper, normalize, margin)
    counts = None if s.masked else block.keep.sum(dim=1)
    if d_v is None:
        return torch.zeros_like(own), counts
    d_v_own, d_n_own = own_negatives.grads(i2t, g, block, v_hat, eps, n_keys, shifted, shift)
    d_v.add_(d_v_own)
    del block, v_hat, d_v_own  # n̂ (N, K, D) freed before the normalisation's temporaries
    return own_negatives.unnormalize(own, d_n_own, s.pair.inv_tau, normalize), counts


def _symmetric_nll(
    img: Tensor,
    txt: Tensor,
    negatives: Tensor,
    own: Tensor,
    own_mask: Tensor,
    group_ids: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    margin: int,
    group_mode: int = 0,
) -> schema(PairsOut):
    """Per-pair losses ½(i2t_k + t2i_k) (N,), i2t over the N + M columns, and what the backward
    needs (``PairsOut``; ``rn`` (M,), ``kept`` (0,) without a threshold or ids, the positives'
    statistics (4, N) each under a positive ``group_mode`` code, else (0,))."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (img, txt, negatives))
    flags = (normalize, masked, has_margin, smoothing, precision)
    s = _setup((img, txt, negatives), norms, group_ids, (tau, gamma, threshold), flags, Margin.from_code(margin))
    (n, _), m = img.shape, negatives.shape[0]
    pos = epilogue.positive_logits(epilogue.scaled(img, norms[0]), epilogue.scaled(txt, norms[1]), 0, s.pair.inv_tau)
    if m == 0:  # the walk's summaries merged, each direction's lines
        i2t, t2i = symmetric_stats((img, txt), norms[:2], pos, s.pair)
    else:  # the block's partials of the same rows (no positive among its M columns), after the walk's summaries
        acc = symmetric_summaries((img, txt), norms[:2], pos, s.pair)
        t2i = softmax.RowStats(pos, *merge_stats(acc, smoothing, 0, n, s.masked))
        block = directional_partials(*s.block_ops, pos, s.block, offset=m)
        rows = torch.empty((1 + block.shape[0], *block.shape[1:]), device=img.device, dtype=torch.float32)
        rows[0].copy_(acc[0, :, n:])
        rows[1:].copy_(block)
        del acc, block
        i2t = softmax.RowStats(pos, *merge_stats(rows, smoothing, masked=s.masked))
    eps = label_smoothing if smoothing else 0.0
    n_keys = n + m
    if own_negatives.present(own):  # merged into the i2t statistics (the negatives' L_K), which the backward reads
        i2t, n_keys = _own_forward(i2t, n_keys, (img, txt, own, own_mask), norms, pos, s, (gamma, threshold),
                                   normalize, margin)  # fmt: skip
    if group_mode != 0:  # positives: their statistics beside the (merged) negatives'
        return _positive_pairs(img, txt, norms, pos, s, (i2t, t2i), eps, group_mode)
    pairs = 0.5 * (softmax.row_losses(i2t, n_keys, eps) + softmax.row_losses(t2i, n, eps))
    no_extra = (pos.new_empty((0,)), pos.new_empty((0,)))  # two tensors: an operator's outputs may not alias
    return PairsOut(pairs, *norms, pos, *i2t[1:4], kept_output(i2t), *t2i[1:4], kept_output(t2i), *no_extra)


def _positive_pairs(img, txt, norms, pos, s: _Setup, stats, eps, group_mode: int) -> PairsOut:
    """The forward's pairs under a positive ``group_mode`` code: each direction's other positives'
    statistics from the host pass (:mod:`..positives`) beside the walk's over the negatives, the rows
    from both (:func:`..softmax.positive_losses`)."""
    i2t, t2i = stats
    ids = s.pair.family.pair_ids()
    v_hat, t_hat = epilogue.scaled(img, norms[0]), epilogue.scaled(txt, norms[1])
    extra_i2t = positive_fwd(v_hat, t_hat, pos, s.pair.inv_tau, 0, ids, ids)
    extra_t2i = positive_fwd(t_hat, v_hat, pos, s.pair.inv_tau, 0, ids, ids)
    rows = softmax.positive_losses(i2t, extra_i2t, group_mode, eps) + softmax.positive_losses(
        t2i, extra_t2i, group_mode, eps
    )
    return PairsOut(0.5 * rows, *norms, pos, *i2t[1:4], kept_output(i2t), *t2i[1:4], kept_output(t2i), extra_i2t,
                    extra_t2i)  # fmt: skip


def _symmetric_nll_fake(
    img, txt, negatives, own, own_mask, group_ids, tau, gamma, eps, thr, normalize, masked, *rest, group_mode=0
):
    positives = (rest[-1] if len(rest) == 5 else group_mode) != 0  # the flag given by position or by name
    return PairsOut.fake(img, negatives, masked or group_ids.shape[0] > 0, positives)


def _symmetric_nll_backward(
    grad: Tensor,
    img: Tensor,
    txt: Tensor,
    negatives: Tensor,
    own: Tensor,
    own_mask: Tensor,
    group_ids: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    rv: Tensor,
    rt: Tensor,
    rn: Tensor,
    pos: Tensor,
    delta_i2t: Tensor,
    mean_neg_i2t: Tensor,
    dsum_i2t: Tensor,
    kept_i2t: Tensor,
    delta_t2i: Tensor,
    mean_neg_t2i: Tensor,
    dsum_t2i: Tensor,
    kept_t2i: Tensor,
    positives_i2t: Tensor,
    positives_t2i: Tensor,
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    margin: int,
    group_mode: int,
    need_features: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dL/dimg, dL/dtxt, dL/dnegatives, dL/down in their dtypes, dL/dτ in τ's dtype and shape). Each
    recomputed tile carries both directions' softmax into one dS workspace. Under a positive
    ``group_mode`` code the kernels' P is normalised over every class (:func:`.outputs.positive_rows`)
    and the host pass adds the positives' shares."""
    saved = FamilyPairsOut(None, rv, rt, rn, pos, delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t,
                           delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i)  # fmt: skip
    flags = (normalize, masked, has_margin, smoothing, precision)
    features = (img, txt, negatives)
    s = _setup(features, saved[1:4], group_ids, (tau, gamma, threshold), flags, Margin.from_code(margin),
               need_thr=need_features)  # fmt: skip
    i2t, t2i = saved.i2t(s.masked), saved.t2i(s.masked)
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's row k gets half of pair k's gradient
    d, m = img.shape[1], negatives.shape[0]
    d_n = torch.zeros((m, d), device=img.device, dtype=torch.float32)  # M = 0, or only dτ wanted
    kernel_rows, kernel_cols, shifts = i2t, t2i, smoothing_shifts(s.pair, eps, i2t, t2i)
    if group_mode != 0:  # the negatives' P over all of each row's classes
        kernel_rows, shift_r, factors_r = positive_rows(i2t, positives_i2t, eps, smoothing)
        kernel_cols, shift_c, factors_c = positive_rows(t2i, positives_t2i, eps, smoothing)
        shifts = None if shift_r is None else (shift_r, shift_c)
    if need_features:
        d_v, d_t = symmetric_shares((img, txt), (rv, rt), (kernel_rows, g), (kernel_cols, g), s.pair, shifts)
        if m > 0:  # the block: P over all N + M columns (the merged statistics)
            d_v_block, d_n = directional_shares(
                *s.block_ops, kernel_rows, g, s.block, m, None if shifts is None else shifts[:1], positives=(txt, rt)
            )
            d_v.add_(d_v_block)
            del d_v_block
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    own_counts, d_own = None, None
    if own_negatives.present(own):  # the own columns' share, P from the merged statistics
        shifted = need_features and shifts is not None
        rows = (i2t, g, eps, img.shape[0] + m, shifted, None)
        if group_mode != 0:  # P over every class C(i) and ε/|C(i)|: the negatives' kernels' own
            rows = (kernel_rows, g, eps, img.shape[0] + m, shifts is not None, shifts[0] if shifts else None)
        d_own, own_counts = _own_backward(d_v if need_features else None, rows,
                                          (img, txt, own, own_mask), saved[1:3], pos, s, (gamma, threshold),
                                          normalize, margin)  # fmt: skip
    else:
        d_own = own.new_empty(own.shape)  # (0, 0, D)
    v_hat, t_hat = epilogue.scaled(img, rv), epilogue.scaled(txt, rt)
    if group_mode != 0:  # each direction's positives: their shares and Σ dS·d (the host pass)
        ids = s.pair.family.pair_ids()
        dz_z = None
        for q_hat, k_hat, d_q, d_k, stats, factors in (
            (v_hat, t_hat, d_v, d_t, i2t, factors_r),
            (t_hat, v_hat, d_t, d_v, t2i, factors_c),
        ):
            d_q_pos, d_k_pos, dz_d = positive_bwd(
                q_hat, k_hat, pos, s.pair.inv_tau, 0, ids, ids, factors, g, label_smoothing, group_mode
            )
            if need_features:
                d_q.add_(d_q_pos)
                d_k.add_(d_k_pos)
            part = softmax.positive_dz_z(stats, factors, g, dz_d)
            dz_z = part if dz_z is None else dz_z + part
        return _unnormalized(features, (rv, rt, rn), (d_v, d_t, d_n), s.pair.inv_tau, normalize, d_own, tau, dz_z)
    # i2t's keys: the captions, then the negatives (their n̂ only for the uniform smoothing term)
    n_hat = epilogue.scaled(negatives, rn) if m > 0 and softmax.smooths(eps) and not s.masked else None
    more = (n_hat, d_n) if m > 0 else None
    own_kw = {} if own_counts is None else dict(own_counts=own_counts)
    dz_z = softmax.add_positive_and_smoothing(i2t, g, v_hat, t_hat, d_v, d_t, 0, eps, more_keys=more, **own_kw)
    dz_z = dz_z + softmax.add_positive_and_smoothing(t2i, g, t_hat, v_hat, d_t, d_v, 0, eps)
    del v_hat, t_hat, n_hat  # peak memory: free before the normalisation's temporaries
    return _unnormalized(features, (rv, rt, rn), (d_v, d_t, d_n), s.pair.inv_tau, normalize, d_own, tau, dz_z)


def _unnormalized(features, norms, shares, inv_tau, normalize: bool, d_own, tau, dz_z):
    """The backward's outputs from the shares (times τ) of dL/dv̂, dL/dt̂, dL/dn̂ and Σ dZ·Z."""
    grads = []
    for x, r, d_x in zip(features, norms, shares):
        grads.append(epilogue.unnormalize_grad(x, r, d_x.mul_(inv_tau), normalize).to(x.dtype).contiguous())
    return (*grads, d_own, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape))


def _symmetric_grads_fake(grad, img, txt, negatives, own, own_mask, group_ids, tau, *rest):
    return tuple(x.new_empty(x.shape) for x in (img, txt, negatives, own, tau))
