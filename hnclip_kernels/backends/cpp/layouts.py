"""The C++ operators' arguments by name: each operator's tensor inputs and flags as NamedTuple
layouts, from which :func:`operator` builds the flat signature ``torch.library`` infers the schema
from, and which the operator bodies receive grouped.

The forward operators take ``(*inputs, *flags)``, their backward operators ``(grad, *inputs,
*saved, *flags, need_features)`` (:mod:`..glue`'s convention; ``saved``: the forward's outputs
after the loss, :class:`Saved`). Optional features are empty tensors when absent. A flag with a
default (a layout's field default) keeps it where no parameter without one follows: in the
forward's schema, not in the backward's, where ``need_features`` comes after the flags.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Callable, NamedTuple

from torch import Tensor


class SymmetricInputs(NamedTuple):
    """``hnclip::cpp_symmetric_nll``'s tensor inputs."""

    img: Tensor  # (N, D)
    txt: Tensor  # (N, D)
    negatives: Tensor  # (M, D), M ≥ 0: the i2t rows' extra caption columns
    own_negatives: Tensor  # (N, K, D): each i2t row's own extra columns, or (0, 0, D)
    own_mask: Tensor  # (N, K) bool, True where real, or (0, 0): all real
    group_ids: Tensor  # (N,) int64, or (0,) without ids
    tau: Tensor
    gamma: Tensor  # 0-dim float64 (glue.hyperparameter), as ε and the threshold
    label_smoothing: Tensor
    threshold: Tensor


class SymmetricFlags(NamedTuple):
    """``hnclip::cpp_symmetric_nll``'s flags."""

    normalize: bool
    masked: bool  # a threshold or group ids (ids alone: threshold +inf)
    margin: int  # hnclip_kernels.margin.Margin.code, range-checked by the raw kernels
    need_grad: bool  # keep the negative block's gradient shares for a backward
    # hnclip_kernels.group_mode.GroupMode.code, range-checked by the raw positives' kernels; last and
    # 0 ("mask", today's) by default, so the calls made before it keep their positions
    group_mode: int = 0


class DirectionalInputs(NamedTuple):
    """``hnclip::cpp_directional_nll``'s tensor inputs."""

    q: Tensor  # (M, D)
    k: Tensor  # (N, D)
    a: Tensor  # (M, D), (N, D): the margin's factors (stop-gradient)
    b: Tensor
    mask_query: Tensor  # (M, D), (N, D): the captions the threshold compares, or (0,)
    mask_key: Tensor
    query_groups: Tensor  # (M,), (K ≤ N,) int64 group ids, or (0,)
    key_groups: Tensor
    tau: Tensor
    gamma: Tensor
    label_smoothing: Tensor
    threshold: Tensor


class DirectionalFlags(NamedTuple):
    """``hnclip::cpp_directional_nll``'s flags."""

    offset: int
    normalize: bool
    masked: bool
    need_grad: bool  # the forward also forms the negatives' gradient shares
    group_mode: int = 0  # as SymmetricFlags.group_mode


class SigmoidInputs(NamedTuple):
    """``hnclip::cpp_sigmoid_nll``'s tensor inputs."""

    img: Tensor  # (R, D)
    txt: Tensor  # (C, D), C ≥ offset + R
    negatives: Tensor  # (M, D), M ≥ 0: extra columns, label −1
    query_groups: Tensor  # (R,), (C,) int64 group ids, or (0,) without ids
    key_groups: Tensor
    logit_scale: Tensor  # s, 0-dim
    logit_bias: Tensor  # b, 0-dim (a zero without a bias)
    gamma: Tensor  # 0-dim float64 (glue.hyperparameter)


class SigmoidFlags(NamedTuple):
    """``hnclip::cpp_sigmoid_nll``'s flags."""

    offset: int  # row i's positive: caption offset + i
    normalize: bool
    margin: int  # hnclip_kernels.margin.Margin.code, range-checked by the raw kernels
    groups_positive: bool  # same-group captions: positives (else masked)


class Saved:
    """The backward's copy of an output ``layout``: its fields after the loss, received as the
    layout with ``None`` for the loss."""

    def __init__(self, layout: type):
        self.layout = layout
        self._fields = layout._fields[1:]

    def _make(self, values):
        return self.layout._make((None, *values))


def _parameters(group) -> list:
    """The flat parameters of one group: a layout's fields, or one ``(name, type[, default])``."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if isinstance(group, tuple):
        default = group[2] if len(group) > 2 else inspect.Parameter.empty
        return [inspect.Parameter(group[0], kind, annotation=group[1], default=default)]
    hints = typing.get_type_hints(group) if isinstance(group, type) else {}
    defaults = getattr(group, "_field_defaults", {})
    return [
        inspect.Parameter(f, kind, annotation=hints.get(f, Tensor), default=defaults.get(f, inspect.Parameter.empty))
        for f in group._fields
    ]


def operator(*groups, returns) -> Callable:
    """Decorate ``body(*values)`` as an operator implementation that takes the ``groups``' fields
    flat: its signature (whence ``torch.library`` infers the schema) lists them with their types
    and ``returns``; ``body`` gets one value per group, a layout instance (a NamedTuple layout or
    :class:`Saved`) or the argument of a ``(name, type)``."""
    sizes = [len(_parameters(group)) for group in groups]

    def wrap(body: Callable) -> Callable:
        @functools.wraps(body)
        def flat(*args):
            values, start = [], 0
            for group, size in zip(groups, sizes):
                part = args[start : start + size]
                if isinstance(group, tuple):
                    values.append(part[0])
                else:  # a layout; a call may leave its trailing defaults out
                    values.append(group._make(part) if isinstance(group, Saved) else group(*part))
                start += size
            return body(*values)

        params = [p for group in groups for p in _parameters(group)]
        for i in range(len(params) - 2, -1, -1):  # a default only where every later parameter has one
            if params[i + 1].default is inspect.Parameter.empty:
                params[i] = params[i].replace(default=inspect.Parameter.empty)
        flat.__signature__ = inspect.Signature(params, return_annotation=returns)
        return flat

    return wrap
