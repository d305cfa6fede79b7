"""``hnclip::cpp_directional_nll``: one direction on the C++ kernels, the operator body.

M query rows against N key columns, the positive of row i at column ``offset + i``: what the
distributed loss runs per rank, twice (:func:`hnclip_kernels.backends.rank_losses`). The
hard-negative family's masking (``docs/hard_negatives.md``) arrives as optional inputs, empty
tensors when absent (then the call is exactly the plain directional one): mask captions (the
threshold's cosine compares captions while ``margin="image_text"`` takes the margin from the
images) and group ids (columns k < K whose id equals the row's are no negatives). With a positive
``group_mode`` code (``docs/hard_negatives.md#multi-positive-targets``) those columns and the
row's own are its positives: the sweeps run as under "mask" (their statistics over the negatives),
the raw positives' kernels (``csrc/positives.cpp``) add the positives' statistics and shares, and
the forward keeps no shares (their P is normalised over the negatives only; the backward
recomputes). Registered with its backward, autograd formula, fakes and vmap rule by
:func:`..glue.fused_op`.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ...numerics import compute_dtype
from .. import epilogue, glue, softmax
from ..outputs import CppDirectionalOut, schema
from .layouts import DirectionalFlags, DirectionalInputs, Saved, operator
from .raw import RAW, FamilyMasks, scalars, shift_arg

_GRADS = Tuple[Tensor, Tensor, Tensor]  # dL/dq, dL/dk, dL/dτ


def _mask_args(x: DirectionalInputs, f: DirectionalFlags, dt) -> list:
    """The raw kernels' masking arguments after ``eps``/``shift``: ``ca, cb, ma, mb, qg, kg``."""
    family = FamilyMasks(x.mask_query, x.mask_key, x.query_groups, x.key_groups)
    return family.raw_args(x.a, x.b, f.normalize, f.masked, dt)


@operator(DirectionalInputs, DirectionalFlags, returns=schema(CppDirectionalOut))
def _forward(x: DirectionalInputs, f: DirectionalFlags):
    """Per-row losses (M,) and what the backward needs (``CppDirectionalOut``); ``kept`` (M,) with
    masking (``masked``: a pair at caption cosine ≥ the threshold, or of equal group ids, is no
    negative; with ids alone the threshold is +inf, no cosine test), else empty."""
    sc = scalars(x.q, x.tau, x.gamma, x.label_smoothing, x.threshold, f.masked)
    rq, rk, ra, rb = (epilogue.inv_norms(t, f.normalize, sc.dt) for t in (x.q, x.k, x.a, x.b))
    q_hat, k_hat = epilogue.scaled(x.q, rq, sc.dt), epilogue.scaled(x.k, rk, sc.dt)
    pos = epilogue.positive_logits(q_hat, k_hat, f.offset, sc.inv_tau)
    raw = RAW.cpp_raw_directional_fwd(
        q_hat,
        k_hat,
        x.a,
        x.b,
        ra,
        rb,
        pos,
        sc.inv_tau,
        f.offset,
        sc.gamma,
        f.need_grad,
        sc.threshold,
        sc.eps,
        *_mask_args(x, f, sc.dt),
    )
    out = CppDirectionalOut(None, rq, rk, ra, rb, pos, *raw, q_hat.new_empty((0,)))
    if f.group_mode == 0:
        return out._replace(loss=softmax.row_losses(out.stats(f.masked), x.k.shape[0], sc.eps))
    extra = RAW.cpp_raw_positive_fwd(q_hat, k_hat, pos, sc.inv_tau, f.offset, x.query_groups, x.key_groups)
    loss = softmax.positive_losses(out.stats(f.masked), extra, f.group_mode, sc.eps)
    return out._replace(loss=loss, positives=extra)


@operator(DirectionalInputs, DirectionalFlags, returns=schema(CppDirectionalOut))
def _forward_fake(x: DirectionalInputs, f: DirectionalFlags):
    dt = compute_dtype(x.q.dtype)
    return CppDirectionalOut.fake(x.q, x.k, f.masked, f.need_grad, dt, positives=f.group_mode != 0)


_BACKWARD = (("grad", Tensor), DirectionalInputs, Saved(CppDirectionalOut), DirectionalFlags, ("need_qk", bool))


@operator(*_BACKWARD, returns=_GRADS)
def _backward(grad: Tensor, x: DirectionalInputs, out: CppDirectionalOut, f: DirectionalFlags, need_qk: bool):
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    sc = scalars(x.q, x.tau, x.gamma, x.label_smoothing, x.threshold, f.masked)
    g = grad.to(sc.dt).contiguous()
    stats = out.stats(f.masked)
    shift, delta, dz_z = shift_arg(stats, sc.eps, f.masked), out.delta, None
    if f.group_mode != 0:  # the negatives' P over all the row's classes; the positives' own kernel
        delta, shift, factors = softmax.positive_factors(stats, out.positives, sc.eps)
    q_hat, k_hat = epilogue.scaled(x.q, out.rq, sc.dt), epilogue.scaled(x.k, out.rk, sc.dt)
    if need_qk:
        d_q_neg, d_k_neg = RAW.cpp_raw_directional_bwd(
            q_hat,
            k_hat,
            x.a,
            x.b,
            out.ra,
            out.rb,
            out.pos,
            sc.inv_tau,
            delta,
            out.row_acc,
            out.col_acc,
            g,
            f.offset,
            sc.gamma,
            sc.threshold,
            shift,
            *_mask_args(x, f, sc.dt),
        )
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q_neg, d_k_neg = torch.zeros_like(q_hat), torch.zeros_like(k_hat)
    if f.group_mode != 0:
        d_q_pos, d_k_pos, dz_d = RAW.cpp_raw_positive_bwd(
            q_hat, k_hat, out.pos, sc.inv_tau, f.offset, x.query_groups, x.key_groups, factors, g, sc.eps,
            f.group_mode,
        )  # fmt: skip
        if need_qk:
            d_q_neg.add_(d_q_pos)
            d_k_neg.add_(d_k_pos)
        dz_z = softmax.positive_dz_z(stats, factors, g, dz_d)
    del q_hat, k_hat  # peak memory: the finisher forms them again after the kernel's temporaries are gone
    d_q, d_k, dz_z = softmax.finish_directional(
        stats, g, x.q, x.k, out.rq, out.rk, d_q_neg, d_k_neg, f.offset, sc.inv_tau, sc.eps, f.normalize, dz_z
    )
    return d_q, d_k, epilogue.tau_grad(dz_z, sc.inv_tau, x.tau.dtype, x.tau.shape)


@operator(*_BACKWARD, returns=_GRADS)
def _backward_fake(grad, x: DirectionalInputs, out, f, need_qk):
    return x.q.new_empty(x.q.shape), x.k.new_empty(x.k.shape), x.tau.new_empty(x.tau.shape)


DirectionalNLL = glue.fused_op(
    "cpp",
    "cpp_directional_nll",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    tau_input=DirectionalInputs._fields.index("tau"),
    device_types="cpu",
)
