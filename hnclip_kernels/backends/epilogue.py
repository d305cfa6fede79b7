"""The O(N·D) algebra around every fused kernel, whatever its loss kind (Triton and C++ alike):
inverse norms and the normalised features, the positive logits, the normalisation's chain rule,
dL/dτ from Σ dZ·Z, and the 16-bit rounding compensation. The softmax kind's row statistics and
its epilogue are in :mod:`.softmax` (docs/layout.md, "Where a new loss kind goes").
"""

from __future__ import annotations

import torch

from ..numerics import NORM_EPS


def inv_norms(x: torch.Tensor, normalize: bool, dt: torch.dtype = torch.float32) -> torch.Tensor:
    """1 / max(‖x_i‖, eps) per row in ``dt`` (ones when not normalising): ``F.normalize``'s clamp.
    The norm is taken in float64: in float32 it overflows for finite rows with entries ≳ 1.8e19
    (and their normalised vectors would silently become 0)."""
    if not normalize:
        return torch.ones(x.shape[0], device=x.device, dtype=dt)
    return (1.0 / torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).clamp_min(NORM_EPS)).to(dt)


def scaled(x: torch.Tensor, inv_norm: torch.Tensor, dt: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = x · inv_norm in ``dt``. The C++ kernel builds b̂ / â with this same expression and
    compares bits to spot i2t / t2i, so every wrapper must use it."""
    return x.to(dt) * inv_norm[:, None]


def positive_logits(q_hat: torch.Tensor, k_hat: torch.Tensor, offset: int, inv_tau: torch.Tensor) -> torch.Tensor:
    """Z_i,pos = q̂_i · k̂_{offset+i} / τ, float32 row dots (no margin on the positive)."""
    m = q_hat.shape[0]
    return (q_hat * k_hat[offset : offset + m]).sum(dim=1) * inv_tau


def add_rounding_compensation(d_q, d_k, rho, sigma, q, k, rq, rk, offset: int, positives=None) -> None:
    """Add, in place, what a 16-bit dS lost to rounding, referred to each row's positive key:
    ``d_q[i] += rho[i] · k̂[offset + i]`` and ``d_k[offset + i] += sigma[offset + i] · q̂[i]``.

    ``rho`` (M,) / ``sigma`` (N,): per row / column Σ of dS − round16(dS) (the dS kernel's
    residual sums). The GEMM's rounding error then becomes Σ_k ε_ik dS_ik (k̂_k − k̂_offset+i):
    see ``triton.backward``'s docstring. Columns without a local positive row (the directional
    op's k ∉ [offset, offset + M)) have no reference vector here and keep their error.
    ``positives`` = (the rows' positive keys (M, D), their inverse norms) where none is among k
    (the family's negative block): the rows refer to them, every column keeps its error."""
    if positives is not None:
        d_q.add_(rho[:, None] * scaled(*positives))
        return
    m = q.shape[0]
    d_q.add_(rho[:, None] * scaled(k[offset : offset + m], rk[offset : offset + m]))
    d_k[offset : offset + m].add_(sigma[offset : offset + m, None] * scaled(q, rq))


def tau_grad(dz_z: torch.Tensor, inv_tau: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """dL/dτ = −(Σ_ik dZ_ik·Z_ik) / τ, in τ's ``dtype`` and ``shape`` (``dz_z`` from the finishers)."""
    return (-dz_z * inv_tau).to(dtype).reshape(shape).contiguous()


def unnormalize_grad(x: torch.Tensor, inv_norm: torch.Tensor, d_hat: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Chain dL/dx̂ through x̂ = x / max(‖x‖, eps) (F.normalize semantics), in ``inv_norm``'s
    dtype (float32; float64 for the C++ kernel's float64 path)."""
    if not normalize:
        return d_hat
    x_hat = x.to(inv_norm.dtype) * inv_norm[:, None]
    radial = (x_hat * d_hat).sum(dim=1, keepdim=True)
    clamped = inv_norm >= 1.0 / NORM_EPS  # ‖x‖ below eps: x̂ = x / eps is linear, no projection
    proj = torch.where(clamped[:, None], d_hat, d_hat - x_hat * radial)
    return proj * inv_norm[:, None]
