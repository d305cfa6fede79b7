"""The O(N·D) algebra around every fused kernel (Triton and C++ alike).

A fused kernel only ever touches the *negatives* of a row (k != offset + i). It returns,
per query row i, with d_ik = Z_ik - Z_i,pos:

* ``delta_i = LSE_{k != pos} d_ik``   (so nll_i = softplus(delta_i): tiny losses survive)
* ``mean_neg_i = Σ_k softmax_neg(d)_ik · d_ik``   (for the τ gradient, no cancellation)
* ``dsum_i = Σ_{k != pos} d_ik``   (label smoothing: ε·mean_k(Z_pos − Z_ik) = −ε·dsum/N)

and in the backward, the negatives' share of the gradient,
``Σ_{k != pos} g_i P_ik k̂_k`` (row kernel) and ``Σ_i g_i P_ik q̂_i`` (column kernel).
Everything else, the positive's gradient written as −(sum of the negatives'
probabilities), the uniform label-smoothing term and dL/dτ, is cheap and lives here.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class RowStats(NamedTuple):
    pos: torch.Tensor  # (M,) Z_i,pos, float32
    delta: torch.Tensor  # (M,) LSE over negatives of Z - Z_pos
    mean_neg: torch.Tensor  # (M,) E_softmax_neg[Z - Z_pos]
    dsum: torch.Tensor  # (M,) Σ_neg (Z - Z_pos)


def positive_logits(q_hat: torch.Tensor, k_hat: torch.Tensor, offset: int, inv_tau: torch.Tensor) -> torch.Tensor:
    """Z_i,pos = q̂_i · k̂_{offset+i} / τ, float32 row dots (no margin on the positive)."""
    m = q_hat.shape[0]
    return (q_hat * k_hat[offset : offset + m]).sum(dim=1) * inv_tau


def row_losses(stats: RowStats, n_keys: int, label_smoothing: float) -> torch.Tensor:
    nll = F.softplus(stats.delta)
    if label_smoothing == 0.0:
        return nll
    return nll - (label_smoothing / n_keys) * stats.dsum


def row_nll(stats: RowStats) -> torch.Tensor:
    """softplus(delta) = LSE_all − Z_pos, what the backward kernels subtract from d_ik."""
    return F.softplus(stats.delta)


def add_positive_and_smoothing(stats: RowStats, g, q_hat, k_hat, d_q, d_k, offset: int, label_smoothing: float):
    """Add, in place, the parts of dL/dq̂ and dL/dk̂ (times τ) that no kernel computes: the
    positive's gradient and the uniform label-smoothing term. Returns this direction's
    Σ_ik dZ_ik·Z_ik (a scalar), from which dL/dτ = −(that) / τ.
    """
    m, n = q_hat.shape[0], k_hat.shape[0]
    eps = label_smoothing
    q_prob = torch.sigmoid(stats.delta)  # Σ of the negatives' probabilities, stable when tiny
    g_pos = g * (eps - q_prob)  # dL/dZ_pos = ε(1 − 1/N) − q, the −ε/N part is in the uniform term below
    d_q.add_(g_pos[:, None] * k_hat[offset : offset + m])
    d_k[offset : offset + m].add_(g_pos[:, None] * q_hat)
    if eps != 0.0:
        # every column (positive included) gets −ε/N · g_i
        d_q.sub_((eps / n) * g[:, None] * k_hat.sum(dim=0)[None, :])
        d_k.sub_((eps / n) * (g[:, None] * q_hat).sum(dim=0)[None, :])
    # Σ_k dZ_ik Z_ik = Σ_{k≠pos} (P_ik − ε/N)(Z_ik − Z_pos), since each row of dZ sums to 0:
    # written with gaps, so there is no cancellation when the loss is tiny
    return (g * (q_prob * stats.mean_neg - (eps / n) * stats.dsum)).sum()


def grads_outside_kernel(
    stats: RowStats,
    g: torch.Tensor,
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    d_q_neg: torch.Tensor,
    d_k_neg: torch.Tensor,
    offset: int,
    inv_tau: torch.Tensor,
    label_smoothing: float,
):
    """Complete the gradients w.r.t. the normalised q̂ (M, D), k̂ (N, D) and w.r.t. τ.

    ``d_q_neg``/``d_k_neg`` are the kernels' float32 negatives-only sums (before 1/τ).
    ``g`` (M,) is the upstream gradient of each row's loss. Modifies ``d_q_neg`` and
    ``d_k_neg`` in place (they are kernel scratch) and returns (dq̂, dk̂, dτ_times_tau)
    where the last must still be divided by τ (done by the caller to keep τ's dtype).
    """
    dz_z = add_positive_and_smoothing(stats, g, q_hat, k_hat, d_q_neg, d_k_neg, offset, label_smoothing)
    # dL/dτ = −(1/τ) Σ_ik dZ_ik Z_ik
    return d_q_neg.mul_(inv_tau), d_k_neg.mul_(inv_tau), -dz_z


def unnormalize_grad(x: torch.Tensor, inv_norm: torch.Tensor, d_hat: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Chain dL/dx̂ through x̂ = x / max(‖x‖, eps) (F.normalize semantics), in ``inv_norm``'s
    dtype (float32; float64 for the C++ kernel's float64 path)."""
    if not normalize:
        return d_hat
    x_hat = x.to(inv_norm.dtype) * inv_norm[:, None]
    radial = (x_hat * d_hat).sum(dim=1, keepdim=True)
    clamped = inv_norm >= 1.0 / 1e-12  # ‖x‖ below eps: x̂ = x / eps is linear, no projection
    proj = torch.where(clamped[:, None], d_hat, d_hat - x_hat * radial)
    return proj * inv_norm[:, None]
