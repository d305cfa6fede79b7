"""The single-process loss's operator bodies: ``hnclip::triton_symmetric_nll`` and its backward
(registered in :mod:`.ops`), with their fake implementations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import epilogue
from .backward import symmetric_shares
from .forward import symmetric_stats
from .outputs import Grads, SymOut, kept_or_none, no_kept, smoothing_shifts
from .params import scalars, threshold_block


def _symmetric_nll(
    img: Tensor,
    txt: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    has_margin: bool,
    smoothing: bool,
    masked: bool,
    normalize: bool,
    precision: str,
) -> SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs: (pairs, rv, rt, pos,
    delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i).

    Forward: one walk over the tiles of Z gives its rows' (i2t) and columns' (t2i) statistics."""
    rv, rt = epilogue.inv_norms(img, normalize), epilogue.inv_norms(txt, normalize)
    sc = scalars(
        img,
        tau,
        gamma,
        has_margin,
        smoothing,
        precision,
        threshold_block(threshold, (txt, txt), (rt, rt), normalize) if masked else None,
    )
    pos = epilogue.positive_logits(epilogue.scaled(img, rv), epilogue.scaled(txt, rt), 0, sc.inv_tau)
    i2t, t2i = symmetric_stats((img, txt), (rv, rt), pos, sc)
    pairs = epilogue.pair_losses(i2t, t2i, img.shape[0], label_smoothing if smoothing else 0.0)
    kept = (i2t.kept, t2i.kept) if masked else (no_kept(img), no_kept(img))
    return (pairs, rv, rt, pos, *i2t[1:4], kept[0], *t2i[1:4], kept[1])


def _symmetric_nll_fake(
    img, txt, tau, gamma, label_smoothing, threshold, has_margin, smoothing, masked, normalize, precision
):
    n = img.shape[0]
    return tuple(img.new_empty((0 if i in (7, 11) and not masked else n,), dtype=torch.float32) for i in range(12))


def _symmetric_nll_backward(
    grad: Tensor,
    img: Tensor,
    txt: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    rv: Tensor,
    rt: Tensor,
    pos: Tensor,
    delta_r: Tensor,
    mean_neg_r: Tensor,
    dsum_r: Tensor,
    kept_r: Tensor,
    delta_c: Tensor,
    mean_neg_c: Tensor,
    dsum_c: Tensor,
    kept_c: Tensor,
    has_margin: bool,
    smoothing: bool,
    masked: bool,
    normalize: bool,
    precision: str,
    need_vt: bool,
) -> Grads:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape). Each
    recomputed tile carries both directions' softmax into one dS workspace."""
    i2t = epilogue.RowStats(pos, delta_r, mean_neg_r, dsum_r, kept_or_none(kept_r, masked))
    t2i = epilogue.RowStats(pos, delta_c, mean_neg_c, dsum_c, kept_or_none(kept_c, masked))
    sc = scalars(
        img,
        tau,
        gamma,
        has_margin,
        smoothing,
        precision,
        threshold_block(threshold, (txt, txt), (rt, rt), normalize) if masked and need_vt else None,
    )
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's rows get half
    if need_vt:
        d_v, d_t = symmetric_shares(
            (img, txt),
            (rv, rt),
            (i2t, g),
            (t2i, g),
            sc,
            smoothing_shifts(sc, eps, i2t, t2i),
        )
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    d_img, d_txt, dz_z = epilogue.finish_symmetric(i2t, t2i, g, img, txt, rv, rt, d_v, d_t, sc.inv_tau, eps, normalize)
    return d_img, d_txt, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _symmetric_grads_fake(grad, img, txt, tau, *rest):
    return img.new_empty(img.shape), txt.new_empty(txt.shape), tau.new_empty(tau.shape)
