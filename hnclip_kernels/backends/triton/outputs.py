"""What the Triton operators' bodies share: a rank's output layout and its two directions'
statistics, the backward's ε/n shifts, the operators' output layouts with the multi-positive
targets' statistics and those targets' row factors (the layouts both backends share: :mod:`..outputs`).
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from .. import softmax
from ..outputs import DirectionalOut, FamilyPairsOut, fake, kept_output, positives_shape

Grads = Tuple[Tensor, Tensor, Tensor]
RankGrads = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def smoothing_shifts(sc, eps, rows: softmax.RowStats, key_rows: softmax.RowStats):
    """The backward's ε/n_i of each side (``rows``: the rows', ``key_rows``: the key side's, or the
    rows' again for one direction; ``backends.softmax.smoothing_shift``), read by the dS kernels only with
    masking and label smoothing (SHIFT); None otherwise."""
    if not (sc.masked and sc.smoothing):
        return None
    shift = softmax.smoothing_shift(rows, eps)
    return shift, (shift if key_rows is rows else softmax.smoothing_shift(key_rows, eps))


def rank_directions(stats, m: int, masked: bool):
    """The (i2t, t2i) ``RowStats`` of a rank's 2M lines (views)."""
    return tuple(
        softmax.RowStats(*(x[sl] for x in stats[:4]), stats[4][sl] if masked else None)
        for sl in (slice(0, m), slice(m, 2 * m))
    )


class RankOut(NamedTuple):
    """``hnclip::triton_rank_nll``'s outputs, float32: M local rows against N gathered columns;
    the statistics cover 2M lines (i2t rows, then t2i rows), ``kept`` (0,) without masking."""

    rows: Tensor  # (M,) ½(i2t_i + t2i_i)
    rv: Tensor  # (M,) 1/‖v_i‖, 1/‖t_i‖ (ones without normalize)
    rt: Tensor
    rv_all: Tensor  # (N,) the gathered features'
    rt_all: Tensor
    pos: Tensor  # (2M,) the lines' statistics (softmax.RowStats)
    delta: Tensor
    mean_neg: Tensor
    dsum: Tensor
    kept: Tensor

    def directions(self, masked: bool):
        """The (i2t, t2i) ``RowStats`` (views)."""
        stats = softmax.RowStats(self.pos, self.delta, self.mean_neg, self.dsum, self.kept)
        return rank_directions(stats, self.rv.shape[0], masked)

    @classmethod
    def of(cls, rows: Tensor, norms, stats: softmax.RowStats) -> "RankOut":
        """From the row losses, the four norms (img, txt, all_img, all_txt) and the 2M lines' statistics."""
        return cls(rows, *norms, *stats[:4], kept_output(stats))

    @classmethod
    def fake(cls, img: Tensor, all_img: Tensor, masked: bool) -> "RankOut":
        m, n = img.shape[0], all_img.shape[0]
        return fake(cls, img, torch.float32, 2 * m, rows=m, rv=m, rt=m, rv_all=n, rt_all=n, kept=2 * m if masked else 0)


def positive_rows(stats: softmax.RowStats, extra: Tensor, eps, smoothing: bool):
    """A multi-positive direction's (statistics for the dS kernels, their ε/|C(i)| shifts or None,
    the positives' (4, M) factors), from its negatives' ``stats`` and its other positives' ``extra``
    (:func:`..softmax.positive_factors`, the one home of both): the kernels run as under "mask" but
    with δ' = logaddexp(L_K, the other positives' LSE), so that their P is the softmax over every
    class C(i); the shifts only with label smoothing (the kernels' SHIFT derives from them)."""
    delta, shift, factors = softmax.positive_factors(stats, extra, eps)
    return stats._replace(delta=delta), (shift if smoothing else None), factors


_POSITIVES = ("positives_i2t", "positives_t2i")


class PairsOut(NamedTuple("_PairsOut", [(f, Tensor) for f in (*FamilyPairsOut._fields, *_POSITIVES)])):
    """``hnclip::triton_symmetric_nll``'s outputs: :class:`..outputs.FamilyPairsOut`'s, then each
    direction's other positives' statistics (:func:`..outputs.positives_shape`: (4, N) under a positive
    ``group_mode``, else (0,))."""

    __slots__ = ()
    i2t = FamilyPairsOut.i2t
    t2i = FamilyPairsOut.t2i

    @classmethod
    def fake(cls, img: Tensor, negatives: Tensor, masked: bool, positives: bool) -> "PairsOut":
        n, kept = img.shape[0], img.shape[0] if masked else 0
        extra = positives_shape(n, positives)
        shapes = dict(rn=negatives.shape[0], kept_i2t=kept, kept_t2i=kept, positives_i2t=extra, positives_t2i=extra)
        return fake(cls, img, torch.float32, n, **shapes)


class DirectionalPositivesOut(
    NamedTuple("_DirectionalPositivesOut", [(f, Tensor) for f in (*DirectionalOut._fields, "positives")])
):
    """``hnclip::triton_directional_nll``'s outputs: :class:`..outputs.DirectionalOut`'s, then the
    rows' other positives' statistics (:func:`..outputs.positives_shape`)."""

    __slots__ = ()
    stats = DirectionalOut.stats

    @classmethod
    def fake(cls, q: Tensor, k: Tensor, masked: bool, positives: bool) -> "DirectionalPositivesOut":
        m, n = q.shape[0], k.shape[0]
        extra = positives_shape(m, positives)
        return fake(cls, q, torch.float32, m, rk=n, rb=n, kept=m if masked else 0, positives=extra)
