"""The Triton backend as operators, ``hnclip::triton_symmetric_nll``, ``hnclip::triton_directional_nll``
and ``hnclip::triton_rank_nll`` with their ``*_backward`` operators, and their public wrappers
(importing it also registers the hard-negative family's operator, :mod:`.family`).

The bodies are :mod:`.symmetric_op` and :mod:`.distributed_ops`, their outputs by name
:class:`..outputs.SymmetricOut`, :class:`..outputs.DirectionalOut` and :class:`.outputs.RankOut`;
:func:`..glue.fused_op` registers them (``triton_op``, or ``custom_op`` under the interpreter)
with the glue the C++ operators share. Signatures, flags and registration: ``docs/triton.md``,
"The operators".
"""

from __future__ import annotations

import torch

from ...validation import check_directional
from .. import glue
from ..outputs import DirectionalOut, SymmetricOut
from . import flops
from .distributed_ops import (
    _directional_grads_fake,
    _directional_nll,
    _directional_nll_backward,
    _directional_nll_fake,
    _rank_grads_fake,
    _rank_nll,
    _rank_nll_backward,
    _rank_nll_fake,
)
from .launch import USE_TRITON_OP
from .outputs import RankOut
from .params import scalar_args, tamed
from .symmetric_op import _symmetric_grads_fake, _symmetric_nll, _symmetric_nll_backward, _symmetric_nll_fake

HNClipTriton = glue.fused_op(
    "triton",
    "triton_symmetric_nll",
    forward=_symmetric_nll,
    forward_fake=_symmetric_nll_fake,
    backward=_symmetric_nll_backward,
    backward_fake=_symmetric_grads_fake,
    tau_input=2,
    use_triton_op=USE_TRITON_OP,
)
HNClipDirectionalTriton = glue.fused_op(
    "triton",
    "triton_directional_nll",
    forward=_directional_nll,
    forward_fake=_directional_nll_fake,
    backward=_directional_nll_backward,
    backward_fake=_directional_grads_fake,
    tau_input=4,
    use_triton_op=USE_TRITON_OP,
)
HNClipRankTriton = glue.fused_op(
    "triton",
    "triton_rank_nll",
    forward=_rank_nll,
    forward_fake=_rank_nll_fake,
    backward=_rank_nll_backward,
    backward_fake=_rank_grads_fake,
    tau_input=4,
    feature_inputs=(0, 1, 2, 3),
    use_triton_op=USE_TRITON_OP,
)

flops.register()  # FlopCounterMode's formulas of the six operators
# the hard-negative family's operators (hnclip::triton_family_directional_nll, ::triton_family_nll) register with these
from . import family, family_sym  # noqa: E402, F401


# ------------------------------------------------------------------ public wrappers
def directional_nll_triton(
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
    precision=None,
    false_negative_threshold=None,
):
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
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, queries)
    thr_t, masked = glue.threshold_args(false_negative_threshold, queries)
    out = DirectionalOut._make(
        glue.call(
            HNClipDirectionalTriton,
            torch.ops.hnclip.triton_directional_nll,
            *(tamed(x, normalize) for x in (queries, keys, query_txt, key_txt)),
            tau,
            gamma_t,
            eps_t,
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
        )
    )
    return (out.loss, out.stats(masked)) if return_stats else out.loss


def hn_clip_pairs_triton(
    img,
    txt,
    *,
    tau,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    precision=None,
    false_negative_threshold=None,
):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the fused single-process loss
    (``hnclip::triton_symmetric_nll``; composes as :func:`directional_nll_triton` does).
    ``return_stats``: also ``(i2t, t2i)``, the detached ``epilogue.RowStats`` of both directions.
    ``false_negative_threshold``: as :func:`directional_nll_triton` (off the diagonal super-tiles
    one caption tile masks Z_IJ and Z_JIᵀ alike: the mask is symmetric to the bit there)."""
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, img)
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    out = SymmetricOut._make(
        glue.call(
            HNClipTriton,
            torch.ops.hnclip.triton_symmetric_nll,
            tamed(img, normalize),
            tamed(txt, normalize),
            tau,
            gamma_t,
            eps_t,
            thr_t,
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
        )
    )
    return (out.pairs, (out.i2t(masked), out.t2i(masked))) if return_stats else out.pairs


def rank_nll_triton(
    img,
    txt,
    all_img,
    all_txt,
    *,
    tau,
    offset,
    gamma,
    label_smoothing,
    normalize,
    return_stats=False,
    precision=None,
    false_negative_threshold=None,
):
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
    gamma_t, eps_t, has_margin, smoothing, precision = scalar_args(gamma, label_smoothing, precision, img)
    thr_t, masked = glue.threshold_args(false_negative_threshold, img)
    out = RankOut._make(
        glue.call(
            HNClipRankTriton,
            torch.ops.hnclip.triton_rank_nll,
            *(tamed(x, normalize) for x in (img, txt, all_img, all_txt)),
            tau,
            gamma_t,
            eps_t,
            thr_t,
            int(offset),
            bool(normalize),
            masked,
            has_margin,
            smoothing,
            precision,
        )
    )
    return (out.rows, out.directions(masked)) if return_stats else out.rows
