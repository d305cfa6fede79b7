"""W's scales: exact powers of two that keep every row and column of a 16-bit dS in range.

W = diag(a) · dS · diag(b) (:mod:`.dscore`): a, b are the inverse norms times exact powers of two.
Their norms are first brought near 1 (``_pow2_unit``): with ‖q‖‖k‖ ~ 1e36 the plain r_q·r_k·dS falls
below float32's normal range. For 16-bit features the dS kernels write W in float32 (a staging
buffer), with one more power of two c (``_pow2_stage``) that puts a bound B ≥ |dS| at 2⁹⁹–2¹⁰⁰;
:mod:`.round16` then rounds each chunk of it to float16 twice, with each row's own power of two
(for the rows' GEMM) and each column's (for the columns' GEMM), from the chunk's exact maxima
(``fit16``). No row's scale depends on another row's loss: the argument is in docs/numerics.md.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

STAGE_EXP = 100  # the staged float32 W's bound: 2^100 (float32's largest finite is 2^128)
FIT_EXP = 13  # a rounded line's largest |W| in [2^12, 2^13): float16's largest finite is 65504
LINE_CAP_EXP = 126  # a line's scale at most 2^126 (1 / scale stays a normal float32)


class F16Scales(NamedTuple):
    """bf16 features' exact float16 copies' per-row scales (``_f16_scales``): x·s[:, None] in float16."""

    q: torch.Tensor  # (M,) the rows q's
    k: torch.Tensor  # (N,) the columns k's


class WScales(NamedTuple):
    """W = diag(a) dS diag(b)'s scales for rows q against columns k (:func:`w_scales`)."""

    a: torch.Tensor  # (M,) W's row scales
    b: torch.Tensor  # (N,) W's column scales
    rq: torch.Tensor  # (M,) what the rows' GEMM result divides out (a_i · k's power of two)
    rk: torch.Tensor  # (N,) what the columns' GEMM result divides out (b_k · q's power of two)
    f16: Optional[F16Scales]  # bf16 features: the exact float16 copies' scales, else None


def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _pow2_stage(gs, w: torch.Tensor) -> torch.Tensor:
    """The power of two c (1-element float32, no host sync) with c·B in [2⁹⁹, 2¹⁰⁰), B = Σ max|g|
    over ``gs`` (each side's upstream gradients) ≥ |dS_ik| = |g_i (P_ik − s_i) + g'_k (P'_ki − s'_k)|
    (P and s in [0, 1]), and c ≤ 2¹²⁰ / w (w ≥ 1: the other powers of two in a·wk, b·wq; when B is
    tiny, a tiny upstream gradient, c stays finite and so do a and the scales divided out).
    A bound, not each row's mass: the float32 staging W has 2²¹⁴ of range below 2¹⁰⁰ (the line
    scales reach 2¹²⁶), so no row's scale needs to follow its own loss here; ``fit16`` does that."""
    bound = sum(g.abs().max() for g in gs)
    _, exponent = torch.frexp(torch.as_tensor(bound, dtype=torch.float32, device=w.device).reshape(1))
    return torch.minimum(torch.ldexp(torch.ones(1, device=w.device), STAGE_EXP - exponent), 2.0**120 / w)


def fit16(line_max: torch.Tensor) -> torch.Tensor:
    """Per line (row or column of a staged chunk), the power of two that brings its largest |W|
    into [2¹², 2¹³) (at most 2¹²⁶; 2¹³ for a zero line): float16 holds the line's entries to
    11 bits down to 2⁻²⁶ of its largest, whatever the other lines hold."""
    _, exponent = torch.frexp(line_max)
    return torch.ldexp(torch.ones_like(line_max), (FIT_EXP - exponent).clamp_max(LINE_CAP_EXP))


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


def w_scales(q, k, r_q, r_k, gs, round16: bool, tail: bool) -> WScales:
    """W = diag(a) dS diag(b)'s scales for rows ``q`` against columns ``k`` (inverse norms r_q,
    r_k; ``gs`` each side's upstream gradients, which bound |dS|, see ``_pow2_stage``). A GEMM
    against x·s gives a_i·wk·Σ_k dS_ik k̂_k, so rq, rk divide the results back (the power-of-two
    products are exact); f16 the exact float16 conversions' scales of bf16 features (W's scales
    then carry 1/s: t = r/s exactly)."""
    if round16 and not tail:
        f16 = F16Scales(_f16_scales(q, r_q), _f16_scales(k, r_k))
        t_q, t_k = r_q / f16.q, r_k / f16.k
    else:
        f16, t_q, t_k = None, r_q, r_k
    wq, wk = _pow2_unit(t_q), _pow2_unit(t_k)
    if round16:
        wq = wq * _pow2_stage(gs, torch.maximum(wq, wk).clamp_min(1.0))
    a, b = t_q * wq, t_k * wk
    return WScales(a, b, a * wk, b * wq, f16)
