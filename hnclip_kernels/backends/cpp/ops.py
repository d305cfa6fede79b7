"""Fused HN-CLIP loss on CPU: the C++ kernels of ``csrc/`` and their autograd.

This module wraps the raw C++ kernels (:mod:`.raw`: what they compute, their argument
conventions and fakes), together with the O(N·D) algebra of :mod:`..epilogue`, in the
operators ``hnclip::cpp_directional_nll`` (what the distributed loss runs per rank) and
``hnclip::cpp_symmetric_nll`` (what ``hn_clip_loss(backend="cpp")`` runs), each with a
``*_backward`` operator, registered with their autograd formulas, fakes and vmap rules by
:func:`..glue.fused_op` (the same glue as the Triton backend's ``hnclip::triton_*``). Being registered operators they compose with
``torch.compile(fullgraph=True)`` (no graph break) and ``torch.autograd.gradcheck``.
γ and ε reach the operators as 0-dim float64 tensors, not ``float`` arguments, so a γ
schedule under ``torch.compile`` reuses one graph instead of recompiling per value.
The ``*_backward`` operators' own autograd formula raises: a second derivative through
this backend is one clear error naming backend="torch" (:mod:`hnclip_kernels.backends.first_order`).

``torch.func``: the wrappers :func:`directional_nll_cpp` and :func:`hn_clip_pairs_cpp` (and so
``hn_clip_loss``) work under ``grad``, ``grad_and_value``, ``vjp``, ``jacrev`` and ``vmap``,
nested too (``vmap(grad(...))``, per-example gradients), with the eager results; under
``vmap`` the kernels run once per batch entry (a loop). The operators called directly
(``torch.ops.hnclip.cpp_*``) support autograd and ``vmap`` but not ``torch.func.grad``: the
autograd.Function that ``torch.library.register_autograd`` builds has no ``setup_context``,
which functorch requires (pytorch/pytorch#168393). Forward mode (``jvp``, ``jacfwd``,
``hessian``) raises a clear error.

Importing this module raises ImportError when the extension was not built (:mod:`.raw`);
:mod:`hnclip_kernels.backends` treats that as "C++ backend unavailable".
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ...numerics import compute_dtype
from ...validation import check_directional
from .. import epilogue, glue
from ..outputs import CppDirectionalOut, SymmetricOut, row_stats, schema
from . import flops
from .raw import RAW, caption_norms, scalars, shift_arg

# ---- one direction: M query rows against N key columns, positive of row i at column offset + i


def _directional_nll(
    q: Tensor,
    k: Tensor,
    a: Tensor,
    b: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    offset: int,
    normalize: bool,
    masked: bool,
    need_grad: bool,
) -> schema(CppDirectionalOut):
    """Per-row losses (M,) and what the backward needs (``CppDirectionalOut``); ``kept`` (M,) with
    false-negative masking (``masked``: a pair at caption cosine ≥ ``threshold`` is no negative),
    else empty."""
    return directional_forward(q, k, a, b, tau, gamma, label_smoothing, threshold, offset, normalize, masked, need_grad)


def directional_forward(
    q, k, a, b, tau, gamma, label_smoothing, threshold, offset, normalize, masked, need_grad, family=None
):  # fmt: skip
    """The body of ``hnclip::cpp_directional_nll`` and, with ``family`` (a :class:`.raw.FamilyMasks`:
    the hard-negative family's mask captions and group ids), ``hnclip::cpp_family_directional_nll``."""
    sc = scalars(q, tau, gamma, label_smoothing, threshold, masked)
    rq, rk, ra, rb = (epilogue.inv_norms(x, normalize, sc.dt) for x in (q, k, a, b))
    q_hat, k_hat = epilogue.scaled(q, rq, sc.dt), epilogue.scaled(k, rk, sc.dt)
    pos = epilogue.positive_logits(q_hat, k_hat, offset, sc.inv_tau)
    raw = RAW.cpp_raw_directional_fwd(
        q_hat,
        k_hat,
        a,
        b,
        ra,
        rb,
        pos,
        sc.inv_tau,
        offset,
        sc.gamma,
        need_grad,
        sc.threshold,
        sc.eps,
        *_mask_args(a, b, normalize, masked, sc.dt, family),
    )
    out = CppDirectionalOut(None, rq, rk, ra, rb, pos, *raw)
    return out._replace(loss=epilogue.row_losses(out.stats(masked), k.shape[0], sc.eps))


def _mask_args(a, b, normalize: bool, masked: bool, dt, family) -> list:
    """The raw kernels' masking arguments after ``eps``/``shift``: the caption norms (today's
    call), then with ``family`` its mask captions and group ids."""
    if family is None:
        return caption_norms((a, b), normalize, masked, dt)
    return family.raw_args(a, b, normalize, masked, dt)


def _directional_nll_fake(q, k, a, b, tau, gamma, label_smoothing, threshold, offset, normalize, masked, need_grad):
    return CppDirectionalOut.fake(q, k, masked, need_grad, compute_dtype(q.dtype))


def _directional_nll_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    a: Tensor,
    b: Tensor,
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
    row_acc: Tensor,
    col_acc: Tensor,
    offset: int,
    normalize: bool,
    masked: bool,
    need_grad: bool,
    need_qk: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    return directional_backward(
        grad, q, k, a, b, tau, gamma, label_smoothing, threshold, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept,
        row_acc, col_acc, offset, normalize, masked, need_qk,
    )  # fmt: skip


def directional_backward(
    grad, q, k, a, b, tau, gamma, label_smoothing, threshold, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept,
    row_acc, col_acc, offset, normalize, masked, need_qk, family=None,
):  # fmt: skip
    """The body of ``hnclip::cpp_directional_nll_backward`` and, with ``family``, of
    ``hnclip::cpp_family_directional_nll_backward`` (:func:`directional_forward`)."""
    sc = scalars(q, tau, gamma, label_smoothing, threshold, masked)
    g = grad.to(sc.dt).contiguous()
    stats = row_stats(pos, delta, mean_neg, dsum, kept, masked)
    shift = shift_arg(stats, sc.eps, masked)
    q_hat, k_hat = epilogue.scaled(q, rq, sc.dt), epilogue.scaled(k, rk, sc.dt)
    if need_qk:
        d_q_neg, d_k_neg = RAW.cpp_raw_directional_bwd(
            q_hat,
            k_hat,
            a,
            b,
            ra,
            rb,
            pos,
            sc.inv_tau,
            delta,
            row_acc,
            col_acc,
            g,
            offset,
            sc.gamma,
            sc.threshold,
            shift,
            *_mask_args(a, b, normalize, masked, sc.dt, family),
        )
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q_neg, d_k_neg = torch.zeros_like(q_hat), torch.zeros_like(k_hat)
    del q_hat, k_hat  # peak memory: the finisher forms them again after the kernel's temporaries are gone
    d_q, d_k, dz_z = epilogue.finish_directional(
        stats, g, q, k, rq, rk, d_q_neg, d_k_neg, offset, sc.inv_tau, sc.eps, normalize
    )
    return d_q, d_k, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _directional_grads_fake(grad, q, k, a, b, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


_DirectionalNLL = glue.fused_op(
    "cpp",
    "cpp_directional_nll",
    forward=_directional_nll,
    forward_fake=_directional_nll_fake,
    backward=_directional_nll_backward,
    backward_fake=_directional_grads_fake,
    tau_input=4,
    device_types="cpu",
)


# ---- the single-process loss: both directions from one product per tile
def _symmetric_nll(
    img: Tensor,
    txt: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    normalize: bool,
    masked: bool,
) -> schema(SymmetricOut):
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs (``SymmetricOut``;
    ``kept``: empty without false-negative masking)."""
    sc = scalars(img, tau, gamma, label_smoothing, threshold, masked)
    rv, rt = epilogue.inv_norms(img, normalize, sc.dt), epilogue.inv_norms(txt, normalize, sc.dt)
    v_hat, t_hat = epilogue.scaled(img, rv, sc.dt), epilogue.scaled(txt, rt, sc.dt)
    pos = epilogue.positive_logits(v_hat, t_hat, 0, sc.inv_tau)  # Z_kk, the same for both directions
    raw = RAW.cpp_raw_symmetric_fwd(
        v_hat,
        t_hat,
        pos,
        sc.inv_tau,
        sc.gamma,
        sc.threshold,
        *caption_norms((txt,), normalize, masked, sc.dt),
    )
    out = SymmetricOut(None, rv, rt, pos, *raw)
    return out._replace(pairs=epilogue.pair_losses(out.i2t(masked), out.t2i(masked), img.shape[0], sc.eps))


def _symmetric_nll_fake(img, txt, tau, gamma, label_smoothing, threshold, normalize, masked, *rest):
    return SymmetricOut.fake(img, masked, compute_dtype(img.dtype))


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
    need_vt: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape)."""
    sc = scalars(img, tau, gamma, label_smoothing, threshold, masked)
    g = 0.5 * grad.to(sc.dt).contiguous()  # each direction's row k gets half of pair k's gradient
    i2t = row_stats(pos, delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, masked)
    t2i = row_stats(pos, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i, masked)
    v_hat, t_hat = epilogue.scaled(img, rv, sc.dt), epilogue.scaled(txt, rt, sc.dt)
    if need_vt:
        d_v, d_t = RAW.cpp_raw_symmetric_bwd(
            v_hat,
            t_hat,
            pos,
            sc.inv_tau,
            delta_i2t,
            delta_t2i,
            g,
            sc.gamma,
            sc.threshold,
            shift_arg(i2t, sc.eps, masked),
            shift_arg(t2i, sc.eps, masked),
            *caption_norms((txt,), normalize, masked, sc.dt),
        )
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = torch.zeros_like(v_hat), torch.zeros_like(t_hat)
    del v_hat, t_hat
    d_img, d_txt, dz_z = epilogue.finish_symmetric(
        i2t, t2i, g, img, txt, rv, rt, d_v, d_t, sc.inv_tau, sc.eps, normalize
    )
    return d_img, d_txt, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _symmetric_grads_fake(grad, img, txt, tau, *rest):
    return img.new_empty(img.shape), txt.new_empty(txt.shape), tau.new_empty(tau.shape)


_SymmetricNLL = glue.fused_op(
    "cpp",
    "cpp_symmetric_nll",
    forward=_symmetric_nll,
    forward_fake=_symmetric_nll_fake,
    backward=_symmetric_nll_backward,
    backward_fake=_symmetric_grads_fake,
    tau_input=2,
    device_types="cpu",
)
flops.register()  # FlopCounterMode's formulas of the operators and the raw kernels


# ---- public wrappers
def directional_nll_cpp(
    queries,
    keys,
    *,
    query_txt,
    key_txt,
    tau,
    offset,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    false_negative_threshold=None,
):
    """C++ counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch` (same
    keyword-only protocol and result).

    Per-row losses (M,) of query rows ``queries`` (M, D) against key rows ``keys`` (N, D), the
    positive of row i at column ``offset + i``; margin factors ``query_txt`` (M, D), ``key_txt``
    (N, D) are stop-gradient. float32 result (float64 for float64 inputs); gradients reach
    ``queries``, ``keys`` and ``tau`` (a 0-dim tensor). ``return_stats``: also the detached
    ``epilogue.RowStats`` the backward uses. ``gamma`` and ``label_smoothing``: Python floats
    (or 0-dim tensors, which get no gradient); under ``torch.compile`` a new value does not
    recompile. Works under ``torch.func.grad``/``vjp``/``vmap`` (vmap: one kernel call per batch
    entry); second derivatives raise the ``RuntimeError`` naming backend="torch".
    ``false_negative_threshold``: as the reference's (the kernels compare the cosine of the
    normalised captions' product â_i·b̂_k as BLAS forms it on each tile, in the compute dtype).
    """
    check_directional(queries, keys, query_txt, key_txt, offset)
    # the forward also produces the gradient shares only when a backward can follow
    need_grad = torch.is_grad_enabled() and bool(queries.requires_grad or keys.requires_grad)
    thr_t, masked = glue.threshold_args(false_negative_threshold, queries)
    out = CppDirectionalOut._make(
        glue.call(
            _DirectionalNLL,
            torch.ops.hnclip.cpp_directional_nll,
            queries,
            keys,
            query_txt,
            key_txt,
            tau,
            glue.hyperparameter(gamma, queries),
            glue.hyperparameter(label_smoothing, queries),
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            need_grad,
        )
    )
    return (out.loss, out.stats(masked)) if return_stats else out.loss


def hn_clip_pairs_cpp(
    img, txt, *, tau, gamma, label_smoothing, normalize, return_stats=False, false_negative_threshold=None
):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the single-process loss in one operator.

    Each logit tile is computed once for both directions (its rows are i2t's, its columns
    t2i's): one product in the forward, three in the backward, against six for two
    :func:`directional_nll_cpp` calls. float32 result (float64 for float64 inputs);
    gradients reach ``img``, ``txt`` and ``tau`` (a 0-dim tensor). ``return_stats``: also
    ``(i2t, t2i)``, the detached ``epilogue.RowStats`` of both directions. ``gamma``,
    ``label_smoothing``, ``false_negative_threshold``, ``torch.compile`` and ``torch.func``: as
    :func:`directional_nll_cpp` (the caption tile t̂_I t̂_Jᵀ is formed beside each logit tile).
    """
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    out = SymmetricOut._make(
        glue.call(
            _SymmetricNLL,
            torch.ops.hnclip.cpp_symmetric_nll,
            img,
            txt,
            tau,
            glue.hyperparameter(gamma, img),
            glue.hyperparameter(label_smoothing, img),
            thr_t,
            bool(normalize),
            masked,
        )
    )
    return (out.pairs, (out.i2t(masked), out.t2i(masked))) if return_stats else out.pairs
