"""Checks of the scalar arguments: Python and NumPy numbers, one-element tensors.

Split from :mod:`hnclip_kernels.validation` by role. The entry points turn NumPy scalars and
Fractions into Python numbers here (:func:`plain_number`), so the rest of the package sees
Python numbers only; :func:`real_number` and :func:`hyperparameter` read one named argument,
:func:`read_logit_scale` open_clip's ``logit_scale``. Each raises ``TypeError`` (wrong kind of
thing) or ``ValueError`` (right kind, bad value) naming the argument. Imports no module of the
package.
"""

from __future__ import annotations

import math
import numbers

import torch

try:
    import numpy as _np
except ImportError:  # pragma: no cover - torch runs without NumPy
    _np = None


def plain_number(x):
    """A NumPy scalar (``np.float32(0.5)``, ``np.int64(1)``) as the Python number it holds, a
    ``fractions.Fraction`` as a float; anything else unchanged. Done at the entry points, so that
    the rest of the package, and Dynamo under ``torch.compile(fullgraph=True)``, only ever see
    Python numbers (Dynamo cannot trace the ``numbers.Real`` check of a NumPy scalar, and NumPy
    floats would not become symbolic floats)."""
    if _np is not None and isinstance(x, (_np.generic, _np.ndarray)) and x.ndim == 0:
        # Dynamo traces a NumPy scalar as a 0-dim array backed by a tensor, a graph input: as a
        # 0-dim tensor it stays one (no recompile per value), which is what the operators take
        if not torch.compiler.is_compiling():
            return x.item()
        value = torch.as_tensor(x)
        # an integer scalar (np.int64(1)) is a real number: a float64 tensor, as eagerly a float
        integral = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return value.to(torch.float64) if integral else value
    if isinstance(x, numbers.Rational) and not isinstance(x, int):  # fractions.Fraction: tensors take no Fraction
        return float(x)
    return x


def hyperparameter(name: str, x):
    """γ or ε as the loss carries it: a Python number, or (under ``torch.compile``, where it is
    a graph input) a detached 0-dim tensor. NumPy scalars and one-element floating tensors are
    accepted: eagerly they become Python floats (a tensor is read once on the host)."""
    x = plain_number(x)
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or not x.is_floating_point():
            raise TypeError(
                f"{name} must be a real number or a one-element floating tensor, got a {x.dtype} "
                f"tensor of shape {tuple(x.shape)}"
            )
        if torch.compiler.is_compiling() or x.device.type == "meta":
            return x.detach().reshape(())
        return float(x.detach())
    return x


def real_number(name: str, x) -> float:
    """A Python/NumPy real number as a float, or TypeError/ValueError naming ``name``."""
    x = plain_number(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number (float), got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} = {x} does not fit in a float") from None


def read_logit_scale(logit_scale):
    """(s as a host float or None where it cannot be read, the error naming ``logit_scale`` (not
    the τ = 1/s it becomes) or None if it is valid). Reads a tensor s once (one host sync)."""
    if isinstance(logit_scale, torch.Tensor):
        if logit_scale.numel() != 1 or not logit_scale.is_floating_point():
            return None, ValueError(
                f"logit_scale must be a floating 0-dim tensor (model(...)'s third output), "
                f"got {logit_scale.dtype} of shape {tuple(logit_scale.shape)}"
            )
        if torch.compiler.is_compiling() or logit_scale.device.type == "meta":
            return None, None  # no value to read: a graph break under compile; meta tensors have none
        value = float(logit_scale.detach())
    elif isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real):
        return None, TypeError(f"logit_scale must be a tensor or a float, got {type(logit_scale).__name__}")
    elif torch.compiler.is_compiling():
        return None, None  # a symbolic float under torch.compile: no value to check (eager calls check it)
    else:
        value = float(logit_scale)
    if not math.isfinite(value) or value <= 0:
        return None, ValueError(f"logit_scale (s = 1/tau, already exponentiated) must be finite and > 0, got {value}")
    return value, None
