"""Checks of the features, τ and the range they span, shared by every entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
bad value) with a message that names the argument and says how to fix it. The option checks
are in :mod:`hnclip_kernels.validation_options`, those of the scalar arguments in
:mod:`hnclip_kernels.validation_scalars`, the hard-negative family's in
:mod:`hnclip_kernels.validation_family`.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Optional, Union

import torch

from .plausibility import warn_if_not_unit_norm

# the names the entry points and backends read as ``validation.<name>``, at home in the modules split off
from .validation_options import DEFAULT_FP32_PRECISION, FP32_PRECISIONS, resolve_precision  # noqa: F401
from .validation_scalars import plain_number, read_logit_scale, real_number  # noqa: F401

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _is_dtensor(x) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing that module: if it
    was never imported, no DTensor exists). Its operators need a sharding rule for every op,
    which the loss's custom operators do not have."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(x, dtensor)


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
