"""τ against the smallest row norms with ``normalize=True``: the feature gradients' overflow bound.

x̂ = x / max(‖x‖, eps) (eps = ``numerics.NORM_EPS`` = 1e-12, ``F.normalize``'s clamp) multiplies
dL/dx̂ by up to 1 / max(‖x_i‖, eps) on its way to dL/dx, and dL/dx̂ reaches (2 + K)(1 + |ε|)/τ
for an upstream gradient of 1 per loss row: each row's dL/dZ has ℓ1 norm at most 2(1 + |ε|)
(the probabilities less the one-hot target, label smoothing ε), a feature is the query of its own
row and a key of at most K rows of the other direction, and every logit is x̂·ŷ/τ with ‖ŷ‖ ≤ 1.
At τ = 1e-30 a row of norm ≤ 1e-12 makes that 1e42: an infinite gradient from a finite loss, which
a loop that skips non-finite losses does not catch. The loss bound (``validation.check_tau``)
does not see it: the logits of a normalised row do not grow as its norm shrinks.

The norms are read (one host sync) only where the bound could overflow with the clamp itself,
(2 + K)(1 + |ε|)/(τ·eps) ≥ the dtype's largest finite number: for float32, τ below about
3e-27·(2 + K). No τ a model trains with pays for it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .numerics import NORM_EPS
from .validation import finite_limit


def check_small_rows(
    features: tuple, tau_value: Optional[float], label_smoothing: float, n_keys: int, names: tuple
) -> None:
    """Raise ``ValueError`` naming τ and the feature tensor whose smallest row (norm clamped at
    NORM_EPS) makes dL/dx overflow its dtype at this τ (module docstring). ``features``: the
    normalised (rows, D) tensors, ``names`` theirs; ``n_keys`` K, the key columns of the widest row.
    Skipped under ``torch.compile``, for meta tensors and where τ was not read (None)."""
    x0 = features[0]
    if tau_value is None or torch.compiler.is_compiling() or x0.device.type == "meta":
        return
    limit = finite_limit(x0.dtype)
    bound = (2.0 + n_keys) * (1.0 + abs(float(label_smoothing))) / tau_value
    if bound / NORM_EPS < limit:
        return
    present = [(x, name) for x, name in zip(features, names) if x.shape[0] > 0]
    if not present:
        return
    mins = torch.stack([torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float64).min() for x, _ in present])
    for norm, (_, name) in zip(mins.tolist(), present):
        rho = max(norm, NORM_EPS)
        if math.isfinite(norm) and bound / rho >= limit:
            raise ValueError(
                f"tau = {tau_value:g} with a row of {name} of norm {norm:.3g} (normalize=True clamps it at "
                f"{NORM_EPS:g}) gives dL/d{name} up to (2 + K)(1 + |label_smoothing|) / (tau * norm) = "
                f"{bound / rho:.3g} (K = {n_keys} key columns), beyond "
                f"{'float64' if x0.dtype == torch.float64 else 'float32'} range: use tau > "
                f"{bound * tau_value / (rho * limit):.2e}, or drop the rows of (near-)zero norm"
            )
