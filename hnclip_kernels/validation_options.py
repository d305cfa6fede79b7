"""Checks of the loss's options: reduction, backend, γ, ε, normalize, the false-negative
threshold and the Triton backend's precision for float32 features (its modes and default).

Split from :mod:`hnclip_kernels.validation` by role; :class:`hnclip_kernels.LossOptions` runs
these once at construction. Each raises ``TypeError`` (wrong kind of thing) or ``ValueError``
(right kind, bad value) naming the argument and saying how to fix it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .validation_scalars import real_number

REDUCTIONS = ("mean", "sum", "none", "directions")
# the reductions that return per-row outputs (the overflow bound then covers one row's loss)
ROW_REDUCTIONS = ("none", "directions")
# the loss modules and the distributed loss return a rank's scalar or its direction rows
MODULE_REDUCTIONS = ("mean", "directions")
BACKENDS = ("auto", "torch", "triton", "cpp")
# tensor-core input precisions of the Triton backend for float32 features (README, "Precision")
FP32_PRECISIONS = ("ieee", "tf32x3", "bf16x6", "bf16x3")
# tf32x3 splits each operand into a tf32 head and tail and sums three tf32 products: float32
# accuracy on tensor cores ("ieee" is plain FMA, no tensor cores; README, "Precision")
DEFAULT_FP32_PRECISION = "tf32x3"


def resolve_precision(precision: Optional[str]) -> str:
    """The Triton backend's mode for float32 features: ``precision``, or the default for None
    (the one place the default is applied)."""
    return DEFAULT_FP32_PRECISION if precision is None else precision


def check_precision(precision) -> None:
    if precision is None:
        return
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a string or None, got {type(precision).__name__}")
    if precision not in FP32_PRECISIONS:
        hint = " (plain tf32 loses float32 accuracy: use tf32x3)" if precision == "tf32" else ""
        raise ValueError(f"precision must be None or one of {FP32_PRECISIONS}, got {precision!r}{hint}")


def check_false_negative_threshold(threshold) -> None:
    """``false_negative_threshold``: None (no masking) or a real number in (−1, 1], the caption
    cosine at and above which a pair i ≠ j stops being a negative (see ``hn_clip_loss``)."""
    if threshold is None:
        return
    value = real_number("false_negative_threshold", threshold)
    if torch.compiler.is_compiling():
        return  # may be a symbolic float under torch.compile; eager calls check it
    if not (-1.0 < value <= 1.0):  # NaN fails too
        raise ValueError(
            f"false_negative_threshold must be None or a caption cosine in (-1, 1], got {threshold}; "
            "e.g. 0.95 masks near-duplicate captions, 0.9999 exact duplicates (the float32 cosine of two "
            "identical captions can round below 1.0)"
        )


def check_module_reduction(reduction, where: str) -> None:
    """``reduction`` of the loss module or the distributed loss (``where``): "mean" (the rank's
    scalar) or "directions" (its rows); "sum" and "none" are ``hn_clip_loss``'s."""
    if reduction not in MODULE_REDUCTIONS:
        raise ValueError(
            f"{where} takes reduction in {MODULE_REDUCTIONS}, got {reduction!r}; per-pair rows ('none') "
            "and sums are hn_clip_loss's (one process), or weight the rows of reduction='directions'"
        )


def check_options(gamma: float, label_smoothing: float, reduction: str, backend: str, normalize: bool = True) -> None:
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True or False, got {normalize!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    pairs = (("gamma", gamma), ("label_smoothing", label_smoothing))
    if torch.compiler.is_compiling():  # symbolic floats or traced tensors: eager calls check the values
        for name, x in pairs:
            if not isinstance(x, torch.Tensor):
                real_number(name, x)
        return
    values = {name: real_number(name, x) for name, x in pairs}
    for name, x in values.items():
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
    if values["gamma"] < 0:
        raise ValueError(f"gamma (margin scale) must be >= 0, got {gamma}; gamma = 0 is plain InfoNCE")
    if not 0.0 <= values["label_smoothing"] < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
