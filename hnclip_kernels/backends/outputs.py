"""The fused operators' outputs by name, one layout per operator and one for both backends where
their fields are the same: the operator bodies return them, the fakes build them from one size
rule, the public wrappers read them.

The first output is the loss; the rest are what the backward operator takes back, in this order,
after the forward's tensor inputs (:mod:`.glue`). ``kept`` (each row's kept negatives under
false-negative masking) is an empty tensor without masking (an operator's outputs are tensors);
in :class:`.softmax.RowStats` it is None then. The operators return plain tuples (the schema's
``Tensor[]``-like tuple; a NamedTuple is a tuple, :func:`schema` is its annotation), so a wrapper
wraps what it gets with ``._make``.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from . import softmax


def schema(layout: type) -> type:
    """The return annotation of an operator returning ``layout``: a tuple of as many tensors
    (what ``torch.library`` infers a schema from)."""
    return Tuple[(Tensor,) * len(layout._fields)]


def row_stats(pos: Tensor, delta: Tensor, mean_neg: Tensor, dsum: Tensor, kept: Tensor, masked: bool):
    """A direction's ``softmax.RowStats`` from its outputs (``kept`` None without masking)."""
    return softmax.RowStats(pos, delta, mean_neg, dsum, kept if masked else None)


def kept_output(stats: softmax.RowStats) -> Tensor:
    """The ``kept`` output of statistics: their counts, or without masking (None) an empty tensor
    of pos's dtype."""
    return stats.pos.new_empty((0,)) if stats.kept is None else stats.kept


def fake(layout: type, like: Tensor, dtype: torch.dtype, length: int, **shapes):
    """``layout`` of empty tensors on ``like``'s device in ``dtype`` (an operator's fake outputs):
    each field of shape (length,) unless ``shapes`` names it (a length or a shape)."""

    def shape(name: str) -> tuple:
        size = shapes.get(name, length)
        return size if isinstance(size, tuple) else (size,)

    return layout._make(like.new_empty(shape(name), dtype=dtype) for name in layout._fields)


class SymmetricOut(NamedTuple):
    """The symmetric walk's outputs without negatives (the raw C++ symmetric kernel's statistics
    follow ``pos``): each (N,) in the compute dtype (float32; the C++ backend's float64 for float64
    features), the ``kept`` counts (0,) without masking."""

    pairs: Tensor  # ½(i2t_k + t2i_k)
    rv: Tensor  # 1/‖v_k‖ (ones without normalize)
    rt: Tensor  # 1/‖t_k‖
    pos: Tensor  # Z_kk, both directions' positive
    delta_i2t: Tensor  # the rows' statistics (softmax.RowStats)
    mean_neg_i2t: Tensor
    dsum_i2t: Tensor
    kept_i2t: Tensor
    delta_t2i: Tensor  # the columns'
    mean_neg_t2i: Tensor
    dsum_t2i: Tensor
    kept_t2i: Tensor

    def i2t(self, masked: bool) -> softmax.RowStats:
        return row_stats(self.pos, self.delta_i2t, self.mean_neg_i2t, self.dsum_i2t, self.kept_i2t, masked)

    def t2i(self, masked: bool) -> softmax.RowStats:
        return row_stats(self.pos, self.delta_t2i, self.mean_neg_t2i, self.dsum_t2i, self.kept_t2i, masked)

    @classmethod
    def of(cls, pairs: Tensor, rv: Tensor, rt: Tensor, i2t: softmax.RowStats, t2i: softmax.RowStats):
        """From the two directions' statistics (the same ``pos``)."""
        return cls(pairs, rv, rt, i2t.pos, *i2t[1:4], kept_output(i2t), *t2i[1:4], kept_output(t2i))

    @classmethod
    def fake(cls, img: Tensor, masked: bool, dtype: torch.dtype) -> "SymmetricOut":
        n = img.shape[0]
        return fake(cls, img, dtype, n, kept_i2t=n if masked else 0, kept_t2i=n if masked else 0)


# the raw C++ symmetric kernel's outputs: SymmetricOut's fields from delta_i2t on
SYMMETRIC_STATS = slice(SymmetricOut._fields.index("delta_i2t"), None)


class DirectionalOut(NamedTuple):
    """``hnclip::triton_directional_nll``'s outputs (``hnclip::cpp_directional_nll``'s begin with
    them): M query rows against N key columns, each (M,) in the compute dtype but the keys' and
    their margin factors' norms (N,), ``kept`` (0,) without masking."""

    loss: Tensor  # (M,) per-row losses
    rq: Tensor  # 1/‖q_i‖, 1/‖k_j‖, 1/‖a_i‖, 1/‖b_j‖ (ones without normalize)
    rk: Tensor
    ra: Tensor
    rb: Tensor
    pos: Tensor  # the rows' statistics (softmax.RowStats)
    delta: Tensor
    mean_neg: Tensor
    dsum: Tensor
    kept: Tensor

    def stats(self, masked: bool) -> softmax.RowStats:
        return row_stats(self.pos, self.delta, self.mean_neg, self.dsum, self.kept, masked)

    @classmethod
    def of(cls, loss: Tensor, norms, stats: softmax.RowStats) -> "DirectionalOut":
        """From the losses, the four norms (q, k, a, b) and the rows' statistics."""
        return cls(loss, *norms, *stats[:4], kept_output(stats))

    @classmethod
    def fake(cls, q: Tensor, k: Tensor, masked: bool, dtype: torch.dtype) -> "DirectionalOut":
        m, n = q.shape[0], k.shape[0]
        return fake(cls, q, dtype, m, rk=n, rb=n, kept=m if masked else 0)


def positives_shape(rows: int, positives: bool) -> tuple:
    """The shape of a multi-positive ``positives`` output (the other positives' four statistics per
    row, ``csrc/positives.cpp``): (4, rows) under ``group_mode="supcon"``/``"mil_nce"``, else (0,)."""
    return (4, rows) if positives else (0,)


class CppDirectionalOut(
    NamedTuple(
        "_CppDirectionalOut", [(f, Tensor) for f in (*DirectionalOut._fields, "row_acc", "col_acc", "positives")]
    )
):
    """``hnclip::cpp_directional_nll``'s outputs: :class:`DirectionalOut`'s, then the negatives'
    gradient shares the forward kept for the backward (``need_grad``: row_acc (M, D), col_acc
    (N, D); else (0, D)), then the other positives' statistics (:func:`positives_shape`)."""

    __slots__ = ()
    stats = DirectionalOut.stats

    @classmethod
    def fake(
        cls, q: Tensor, k: Tensor, masked: bool, need_grad: bool, dtype: torch.dtype, positives: bool = False
    ) -> "CppDirectionalOut":
        (m, d), n = q.shape, k.shape[0]
        acc = {"row_acc": (m if need_grad else 0, d), "col_acc": (n if need_grad else 0, d)}
        return fake(
            cls, q, dtype, m, rk=n, rb=n, kept=m if masked else 0, positives=positives_shape(m, positives), **acc
        )


# the raw C++ directional kernel's outputs: CppDirectionalOut's fields from delta to col_acc
DIRECTIONAL_STATS = slice(CppDirectionalOut._fields.index("delta"), CppDirectionalOut._fields.index("col_acc") + 1)


class FamilyPairsOut(NamedTuple):
    """``hnclip::triton_symmetric_nll``'s outputs (and the head of :class:`FamilyOut`): :class:`SymmetricOut`'s with the negatives' inverse norms ``rn``
    (M,) after ``rt``; the i2t statistics are over the N + M columns (the symmetric walk's and the
    negative block's, merged)."""

    pairs: Tensor
    rv: Tensor
    rt: Tensor
    rn: Tensor  # 1/‖n_j‖ (M,)
    pos: Tensor
    delta_i2t: Tensor
    mean_neg_i2t: Tensor
    dsum_i2t: Tensor
    kept_i2t: Tensor
    delta_t2i: Tensor
    mean_neg_t2i: Tensor
    dsum_t2i: Tensor
    kept_t2i: Tensor

    i2t = SymmetricOut.i2t
    t2i = SymmetricOut.t2i

    @classmethod
    def fake(cls, img: Tensor, negatives: Tensor, masked: bool, dtype: torch.dtype) -> "FamilyPairsOut":
        n, kept = img.shape[0], img.shape[0] if masked else 0
        return fake(cls, img, dtype, n, rn=negatives.shape[0], kept_i2t=kept, kept_t2i=kept)


_FAMILY_FIELDS = (*FamilyPairsOut._fields, "row_acc", "col_acc", "positives_i2t", "positives_t2i")


class FamilyOut(NamedTuple("_FamilyOut", [(f, Tensor) for f in _FAMILY_FIELDS])):
    """``hnclip::cpp_symmetric_nll``'s outputs: :class:`FamilyPairsOut`'s, then the negative block's
    gradient shares (as :class:`CppDirectionalOut`'s, P normalised over all N + M columns; with
    need_grad and M > 0 row_acc (N, D), col_acc (M, D), else (0, D)), then each direction's other
    positives' statistics (:func:`positives_shape`)."""

    i2t = SymmetricOut.i2t
    t2i = SymmetricOut.t2i

    @classmethod
    def fake(
        cls, img: Tensor, negatives: Tensor, masked: bool, need_grad: bool, dtype: torch.dtype, positives: bool = False
    ) -> "FamilyOut":
        (n, d), m = img.shape, negatives.shape[0]
        shares = need_grad and m > 0
        acc = {"row_acc": (n if shares else 0, d), "col_acc": (m if shares else 0, d)}
        kept = n if masked else 0
        extra = positives_shape(n, positives)
        return fake(
            cls, img, dtype, n, rn=m, kept_i2t=kept, kept_t2i=kept, positives_i2t=extra, positives_t2i=extra, **acc
        )
