"""Argument checks shared by every entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
bad value) with a message that names the argument and says how to fix it.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Union

import torch

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton", "cpp")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# tensor-core input precisions of the Triton backend for float32 features (README, "Precision")
FP32_PRECISIONS = ("ieee", "tf32x3", "bf16x6", "bf16x3")


def check_features(img: torch.Tensor, txt: torch.Tensor, img_name: str = "img", txt_name: str = "txt") -> None:
    for name, x in ((img_name, img), (txt_name, txt)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (N, D), got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D (N, D), got shape {tuple(x.shape)}; flatten or reshape it first")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} has dtype {x.dtype}; use float16, bfloat16, float32 or float64 embeddings (cast with .float())"
            )
    if img.shape != txt.shape:
        raise ValueError(
            f"{img_name} and {txt_name} must have the same shape (N, D), got {tuple(img.shape)} and {tuple(txt.shape)}"
        )
    if img.shape[0] == 0:
        raise ValueError(f"{img_name} and {txt_name} have N = 0 rows; the loss needs at least one image-text pair")
    if img.shape[1] == 0:
        raise ValueError(f"{img_name} and {txt_name} have D = 0 columns; embeddings need at least one dimension")
    if img.dtype != txt.dtype:
        raise TypeError(f"{img_name} ({img.dtype}) and {txt_name} ({txt.dtype}) must have the same dtype; cast one of them")
    if img.device != txt.device:
        raise ValueError(f"{img_name} ({img.device}) and {txt_name} ({txt.device}) must be on the same device; move one of them")


def _real(name: str, x) -> float:
    """A Python/NumPy real number as a float, or TypeError/ValueError naming ``name``."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number (float), got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} = {x} does not fit in a float") from None


def check_tau(tau: Union[float, torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32,
              gamma: float = 0.0) -> Optional[float]:
    """τ must be a positive finite number or a one-element floating tensor, large enough that
    the logits (1 + γ)/τ stay finite in the compute ``dtype`` (float32 for all but float64):
    pass the margin scale ``gamma`` (already checked: a finite float ≥ 0) so the bound holds.

    Returns τ's value, or None where it is not read: under ``torch.compile`` (a value check
    would break the graph) and for a meta-device τ (it has no value)."""
    if isinstance(tau, torch.Tensor):
        if tau.numel() != 1:
            raise ValueError(f"tau must be a scalar (0-dim) tensor, got shape {tuple(tau.shape)}")
        if not tau.is_floating_point():
            raise TypeError(f"tau tensor must be floating point, got {tau.dtype}; pass e.g. 1 / logit_scale.exp()")
        if tau.device != device and tau.device.type != "cpu":
            raise ValueError(f"tau is on {tau.device} but the features are on {device}; move tau to {device}")
        if torch.compiler.is_compiling() or tau.device.type == "meta":
            return None  # a value check would break the graph (eager calls check it); meta has no value
        value = float(tau.detach())  # one host sync: the price of a clear error instead of a NaN loss
    else:
        value = _real("tau", tau)
        if torch.compiler.is_compiling():
            return None  # may be a symbolic float under torch.compile
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"tau (temperature) must be finite and > 0, got {value}; open_clip users pass 1 / logit_scale")
    largest = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    if (1.0 + gamma) / value >= largest:
        raise ValueError(f"tau = {value} makes the logits (1 + gamma) / tau overflow {dtype} arithmetic "
                         f"(gamma = {gamma}); use tau > {(1.0 + gamma) / largest:.1e}")
    return value


def check_precision(precision) -> None:
    if precision is None:
        return
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a string or None, got {type(precision).__name__}")
    if precision not in FP32_PRECISIONS:
        hint = " (plain tf32 loses float32 accuracy: use tf32x3)" if precision == "tf32" else ""
        raise ValueError(f"precision must be None or one of {FP32_PRECISIONS}, got {precision!r}{hint}")


def check_options(gamma: float, label_smoothing: float, reduction: str, backend: str, normalize: bool = True) -> None:
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True or False, got {normalize!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    values = {name: _real(name, x) for name, x in (("gamma", gamma), ("label_smoothing", label_smoothing))}
    if torch.compiler.is_compiling():
        return  # the floats may be symbolic under torch.compile; eager calls check them
    for name, x in values.items():
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
    if values["gamma"] < 0:
        raise ValueError(f"gamma (margin scale) must be >= 0, got {gamma}; gamma = 0 is plain InfoNCE")
    if not 0.0 <= values["label_smoothing"] < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
