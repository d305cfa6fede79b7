"""The softmax (InfoNCE) loss kind: its row statistics and the O(N·D) epilogue after a fused
kernel (Triton and C++ alike; the device side is ``triton/softmax.py`` and ``csrc/online_lse.h``).

A fused kernel only ever touches the *negatives* of a row (k != offset + i). It returns,
per query row i, with d_ik = Z_ik - Z_i,pos:

* ``delta_i = LSE_{k != pos} d_ik``   (so nll_i = softplus(delta_i): tiny losses survive)
* ``mean_neg_i = Σ_k softmax_neg(d)_ik · d_ik``   (for the τ gradient, no cancellation)
* ``dsum_i = Σ_{k != pos} d_ik``   (label smoothing: ε·mean_k(Z_pos − Z_ik) = −ε·dsum/N)

and in the backward, the negatives' share of the gradient,
``Σ_{k != pos} g_i P_ik k̂_k`` (row kernel) and ``Σ_i g_i P_ik q̂_i`` (column kernel).
Everything else, the positive's gradient written as −(sum of the negatives'
probabilities), the uniform label-smoothing term and dL/dτ, is cheap and lives here.

False-negative masking (``false_negative_threshold``, not in the paper): a masked pair is no
negative of its row, so every sum above runs over the row's *kept* negatives K_i, and the
kernels also return ``kept_i = |K_i|``. Label smoothing then spreads ε over the n_i = kept_i + 1
classes the row keeps: nll_i − (ε/n_i)·dsum_i, and dL/dZ_ik = g_i (P_ik − ε/n_i) on K_i, which
the kernels apply themselves (the masked columns get nothing, so the "uniform" term is not
uniform any more); the epilogue adds the positive's −ε/n_i·g_i (:func:`smoothing_shift`).

Multi-positive targets (``group_mode="supcon"`` / ``"mil_nce"``, ``docs/hard_negatives.md``): the
kernels' statistics are over the row's kept negatives K(i) (the group's columns masked as under
"mask"), and a positives' pass returns the same four numbers over its other positives P(i) ∖ {pos}
(``extra``, (4, M)). From the two: :func:`positive_losses`, :func:`positive_factors` (what the dS
kernels read) and :func:`positive_dz_z` (the τ term).

A loss kind provides: its statistics (:class:`RowStats`), the rows' losses from them
(:func:`row_losses`, :func:`pair_losses`), the per-row factors its dS kernels read
(:func:`row_factors`) and the finishers (:func:`finish_directional`, :func:`finish_symmetric`)
that add what no kernel computes. The shared algebra is :mod:`.epilogue`'s.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..group_mode import GroupMode
from ..numerics import softplus
from .epilogue import scaled, unnormalize_grad


class RowStats(NamedTuple):
    pos: torch.Tensor  # (M,) Z_i,pos, float32
    delta: torch.Tensor  # (M,) LSE over negatives of Z - Z_pos
    mean_neg: torch.Tensor  # (M,) E_softmax_neg[Z - Z_pos]
    dsum: torch.Tensor  # (M,) Σ_neg (Z - Z_pos)
    kept: Optional[torch.Tensor] = None  # (M,) kept negatives |K_i| with false-negative masking, else None


def smooths(label_smoothing) -> bool:
    """Is there a label-smoothing term? ε is a float (0.0: none) or a 0-dim tensor (the Triton
    operators' ε, passed only when its SMOOTHING flag is set: testing its value would read the
    device, and fail inside a traced ``triton_op``)."""
    return isinstance(label_smoothing, torch.Tensor) or label_smoothing != 0.0


def classes(stats: RowStats, n_keys: int):
    """The classes each row's softmax keeps: N (``n_keys``), or with false-negative masking the
    per-row ``kept + 1`` (its kept negatives and its positive)."""
    return n_keys if stats.kept is None else stats.kept + 1.0


def smoothing_shift(stats: RowStats, label_smoothing) -> torch.Tensor:
    """ε / n_i per row (float, the stats' dtype): what the masked kernels subtract from P_ik on the
    row's kept negatives (zeros without label smoothing)."""
    if not smooths(label_smoothing):
        return torch.zeros_like(stats.delta)
    return (label_smoothing / (stats.kept + 1.0)).to(stats.delta.dtype).contiguous()


def row_losses(stats: RowStats, n_keys: int, label_smoothing) -> torch.Tensor:
    """Each row's NLL, softplus(delta), minus ε · mean_k (Z_ik − Z_i,pos) with label smoothing ε
    (the mean over the row's kept classes with false-negative masking)."""
    nll = softplus(stats.delta)
    if not smooths(label_smoothing):
        return nll
    return nll - (label_smoothing / classes(stats, n_keys)) * stats.dsum


def pair_losses(i2t: RowStats, t2i: RowStats, n_keys: int, label_smoothing: float) -> torch.Tensor:
    """½(i2t_k + t2i_k) per pair k: what the single-process loss returns with reduction="none"."""
    return 0.5 * (row_losses(i2t, n_keys, label_smoothing) + row_losses(t2i, n_keys, label_smoothing))


def row_nll(stats: RowStats) -> torch.Tensor:
    """softplus(delta) = LSE_all − Z_pos, what the backward kernels subtract from d_ik."""
    return softplus(stats.delta)


# below this a row's probabilities e^(d − softplus δ) ≤ e^δ are float32 subnormals (e^−87 ≈ 1.6e−38):
# such a row is weighted as the softmax over its negatives times g·σ(δ), formed in logs
SUBNORMAL_DELTA = -87.0


def weighted_mass(stats: RowStats, g) -> torch.Tensor:
    """g_i·σ(δ_i) per row (the upstream gradient times the negatives' total probability q_i), as
    sign(g)·exp(log|g| + logsigmoid(δ)) where q_i is below float32's normal range (a bf16 batch
    under a loss scale keeps such rows' gradients), else g·σ(δ) as ever."""
    q_prob = torch.sigmoid(stats.delta)
    logs = torch.sign(g) * torch.exp(torch.log(torch.abs(g)) + F.logsigmoid(stats.delta))
    return torch.where(_deep(stats), logs, g * q_prob)


def _deep(stats: RowStats) -> torch.Tensor:
    """The rows whose probabilities are float32 subnormals (float64 statistics have none here)."""
    if stats.delta.dtype != torch.float32:
        return torch.zeros_like(stats.delta, dtype=torch.bool)
    return stats.delta < SUBNORMAL_DELTA


def row_factors(stats: RowStats, g, shifted: bool):
    """(L, G) per row, what a dS kernel subtracts from the gaps and weights them by:
    g_i P_ik = exp(d_ik − L_i)·G_i. (softplus δ, g), or for rows whose probabilities are float32
    subnormals (δ < SUBNORMAL_DELTA) (δ, g·σ(δ)): the softmax over the negatives, normal, times
    the row's weighted mass. ``shifted`` (label smoothing with masking: dS = g (P − ε/n)): (softplus
    δ, g) for every row (−g ε/n dwarfs such a row's P)."""
    nll = row_nll(stats)
    if shifted:
        return nll, g
    deep = _deep(stats)
    return torch.where(deep, stats.delta, nll), torch.where(deep, weighted_mass(stats, g), g)


def add_positive_and_smoothing(
    stats: RowStats, g, q_hat, k_hat, d_q, d_k, offset: int, label_smoothing: float, more_keys=None, own_counts=None
):
    """Add, in place, the parts of dL/dq̂ and dL/dk̂ (times τ) that no kernel computes: the
    positive's gradient and the uniform label-smoothing term. Returns this direction's
    Σ_ik dZ_ik·Z_ik (a scalar), from which dL/dτ = −(that) / τ.

    ``more_keys`` = (their k̂ (K, D), or None where unread; their dL/dk̂ (K, D)): columns after
    k's with no positive among them (the family's negative captions), which share the uniform
    smoothing term (k̂ read only for label smoothing without masking); None: none.
    ``own_counts`` (M,): each row's own extra columns (:mod:`.own_negatives`, which adds their
    gradient), so its smoothing spreads over n + own_counts_i classes; None: none.
    """
    m, n = q_hat.shape[0], k_hat.shape[0] + (0 if more_keys is None else more_keys[1].shape[0])
    eps = label_smoothing
    q_prob = torch.sigmoid(stats.delta)  # Σ of the negatives' probabilities, stable when tiny
    g_q = weighted_mass(stats, g)  # g·q, also where q is a float32 subnormal
    deep = _deep(stats)
    if stats.kept is not None:
        return _add_positive_masked(stats, g, q_hat, k_hat, d_q, d_k, offset, eps, (q_prob, g_q, deep))
    # dL/dZ_pos = ε(1 − 1/N) − q, the −ε/N part is in the uniform term below
    g_pos = torch.where(deep, g * eps - g_q, g * (eps - q_prob))
    d_q.add_(g_pos[:, None] * k_hat[offset : offset + m])
    d_k[offset : offset + m].add_(g_pos[:, None] * q_hat)
    if own_counts is not None:
        n = n + own_counts.to(g.dtype)
    if smooths(eps):
        # every column (positive included) gets −ε/N · g_i
        key_sum = k_hat.sum(dim=0) if more_keys is None else k_hat.sum(dim=0) + more_keys[0].sum(dim=0)
        if own_counts is not None:  # ε/n_i per row
            weight = (eps / n) * g
            d_q.sub_(weight[:, None] * key_sum[None, :])
            column = (weight[:, None] * q_hat).sum(dim=0)[None, :]
        else:
            d_q.sub_((eps / n) * g[:, None] * key_sum[None, :])
            column = (eps / n) * (g[:, None] * q_hat).sum(dim=0)[None, :]
        d_k.sub_(column)
        if more_keys is not None:
            more_keys[1].sub_(column)
    # Σ_k dZ_ik Z_ik = Σ_{k≠pos} (P_ik − ε/N)(Z_ik − Z_pos), since each row of dZ sums to 0:
    # written with gaps, so there is no cancellation when the loss is tiny
    uniform = (eps / n) * stats.dsum
    return torch.where(deep, g_q * stats.mean_neg - g * uniform, g * (q_prob * stats.mean_neg - uniform)).sum()


def _add_positive_masked(stats: RowStats, g, q_hat, k_hat, d_q, d_k, offset: int, eps, probs):
    """:func:`add_positive_and_smoothing` with false-negative masking: the kernels put
    g_i (P_ik − ε/n_i) on the kept negatives, so only the positive is left, dL/dZ_pos =
    ε − q − ε/n_i (n_i = kept_i + 1 classes). ``probs`` = (q, g·q, the rows where q is subnormal)."""
    m = q_hat.shape[0]
    q_prob, g_q, deep = probs
    g_pos = torch.where(deep, g * eps - g_q, g * (eps - q_prob))
    if smooths(eps):
        shift = eps / (stats.kept + 1.0)
        g_pos = g_pos - g * shift
    d_q.add_(g_pos[:, None] * k_hat[offset : offset + m])
    d_k[offset : offset + m].add_(g_pos[:, None] * q_hat)
    if not smooths(eps):
        return torch.where(deep, g_q * stats.mean_neg, g * (q_prob * stats.mean_neg)).sum()
    uniform = shift * stats.dsum
    return torch.where(deep, g_q * stats.mean_neg - g * uniform, g * (q_prob * stats.mean_neg - uniform)).sum()


def finish_directional(
    stats: RowStats,
    g,
    q,
    k,
    rq,
    rk,
    d_q_neg,
    d_k_neg,
    offset: int,
    inv_tau,
    label_smoothing: float,
    normalize: bool,
    dz_z=None,
):
    """(dL/dq, dL/dk in the inputs' dtypes, Σ_ik dZ_ik·Z_ik for :func:`tau_grad`) of one direction.

    ``d_q_neg`` (M, D) / ``d_k_neg`` (N, D): a kernel's negatives-only shares (times τ) of dL/dq̂
    and dL/dk̂, float32 (float64 for float64 inputs) scratch, modified in place. ``g`` (M,): the
    upstream gradient of each row's loss. ``rq``/``rk``: the inverse row norms. ``dz_z`` given (the
    multi-positive modes, :func:`positive_dz_z`): the shares hold every positive's part already.
    """
    dt = rq.dtype
    if dz_z is None:
        dz_z = add_positive_and_smoothing(
            stats, g, scaled(q, rq, dt), scaled(k, rk, dt), d_q_neg, d_k_neg, offset, label_smoothing
        )
    d_q = unnormalize_grad(q, rq, d_q_neg.mul_(inv_tau), normalize).to(q.dtype).contiguous()
    d_k = unnormalize_grad(k, rk, d_k_neg.mul_(inv_tau), normalize).to(k.dtype).contiguous()
    return d_q, d_k, dz_z


def finish_symmetric(
    i2t: RowStats,
    t2i: RowStats,
    g,
    img,
    txt,
    rv,
    rt,
    d_v_neg,
    d_t_neg,
    inv_tau,
    label_smoothing: float,
    normalize: bool,
    dz_z=None,
    own_counts=None,
):
    """The single-process version of :func:`finish_directional`: both directions' positive and
    smoothing terms on top of a kernel's combined negatives' shares (``g`` already halved);
    ``dz_z`` as there; ``own_counts``: the i2t rows' own extra columns
    (:func:`add_positive_and_smoothing`)."""
    if dz_z is None:
        dt = rv.dtype
        v_hat, t_hat = scaled(img, rv, dt), scaled(txt, rt, dt)
        own = {} if own_counts is None else dict(own_counts=own_counts)
        dz_z = add_positive_and_smoothing(i2t, g, v_hat, t_hat, d_v_neg, d_t_neg, 0, label_smoothing, **own)
        dz_z = dz_z + add_positive_and_smoothing(t2i, g, t_hat, v_hat, d_t_neg, d_v_neg, 0, label_smoothing)
        del v_hat, t_hat  # peak memory: free before the normalisation's temporaries
    d_img = unnormalize_grad(img, rv, d_v_neg.mul_(inv_tau), normalize).to(img.dtype).contiguous()
    d_txt = unnormalize_grad(txt, rt, d_t_neg.mul_(inv_tau), normalize).to(txt.dtype).contiguous()
    return d_img, d_txt, dz_z


# ---- multi-positive targets (group_mode "supcon" / "mil_nce")
def _positive_parts(neg: RowStats, extra: torch.Tensor):
    """(L_P, x, |P|) per row, relative to the row's own positive: L_P = LSE over P(i) of the gaps
    (softplus of the other positives' LSE), x = L_K − L_P, |P| = the other positives + 1."""
    lse_p = softplus(extra[0])
    return lse_p, neg.delta - lse_p, extra[3] + 1.0


def positive_losses(neg: RowStats, extra: torch.Tensor, group_mode: int, label_smoothing) -> torch.Tensor:
    """Each row's multi-positive loss from its negatives' statistics ``neg`` (``kept`` given) and its
    other positives' ``extra`` (4, M) (their LSE, softmax-mean gap, Σ gap, count), for a positive
    ``group_mode`` code (:attr:`~hnclip_kernels.group_mode.GroupMode.code`, as the operators carry it): MIL-NCE's
    softplus(L_K − L_P), SupCon's that plus L_P − mean_P Z (both ≥ 0 and formed from gaps: a loss far
    below float32's epsilon keeps its value); with ε, (1 − ε)·that + ε·(LSE_C − mean_C Z)."""
    supcon = GroupMode.from_code(group_mode) is GroupMode.SUPCON
    lse_p, x, count = _positive_parts(neg, extra)
    any_positive = softplus(x)
    rows = any_positive + (lse_p - extra[2] / count) if supcon else any_positive
    if not smooths(label_smoothing):
        return rows
    classes = neg.kept + count
    uniform = lse_p + any_positive - (neg.dsum + extra[2]) / classes
    return (1.0 - label_smoothing) * rows + label_smoothing * uniform


def positive_factors(neg: RowStats, extra: torch.Tensor, label_smoothing):
    """What the dS kernels read for a multi-positive row: (δ over every class but the row's own
    positive, logaddexp(L_K, the other positives' LSE), so that the negatives' kernels' softplus δ is
    LSE_C and their P the softmax over C(i); ε/|C(i)| per row; the positives' kernel's (4, M) rows
    L_P, σ(L_K − L_P), |P|, ε/|C(i)| (csrc/factors.h PositiveRow))."""
    lse_p, x, count = _positive_parts(neg, extra)
    shift = torch.zeros_like(neg.delta)
    if smooths(label_smoothing):
        shift = (label_smoothing / (neg.kept + count)).to(neg.delta.dtype)
    factors = torch.stack([lse_p, torch.sigmoid(x), count, shift])
    return torch.logaddexp(neg.delta, extra[0]).contiguous(), shift.contiguous(), factors


def positive_dz_z(neg: RowStats, factors: torch.Tensor, g, dz_d) -> torch.Tensor:
    """Σ_ik dZ_ik·Z_ik of a multi-positive direction (dL/dτ = −that/τ), written with gaps (each row
    of dZ sums to 0): the negatives' g·(σ(L_K − L_P)·mean_neg − ε/|C|·Σ_K d) plus the positives'
    kernel's Σ_P dS·d per row (``dz_d``)."""
    return (g * (factors[1] * neg.mean_neg - factors[3] * neg.dsum) + dz_d).sum()
