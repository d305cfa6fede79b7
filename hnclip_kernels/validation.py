"""Argument checks shared by every entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
bad value) with a message that names the argument and says how to fix it.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from typing import Optional, Union

import torch

from .plausibility import warn_if_not_unit_norm

try:
    import numpy as _np
except ImportError:  # pragma: no cover - torch runs without NumPy
    _np = None

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton", "cpp")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# tensor-core input precisions of the Triton backend for float32 features (README, "Precision")
FP32_PRECISIONS = ("ieee", "tf32x3", "bf16x6", "bf16x3")
# tf32x3 splits each operand into a tf32 head and tail and sums three tf32 products: float32
# accuracy on tensor cores ("ieee" is plain FMA, no tensor cores; README, "Precision")
DEFAULT_FP32_PRECISION = "tf32x3"


def resolve_precision(precision: Optional[str]) -> str:
    """The Triton backend's mode for float32 features: ``precision``, or the default for None
    (the one place the default is applied)."""
    return DEFAULT_FP32_PRECISION if precision is None else precision


def check_features(img: torch.Tensor, txt: torch.Tensor, img_name: str = "img", txt_name: str = "txt") -> None:
    for name, x in ((img_name, img), (txt_name, txt)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (N, D), got {type(x).__name__}")
        if _is_dtensor(x):
            raise TypeError(
                f"{name} is a DTensor (placements {tuple(x.placements)}); the loss takes plain tensors: "
                f"pass {name}.full_tensor() (its global value as a plain tensor; gradients flow back to "
                f"the DTensor)"
            )
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
        raise TypeError(
            f"{img_name} ({img.dtype}) and {txt_name} ({txt.dtype}) must have the same dtype; cast one of them"
        )
    if img.device != txt.device:
        raise ValueError(
            f"{img_name} ({img.device}) and {txt_name} ({txt.device}) must be on the same device; move one of them"
        )


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


def _is_dtensor(x) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing that module: if it
    was never imported, no DTensor exists). Its operators need a sharding rule for every op,
    which the loss's custom operators do not have."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(x, dtensor)


def real_number(name: str, x) -> float:
    """A Python/NumPy real number as a float, or TypeError/ValueError naming ``name``."""
    x = plain_number(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number (float), got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name} = {x} does not fit in a float") from None


def largest_intermediate(
    tau: float,
    gamma: float,
    label_smoothing: float = 0.0,
    n_keys: int = 1,
    img_norm: float = 1.0,
    txt_norm: float = 1.0,
    n_rows: int = 1,
    tau_grad: bool = False,
) -> float:
    """The largest magnitude any backend forms on the way to the loss (with ``tau_grad``, to dL/dτ).

    With ‖v_i‖ ≤ img_norm and ‖t_j‖ ≤ txt_norm (1 for normalised features):

    * the raw products v·t and t·t (before 1/τ and γ) reach img_norm·txt_norm and txt_norm²;
    * the gaps Z_ij − Z_ii that the kernels work with reach
      g = (2·img_norm·txt_norm + γ·txt_norm²)/τ, that is (2 + γ)/τ when normalised;
    * label smoothing sums N gaps per row (``dsum``): N·g;
    * a row's loss is at most g (2g with label smoothing), a pair sums two rows, and the
      "mean"/"sum" reductions add up ``n_rows`` pairs: the loss bound 2·row·n_rows;
    * ``tau_grad``: dL/dτ = −Σ ∂L/∂Z_ij · (Z_ij − Z_ii) / τ (each row's ∂L/∂Z sums to 0, every
      logit is ∝ 1/τ) reaches the loss bound / τ, ∝ 1/τ² (float32 overflows below τ ≈ 1e-19).
    """
    gap = (2.0 * img_norm * txt_norm + gamma * txt_norm * txt_norm) / tau
    smoothing = gap * n_keys if label_smoothing != 0.0 else 0.0
    row = gap * (2.0 if label_smoothing != 0.0 else 1.0)
    loss = 2.0 * row * n_rows
    return max(img_norm * txt_norm, txt_norm * txt_norm, gap, smoothing, loss, loss / tau if tau_grad else 0.0)


def tau_requires_grad(tau) -> bool:
    """Whether dL/dτ will be formed: ``tau`` a tensor that requires grad (or, under
    ``torch.func`` transforms, whose wrapper or wrapped tensor does), with grad mode on."""
    if not isinstance(tau, torch.Tensor) or not torch.is_grad_enabled():
        return False
    # Dynamo cannot trace functorch's unwrapping (and traces no functorch wrapper)
    return tau.requires_grad or (not torch.compiler.is_compiling() and _unwrapped(tau).requires_grad)


def finite_limit(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max


def check_tau(
    tau: Union[float, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    gamma: float = 0.0,
    *,
    label_smoothing: float = 0.0,
    n_keys: int = 1,
    n_rows: int = 1,
    tau_grad: Optional[bool] = None,
) -> Optional[float]:
    """τ must be a positive finite number or a one-element floating tensor, large enough that
    every intermediate of normalised features (:func:`largest_intermediate`: the gaps reach
    (2 + γ)/τ) stays finite in the compute ``dtype`` (float32 for all but float64). Pass the
    margin scale ``gamma`` (already checked: a finite float ≥ 0), with label smoothing
    ``label_smoothing`` and the number of key columns ``n_keys``, and the number of rows a
    reduction sums, ``n_rows``, so the bound holds. ``tau_grad``: whether dL/dτ will be formed
    (its bound, the loss bound / τ, then counts too); None: :func:`tau_requires_grad` of ``tau``
    (pass it where ``tau`` is a value read earlier from a tensor).

    Returns τ's value, or None where it is not read: under ``torch.compile`` (a value check
    would break the graph, and reading a Python float would specialise the graph on it) and
    for a meta-device τ (it has no value)."""
    if torch.compiler.is_compiling():
        return None  # τ may be a symbolic float or a traced tensor: eager calls check it
    if tau_grad is None:
        tau_grad = tau_requires_grad(tau)
    if isinstance(tau, torch.Tensor):
        if tau.numel() != 1:
            raise ValueError(
                f"tau must be a scalar: a Python number or a one-element tensor, got shape {tuple(tau.shape)}"
            )
        if not tau.is_floating_point():
            raise TypeError(f"tau tensor must be floating point, got {tau.dtype}; pass e.g. 1 / logit_scale.exp()")
        if tau.device != device and tau.device.type != "cpu":
            raise ValueError(f"tau is on {tau.device} but the features are on {device}; move tau to {device}")
        if tau.device.type == "meta":
            return None  # meta tensors have no value
        values = _functorch_values(tau.detach())
        if values is not None:  # under torch.func.vmap: check every batch entry's τ; the smallest bounds them all
            sizes = dict(label_smoothing=label_smoothing, n_keys=n_keys, n_rows=n_rows, tau_grad=tau_grad)
            for value in values:
                check_tau(value, device, dtype, gamma, **sizes)
            return min(values)
        value = float(tau.detach())  # one host sync: the price of a clear error instead of a NaN loss
    else:
        value = real_number("tau", tau)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"tau (temperature) must be finite and > 0, got {value}; open_clip users pass 1 / logit_scale")
    limit = finite_limit(dtype)
    if largest_intermediate(value, gamma, label_smoothing, n_keys, n_rows=n_rows, tau_grad=tau_grad) >= limit:
        at_one = functools.partial(largest_intermediate, 1.0, gamma, label_smoothing, n_keys, n_rows=n_rows)
        smallest = at_one() / limit  # the gaps, the sums and the loss are ∝ 1/τ
        if tau_grad:  # dL/dτ ∝ 1/τ²
            smallest = max(smallest, math.sqrt(at_one(tau_grad=True) / limit))
        raise ValueError(
            f"tau = {value} makes the logit gaps (2 + gamma) / tau"
            + (f" summed over N = {n_keys} columns (label smoothing)" if label_smoothing else "")
            + (f" or the {n_rows} rows' losses summed by the reduction" if n_rows > 1 else "")
            + (" or dL/dtau (up to that loss / tau; tau requires grad)" if tau_grad else "")
            + f" overflow {dtype} arithmetic (gamma = {gamma}); use tau > {smallest:.2e}"
        )
    return value


def _unwrapped(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind ``torch.func`` wrappers (a batched tensor keeps its batch
    dimensions), or ``x`` itself: vmap cannot read values out of a batched tensor."""
    functorch = getattr(torch._C, "_functorch", None)
    while functorch is not None and functorch.is_functorch_wrapped_tensor(x):
        x = functorch.get_unwrapped(x)
    return x


def _functorch_values(tau: torch.Tensor):
    """Every value behind a τ wrapped by ``torch.func`` transforms, or None for a plain tensor."""
    plain = _unwrapped(tau)
    return None if plain is tau else plain.reshape(-1).tolist()


def row_norm_extremes(*features: torch.Tensor) -> list:
    """For each of ``features`` ((N, D) tensors), (its largest row norm, its largest
    |‖x_i‖ − 1|) as Python floats, taken in float64 in one host sync (under ``torch.func``, over
    every batch entry's rows). The second is for
    :func:`hnclip_kernels.plausibility.warn_if_not_unit_norm`, from the same norms and in the same
    sync."""
    norms = [torch.linalg.vector_norm(_unwrapped(x), dim=-1, dtype=torch.float64) for x in features]
    values = torch.stack([v for n in norms for v in (n.max(), (n - 1.0).abs().max())]).tolist()
    return [tuple(values[k : k + 2]) for k in range(0, len(values), 2)]


def check_feature_range(
    img: torch.Tensor,
    txt: torch.Tensor,
    tau_value: Optional[float],
    gamma: float,
    label_smoothing: float = 0.0,
    img_name: str = "img",
    txt_name: str = "txt",
    n_rows: int = 1,
    tau_grad: bool = False,
) -> None:
    """With ``normalize=False`` the logits grow with the feature norms: raise ``ValueError`` if
    they (with ``tau_grad``, or dL/dτ) would overflow the compute dtype (one host sync for the
    two largest row norms), so that no backend returns a silently non-finite loss or gradient
    for finite features; otherwise warn once
    per process if a row's norm is off 1 by more than 5% (no extra sync). Skipped under
    ``torch.compile``, for meta tensors and where τ was not read (``tau_value`` None)."""
    if tau_value is None or torch.compiler.is_compiling() or img.device.type == "meta":
        return
    (img_norm, img_off), (txt_norm, txt_off) = row_norm_extremes(img, txt)
    if not (math.isfinite(img_norm) and math.isfinite(txt_norm)):
        return  # non-finite features: the loss is non-finite too, as in torch.nn.functional
    limit = finite_limit(img.dtype)
    largest = largest_intermediate(
        tau_value, gamma, label_smoothing, img.shape[-2], img_norm, txt_norm, n_rows, tau_grad=tau_grad
    )
    if largest >= limit:
        raise ValueError(
            f"with normalize=False, {img_name} (row norms up to {img_norm:.3g}) and {txt_name} "
            f"(up to {txt_norm:.3g}) at tau = {tau_value:g} give logit gaps"
            + (" or dL/dtau" if tau_grad else "")
            + f" up to {largest:.3g}, beyond "
            f"{'float64' if img.dtype == torch.float64 else 'float32'} range; pass normalize=True or "
            "scale the features down"
        )
    warn_if_not_unit_norm(max(img_off, txt_off), (img_name, txt_name))


def check_directional(
    queries: torch.Tensor, keys: torch.Tensor, query_txt: torch.Tensor, key_txt: torch.Tensor, offset
) -> None:
    """The shapes and the positive's ``offset`` of a directional op (M query rows against N key
    columns, positive of row i at column offset + i): every backend raises the same
    ``ValueError``/``TypeError`` instead of reading out of bounds."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"offset must be an int (the global column of the first query row's positive), got {type(offset).__name__}"
        )
    m, n = queries.shape[0], keys.shape[0]
    if not 0 <= offset <= n - m:
        raise ValueError(
            f"offset must satisfy 0 <= offset and offset + M <= N (M = {m} query rows, N = {n} key "
            f"columns), got offset = {offset}"
        )
    if query_txt.shape[0] != m or key_txt.shape[0] != n:
        raise ValueError(
            f"query_txt must have the M = {m} rows of queries and key_txt the N = {n} rows of keys, "
            f"got {query_txt.shape[0]} and {key_txt.shape[0]}"
        )
    dims = {x.shape[-1] for x in (queries, keys, query_txt, key_txt)}
    if len(dims) != 1:
        raise ValueError(f"queries, keys, query_txt and key_txt must share the feature dimension D, got {sorted(dims)}")


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
