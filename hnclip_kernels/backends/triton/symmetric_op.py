"""The single-process loss's operator bodies: ``hnclip::triton_symmetric_nll`` and its backward
(registered in :mod:`.ops`), with their fake implementations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import epilogue
from ..outputs import SymmetricOut, row_stats, schema
from .backward import symmetric_shares
from .forward import symmetric_stats
from .outputs import Grads, smoothing_shifts
from .params import scalars, threshold_block


def _symmetric_nll(
    img: Tensor,
    txt: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    normalize: bool,
    masked: bool,
    has_margin: bool,
    smoothing: bool,
    precision: str,
) -> schema(SymmetricOut):
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs (``SymmetricOut``).

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
    return SymmetricOut.of(pairs, rv, rt, i2t, t2i)


def _symmetric_nll_fake(img, txt, tau, gamma, label_smoothing, threshold, normalize, masked, *rest):
    return SymmetricOut.fake(img, masked, torch.float32)


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
    need_vt: bool,
) -> Grads:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape). Each
    recomputed tile carries both directions' softmax into one dS workspace."""
    i2t = row_stats(pos, delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, masked)
    t2i = row_stats(pos, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i, masked)
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
