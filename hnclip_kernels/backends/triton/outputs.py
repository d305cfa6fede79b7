"""What the Triton operators' bodies share: a rank's output layout and its two directions'
statistics, the backward's ε/n shifts (the layouts both backends share: :mod:`..outputs`).
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from .. import softmax
from ..outputs import fake, kept_output

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
