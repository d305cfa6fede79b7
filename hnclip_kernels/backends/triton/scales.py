"""W's scales: exact powers of two that keep dS in float16's range, and bf16's exact float16 copies.

W = diag(a) · dS · diag(b) (:mod:`.dscore`): a, b are the inverse norms times exact powers of two.
Scales. W's norms are first brought near 1 by exact powers of two (``_pow2_unit``): with
‖q‖‖k‖ ~ 1e36 the plain r_q·r_k·dS falls below float32's normal range. For 16-bit W one more
power of two c (``_pow2_fit``) brings B ≥ |W_ik| into [2¹², 2¹³): float16 (max 65504) never
overflows. B holds in every regime: |dS_ik| ≤ |g_i|·μ_i (+ |g'_k|·μ'_k), μ_i the row's negative
mass Σ_k P_ik = 1 − e^(−nll_i) (or ε/n_i if larger) rounded up to a power of two, at most 1
(B = max|g| put a saturated batch's W, P_ik ~ 1e-13, below float16's subnormals, all of dS then
compensated along the positive). Rows of mass > ½ keep B = max|g| (+ max|g'|), bit for bit. One
c serves all of W: a row whose |g_i|·μ_i is below ~2⁻²⁵ of the largest still flushes (its absolute
error below ~2⁻²⁵ of the largest row's share). All scales are exact powers of two.
"""

from __future__ import annotations

import torch


def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _pow2_fit(sides, w: torch.Tensor) -> torch.Tensor:
    """The power of two c (1-element float32, no host sync) with c·B in [2¹², 2¹³), B ≥ |dS| from each
    side's rows (g, nll, ε/n_i or None; module docstring, Scales), and c ≤ 2¹²⁰ / w (w ≥ 1: the
    other powers of two in a·wk, b·wq; they stay finite when B is tiny)."""
    bound = 0.0
    for g, nll, s in sides:
        mass = -torch.expm1(-nll) if s is None else torch.maximum(-torch.expm1(-nll), s)
        bound = bound + (g.abs() * torch.ldexp(torch.ones_like(mass), torch.frexp(mass)[1]).clamp_max(1.0)).max()
    _, exponent = torch.frexp(bound.reshape(1))
    return torch.minimum(torch.ldexp(torch.ones(1, device=w.device), 13 - exponent), 2.0**120 / w)


def _f16_scales(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per row of bf16 ``x`` (inverse norms ``r``) the power of two s (float32) with x·s exact in
    float16: s = min(2^e_r, 2^−e_x), r ∈ [2^(e_r−1), 2^e_r), max|x_j| ∈ [2^(e_x−1), 2^e_x)
    (2^e_r for a zero row). Every |x_j s| < 1, and r/s ∈ [½, 1) for a normalised row
    (‖x‖·r = 1 ⇒ max|x_j| ≤ 1/r, so 2^e_r ≤ 2^−e_x)."""
    _, e_r = torch.frexp(r)
    s_r = torch.ldexp(torch.ones_like(r), e_r)
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, dtype=torch.float32)  # max|x_j|, no |x| temporary
    _, e_x = torch.frexp(amax)
    return torch.where(amax > 0, torch.minimum(s_r, torch.ldexp(torch.ones_like(r), -e_x)), s_r)


def to_f16(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x · s[:, None] in float16, exact (``_f16_scales``; entries below 2^−17 lose bits to
    float16's subnormals, below 2^−25 flush), in a buffer of the backward's workspace."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.float16)
    torch.mul(x, s[:, None], out=out)
    return out


def w_scales(q, k, r_q, r_k, sides, round16: bool, tail: bool):
    """W = diag(a) dS diag(b)'s scales for rows ``q`` against columns ``k`` (inverse norms r_q,
    r_k; ``sides`` what bounds |dS|, see ``_pow2_fit``):
    (a, b, rq, rk, f16): rq, rk what the products divide out (W's own side's scale and the other
    side's power of two: a GEMM against x·s gives a_i·wk·Σ_k dS_ik k̂_k; the power-of-two
    products are exact), f16 the exact float16 conversions' scales (s_q, s_k) of bf16 features
    (None otherwise; W's scales then carry 1/s, t = r/s exactly)."""
    if round16 and not tail:
        f16 = _f16_scales(q, r_q), _f16_scales(k, r_k)
        t_q, t_k = r_q / f16[0], r_k / f16[1]
    else:
        f16, t_q, t_k = None, r_q, r_k
    wq, wk = _pow2_unit(t_q), _pow2_unit(t_k)
    if round16:
        wq = wq * _pow2_fit(sides, torch.maximum(wq, wk).clamp_min(1.0))
    a, b = t_q * wq, t_k * wk
    return a, b, a * wk, b * wq, f16
