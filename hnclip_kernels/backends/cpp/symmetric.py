"""``hnclip::cpp_symmetric_nll``: the single-process loss on the C++ kernels, the operator body.

N images against N texts, both directions from one logit tile (its rows are i2t's, its columns
t2i's): one product in the forward, three in the backward. The hard-negative family
(``docs/hard_negatives.md``) arrives as optional inputs, empty when absent (then the call is
exactly today's loss): group ids (pairs with equal ids masked in both directions), the margin's
kind as its code (:attr:`hnclip_kernels.margin.Margin.code`; ``image_text``'s margin
γ·sg(v̂_i·t̂_k) is the logit tile's own score: L = (v̂ + γ v̂)/τ, no extra product), and M ≥ 0
negative captions: one directional pass over their N×M block for the i2t rows only (no positive
in it: ``offset`` = M), started from the symmetric kernel's i2t statistics (the raw kernel's
``prior``), which it returns merged over all N + M columns, with (when a gradient follows) the
block's gradient shares of P normalised over all N + M columns. The backward runs the symmetric
backward with the merged statistics and takes the block's part from those shares (a rescale for
a uniform upstream gradient; else the directional backward's recompute).

A positive ``group_mode`` code (``docs/hard_negatives.md#multi-positive-targets``) makes the ids'
pairs positives in both directions: the kernels above run as under "mask" (their statistics over
each row's negatives, the block's shares not kept), the raw positives' kernels
(``csrc/positives.cpp``) add each direction's positives, in the forward their statistics, in the
backward their shares (the negatives' kernels then normalise P over all the row's classes:
:func:`..softmax.positive_factors`).

Products (multiply-adds, f = 1 when the threshold's caption tile is formed): forward
(1 + f)·N²·D + (1 + f + 2)·N·M·D (the shares P·n̂, Pᵀ·v̂ only when a gradient follows), backward
(3 + f)·N²·D + 0 (uniform upstream gradient, as for mean/sum) or (2 + f)·N·M·D, executed
(``FlopCounterMode`` states the useful products, :mod:`.flops`). The block's key factor is the
negatives' own row (b̂ = n̂), so the margin folds into the left factor (width 1) for either kind.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from ...margin import Margin, margin_operands
from ...numerics import compute_dtype
from .. import epilogue, glue, own_negatives, softmax
from ..outputs import FamilyOut, schema
from .layouts import Saved, SymmetricFlags, SymmetricInputs, operator
from .raw import RAW, caption_norms, scalars, shift_arg

_GRADS = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # dL/dimg, dL/dtxt, dL/dnegatives, dL/down_negatives, dL/dτ


class _Setup:
    """What the forward and the backward form alike from the operator's inputs."""

    def __init__(self, x: SymmetricInputs, f: SymmetricFlags):
        self.sc = sc = scalars(x.img, x.tau, x.gamma, x.label_smoothing, x.threshold, f.masked)
        self.ids = x.group_ids if x.group_ids.numel() > 0 else None
        # the caption tile is formed for a threshold, not for ids alone (threshold +inf)
        self.cosine = f.masked and not (self.ids is not None and math.isinf(sc.threshold))
        self.rc = caption_norms((x.txt,), f.normalize, self.cosine, sc.dt)[0]
        self.m = x.negatives.shape[0]
        self.own = own_negatives.present(x.own_negatives)

    def own_block(self, x: SymmetricInputs, f: SymmetricFlags, v_hat, rt, pos):
        """Each row's own columns (:mod:`..own_negatives`): the margin's query factor t̂ or v̂,
        the threshold against the unit captions."""
        a_hat = v_hat if Margin.from_code(f.margin) is Margin.IMAGE_TEXT else epilogue.scaled(x.txt, rt, self.sc.dt)
        cosine = self.sc.threshold if f.masked and not math.isinf(self.sc.threshold) else None
        unit = (
            None if cosine is None else epilogue.scaled(x.txt, epilogue.inv_norms(x.txt, True, self.sc.dt), self.sc.dt)
        )
        return own_negatives.block(
            v_hat, a_hat, x.own_negatives, x.own_mask, pos, self.sc.inv_tau, x.gamma, f.normalize, cosine, unit
        )

    def block_args(self, x: SymmetricInputs, f: SymmetricFlags, rv, rt, rn) -> tuple:
        """The N×M block's margin factors and their inverse norms ``a, b, ra, rb`` (the margin's
        operands for the image rows against the negatives, which are their own captions)."""
        margin = Margin.from_code(f.margin)
        a, b = margin_operands(margin, x.img, x.negatives, x.txt, x.negatives)[:2]
        ra, rb = margin_operands(margin, rv, rn, rt, rn)[:2]
        return a, b, ra, rb

    def block_mask_args(self, x: SymmetricInputs) -> list:
        """The block's ``ca, cb, ma, mb, qg, kg``: the captions t, n whose cosine the threshold
        compares; the row ids against no column id (K = 0: masking on, so the block's kept counts
        and ε/n_i come out as the symmetric kernel's, with ids alone no caption tile)."""
        dt = self.sc.dt
        if self.cosine:
            captions = [epilogue.inv_norms(t, True, dt) for t in (x.txt, x.negatives)] + [x.txt, x.negatives]
        else:
            captions = [None] * 4
        if self.ids is None:
            return captions + [None, None]
        return captions + [self.ids, self.ids.new_empty((0,))]


@operator(SymmetricInputs, SymmetricFlags, returns=schema(FamilyOut))
def _forward(x: SymmetricInputs, f: SymmetricFlags):
    """Per-pair losses ½(i2t_k + t2i_k) (N,), i2t over the N + M columns, and what the backward
    needs (``FamilyOut``; ``kept``: empty without masking, a threshold or ids; the block's shares
    with ``need_grad`` and M > 0, else (0, D))."""
    s = _Setup(x, f)
    sc = s.sc
    rv, rt, rn = (epilogue.inv_norms(t, f.normalize, sc.dt) for t in (x.img, x.txt, x.negatives))
    v_hat, t_hat = epilogue.scaled(x.img, rv, sc.dt), epilogue.scaled(x.txt, rt, sc.dt)
    pos = epilogue.positive_logits(v_hat, t_hat, 0, sc.inv_tau)  # Z_kk, the same for both directions
    raw = RAW.cpp_raw_symmetric_fwd(
        v_hat,
        t_hat,
        pos,
        sc.inv_tau,
        sc.gamma,
        sc.threshold,
        s.rc,
        s.ids,
        f.margin,
    )
    (n, d), m = x.img.shape, s.m
    out = FamilyOut(None, rv, rt, rn, pos, *raw, v_hat.new_empty((0, d)), v_hat.new_empty((0, d)), None, None)
    if m > 0:  # the negative block, from the symmetric tile's i2t statistics: merged ones out
        stats = out.i2t(f.masked)
        prior = torch.stack([*stats[1:4], stats.kept if f.masked else torch.zeros_like(stats.delta)])
        n_hat = epilogue.scaled(x.negatives, rn, sc.dt)
        a, b, ra, rb = s.block_args(x, f, rv, rt, rn)
        block = RAW.cpp_raw_directional_fwd(
            v_hat,
            n_hat,
            a,
            b,
            ra,
            rb,
            pos,
            sc.inv_tau,
            m,
            sc.gamma,
            f.need_grad,
            sc.threshold,
            sc.eps,
            *s.block_mask_args(x),
            prior=prior,
        )
        kept = block[3] if f.masked else out.kept_i2t
        out = out._replace(
            delta_i2t=block[0], mean_neg_i2t=block[1], dsum_i2t=block[2], kept_i2t=kept, row_acc=block[4],
            col_acc=block[5],
        )  # fmt: skip
    i2t, t2i = out.i2t(f.masked), out.t2i(f.masked)
    n_keys = n + m
    if s.own:  # each row's own columns, merged into its i2t statistics (the negatives' L_K): the backward reads those
        own = s.own_block(x, f, v_hat, rt, pos)
        i2t = own_negatives.merge(i2t, own)
        n_keys = own_negatives.classes(i2t, n_keys, own)
        out = out._replace(delta_i2t=i2t.delta, mean_neg_i2t=i2t.mean_neg, dsum_i2t=i2t.dsum)
        out = out._replace(kept_i2t=i2t.kept if f.masked else out.kept_i2t)
    if f.group_mode != 0:  # positives: their statistics beside the (merged) negatives'
        extra_i2t = RAW.cpp_raw_positive_fwd(v_hat, t_hat, pos, sc.inv_tau, 0, s.ids, s.ids)
        extra_t2i = RAW.cpp_raw_positive_fwd(t_hat, v_hat, pos, sc.inv_tau, 0, s.ids, s.ids)
        i2t_rows = softmax.positive_losses(i2t, extra_i2t, f.group_mode, sc.eps)
        pairs = 0.5 * (i2t_rows + softmax.positive_losses(t2i, extra_t2i, f.group_mode, sc.eps))
        return out._replace(pairs=pairs, positives_i2t=extra_i2t, positives_t2i=extra_t2i)
    pairs = 0.5 * (softmax.row_losses(i2t, n_keys, sc.eps) + softmax.row_losses(t2i, n, sc.eps))
    return out._replace(pairs=pairs, positives_i2t=pos.new_empty((0,)), positives_t2i=pos.new_empty((0,)))


@operator(SymmetricInputs, SymmetricFlags, returns=schema(FamilyOut))
def _forward_fake(x: SymmetricInputs, f: SymmetricFlags):
    dt = compute_dtype(x.img.dtype)
    return FamilyOut.fake(x.img, x.negatives, f.masked, f.need_grad, dt, positives=f.group_mode != 0)


_BACKWARD = (("grad", Tensor), SymmetricInputs, Saved(FamilyOut), SymmetricFlags, ("need_features", bool))


@operator(*_BACKWARD, returns=_GRADS)
def _backward(grad: Tensor, x: SymmetricInputs, out: FamilyOut, f: SymmetricFlags, need_features: bool):
    """(dL/dimg, dL/dtxt, dL/dnegatives in their dtypes, dL/dτ in τ's dtype and shape)."""
    s = _Setup(x, f)
    sc = s.sc
    g = 0.5 * grad.to(sc.dt).contiguous()  # each direction's row k gets half of pair k's gradient
    i2t, t2i = out.i2t(f.masked), out.t2i(f.masked)
    v_hat, t_hat = epilogue.scaled(x.img, out.rv, sc.dt), epilogue.scaled(x.txt, out.rt, sc.dt)
    shift_r, shift_c = shift_arg(i2t, sc.eps, f.masked), shift_arg(t2i, sc.eps, f.masked)
    delta_r, delta_c, dz_z = out.delta_i2t, out.delta_t2i, None
    if f.group_mode != 0:  # the negatives' P over all of each row's classes (softmax.positive_factors)
        delta_r, shift_r, factors_r = softmax.positive_factors(i2t, out.positives_i2t, sc.eps)
        delta_c, shift_c, factors_c = softmax.positive_factors(t2i, out.positives_t2i, sc.eps)
    if need_features:
        d_v, d_t = RAW.cpp_raw_symmetric_bwd(
            v_hat,
            t_hat,
            out.pos,
            sc.inv_tau,
            delta_r,
            delta_c,
            g,
            sc.gamma,
            sc.threshold,
            shift_r,
            shift_c,
            s.rc,
            s.ids,
            f.margin,
        )
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = torch.zeros_like(v_hat), torch.zeros_like(t_hat)
    if f.group_mode != 0:  # each direction's positives: their shares and Σ dS·d
        for q_hat, k_hat, d_q, d_k, stats, factors in (
            (v_hat, t_hat, d_v, d_t, i2t, factors_r),
            (t_hat, v_hat, d_t, d_v, t2i, factors_c),
        ):
            d_q_pos, d_k_pos, dz_d = RAW.cpp_raw_positive_bwd(
                q_hat, k_hat, out.pos, sc.inv_tau, 0, s.ids, s.ids, factors, g, sc.eps, f.group_mode
            )
            if need_features:
                d_q.add_(d_q_pos)
                d_k.add_(d_k_pos)
            part = softmax.positive_dz_z(stats, factors, g, dz_d)
            dz_z = part if dz_z is None else dz_z + part
    d_own, own_counts = x.own_negatives.new_empty(x.own_negatives.shape), None
    if s.own:  # the own columns' share, P from the merged statistics (no kernel sees them)
        own = s.own_block(x, f, v_hat, out.rt, out.pos)
        if need_features:
            # under a positive mode P over every class C(i) and ε/|C(i)|, the negatives' kernels' own
            rows, shifted, shift = i2t, f.masked and softmax.smooths(sc.eps), None
            if f.group_mode != 0:
                rows, shifted, shift = i2t._replace(delta=delta_r), softmax.smooths(sc.eps), shift_r
            d_v_own, d_n_own = own_negatives.grads(rows, g, own, v_hat, sc.eps, x.img.shape[0], shifted, shift)
            d_v.add_(d_v_own)
            d_own = own_negatives.unnormalize(x.own_negatives, d_n_own, sc.inv_tau, f.normalize)
        else:
            d_own = torch.zeros_like(x.own_negatives)
        own_counts = None if f.masked else own.keep.sum(dim=1)
        del own
    if s.m == 0:
        del v_hat, t_hat  # peak memory: the finisher forms them again
        d_img, d_txt, dz_z = softmax.finish_symmetric(
            i2t, t2i, g, x.img, x.txt, out.rv, out.rt, d_v, d_t, sc.inv_tau, sc.eps, f.normalize, dz_z,
            own_counts=own_counts,
        )  # fmt: skip
        d_neg = x.negatives.new_empty(x.negatives.shape)
    else:
        n_hat = epilogue.scaled(x.negatives, out.rn, sc.dt)
        if need_features:  # the block: its forward's shares (P over all N + M columns), or a recompute
            a, b, ra, rb = s.block_args(x, f, out.rv, out.rt, out.rn)
            d_v_block, d_n = RAW.cpp_raw_directional_bwd(
                v_hat, n_hat, a, b, ra, rb, out.pos, sc.inv_tau, delta_r, out.row_acc, out.col_acc, g, s.m,
                sc.gamma, sc.threshold, shift_r, *s.block_mask_args(x),
            )  # fmt: skip
            d_v.add_(d_v_block)
        else:
            d_n = torch.zeros_like(n_hat)
        d_keys = torch.cat([d_t, d_n])  # [dt̂; dn̂]: i2t's keys, one buffer
        keys_hat = torch.cat([t_hat, n_hat])
        del n_hat, d_t, d_n
        if dz_z is None:  # the diagonal positives' and the smoothing's parts (positive modes: in the shares)
            dz_z = softmax.add_positive_and_smoothing(i2t, g, v_hat, keys_hat, d_v, d_keys, 0, sc.eps)
            dz_z = dz_z + softmax.add_positive_and_smoothing(
                t2i, g, t_hat, v_hat, d_keys[: x.img.shape[0]], d_v, 0, sc.eps
            )
        del v_hat, t_hat, keys_hat
        d_img, d_txt, d_neg = _unnormalize_with_block(x, out, d_v, d_keys, sc.inv_tau, f.normalize)
    return d_img, d_txt, d_neg, d_own, epilogue.tau_grad(dz_z, sc.inv_tau, x.tau.dtype, x.tau.shape)


def _unnormalize_with_block(x: SymmetricInputs, out: FamilyOut, d_v, d_keys, inv_tau, normalize: bool):
    """dL/dimg, dL/dtxt, dL/dnegatives in their dtypes from dL/dv̂ and dL/d[t̂; n̂] (times τ)."""
    n = x.img.shape[0]
    d_keys.mul_(inv_tau)
    d_img = epilogue.unnormalize_grad(x.img, out.rv, d_v.mul_(inv_tau), normalize).to(x.img.dtype).contiguous()
    d_t, d_n = d_keys[:n], d_keys[n:]
    if not normalize:  # unnormalize_grad returns them as they are: an operator's outputs may not alias
        d_t, d_n = d_t.clone(), d_n.clone()
    d_txt = epilogue.unnormalize_grad(x.txt, out.rt, d_t, normalize).to(x.txt.dtype).contiguous()
    d_neg = epilogue.unnormalize_grad(x.negatives, out.rn, d_n, normalize).to(x.negatives.dtype).contiguous()
    return d_img, d_txt, d_neg


@operator(*_BACKWARD, returns=_GRADS)
def _backward_fake(grad, x: SymmetricInputs, out, f, need_features):
    return tuple(t.new_empty(t.shape) for t in (x.img, x.txt, x.negatives, x.own_negatives, x.tau))


SymmetricNLL = glue.fused_op(
    "cpp",
    "cpp_symmetric_nll",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    tau_input=SymmetricInputs._fields.index("tau"),
    feature_inputs=(0, 1, 2, 3),
    device_types="cpu",
)
