"""What the Triton operators' bodies share: their output types, the ``kept`` convention, the
backward's ε/n shifts, and a rank's two directions' statistics.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .. import epilogue

SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
DirOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
Grads = Tuple[Tensor, Tensor, Tensor]
RankGrads = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def kept_or_none(kept: Tensor, masked: bool):
    """``kept`` as the statistics carry it: the counts with masking, else None (the operator's empty output)."""
    return kept if masked else None


def smoothing_shifts(sc, eps, rows: epilogue.RowStats, key_rows: epilogue.RowStats):
    """The backward's ε/n_i of each side (``rows``: the rows', ``key_rows``: the key side's, or the
    rows' again for one direction; ``epilogue.smoothing_shift``), read by the dS kernels only with
    masking and label smoothing (SHIFT); None otherwise."""
    if not (sc.masked and sc.smoothing):
        return None
    shift = epilogue.smoothing_shift(rows, eps)
    return shift, (shift if key_rows is rows else epilogue.smoothing_shift(key_rows, eps))


def no_kept(like: Tensor) -> Tensor:
    """The ``kept`` output without masking: empty (an operator's outputs are tensors)."""
    return like.new_empty((0,), dtype=torch.float32)


def rank_directions(stats, m: int, masked: bool):
    """The (i2t, t2i) ``RowStats`` of a rank's 2M lines (views)."""
    return tuple(
        epilogue.RowStats(*(x[sl] for x in stats[:4]), stats[4][sl] if masked else None)
        for sl in (slice(0, m), slice(m, 2 * m))
    )
