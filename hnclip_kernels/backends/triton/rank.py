"""A distributed rank's operator body: ``hnclip::triton_rank_nll`` (the rank's two directions in
one op: each tile's i2t and t2i logits from 3 products sharing the margin's G) and its backward
(registered in :mod:`.ops`), with their fake implementations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import epilogue, softmax
from ..outputs import schema
from .backward import rank_shares
from .forward import rank_stats
from .outputs import RankGrads, RankOut, rank_directions, smoothing_shifts
from .params import scalars, threshold_block


def _rank_nll(
    img: Tensor,
    txt: Tensor,
    all_img: Tensor,
    all_txt: Tensor,
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
) -> schema(RankOut):
    """A rank's per-row losses ½(i2t_i + t2i_i) (M,) and what the backward needs (``RankOut``).
    Each direction's values are its directional op's to the bit (the same positives, tiles and
    partial order)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (img, txt, all_img, all_txt))
    sc = scalars(
        img,
        tau,
        gamma,
        has_margin,
        smoothing,
        precision,
        threshold_block(threshold, (txt, all_txt), (norms[1], norms[3]), normalize) if masked else None,
    )
    m, inv_tau = img.shape[0], sc.inv_tau
    pos = torch.cat(
        (
            epilogue.positive_logits(
                epilogue.scaled(img, norms[0]), epilogue.scaled(all_txt, norms[3]), offset, inv_tau
            ),
            epilogue.positive_logits(
                epilogue.scaled(txt, norms[1]), epilogue.scaled(all_img, norms[2]), offset, inv_tau
            ),
        )
    )
    stats = rank_stats((img, txt, all_img, all_txt), norms, pos, sc, offset)
    # each direction's losses from its own slice: torch's vectorised softplus rounds an element
    # differently in a loop's tail, and the directional op's tails are M long
    eps, n = label_smoothing if smoothing else 0.0, all_img.shape[0]
    i2t, t2i = rank_directions(stats, m, masked)
    rows = 0.5 * (softmax.row_losses(i2t, n, eps) + softmax.row_losses(t2i, n, eps))
    return RankOut.of(rows, norms, stats)


def _rank_nll_fake(
    img, txt, all_img, all_txt, tau, gamma, label_smoothing, threshold, offset, normalize, masked, *rest
):
    return RankOut.fake(img, all_img, masked)


def _rank_nll_backward(
    grad: Tensor,
    img: Tensor,
    txt: Tensor,
    all_img: Tensor,
    all_txt: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    rv: Tensor,
    rt: Tensor,
    rv_all: Tensor,
    rt_all: Tensor,
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
    need_features: bool,
) -> RankGrads:
    """(dL/dimg, dL/dtxt, dL/dall_img, dL/dall_txt in their dtypes, dL/dτ in τ's dtype and shape):
    i2t gives img and all_txt theirs, t2i txt and all_img (the margin is a constant)."""
    m = img.shape[0]
    i2t, t2i = rank_directions(softmax.RowStats(pos, delta, mean_neg, dsum, kept), m, masked)
    sc = scalars(
        img,
        tau,
        gamma,
        has_margin,
        smoothing,
        precision,
        threshold_block(threshold, (txt, all_txt), (rt, rt_all), normalize) if masked and need_features else None,
    )
    inv_tau = sc.inv_tau
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's row gets half
    ops, norms = (img, txt, all_img, all_txt), (rv, rt, rv_all, rt_all)
    if need_features:
        (d_v, d_ta), (d_t, d_va) = rank_shares(
            ops, norms, (i2t, t2i), g, sc, offset, smoothing_shifts(sc, eps, i2t, t2i)
        )
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t, d_va, d_ta = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in ops)
    d_img, d_all_txt, dz_i2t = softmax.finish_directional(
        i2t, g, img, all_txt, rv, rt_all, d_v, d_ta, offset, inv_tau, eps, normalize
    )
    d_txt, d_all_img, dz_t2i = softmax.finish_directional(
        t2i, g, txt, all_img, rt, rv_all, d_t, d_va, offset, inv_tau, eps, normalize
    )
    # dτ as autograd would sum the two directional ops' (each in τ's dtype)
    d_tau = epilogue.tau_grad(dz_i2t, inv_tau, tau.dtype, tau.shape) + epilogue.tau_grad(
        dz_t2i, inv_tau, tau.dtype, tau.shape
    )
    return d_img, d_txt, d_all_img, d_all_txt, d_tau


def _rank_grads_fake(grad, img, txt, all_img, all_txt, tau, *rest):
    return tuple(x.new_empty(x.shape) for x in (img, txt, all_img, all_txt, tau))
