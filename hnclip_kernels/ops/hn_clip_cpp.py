"""Fused HN-CLIP loss on CPU: the C++ kernels of ``csrc/`` and their autograd.

The extension ``hnclip_kernels._C`` registers two kernel operators with ``TORCH_LIBRARY``:

* ``torch.ops.hnclip.directional_fwd``: per-row ``delta``, ``mean_neg``, ``dsum`` over the
  negatives (the same three numbers as the Triton forward kernel) and, when a gradient
  will be needed, the negatives' gradient shares for an upstream gradient of 1
  (``Σ_k P_ik k̂_k`` per query row and ``Σ_i P_ik q̂_i`` per key row), computed from the
  same logit tiles, so the backward usually recomputes nothing.
* ``torch.ops.hnclip.directional_bwd``: the negatives' shares for the actual upstream
  gradient ``g`` (a rescale of the forward's shares when ``g`` is the same for every row,
  as for ``mean``/``sum``; otherwise a column sweep that recomputes the tiles).

* ``torch.ops.hnclip.symmetric_fwd`` / ``symmetric_bwd``: the single-process loss (N images
  against N texts, positives on the diagonal). Each logit tile Z = (v̂ + γ t̂) t̂ᵀ / τ is
  computed once for both directions: its rows give the i2t statistics and its columns the
  t2i ones (Zᵀ holds the t2i logits): one product in the forward. The backward recomputes
  a strip of tiles (one product), forms ds_ij = g_i P_ij + g_j P'_ji and applies it to t̂ and
  v̂ (two products). Four N×N×D
  products for forward + backward, against six for two directional calls (ten when the
  upstream gradient differs per row).

This module wraps them, together with the O(N·D) algebra of :mod:`.epilogue`, in
``torch.library.custom_op`` operators, ``hnclip::directional_nll`` (what the distributed
loss runs per rank) and ``hnclip::symmetric_nll`` (what ``hn_clip_loss(backend="cpp")``
runs), each with a ``*_backward`` operator, and registers the autograd formulas and the
fake (meta) kernels once, at import. Being registered operators they compose with
``torch.compile(fullgraph=True)`` (no graph break) and ``torch.autograd.gradcheck``.
The ``*_backward`` operators' own autograd formula raises: a second derivative through
this backend is one clear error naming backend="torch" (:mod:`hnclip_kernels._first_order`).

Importing this module raises ImportError when the extension was not built;
``hnclip_kernels.loss`` treats that as "C++ backend unavailable".
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .._first_order import raising_backward
from ..reference import NORM_EPS, compute_dtype
from . import epilogue

try:
    from .. import _C  # noqa: F401  (loading the library runs its TORCH_LIBRARY registrations)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"hnclip_kernels._C, the C++ CPU kernel, is not available ({exc}); reinstall with "
        "`pip install --no-build-isolation -e .` to compile csrc/"
    ) from exc

if not hasattr(torch.ops.hnclip, "directional_fwd"):  # pragma: no cover
    raise ImportError("hnclip_kernels._C loaded but did not register torch.ops.hnclip.directional_fwd")


def _inv_norms(x: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    """1 / max(‖x_i‖, eps) per row in ``dt`` (ones when not normalising)."""
    if not normalize:
        return torch.ones(x.shape[0], device=x.device, dtype=dt)
    return 1.0 / torch.linalg.vector_norm(x, dim=1, dtype=dt).clamp_min(NORM_EPS)


def _scaled(x: Tensor, inv_norm: Tensor, dt: torch.dtype) -> Tensor:
    # the C++ side builds b̂ / â with the same expression and compares bits to spot i2t / t2i
    return x.to(dt) * inv_norm[:, None]


_FwdOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("hnclip::directional_nll", mutates_args=(), device_types="cpu")
def _directional_nll(
    q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor,
    offset: int, gamma: float, label_smoothing: float, normalize: bool, need_grad: bool,
) -> _FwdOut:
    """Per-row losses (M,) and what the backward needs:
    (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, row_acc, col_acc)."""
    dt = compute_dtype(q.dtype)
    rq, rk, ra, rb = (_inv_norms(x, normalize, dt) for x in (q, k, a, b))
    inv_tau = 1.0 / tau.detach().to(dt)
    q_hat, k_hat = _scaled(q, rq, dt), _scaled(k, rk, dt)
    pos = epilogue.positive_logits(q_hat, k_hat, offset, inv_tau)
    delta, mean_neg, dsum, row_acc, col_acc = torch.ops.hnclip.directional_fwd(
        q_hat, k_hat, a, b, ra, rb, pos, inv_tau, offset, gamma, need_grad)
    loss = epilogue.row_losses(epilogue.RowStats(pos, delta, mean_neg, dsum), k.shape[0], label_smoothing)
    return loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, row_acc, col_acc


@_directional_nll.register_fake
def _directional_nll_fake(q, k, a, b, tau, offset, gamma, label_smoothing, normalize, need_grad):
    dt = compute_dtype(q.dtype)
    m, d = q.shape
    n = k.shape[0]
    loss, rq, ra, pos, delta, mean_neg, dsum = (q.new_empty((m,), dtype=dt) for _ in range(7))
    rk, rb = q.new_empty((n,), dtype=dt), q.new_empty((n,), dtype=dt)
    row_acc = q.new_empty((m if need_grad else 0, d), dtype=dt)
    col_acc = q.new_empty((n if need_grad else 0, d), dtype=dt)
    return loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, row_acc, col_acc


@torch.library.custom_op("hnclip::directional_nll_backward", mutates_args=(), device_types="cpu")
def _directional_nll_backward(
    grad: Tensor, q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor,
    rq: Tensor, rk: Tensor, ra: Tensor, rb: Tensor, pos: Tensor, delta: Tensor, mean_neg: Tensor, dsum: Tensor,
    row_acc: Tensor, col_acc: Tensor,
    offset: int, gamma: float, label_smoothing: float, normalize: bool, need_qk: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    dt = compute_dtype(q.dtype)
    g = grad.to(dt).contiguous()
    inv_tau = 1.0 / tau.detach().to(dt)
    q_hat, k_hat = _scaled(q, rq, dt), _scaled(k, rk, dt)
    if need_qk:
        d_q_neg, d_k_neg = torch.ops.hnclip.directional_bwd(
            q_hat, k_hat, a, b, ra, rb, pos, inv_tau, delta, row_acc, col_acc, g, offset, gamma)
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q_neg, d_k_neg = torch.zeros_like(q_hat), torch.zeros_like(k_hat)
    stats = epilogue.RowStats(pos, delta, mean_neg, dsum)
    d_q_hat, d_k_hat, d_tau_scaled = epilogue.grads_outside_kernel(
        stats, g, q_hat, k_hat, d_q_neg, d_k_neg, offset, inv_tau, label_smoothing)
    del q_hat, k_hat, d_q_neg, d_k_neg  # peak memory: free before the normalisation's temporaries
    # contiguous whatever the inputs' strides, as the fake kernel promises
    d_q = epilogue.unnormalize_grad(q, rq, d_q_hat, normalize).to(q.dtype).contiguous()
    d_k = epilogue.unnormalize_grad(k, rk, d_k_hat, normalize).to(k.dtype).contiguous()
    d_tau = (d_tau_scaled * inv_tau).to(tau.dtype).reshape(tau.shape).contiguous()
    return d_q, d_k, d_tau


@_directional_nll_backward.register_fake
def _directional_nll_backward_fake(grad, q, k, a, b, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


def _setup_context(ctx, inputs, output):
    q, k, a, b, tau, offset, gamma, label_smoothing, normalize, need_grad = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, a, b, tau, *saved)
    ctx.options = (int(offset), float(gamma), float(label_smoothing), bool(normalize))


def _backward(ctx, grad_loss, *_unused):
    q, k, a, b, tau, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_loss is None:
        grad_loss = torch.zeros(q.shape[0], dtype=compute_dtype(q.dtype), device=q.device)
    need_qk = bool(needs[0] or needs[1])
    d_q, d_k, d_tau = torch.ops.hnclip.directional_nll_backward(grad_loss, q, k, a, b, tau, *saved, *ctx.options, need_qk)
    return (d_q if needs[0] else None, d_k if needs[1] else None, None, None,
            d_tau if needs[4] else None, None, None, None, None, None)


torch.library.register_autograd("hnclip::directional_nll", _backward, setup_context=_setup_context)
# the backward is not differentiable again: a second derivative raises one clear error naming backend="torch"
torch.library.register_autograd("hnclip::directional_nll_backward", raising_backward("cpp"))


# ---- fake kernels of the raw C++ operators (so they can be traced on their own too) ----
@torch.library.register_fake("hnclip::directional_fwd")
def _directional_fwd_fake(q_hat, k_hat, a, b, ra, rb, pos, inv_tau, offset, gamma, need_grad):
    m, d = q_hat.shape
    n = k_hat.shape[0]
    vec = [q_hat.new_empty((m,)) for _ in range(3)]
    return (*vec, q_hat.new_empty((m if need_grad else 0, d)), q_hat.new_empty((n if need_grad else 0, d)))


@torch.library.register_fake("hnclip::directional_bwd")
def _directional_bwd_fake(q_hat, k_hat, a, b, ra, rb, pos, inv_tau, delta, row_acc, col_acc, g, offset, gamma):
    return q_hat.new_empty(q_hat.shape), k_hat.new_empty(k_hat.shape)


# ---- the single-process loss: both directions from one product per tile ----
_SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("hnclip::symmetric_nll", mutates_args=(), device_types="cpu")
def _symmetric_nll(
    img: Tensor, txt: Tensor, tau: Tensor, gamma: float, label_smoothing: float, normalize: bool,
) -> _SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs:
    (pairs, rv, rt, pos, delta_i2t, mean_neg_i2t, dsum_i2t, delta_t2i, mean_neg_t2i, dsum_t2i)."""
    dt = compute_dtype(img.dtype)
    rv, rt = _inv_norms(img, normalize, dt), _inv_norms(txt, normalize, dt)
    inv_tau = 1.0 / tau.detach().to(dt)
    v_hat, t_hat = _scaled(img, rv, dt), _scaled(txt, rt, dt)
    pos = epilogue.positive_logits(v_hat, t_hat, 0, inv_tau)  # Z_kk, the same for both directions
    stats = torch.ops.hnclip.symmetric_fwd(v_hat, t_hat, pos, inv_tau, gamma)
    n = img.shape[0]
    i2t = epilogue.row_losses(epilogue.RowStats(pos, *stats[:3]), n, label_smoothing)
    t2i = epilogue.row_losses(epilogue.RowStats(pos, *stats[3:]), n, label_smoothing)
    return (0.5 * (i2t + t2i), rv, rt, pos, *stats)


@_symmetric_nll.register_fake
def _symmetric_nll_fake(img, txt, tau, gamma, label_smoothing, normalize):
    dt = compute_dtype(img.dtype)
    return tuple(img.new_empty((img.shape[0],), dtype=dt) for _ in range(10))


@torch.library.custom_op("hnclip::symmetric_nll_backward", mutates_args=(), device_types="cpu")
def _symmetric_nll_backward(
    grad: Tensor, img: Tensor, txt: Tensor, tau: Tensor,
    rv: Tensor, rt: Tensor, pos: Tensor, delta_r: Tensor, mean_neg_r: Tensor, dsum_r: Tensor,
    delta_c: Tensor, mean_neg_c: Tensor, dsum_c: Tensor,
    gamma: float, label_smoothing: float, normalize: bool, need_vt: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape)."""
    dt = compute_dtype(img.dtype)
    g = 0.5 * grad.to(dt).contiguous()  # each direction's row k gets half of pair k's gradient
    inv_tau = 1.0 / tau.detach().to(dt)
    v_hat, t_hat = _scaled(img, rv, dt), _scaled(txt, rt, dt)
    if need_vt:
        d_v, d_t = torch.ops.hnclip.symmetric_bwd(v_hat, t_hat, pos, inv_tau, delta_r, delta_c, g, gamma)
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = torch.zeros_like(v_hat), torch.zeros_like(t_hat)
    i2t = epilogue.RowStats(pos, delta_r, mean_neg_r, dsum_r)
    t2i = epilogue.RowStats(pos, delta_c, mean_neg_c, dsum_c)
    dz_z = epilogue.add_positive_and_smoothing(i2t, g, v_hat, t_hat, d_v, d_t, 0, label_smoothing)
    dz_z = dz_z + epilogue.add_positive_and_smoothing(t2i, g, t_hat, v_hat, d_t, d_v, 0, label_smoothing)
    del v_hat, t_hat  # peak memory: free before the normalisation's temporaries
    d_img = epilogue.unnormalize_grad(img, rv, d_v.mul_(inv_tau), normalize).to(img.dtype).contiguous()
    d_txt = epilogue.unnormalize_grad(txt, rt, d_t.mul_(inv_tau), normalize).to(txt.dtype).contiguous()
    d_tau = (-dz_z * inv_tau).to(tau.dtype).reshape(tau.shape).contiguous()  # dL/dτ = −(Σ dZ·Z) / τ
    return d_img, d_txt, d_tau


@_symmetric_nll_backward.register_fake
def _symmetric_nll_backward_fake(grad, img, txt, tau, *rest):
    return img.new_empty(img.shape), txt.new_empty(txt.shape), tau.new_empty(tau.shape)


def _sym_setup_context(ctx, inputs, output):
    img, txt, tau, gamma, label_smoothing, normalize = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(img, txt, tau, *saved)
    ctx.options = (float(gamma), float(label_smoothing), bool(normalize))


def _sym_backward(ctx, grad_pairs, *_unused):
    img, txt, tau, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_pairs is None:
        grad_pairs = torch.zeros(img.shape[0], dtype=compute_dtype(img.dtype), device=img.device)
    need_vt = bool(needs[0] or needs[1])
    d_img, d_txt, d_tau = torch.ops.hnclip.symmetric_nll_backward(grad_pairs, img, txt, tau, *saved, *ctx.options,
                                                                  need_vt)
    return (d_img if needs[0] else None, d_txt if needs[1] else None, d_tau if needs[2] else None,
            None, None, None)


torch.library.register_autograd("hnclip::symmetric_nll", _sym_backward, setup_context=_sym_setup_context)
torch.library.register_autograd("hnclip::symmetric_nll_backward", raising_backward("cpp"))


@torch.library.register_fake("hnclip::symmetric_fwd")
def _symmetric_fwd_fake(v_hat, t_hat, pos, inv_tau, gamma):
    return tuple(v_hat.new_empty((v_hat.shape[0],)) for _ in range(6))


@torch.library.register_fake("hnclip::symmetric_bwd")
def _symmetric_bwd_fake(v_hat, t_hat, pos, inv_tau, delta_r, delta_c, g, gamma):
    return v_hat.new_empty(v_hat.shape), t_hat.new_empty(t_hat.shape)


def directional_nll_cpp(q, k, a, b, tau, offset, gamma, label_smoothing, normalize):
    """C++ counterpart of :func:`hnclip_kernels.reference.directional_nll_torch`.

    Per-row losses (M,) of query rows ``q`` (M, D) against key rows ``k`` (N, D), the
    positive of row i at column ``offset + i``; margin factors ``a`` (M, D), ``b`` (N, D)
    are stop-gradient. float32 result (float64 for float64 inputs); gradients reach ``q``,
    ``k`` and ``tau`` (a 0-dim tensor).
    """
    # the forward also produces the gradient shares only when a backward can follow
    need_grad = torch.is_grad_enabled() and bool(q.requires_grad or k.requires_grad)
    out = torch.ops.hnclip.directional_nll(
        q, k, a, b, tau, int(offset), float(gamma), float(label_smoothing), bool(normalize), need_grad)
    return out[0]


def hn_clip_pairs_cpp(img, txt, tau, gamma, label_smoothing, normalize):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the single-process loss in one operator.

    Each logit tile is computed once for both directions (its rows are i2t's, its columns
    t2i's): one product in the forward, three in the backward, against six for two
    :func:`directional_nll_cpp` calls. float32 result (float64 for float64 inputs);
    gradients reach ``img``, ``txt`` and ``tau`` (a 0-dim tensor).
    """
    return torch.ops.hnclip.symmetric_nll(img, txt, tau, float(gamma), float(label_smoothing), bool(normalize))[0]
