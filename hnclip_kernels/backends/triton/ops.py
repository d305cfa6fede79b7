"""The Triton backend as operators: ``hnclip::triton_symmetric_nll`` and
``hnclip::triton_directional_nll`` with their ``*_backward`` operators, and the public wrappers.

The kernels and their launchers live beside this module (:mod:`.forward`: one walk over the
logit tiles for the row and column statistics; :mod:`.backward`: the chunked dS and its
GEMMs). Here, per operator: the O(N·D) algebra around them (:mod:`..epilogue`), and its
registration through :func:`..glue.fused_op`, the glue the C++ backend's ``hnclip::cpp_*``
operators share (autograd formula, raising second derivative, vmap rule, ``torch.func``).

* ``triton_symmetric_nll(img, txt, tau, gamma, label_smoothing, threshold, has_margin, smoothing,
  masked, normalize, precision)`` → (pairs, rv, rt, pos, and the (delta, mean_neg, dsum, kept) of
  i2t then of t2i): what ``hn_clip_loss(backend="triton")`` runs;
* ``triton_directional_nll(q, k, a, b, tau, gamma, label_smoothing, threshold, offset, has_margin,
  smoothing, masked, normalize, precision)`` → (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum,
  kept): what a rank of the distributed loss runs;
* their ``*_backward`` operators → (dL/dq, dL/dk, dL/dτ) in the inputs' dtypes.

τ, γ and ε are tensors (γ and ε 0-dim float64, :func:`..glue.hyperparameter`), so a schedule
of any of them reuses a compiled graph; ``has_margin`` (γ ≠ 0) and ``smoothing`` (ε ≠ 0) are the
kernels' HAS_MARGIN and SMOOTHING flags. False-negative masking: ``threshold`` (a 0-dim float64
tensor like γ) and ``masked`` (the kernels' MASK); ``kept`` (each row's kept negatives) is empty
without it. The kernels read τ and γ from device memory as
(1,) float32 tensors and take no float argument at all: Inductor types a Python float fp64
inside a user kernel, and with γ a float argument the float32 tiles become fp64 and the
forward kernel fails to compile ("Loop-carried variable run_max has initial type fp32 but is
re-assigned to fp64"). ``python -m tools.sm90 --wide-scalars`` compiles the kernels with
Inductor's scalar types. ``precision`` is the tensor-core mode string
(``validation.FP32_PRECISIONS``).

With compiled kernels the operators are ``torch.library.triton_op``s launching every kernel
through ``torch.library.wrap_triton``: ``torch.compile`` traces them into one
``triton_kernel_wrapper`` node per launch that Inductor compiles with the rest of the graph,
and the operator function run on fake tensors is its own fake implementation. Under the
interpreter (``TRITON_INTERPRET=1``) ``wrap_triton`` hands back the interpreted kernel, which
cannot run on fake tensors, so the same functions are registered with
``torch.library.custom_op`` and explicit fake implementations: opaque to tracing, the same
kernels run eagerly inside (``torch.compile`` with "eager"/"aot_eager", ``torch.export`` and
``opcheck`` work on CPU tensors; Inductor cannot compile user Triton kernels for CPU tensors).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ...validation import check_directional, resolve_precision
from .. import epilogue, glue
from .backward import backward_shares
from .forward import forward_stats
from .launch import USE_TRITON_OP

# ------------------------------------------------------------------ operators
_SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_DirOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_Grads = Tuple[Tensor, Tensor, Tensor]


def _scalar32(x: Tensor, like: Tensor) -> Tensor:
    """A one-element tensor (τ, γ) as the kernels read it: float32, shape (1,), on ``like``'s device."""
    return x.to(device=like.device, dtype=torch.float32).reshape(1)


def _kept(kept: Tensor, masked: bool):
    return kept if masked else None


def _no_kept(like: Tensor) -> Tensor:
    """The ``kept`` output without masking: empty (an operator's outputs are tensors)."""
    return like.new_empty((0,), dtype=torch.float32)


def _symmetric_nll(img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor, threshold: Tensor,
                   has_margin: bool, smoothing: bool, masked: bool, normalize: bool, precision: str) -> _SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs: (pairs, rv, rt, pos,
    delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i).

    Forward: one walk over the tiles of Z gives its rows' (i2t) and columns' (t2i) statistics."""
    rv, rt = epilogue.inv_norms(img, normalize), epilogue.inv_norms(txt, normalize)
    tau32, gamma32 = _scalar32(tau, img), _scalar32(gamma, img)
    inv_tau = 1.0 / tau32
    pos = epilogue.positive_logits(epilogue.scaled(img, rv), epilogue.scaled(txt, rt), 0, inv_tau)
    i2t, t2i = forward_stats((img, txt, txt, txt), (rv, rt, rt, rt), pos, tau32, gamma32, has_margin, 0,
                              smoothing, precision, columns=True, thr32=_scalar32(threshold, img) if masked else None)
    pairs = epilogue.pair_losses(i2t, t2i, img.shape[0], label_smoothing if smoothing else 0.0)
    kept = (i2t.kept, t2i.kept) if masked else (_no_kept(img), _no_kept(img))
    return (pairs, rv, rt, pos, *i2t[1:4], kept[0], *t2i[1:4], kept[1])


def _symmetric_nll_fake(img, txt, tau, gamma, label_smoothing, threshold, has_margin, smoothing, masked, normalize,
                        precision):
    n = img.shape[0]
    return tuple(img.new_empty((0 if i in (7, 11) and not masked else n,), dtype=torch.float32) for i in range(12))


def _symmetric_nll_backward(
    grad: Tensor, img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor, threshold: Tensor,
    rv: Tensor, rt: Tensor, pos: Tensor, delta_r: Tensor, mean_neg_r: Tensor, dsum_r: Tensor, kept_r: Tensor,
    delta_c: Tensor, mean_neg_c: Tensor, dsum_c: Tensor, kept_c: Tensor,
    has_margin: bool, smoothing: bool, masked: bool, normalize: bool, precision: str, need_vt: bool,
) -> _Grads:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape). Each
    recomputed tile carries both directions' softmax into one dS workspace."""
    i2t = epilogue.RowStats(pos, delta_r, mean_neg_r, dsum_r, _kept(kept_r, masked))
    t2i = epilogue.RowStats(pos, delta_c, mean_neg_c, dsum_c, _kept(kept_c, masked))
    tau32, gamma32 = _scalar32(tau, img), _scalar32(gamma, img)
    inv_tau = 1.0 / tau32
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's rows get half
    if need_vt:
        masking = {}
        if masked:
            masking = dict(thr32=_scalar32(threshold, img), smoothing=smoothing,
                           shifts=(epilogue.smoothing_shift(i2t, eps), epilogue.smoothing_shift(t2i, eps)))
        d_v, d_t = backward_shares((img, txt, txt, txt), (rv, rt, rt, rt), i2t, g, tau32, gamma32, has_margin, 0,
                                    precision, key_side=(t2i, g), **masking)
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    d_img, d_txt, dz_z = epilogue.finish_symmetric(i2t, t2i, g, img, txt, rv, rt, d_v, d_t, inv_tau, eps, normalize)
    return d_img, d_txt, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


def _symmetric_grads_fake(grad, img, txt, tau, *rest):
    return img.new_empty(img.shape), txt.new_empty(txt.shape), tau.new_empty(tau.shape)


def _directional_nll(q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor,
                     threshold: Tensor, offset: int, has_margin: bool, smoothing: bool, masked: bool, normalize: bool,
                     precision: str) -> _DirOut:
    """Per-row losses (M,) of one direction and what the backward needs:
    (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    tau32, gamma32 = _scalar32(tau, q), _scalar32(gamma, q)
    inv_tau = 1.0 / tau32
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, inv_tau)
    stats = forward_stats((q, k, a, b), norms, pos, tau32, gamma32, has_margin, offset, smoothing, precision,
                          thr32=_scalar32(threshold, q) if masked else None)
    return (epilogue.row_losses(stats, k.shape[0], label_smoothing if smoothing else 0.0), *norms, *stats[:4],
            stats.kept if masked else _no_kept(q))


def _directional_nll_fake(q, k, a, b, tau, gamma, label_smoothing, threshold, offset, has_margin, smoothing, masked,
                          normalize, precision):
    m, n = q.shape[0], k.shape[0]
    sizes = [m, m, n, m, n, m, m, m, m, m if masked else 0]
    return tuple(q.new_empty((size,), dtype=torch.float32) for size in sizes)


def _directional_nll_backward(
    grad: Tensor, q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor,
    threshold: Tensor, rq: Tensor, rk: Tensor, ra: Tensor, rb: Tensor, pos: Tensor, delta: Tensor, mean_neg: Tensor,
    dsum: Tensor, kept: Tensor, offset: int, has_margin: bool, smoothing: bool, masked: bool, normalize: bool,
    precision: str, need_qk: bool,
) -> _Grads:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    stats = epilogue.RowStats(pos, delta, mean_neg, dsum, _kept(kept, masked))
    tau32, gamma32 = _scalar32(tau, q), _scalar32(gamma, q)
    inv_tau = 1.0 / tau32
    eps = label_smoothing if smoothing else 0.0
    g = grad.float().contiguous()
    if need_qk:
        masking = {}
        if masked:
            shift = epilogue.smoothing_shift(stats, eps)
            masking = dict(thr32=_scalar32(threshold, q), shifts=(shift, shift), smoothing=smoothing)
        d_q, d_k = backward_shares((q, k, a, b), (rq, rk, ra, rb), stats, g, tau32, gamma32, has_margin, offset,
                                    precision, **masking)
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q, d_k = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k))
    d_q_in, d_k_in, dz_z = epilogue.finish_directional(stats, g, q, k, rq, rk, d_q, d_k, offset, inv_tau, eps,
                                                       normalize)
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


def _directional_grads_fake(grad, q, k, a, b, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


# torch.func-capable Functions of the forward operators (see ..glue)
HNClipTriton = glue.fused_op(
    "triton", "triton_symmetric_nll", forward=_symmetric_nll, forward_fake=_symmetric_nll_fake,
    backward=_symmetric_nll_backward, backward_fake=_symmetric_grads_fake, tau_input=2,
    use_triton_op=USE_TRITON_OP)
HNClipDirectionalTriton = glue.fused_op(
    "triton", "triton_directional_nll", forward=_directional_nll, forward_fake=_directional_nll_fake,
    backward=_directional_nll_backward, backward_fake=_directional_grads_fake, tau_input=4,
    use_triton_op=USE_TRITON_OP)


# ------------------------------------------------------------------ public wrappers
def _scalar_args(gamma, label_smoothing, precision, like: Tensor):
    """(γ, ε as :func:`glue.hyperparameter` tensors, has_margin, smoothing, precision string).

    has_margin (γ ≠ 0) and smoothing (ε ≠ 0), the kernels' HAS_MARGIN and SMOOTHING, stay
    bools: under ``torch.compile`` γ = 0 and γ ≠ 0 are two graphs, every other new γ reuses
    the second (ε alike). A tensor γ or ε is taken to be non-zero."""
    has_margin = True if isinstance(gamma, Tensor) else gamma != 0.0
    smoothing = True if isinstance(label_smoothing, Tensor) else label_smoothing != 0.0
    return (glue.hyperparameter(gamma, like), glue.hyperparameter(label_smoothing, like), has_margin, smoothing,
            resolve_precision(precision))


def directional_nll_triton(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize,
                           return_stats=False, precision=None, false_negative_threshold=None):
    """Triton counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`
    (same keyword-only protocol and result). ``precision``: tensor-core input precision for float32
    features (``validation.FP32_PRECISIONS``; None: ``DEFAULT_FP32_PRECISION``); ignored for
    16-bit features.

    Runs ``hnclip::triton_directional_nll``; works under ``torch.compile(fullgraph=True)`` (a new
    γ, ε or τ does not recompile), ``torch.export``, ``torch.func.grad``/``vjp`` and
    ``torch.func.vmap`` (one kernel call per batch entry). Second derivatives raise the
    ``RuntimeError`` naming backend="torch". ``false_negative_threshold``: as the reference's; the
    kernels compare the caption cosine (m_q·m_k)·r_q·r_k, the margin's float32 product on each
    tile (``tiles._caption_keep``), with the threshold rounded to float32."""
    check_directional(queries, keys, query_txt, key_txt, offset)
    gamma_t, eps_t, has_margin, smoothing, precision = _scalar_args(gamma, label_smoothing, precision, queries)
    masked = false_negative_threshold is not None
    thr_t = glue.hyperparameter(false_negative_threshold if masked else 0.0, queries)
    out = glue.call(HNClipDirectionalTriton, torch.ops.hnclip.triton_directional_nll, queries, keys, query_txt,
                    key_txt, tau, gamma_t, eps_t, thr_t, int(offset), has_margin, smoothing, masked, bool(normalize),
                    precision)
    return (out[0], epilogue.RowStats(*out[5:9], _kept(out[9], masked))) if return_stats else out[0]


def hn_clip_pairs_triton(img, txt, *, tau, gamma, label_smoothing, normalize, return_stats=False, precision=None,
                         false_negative_threshold=None):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the fused single-process loss
    (``hnclip::triton_symmetric_nll``; composes as :func:`directional_nll_triton` does).
    ``return_stats``: also ``(i2t, t2i)``, the detached ``epilogue.RowStats`` of both directions.
    ``false_negative_threshold``: as :func:`directional_nll_triton` (off the diagonal super-tiles
    one caption tile masks Z_IJ and Z_JIᵀ alike: the mask is symmetric to the bit there)."""
    gamma_t, eps_t, has_margin, smoothing, precision = _scalar_args(gamma, label_smoothing, precision, img)
    masked = false_negative_threshold is not None
    thr_t = glue.hyperparameter(false_negative_threshold if masked else 0.0, img)
    out = glue.call(HNClipTriton, torch.ops.hnclip.triton_symmetric_nll, img, txt, tau, gamma_t, eps_t, thr_t,
                    has_margin, smoothing, masked, bool(normalize), precision)
    if not return_stats:
        return out[0]
    pos = out[3]
    return out[0], (epilogue.RowStats(pos, *out[4:7], _kept(out[7], masked)),
                    epilogue.RowStats(pos, *out[8:11], _kept(out[11], masked)))
