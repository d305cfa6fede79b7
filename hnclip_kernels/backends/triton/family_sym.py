"""The hard-negative family's single-process loss on the Triton kernels: ``hnclip::triton_family_nll``.

:func:`hnclip_kernels.backends.family_losses` on backend="triton" (``docs/hard_negatives.md``), as
the C++ backend's ``hnclip::cpp_family_nll``: today's symmetric walk over the N×N logits (both
directions from each tile pair, ``_fwd_pair_kernel`` / ``_dscore_pair_kernel``, group ids as their
GROUPS), plus one directional walk over the N×M block of the negative captions for the i2t rows
only (``_fwd_kernel`` / ``_dscore_kernel`` with no positive in it: offset M). The block's row
partials are merged with the symmetric walk's i2t summaries in one ``_merge_kernel`` launch, so
the i2t statistics cover all N + M columns; the backward runs both walks with those statistics.
16-bit features stay 16-bit (the kernels' own rounding-compensated backward).

``margin="image_text"``: the margin γ·sg(v̂_i·x̂) is the logit's own score, so Z_ix = (1 + γ)·v̂_i·x̂/τ
off the positive: the kernels form the logits with 1/τ scaled by 1 + γ and no margin product
(the positive, from the host, and the gradients keep 1/τ: the margin carries no gradient). The
threshold still compares captions (t̂_i·x̂: the margin factors t, and n in the block).

Products executed (P = one N×N×D or N×M×D product; ``FlopCounterMode`` states the useful ones,
:mod:`.flops`): the N×N part is today's loss's to the
multiply-add (γ_text = 1 for ``margin="text"`` with γ ≠ 0, or a threshold); the block costs
(1 + g) P forward and (1 + g) P + 2 P of GEMMs backward, g = 1 for the text margin with γ ≠ 0 or
a threshold (t̂·n̂), else 0. Workspace: :func:`.workspace.family_bytes`.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from .. import epilogue, glue
from ..outputs import FamilyPairsOut, kept_output, row_stats, schema
from . import flops
from .backward import directional_shares, symmetric_shares
from .forward import directional_partials, symmetric_summaries
from .launch import USE_TRITON_OP
from .merge import merge_stats
from .outputs import smoothing_shifts
from .params import Family, scalar_args, scalars, tamed, threshold_block


class _Setup(NamedTuple):
    """What the forward and the backward form alike: the pair walk's scalars, the block's, the
    true 1/τ (the positives, the gradients and dτ) and whether the loss masks."""

    pair: object  # params.Scalars of the N×N walk
    block: object  # params.Scalars of the N×M walk (None: M = 0)
    inv_tau: Tensor
    masked: bool


def _setup(img, txt, neg, groups, tau, gamma, eps, threshold, norms, normalize, masked, has_margin, smoothing,
           precision, image_text, need_thr=True) -> _Setup:  # fmt: skip
    """The scalars of both walks: the logit scale (1 + γ)/τ and no margin product for
    ``image_text``; the threshold blocks of each walk's captions (t against t, t against n); the
    ids for the pairs, and against no column id in the block (K = 0: its masking is on, so its
    kept counts merge with the pairs', with ids alone no caption product)."""
    rv, rt, rn = norms
    base = scalars(img, tau, gamma, has_margin, smoothing, precision)
    inv_tau = base.inv_tau
    if image_text and has_margin:  # the margin is the logit's own score: one product, a scale
        base = base._replace(inv_tau=inv_tau * (1.0 + base.gamma), gamma=None, has_margin=False)
    ids = groups if groups.shape[0] > 0 else None
    thr = threshold_block(threshold, (txt, txt), (rt, rt), normalize) if masked and need_thr else None
    pair = base._replace(thr=thr, family=Family(None, None if ids is None else (ids, ids)))
    block = None
    if neg.shape[0] > 0:
        thr_b = threshold_block(threshold, (txt, neg), (rt, rn), normalize) if masked and need_thr else None
        block = base._replace(thr=thr_b, family=Family(None, None if ids is None else (ids, ids[:0])))
    return _Setup(pair, block, inv_tau, masked or ids is not None)


def _family_nll(
    img: Tensor,
    txt: Tensor,
    negatives: Tensor,
    groups: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    image_text: bool,
) -> schema(FamilyPairsOut):
    """Per-pair losses ½(i2t_k + t2i_k) (N,), i2t over the N + M columns, and what the backward
    needs (``FamilyPairsOut``; ``kept`` (0,) without a threshold or ids)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (img, txt, negatives))
    s = _setup(img, txt, negatives, groups, tau, gamma, label_smoothing, threshold, norms, normalize, masked,
               has_margin, smoothing, precision, image_text)  # fmt: skip
    (n, _), m = img.shape, negatives.shape[0]
    pos = epilogue.positive_logits(epilogue.scaled(img, norms[0]), epilogue.scaled(txt, norms[1]), 0, s.inv_tau)
    acc = symmetric_summaries((img, txt), norms[:2], pos, s.pair)
    t2i = epilogue.RowStats(pos, *merge_stats(acc, s.pair.smoothing, 0, n, s.masked))
    if m == 0:  # today's merge of the rows' summaries
        i2t = epilogue.RowStats(pos, *merge_stats(acc, s.pair.smoothing, n, n, s.masked))
    else:  # the block's partials of the same rows (no positive among its M columns), after the walk's summaries
        block = directional_partials((img, negatives, txt, negatives), (norms[0], norms[2], norms[1], norms[2]),
                                     pos, s.block, offset=m)  # fmt: skip
        rows = torch.empty((1 + block.shape[0], *block.shape[1:]), device=img.device, dtype=torch.float32)
        rows[0].copy_(acc[0, :, n:])
        rows[1:].copy_(block)
        del acc, block
        i2t = epilogue.RowStats(pos, *merge_stats(rows, s.pair.smoothing, masked=s.masked))
    eps = label_smoothing if smoothing else 0.0
    pairs = 0.5 * (epilogue.row_losses(i2t, n + m, eps) + epilogue.row_losses(t2i, n, eps))
    return FamilyPairsOut(pairs, *norms, pos, *i2t[1:4], kept_output(i2t), *t2i[1:4], kept_output(t2i))


def _family_nll_fake(img, txt, negatives, groups, tau, gamma, eps, thr, normalize, masked, *rest):
    return FamilyPairsOut.fake(img, negatives, masked or groups.shape[0] > 0, torch.float32)


def _family_nll_backward(
    grad: Tensor,
    img: Tensor,
    txt: Tensor,
    negatives: Tensor,
    groups: Tensor,
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
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    image_text: bool,
    need_features: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dL/dimg, dL/dtxt, dL/dnegatives in their dtypes, dL/dτ in τ's dtype and shape)."""
    s = _setup(img, txt, negatives, groups, tau, gamma, label_smoothing, threshold, (rv, rt, rn), normalize, masked,
               has_margin, smoothing, precision, image_text, need_thr=need_features)  # fmt: skip
    i2t = row_stats(pos, delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, s.masked)
    t2i = row_stats(pos, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i, s.masked)
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's row k gets half of pair k's gradient
    d, m = img.shape[1], negatives.shape[0]
    d_n = torch.zeros((m, d), device=img.device, dtype=torch.float32)  # M = 0, or only dτ wanted
    if need_features:
        shifts = smoothing_shifts(s.pair, eps, i2t, t2i)
        d_v, d_t = symmetric_shares((img, txt), (rv, rt), (i2t, g), (t2i, g), s.pair, shifts)
        if m > 0:  # the block: P over all N + M columns (the merged statistics)
            d_v_block, d_n = directional_shares(
                (img, negatives, txt, negatives), (rv, rn, rt, rn), i2t, g, s.block, m,
                None if shifts is None else shifts[:1], positives=(txt, rt),
            )  # fmt: skip
            d_v.add_(d_v_block)
            del d_v_block
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    v_hat, t_hat = epilogue.scaled(img, rv), epilogue.scaled(txt, rt)
    # i2t's keys: the captions, then the negatives (their n̂ only for the uniform smoothing term)
    n_hat = epilogue.scaled(negatives, rn) if m > 0 and epilogue.smooths(eps) and not s.masked else None
    more = (n_hat, d_n) if m > 0 else None
    dz_z = epilogue.add_positive_and_smoothing(i2t, g, v_hat, t_hat, d_v, d_t, 0, eps, more_keys=more)
    dz_z = dz_z + epilogue.add_positive_and_smoothing(t2i, g, t_hat, v_hat, d_t, d_v, 0, eps)
    del v_hat, t_hat, n_hat
    grads = []
    for x, r, d_x in ((img, rv, d_v), (txt, rt, d_t), (negatives, rn, d_n)):
        grads.append(epilogue.unnormalize_grad(x, r, d_x.mul_(s.inv_tau), normalize).to(x.dtype).contiguous())
    return (*grads, epilogue.tau_grad(dz_z, s.inv_tau, tau.dtype, tau.shape))


def _family_grads_fake(grad, img, txt, negatives, groups, tau, *rest):
    return tuple(x.new_empty(x.shape) for x in (img, txt, negatives, tau))


HNClipFamilyPairsTriton = glue.fused_op(
    "triton",
    "triton_family_nll",
    forward=_family_nll,
    forward_fake=_family_nll_fake,
    backward=_family_nll_backward,
    backward_fake=_family_grads_fake,
    tau_input=4,
    feature_inputs=(0, 1, 2),
    use_triton_op=USE_TRITON_OP,
)
flops.register_family_symmetric()


def family_pairs_triton(
    img,
    txt,
    negatives=None,
    group_ids=None,
    *,
    tau,
    gamma,
    label_smoothing,
    normalize,
    margin="text",
    return_stats=False,
    precision=None,
    false_negative_threshold=None,
):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,), of the hard-negative family in one operator.

    ``img``, ``txt`` (N, D) float32, bfloat16 or float16 (16-bit stays 16-bit in the kernels);
    ``negatives`` (M, D) in their dtype (None: M = 0), i2t columns only; ``group_ids`` (N,)
    integer (None: no ids), pairs with equal ids masked in both directions; ``margin`` "text" or
    "image_text". float32 result; gradients reach ``img``, ``txt``, ``negatives`` and ``tau``
    (0-dim). ``return_stats``: also ``(i2t, t2i)``, the detached ``epilogue.RowStats`` (i2t's over
    the N + M columns). ``precision``, ``false_negative_threshold``: as
    :func:`.ops.hn_clip_pairs_triton`. With M = 0, no ids and ``margin="text"`` it runs today's
    kernels and gives :func:`.ops.hn_clip_pairs_triton`'s results to the bit. The public checks are
    :func:`hnclip_kernels.validation_family`'s (``hn_clip_loss``)."""
    if negatives is None:
        negatives = img.new_empty((0, img.shape[1]))
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, img)
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    groups = group_ids if group_ids is not None else torch.empty((0,), dtype=torch.long, device=img.device)
    out = FamilyPairsOut._make(
        glue.call(
            HNClipFamilyPairsTriton,
            torch.ops.hnclip.triton_family_nll,
            *(tamed(x, normalize) for x in (img, txt, negatives)),
            groups.contiguous(),
            tau,
            gamma_t,
            eps_t,
            thr_t,
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
            margin == "image_text",
        )
    )
    ids = group_ids is not None
    return (out.pairs, (out.i2t(masked or ids), out.t2i(masked or ids))) if return_stats else out.pairs
