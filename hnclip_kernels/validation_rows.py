"""τ against the smallest row norms with ``normalize=True``: the feature gradients' overflow bound.

x̂ = x / max(‖x‖, eps) (eps = ``numerics.NORM_EPS`` = 1e-12, ``F.normalize``'s clamp) multiplies
dL/dx̂ by up to 1 / max(‖x_i‖, eps) on its way to dL/dx. For unit rows the bound τ is checked
against (``validation.largest_intermediate``: the gaps (2 + γ)/τ, their sums, the loss) also
bounds dL/dx̂ as far as the package checks it; a row of norm ρ < 1 amplifies it by 1/ρ. At τ =
1e-30 a row of norm ≤ 1e-12 makes that ≈ 1e42: an infinite gradient from a finite loss, which a
loop that skips non-finite losses does not catch, and which ``validation.check_tau`` does not see
(the logits of a normalised row do not grow as its norm shrinks). Rows of norm ≥ 1 never raise
here: the unit rows' bound is ``check_tau``'s.

The norms are read (one host sync) only where the bound could overflow with the clamp itself,
bound / eps ≥ the dtype's largest finite number: for float32, τ below about 1e-26·(the rows a
reduction sums). No τ a model trains with pays for it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .numerics import NORM_EPS
from .validation import finite_limit, largest_intermediate


def check_small_rows(
    features: tuple,
    names: tuple,
    tau_value: Optional[float],
    gamma: float,
    label_smoothing: float,
    n_keys: int,
    n_rows: int,
) -> None:
    """Raise ``ValueError`` naming τ and the feature tensor whose smallest row (norm ρ clamped at
    NORM_EPS) makes dL/dx overflow its dtype: ``largest_intermediate`` (τ, γ, ε, ``n_keys`` key
    columns, ``n_rows`` summed rows) / ρ (module docstring). ``features``: the normalised (rows, D)
    tensors, ``names`` theirs. Skipped under ``torch.compile``, for meta tensors and where τ was
    not read (None)."""
    x0 = features[0]
    if tau_value is None or torch.compiler.is_compiling() or x0.device.type == "meta":
        return
    limit = finite_limit(x0.dtype)
    bound = largest_intermediate(tau_value, gamma, float(label_smoothing), n_keys, n_rows=n_rows)
    if bound / NORM_EPS < limit:
        return
    present = [(x, name) for x, name in zip(features, names) if x.shape[0] > 0]
    if not present:
        return
    mins = torch.stack([torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float64).min() for x, _ in present])
    for norm, (_, name) in zip(mins.tolist(), present):
        rho = max(norm, NORM_EPS)
        if math.isfinite(norm) and rho < 1.0 and bound / rho >= limit:
            raise ValueError(
                f"tau = {tau_value:g} with a row of {name} of norm {norm:.3g} (normalize=True clamps it at "
                f"{NORM_EPS:g}) gives dL/d{name} up to {bound / rho:.3g} (the loss's bound {bound:.3g} at this "
                f"tau over the row's norm), beyond {'float64' if x0.dtype == torch.float64 else 'float32'} range: "
                f"use tau > {tau_value * bound / (rho * limit):.2e}, or drop the rows of (near-)zero norm"
            )
