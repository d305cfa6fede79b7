"""The Triton backend as operators: ``hnclip::triton_symmetric_nll`` and
``hnclip::triton_directional_nll`` with their ``*_backward`` operators, and the public wrappers.

The kernels and their launchers live beside this module (:mod:`.forward_kernels` and
:mod:`.merge`, walked by :mod:`.forward`: one walk over the logit tiles for the row and column
statistics; :mod:`.dscore`, walked by :mod:`.backward`: the chunked dS and its GEMMs). Here, per operator: the O(N·D) algebra around them (:mod:`..epilogue`), and its
registration through :func:`..glue.fused_op`, the glue the C++ backend's ``hnclip::cpp_*``
operators share (autograd formula, raising second derivative, vmap rule, ``torch.func``).

* ``triton_symmetric_nll(img, txt, tau, gamma, label_smoothing, threshold, has_margin, smoothing,
  masked, normalize, precision)`` → (pairs, rv, rt, pos, and the (delta, mean_neg, dsum, kept) of
  i2t then of t2i): what ``hn_clip_loss(backend="triton")`` runs;
* ``triton_directional_nll(q, k, a, b, tau, gamma, label_smoothing, threshold, offset, has_margin,
  smoothing, masked, normalize, precision)`` → (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum,
  kept): what a rank of the distributed loss runs;
* ``triton_rank_nll(img, txt, all_img, all_txt, tau, gamma, label_smoothing, threshold, offset,
  has_margin, smoothing, masked, normalize, precision)`` → (rows, rv, rt, rv_all, rt_all, pos,
  delta, mean_neg, dsum, kept): a distributed rank's two directions in one op (rows
  ½(i2t_i + t2i_i), the statistics over 2M lines, i2t then t2i), the margin's G = t tᵀ_all
  formed once per tile for both;
* their ``*_backward`` operators → (dL/dq, dL/dk, dL/dτ) in the inputs' dtypes (the rank op: the
  gradients of its four features, then dL/dτ).

τ, γ and ε are tensors (γ and ε 0-dim float64, :func:`..glue.hyperparameter`), so a schedule
of any of them reuses a compiled graph; ``has_margin`` (γ ≠ 0) and ``smoothing`` (ε ≠ 0) are the
kernels' HAS_MARGIN and SMOOTHING flags. False-negative masking: ``threshold`` (a 0-dim float64
tensor like γ) and ``masked`` (the kernels' MASK); ``kept`` (each row's kept negatives) is empty
without it. What the kernels read of τ, γ and the threshold is one ``params.Scalars``, built once per
operator body (float32 tensors, never float arguments: see :mod:`.params`). ``python -m tools.sm90
--wide-scalars`` compiles the kernels with Inductor's scalar types. ``precision`` is the tensor-core mode string
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
from .backward import directional_shares, rank_shares, symmetric_shares
from .forward import directional_stats, rank_stats, symmetric_stats
from .launch import USE_TRITON_OP
from .params import scalars, threshold_block

# ------------------------------------------------------------------ operators
_SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_DirOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_Grads = Tuple[Tensor, Tensor, Tensor]
_RankGrads = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _kept(kept: Tensor, masked: bool):
    return kept if masked else None


def _shifts(sc, smoothing: bool, eps, rows: epilogue.RowStats, key_rows: epilogue.RowStats):
    """The backward's ε/n_i of each side (``rows``: the rows', ``key_rows``: the key side's, or the
    rows' again for one direction; ``epilogue.smoothing_shift``), read by the dS kernels only with
    masking and label smoothing (SHIFT); None otherwise."""
    if not (sc.masked and smoothing):
        return None
    shift = epilogue.smoothing_shift(rows, eps)
    return shift, (shift if key_rows is rows else epilogue.smoothing_shift(key_rows, eps))


def _no_kept(like: Tensor) -> Tensor:
    """The ``kept`` output without masking: empty (an operator's outputs are tensors)."""
    return like.new_empty((0,), dtype=torch.float32)


def _symmetric_nll(img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor, threshold: Tensor,
                   has_margin: bool, smoothing: bool, masked: bool, normalize: bool, precision: str) -> _SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs: (pairs, rv, rt, pos,
    delta_i2t, mean_neg_i2t, dsum_i2t, kept_i2t, delta_t2i, mean_neg_t2i, dsum_t2i, kept_t2i).

    Forward: one walk over the tiles of Z gives its rows' (i2t) and columns' (t2i) statistics."""
    rv, rt = epilogue.inv_norms(img, normalize), epilogue.inv_norms(txt, normalize)
    sc = scalars(img, tau, gamma, has_margin, smoothing, precision,
                 threshold_block(threshold, (txt, txt), (rt, rt), normalize) if masked else None)
    pos = epilogue.positive_logits(epilogue.scaled(img, rv), epilogue.scaled(txt, rt), 0, sc.inv_tau)
    i2t, t2i = symmetric_stats((img, txt, txt, txt), (rv, rt, rt, rt), pos, sc)
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
    sc = scalars(img, tau, gamma, has_margin, smoothing, precision,
                 threshold_block(threshold, (txt, txt), (rt, rt), normalize) if masked and need_vt else None)
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's rows get half
    if need_vt:
        d_v, d_t = symmetric_shares((img, txt, txt, txt), (rv, rt, rt, rt), (i2t, g), (t2i, g), sc,
                                    _shifts(sc, smoothing, eps, i2t, t2i))
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    d_img, d_txt, dz_z = epilogue.finish_symmetric(i2t, t2i, g, img, txt, rv, rt, d_v, d_t, sc.inv_tau, eps,
                                                   normalize)
    return d_img, d_txt, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _symmetric_grads_fake(grad, img, txt, tau, *rest):
    return img.new_empty(img.shape), txt.new_empty(txt.shape), tau.new_empty(tau.shape)


def _directional_nll(q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor,
                     threshold: Tensor, offset: int, has_margin: bool, smoothing: bool, masked: bool, normalize: bool,
                     precision: str) -> _DirOut:
    """Per-row losses (M,) of one direction and what the backward needs:
    (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum, kept)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision,
                 threshold_block(threshold, (a, b), norms[2:], normalize) if masked else None)
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, sc.inv_tau)
    stats = directional_stats((q, k, a, b), norms, pos, sc, offset)
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
    sc = scalars(q, tau, gamma, has_margin, smoothing, precision,
                 threshold_block(threshold, (a, b), (ra, rb), normalize) if masked and need_qk else None)
    eps = label_smoothing if smoothing else 0.0
    g = grad.float().contiguous()
    if need_qk:
        shifts = _shifts(sc, smoothing, eps, stats, stats)
        d_q, d_k = directional_shares((q, k, a, b), (rq, rk, ra, rb), stats, g, sc, offset,
                                      None if shifts is None else shifts[:1])
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q, d_k = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k))
    d_q_in, d_k_in, dz_z = epilogue.finish_directional(stats, g, q, k, rq, rk, d_q, d_k, offset, sc.inv_tau, eps,
                                                       normalize)
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, sc.inv_tau, tau.dtype, tau.shape)


def _directional_grads_fake(grad, q, k, a, b, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


def _rank_nll(img: Tensor, txt: Tensor, all_img: Tensor, all_txt: Tensor, tau: Tensor, gamma: Tensor,
              label_smoothing: Tensor, threshold: Tensor, offset: int, has_margin: bool, smoothing: bool,
              masked: bool, normalize: bool, precision: str) -> _DirOut:
    """A rank's per-row losses ½(i2t_i + t2i_i) (M,) and what the backward needs:
    (rows, rv, rt, rv_all, rt_all, pos, delta, mean_neg, dsum, kept), the last five over 2M lines
    (i2t rows, then t2i rows; ``kept`` empty without masking). Each direction's values are its
    directional op's to the bit (the same positives, tiles and partial order)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (img, txt, all_img, all_txt))
    sc = scalars(img, tau, gamma, has_margin, smoothing, precision,
                 threshold_block(threshold, (txt, all_txt), (norms[1], norms[3]), normalize) if masked else None)
    m, inv_tau = img.shape[0], sc.inv_tau
    pos = torch.cat((
        epilogue.positive_logits(epilogue.scaled(img, norms[0]), epilogue.scaled(all_txt, norms[3]), offset, inv_tau),
        epilogue.positive_logits(epilogue.scaled(txt, norms[1]), epilogue.scaled(all_img, norms[2]), offset, inv_tau)))
    stats = rank_stats((img, txt, all_img, all_txt), norms, pos, sc, offset)
    # each direction's losses from its own slice: torch's vectorised softplus rounds an element
    # differently in a loop's tail, and the directional op's tails are M long
    eps, n = label_smoothing if smoothing else 0.0, all_img.shape[0]
    i2t, t2i = _rank_directions(stats, m, masked)
    rows = 0.5 * (epilogue.row_losses(i2t, n, eps) + epilogue.row_losses(t2i, n, eps))
    return (rows, *norms, *stats[:4], stats.kept if masked else _no_kept(img))


def _rank_directions(stats, m: int, masked: bool):
    """The (i2t, t2i) ``RowStats`` of a rank's 2M lines (views)."""
    return tuple(epilogue.RowStats(*(x[sl] for x in stats[:4]), stats[4][sl] if masked else None)
                 for sl in (slice(0, m), slice(m, 2 * m)))


def _rank_nll_fake(img, txt, all_img, all_txt, tau, gamma, label_smoothing, threshold, offset, has_margin, smoothing,
                   masked, normalize, precision):
    m, n = img.shape[0], all_img.shape[0]
    sizes = (m, m, m, n, n, 2 * m, 2 * m, 2 * m, 2 * m, 2 * m if masked else 0)
    return tuple(img.new_empty((size,), dtype=torch.float32) for size in sizes)


def _rank_nll_backward(
    grad: Tensor, img: Tensor, txt: Tensor, all_img: Tensor, all_txt: Tensor, tau: Tensor, gamma: Tensor,
    label_smoothing: Tensor, threshold: Tensor, rv: Tensor, rt: Tensor, rv_all: Tensor, rt_all: Tensor, pos: Tensor,
    delta: Tensor, mean_neg: Tensor, dsum: Tensor, kept: Tensor, offset: int, has_margin: bool, smoothing: bool,
    masked: bool, normalize: bool, precision: str, need_features: bool,
) -> _RankGrads:
    """(dL/dimg, dL/dtxt, dL/dall_img, dL/dall_txt in their dtypes, dL/dτ in τ's dtype and shape):
    i2t gives img and all_txt theirs, t2i txt and all_img (the margin is a constant)."""
    m = img.shape[0]
    i2t, t2i = _rank_directions(epilogue.RowStats(pos, delta, mean_neg, dsum, kept), m, masked)
    sc = scalars(img, tau, gamma, has_margin, smoothing, precision,
                 threshold_block(threshold, (txt, all_txt), (rt, rt_all), normalize) if masked and need_features
                 else None)
    inv_tau = sc.inv_tau
    eps = label_smoothing if smoothing else 0.0
    g = 0.5 * grad.float().contiguous()  # each direction's row gets half
    ops, norms = (img, txt, all_img, all_txt), (rv, rt, rv_all, rt_all)
    if need_features:
        (d_v, d_ta), (d_t, d_va) = rank_shares(ops, norms, (i2t, t2i), g, sc, offset,
                                               _shifts(sc, smoothing, eps, i2t, t2i))
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t, d_va, d_ta = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in ops)
    d_img, d_all_txt, dz_i2t = epilogue.finish_directional(i2t, g, img, all_txt, rv, rt_all, d_v, d_ta, offset,
                                                           inv_tau, eps, normalize)
    d_txt, d_all_img, dz_t2i = epilogue.finish_directional(t2i, g, txt, all_img, rt, rv_all, d_t, d_va, offset,
                                                           inv_tau, eps, normalize)
    # dτ as autograd would sum the two directional ops' (each in τ's dtype)
    d_tau = epilogue.tau_grad(dz_i2t, inv_tau, tau.dtype, tau.shape) + epilogue.tau_grad(dz_t2i, inv_tau, tau.dtype,
                                                                                          tau.shape)
    return d_img, d_txt, d_all_img, d_all_txt, d_tau


def _rank_grads_fake(grad, img, txt, all_img, all_txt, tau, *rest):
    return tuple(x.new_empty(x.shape) for x in (img, txt, all_img, all_txt, tau))


# torch.func-capable Functions of the forward operators (see ..glue)
HNClipTriton = glue.fused_op(
    "triton", "triton_symmetric_nll", forward=_symmetric_nll, forward_fake=_symmetric_nll_fake,
    backward=_symmetric_nll_backward, backward_fake=_symmetric_grads_fake, tau_input=2,
    use_triton_op=USE_TRITON_OP)
HNClipDirectionalTriton = glue.fused_op(
    "triton", "triton_directional_nll", forward=_directional_nll, forward_fake=_directional_nll_fake,
    backward=_directional_nll_backward, backward_fake=_directional_grads_fake, tau_input=4,
    use_triton_op=USE_TRITON_OP)
HNClipRankTriton = glue.fused_op(
    "triton", "triton_rank_nll", forward=_rank_nll, forward_fake=_rank_nll_fake, backward=_rank_nll_backward,
    backward_fake=_rank_grads_fake, tau_input=4, feature_inputs=(0, 1, 2, 3), use_triton_op=USE_TRITON_OP)


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
    kernels compare the caption cosine (m_q·m_k)·ρ_q·ρ_k, the margin's float32 product on each
    tile times the captions' inverse norms whatever ``normalize`` says (``tiles._caption_keep``),
    with the threshold rounded to float32."""
    check_directional(queries, keys, query_txt, key_txt, offset)
    gamma_t, eps_t, has_margin, smoothing, precision = _scalar_args(gamma, label_smoothing, precision, queries)
    thr_t, masked = glue.threshold_args(false_negative_threshold, queries)
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
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    out = glue.call(HNClipTriton, torch.ops.hnclip.triton_symmetric_nll, img, txt, tau, gamma_t, eps_t, thr_t,
                    has_margin, smoothing, masked, bool(normalize), precision)
    if not return_stats:
        return out[0]
    pos = out[3]
    return out[0], (epilogue.RowStats(pos, *out[4:7], _kept(out[7], masked)),
                    epilogue.RowStats(pos, *out[8:11], _kept(out[11], masked)))


def rank_nll_triton(img, txt, all_img, all_txt, *, tau, offset, gamma, label_smoothing, normalize,
                    return_stats=False, precision=None, false_negative_threshold=None):
    """A distributed rank's per-row losses ½(i2t_i + t2i_i), shape (M,), in one fused op
    (``hnclip::triton_rank_nll``; composes as :func:`directional_nll_triton` does).

    ``img``, ``txt`` (M, D): the rank's local features; ``all_img``, ``all_txt`` (N, D): the
    gathered batch, local row i's positive at column ``offset + i``. i2t row i: Z_ij =
    (v̂_i t̂_all,j + γ t̂_i t̂_all,j) / τ; t2i row i: (t̂_i v̂_all,j + γ t̂_i t̂_all,j) / τ (arXiv
    2608.18521, Eq. 2, the margins of the local captions against all captions): the same as
    two calls of :func:`directional_nll_triton` (``0.5 * (i2t + t2i)``), each value to the bit,
    with the margin's product formed once for both. ``return_stats``: also ``(i2t, t2i)``, the
    detached ``epilogue.RowStats`` of each direction. ``false_negative_threshold``: as
    :func:`directional_nll_triton` (one caption cosine masks the pair in both directions).
    Raises ``ValueError``/``TypeError`` as :func:`hnclip_kernels.validation.check_directional`
    does for either direction."""
    check_directional(img, all_txt, txt, all_txt, offset)
    check_directional(txt, all_img, txt, all_txt, offset)
    gamma_t, eps_t, has_margin, smoothing, precision = _scalar_args(gamma, label_smoothing, precision, img)
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    out = glue.call(HNClipRankTriton, torch.ops.hnclip.triton_rank_nll, img, txt, all_img, all_txt, tau, gamma_t,
                    eps_t, thr_t, int(offset), has_margin, smoothing, masked, bool(normalize), precision)
    if not return_stats:
        return out[0]
    return out[0], _rank_directions(epilogue.RowStats(*out[5:10]), img.shape[0], masked)
