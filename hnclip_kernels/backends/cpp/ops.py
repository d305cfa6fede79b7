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
from . import flops
from .raw import RAW, caption_norms, row_stats, shift_arg, threshold_arg, value_of

# ---- one direction: M query rows against N key columns, positive of row i at column offset + i
_DirOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


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
    need_grad: bool,
    masked: bool,
) -> _DirOut:
    """Per-row losses (M,) and what the backward needs:
    (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept, row_acc, col_acc); ``kept`` (M,) with
    false-negative masking (``masked``: a pair at caption cosine ≥ ``threshold`` is no negative),
    else empty."""
    gamma, label_smoothing = value_of(gamma), value_of(label_smoothing)
    dt = compute_dtype(q.dtype)
    rq, rk, ra, rb = (epilogue.inv_norms(x, normalize, dt) for x in (q, k, a, b))
    inv_tau = 1.0 / tau.detach().to(dt)
    q_hat, k_hat = epilogue.scaled(q, rq, dt), epilogue.scaled(k, rk, dt)
    pos = epilogue.positive_logits(q_hat, k_hat, offset, inv_tau)
    delta, mean_neg, dsum, kept, row_acc, col_acc = RAW.cpp_raw_directional_fwd(
        q_hat,
        k_hat,
        a,
        b,
        ra,
        rb,
        pos,
        inv_tau,
        offset,
        gamma,
        need_grad,
        threshold_arg(threshold, masked),
        label_smoothing,
        *caption_norms((a, b), normalize, masked, dt),
    )
    loss = epilogue.row_losses(row_stats(pos, delta, mean_neg, dsum, kept, masked), k.shape[0], label_smoothing)
    return loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept, row_acc, col_acc


def _directional_nll_fake(q, k, a, b, tau, gamma, label_smoothing, threshold, offset, normalize, need_grad, masked):
    dt = compute_dtype(q.dtype)
    m, d = q.shape
    n = k.shape[0]
    loss, rq, ra, pos, delta, mean_neg, dsum = (q.new_empty((m,), dtype=dt) for _ in range(7))
    rk, rb = q.new_empty((n,), dtype=dt), q.new_empty((n,), dtype=dt)
    kept = q.new_empty((m if masked else 0,), dtype=dt)
    row_acc = q.new_empty((m if need_grad else 0, d), dtype=dt)
    col_acc = q.new_empty((n if need_grad else 0, d), dtype=dt)
    return loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept, row_acc, col_acc


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
    need_grad: bool,
    masked: bool,
    need_qk: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    gamma, label_smoothing = value_of(gamma), value_of(label_smoothing)
    dt = compute_dtype(q.dtype)
    g = grad.to(dt).contiguous()
    inv_tau = 1.0 / tau.detach().to(dt)
    stats = row_stats(pos, delta, mean_neg, dsum, kept, masked)
    shift = shift_arg(stats, label_smoothing, masked)
    q_hat, k_hat = epilogue.scaled(q, rq, dt), epilogue.scaled(k, rk, dt)
    if need_qk:
        d_q_neg, d_k_neg = RAW.cpp_raw_directional_bwd(
            q_hat,
            k_hat,
            a,
            b,
            ra,
            rb,
            pos,
            inv_tau,
            delta,
            row_acc,
            col_acc,
            g,
            offset,
            gamma,
            threshold_arg(threshold, masked),
            shift,
            *caption_norms((a, b), normalize, masked, dt),
        )
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q_neg, d_k_neg = torch.zeros_like(q_hat), torch.zeros_like(k_hat)
    del q_hat, k_hat  # peak memory: the finisher forms them again after the kernel's temporaries are gone
    d_q, d_k, dz_z = epilogue.finish_directional(
        stats, g, q, k, rq, rk, d_q_neg, d_k_neg, offset, inv_tau, label_smoothing, normalize
    )
    return d_q, d_k, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


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
_SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _symmetric_nll(
    img: Tensor,
    txt: Tensor,
    tau: Tensor,
    gamma: Tensor,
    label_smoothing: Tensor,
    threshold: Tensor,
    normalize: bool,
    masked: bool,
) -> _SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs: (pairs, rv, rt, pos,
    delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i)
    (``kept``: empty without false-negative masking)."""
    gamma, label_smoothing = value_of(gamma), value_of(label_smoothing)
    dt = compute_dtype(img.dtype)
    rv, rt = epilogue.inv_norms(img, normalize, dt), epilogue.inv_norms(txt, normalize, dt)
    inv_tau = 1.0 / tau.detach().to(dt)
    v_hat, t_hat = epilogue.scaled(img, rv, dt), epilogue.scaled(txt, rt, dt)
    pos = epilogue.positive_logits(v_hat, t_hat, 0, inv_tau)  # Z_kk, the same for both directions
    stats = RAW.cpp_raw_symmetric_fwd(
        v_hat,
        t_hat,
        pos,
        inv_tau,
        gamma,
        threshold_arg(threshold, masked),
        *caption_norms((txt,), normalize, masked, dt),
    )
    pairs = epilogue.pair_losses(
        row_stats(pos, *stats[:4], masked), row_stats(pos, *stats[4:], masked), img.shape[0], label_smoothing
    )
    return (pairs, rv, rt, pos, *stats)


def _symmetric_nll_fake(img, txt, tau, gamma, label_smoothing, threshold, normalize, masked):
    dt = compute_dtype(img.dtype)
    n = img.shape[0]
    return tuple(img.new_empty((0 if i in (7, 11) and not masked else n,), dtype=dt) for i in range(12))


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
    normalize: bool,
    masked: bool,
    need_vt: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape)."""
    gamma, label_smoothing = value_of(gamma), value_of(label_smoothing)
    dt = compute_dtype(img.dtype)
    g = 0.5 * grad.to(dt).contiguous()  # each direction's row k gets half of pair k's gradient
    inv_tau = 1.0 / tau.detach().to(dt)
    i2t = row_stats(pos, delta_r, mean_neg_r, dsum_r, kept_r, masked)
    t2i = row_stats(pos, delta_c, mean_neg_c, dsum_c, kept_c, masked)
    v_hat, t_hat = epilogue.scaled(img, rv, dt), epilogue.scaled(txt, rt, dt)
    if need_vt:
        d_v, d_t = RAW.cpp_raw_symmetric_bwd(
            v_hat,
            t_hat,
            pos,
            inv_tau,
            delta_r,
            delta_c,
            g,
            gamma,
            threshold_arg(threshold, masked),
            shift_arg(i2t, label_smoothing, masked),
            shift_arg(t2i, label_smoothing, masked),
            *caption_norms((txt,), normalize, masked, dt),
        )
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = torch.zeros_like(v_hat), torch.zeros_like(t_hat)
    del v_hat, t_hat
    d_img, d_txt, dz_z = epilogue.finish_symmetric(
        i2t, t2i, g, img, txt, rv, rt, d_v, d_t, inv_tau, label_smoothing, normalize
    )
    return d_img, d_txt, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


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
    out = glue.call(
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
        need_grad,
        masked,
    )
    if not return_stats:
        return out[0]
    return out[0], row_stats(*out[5:10], masked)


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
    out = glue.call(
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
    if not return_stats:
        return out[0]
    pos = out[3]
    return out[0], (row_stats(pos, *out[4:8], masked), row_stats(pos, *out[8:12], masked))
