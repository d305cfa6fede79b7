"""The hard-negative family's single-process loss on the C++ kernels: ``hnclip::cpp_family_nll``.

:func:`hnclip_kernels.backends.family_losses` on backend="cpp" (``docs/hard_negatives.md``): the
symmetric kernel of :mod:`.ops` over the N×N block (both directions from one logit tile), with
the family's group ids and ``margin="image_text"`` (the margin γ·sg(v̂_i·t̂_k) is the logit tile's
own score: L = (v̂ + γ v̂)/τ, no extra product), plus one directional pass over the N×M block of
the negative captions for the i2t rows only (no positive in it: ``offset`` = M). That pass
starts from the symmetric kernel's i2t statistics (the raw kernel's ``prior``) and returns them
merged over all N + M columns, with (when a gradient follows) the block's gradient shares of P
normalised over all N + M columns, as the directional operator keeps them. The backward runs
the symmetric backward with the merged statistics and takes the block's part from those shares
(a rescale for a uniform upstream gradient; else the directional backward's recompute).

Products (multiply-adds, f = 1 when the threshold's caption tile is formed): forward
(1 + f)·N²·D + (1 + f + 2)·N·M·D (the shares P·n̂, Pᵀ·v̂ only when a gradient follows), backward
(3 + f)·N²·D + 0 (uniform upstream gradient, as for mean/sum) or (2 + f)·N·M·D, executed
(``FlopCounterMode`` states the useful products, :mod:`.flops`).
The block's margin factor is the keys' own row (b̂ = n̂), so it folds into the left factor (width
1) for either margin. The distributed loss keeps its two directional calls (:mod:`.family`).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from ...numerics import compute_dtype
from .. import epilogue, glue
from ..outputs import FamilyOut, row_stats, schema
from . import flops
from .raw import RAW, caption_norms, scalars, shift_arg


class _Setup:
    """What the forward and the backward form alike from the operator's inputs."""

    def __init__(self, img, txt, neg, groups, tau, gamma, eps, threshold, normalize, masked, image_text):
        self.sc = sc = scalars(img, tau, gamma, eps, threshold, masked)
        self.ids = groups if groups.numel() > 0 else None
        # the caption tile is formed for a threshold, not for ids alone (threshold +inf)
        self.cosine = masked and not (self.ids is not None and math.isinf(sc.threshold))
        self.rc = caption_norms((txt,), normalize, self.cosine, sc.dt)[0]
        self.a = img if image_text else txt  # the block's margin factor rows (sg), keys' factor = n
        self.m = neg.shape[0]

    def block_mask_args(self, txt, neg) -> list:
        """The block's ``ca, cb, ma, mb, qg, kg``: the captions t, n whose cosine the threshold
        compares; the row ids against no column id (K = 0: masking on, so the block's kept counts
        and ε/n_i come out as the symmetric kernel's, with ids alone no caption tile)."""
        dt = self.sc.dt
        if self.cosine:
            captions = [epilogue.inv_norms(x, True, dt) for x in (txt, neg)] + [txt, neg]
        else:
            captions = [None] * 4
        if self.ids is None:
            return captions + [None, None]
        return captions + [self.ids, self.ids.new_empty((0,))]


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
    image_text: bool,
    need_grad: bool,
) -> schema(FamilyOut):
    """Per-pair losses ½(i2t_k + t2i_k) (N,), i2t over the N + M columns, and what the backward
    needs (``FamilyOut``; ``kept``: empty without masking, a threshold or ids; the block's shares
    with ``need_grad`` and M > 0, else (0, D))."""
    s = _Setup(img, txt, negatives, groups, tau, gamma, label_smoothing, threshold, normalize, masked, image_text)
    sc = s.sc
    rv, rt, rn = (epilogue.inv_norms(x, normalize, sc.dt) for x in (img, txt, negatives))
    v_hat, t_hat = epilogue.scaled(img, rv, sc.dt), epilogue.scaled(txt, rt, sc.dt)
    pos = epilogue.positive_logits(v_hat, t_hat, 0, sc.inv_tau)
    raw = RAW.cpp_raw_symmetric_fwd(
        v_hat, t_hat, pos, sc.inv_tau, sc.gamma, sc.threshold, s.rc, s.ids, image_text
    )  # fmt: skip
    (n, d), m = img.shape, s.m
    out = FamilyOut(None, rv, rt, rn, pos, *raw, v_hat.new_empty((0, d)), v_hat.new_empty((0, d)))
    if m > 0:  # the negative block, from the symmetric tile's i2t statistics: merged ones out
        stats = out.i2t(masked)
        prior = torch.stack([*stats[1:4], stats.kept if masked else torch.zeros_like(stats.delta)])
        n_hat = epilogue.scaled(negatives, rn, sc.dt)
        block = RAW.cpp_raw_directional_fwd(
            v_hat, n_hat, s.a, negatives, rv if image_text else rt, rn, pos, sc.inv_tau, m, sc.gamma, need_grad,
            sc.threshold, sc.eps, *s.block_mask_args(txt, negatives), prior=prior,
        )  # fmt: skip
        out = out._replace(
            delta_i2t=block[0], mean_neg_i2t=block[1], dsum_i2t=block[2], kept_i2t=block[3] if masked else
            out.kept_i2t, row_acc=block[4], col_acc=block[5],
        )  # fmt: skip
    i2t, t2i = out.i2t(masked), out.t2i(masked)
    pairs = 0.5 * (
        epilogue.row_losses(i2t, n + m, sc.eps) + epilogue.row_losses(t2i, n, sc.eps)
    )  # fmt: skip
    return out._replace(pairs=pairs)


def _family_nll_fake(img, txt, negatives, groups, tau, gamma, eps, thr, normalize, masked, image_text, need_grad):
    return FamilyOut.fake(img, negatives, masked, need_grad, compute_dtype(img.dtype))


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
    row_acc: Tensor,
    col_acc: Tensor,
    normalize: bool,
    masked: bool,
    image_text: bool,
    need_grad: bool,
    need_features: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dL/dimg, dL/dtxt, dL/dnegatives in their dtypes, dL/dτ in τ's dtype and shape)."""
    s = _Setup(img, txt, negatives, groups, tau, gamma, label_smoothing, threshold, normalize, masked, image_text)
    sc = s.sc
    i2t = row_stats(pos, delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, masked)
    t2i = row_stats(pos, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i, masked)
    g = 0.5 * grad.to(sc.dt).contiguous()  # each direction's row k gets half of pair k's gradient
    n, m = img.shape[0], s.m
    v_hat, t_hat = epilogue.scaled(img, rv, sc.dt), epilogue.scaled(txt, rt, sc.dt)
    n_hat = epilogue.scaled(negatives, rn, sc.dt)
    shift_r = shift_arg(i2t, sc.eps, masked)
    d_keys = v_hat.new_zeros((n + m, v_hat.shape[1]))  # [dt̂; dn̂]: i2t's keys, one buffer
    if need_features:
        d_v, d_keys[:n] = RAW.cpp_raw_symmetric_bwd(
            v_hat, t_hat, pos, sc.inv_tau, delta_i2t, delta_t2i, g, sc.gamma, sc.threshold, shift_r,
            shift_arg(t2i, sc.eps, masked), s.rc, s.ids, image_text,
        )  # fmt: skip
        if m > 0:  # the block: its forward's shares (P over all N + M columns), or a recompute
            d_v_block, d_keys[n:] = RAW.cpp_raw_directional_bwd(
                v_hat, n_hat, s.a, negatives, rv if image_text else rt, rn, pos, sc.inv_tau, delta_i2t, row_acc,
                col_acc, g, m, sc.gamma, sc.threshold, shift_r, *s.block_mask_args(txt, negatives),
            )  # fmt: skip
            d_v.add_(d_v_block)
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v = torch.zeros_like(v_hat)
    keys_hat = torch.cat([t_hat, n_hat])
    del n_hat
    dz_z = epilogue.add_positive_and_smoothing(i2t, g, v_hat, keys_hat, d_v, d_keys, 0, sc.eps)
    dz_z = dz_z + epilogue.add_positive_and_smoothing(t2i, g, t_hat, v_hat, d_keys[:n], d_v, 0, sc.eps)
    del v_hat, t_hat, keys_hat
    d_keys.mul_(sc.inv_tau)
    d_img = epilogue.unnormalize_grad(img, rv, d_v.mul_(sc.inv_tau), normalize).to(img.dtype).contiguous()
    d_t, d_n = d_keys[:n], d_keys[n:]
    if not normalize:  # unnormalize_grad returns them as they are: an operator's outputs may not alias
        d_t, d_n = d_t.clone(), d_n.clone()
    d_txt = epilogue.unnormalize_grad(txt, rt, d_t, normalize).to(txt.dtype).contiguous()
    d_neg = epilogue.unnormalize_grad(negatives, rn, d_n, normalize).to(negatives.dtype).contiguous()
    return d_img, d_txt, d_neg, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _family_grads_fake(grad, img, txt, negatives, groups, tau, *rest):
    return tuple(x.new_empty(x.shape) for x in (img, txt, negatives, tau))


_FamilyNLL = glue.fused_op(
    "cpp",
    "cpp_family_nll",
    forward=_family_nll,
    forward_fake=_family_nll_fake,
    backward=_family_nll_backward,
    backward_fake=_family_grads_fake,
    tau_input=4,
    feature_inputs=(0, 1, 2),
    device_types="cpu",
)
flops.register_family_symmetric()


def family_pairs_cpp(
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
    false_negative_threshold=None,
):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,), of the hard-negative family in one operator.

    ``img``, ``txt`` (N, D); ``negatives`` (M, D) (None: M = 0), i2t columns only;
    ``group_ids`` (N,) integer (None: no ids), pairs with equal ids masked in both directions;
    ``margin`` "text" or "image_text". float32 result (float64 for float64 inputs); gradients
    reach ``img``, ``txt``, ``negatives`` and ``tau`` (0-dim). ``return_stats``: also ``(i2t,
    t2i)``, the detached ``epilogue.RowStats`` (i2t's over the N + M columns). Otherwise as
    :func:`.ops.hn_clip_pairs_cpp`.
    """
    if negatives is None:
        negatives = img.new_empty((0, img.shape[1]))
    # the forward also keeps the negative block's shares only when a backward can follow
    need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (img, txt, negatives))
    ids = group_ids is not None
    # masking by ids alone: threshold +inf (no cosine reaches it), the kernels form no caption tile
    threshold = false_negative_threshold if false_negative_threshold is not None else (math.inf if ids else None)
    thr_t, masked = glue.threshold_args(threshold, img)
    groups = group_ids.to(torch.long) if ids else torch.empty((0,), dtype=torch.long, device=img.device)
    out = FamilyOut._make(
        glue.call(
            _FamilyNLL,
            torch.ops.hnclip.cpp_family_nll,
            img,
            txt,
            negatives,
            groups,
            tau,
            glue.hyperparameter(gamma, img),
            glue.hyperparameter(label_smoothing, img),
            thr_t,
            bool(normalize),
            masked,
            margin == "image_text",
            need_grad,
        )
    )
    return (out.pairs, (out.i2t(masked), out.t2i(masked))) if return_stats else out.pairs
