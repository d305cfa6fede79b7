"""Each row's own negatives (``hn_clip_loss(negatives=(N, K, D), negatives_mask=)``): the host side
both fused backends share, O(N·K·D), no product against other rows.

Row i of the image→text direction gets K extra columns of its own, n_i1 … n_iK (the real ones:
``own_mask``; a threshold also drops those whose caption cosine t̂_i·n̂_ik reaches it), with logits

    W_ik = (v̂_i·n̂_ik + γ·sg(h_ik)) / τ,   h_ik = â_i·n̂_ik,

â_i the margin's query factor (:func:`hnclip_kernels.margin.margin_operands`: t̂_i for "text",
v̂_i for "image_text"). The fused kernels never see these columns. The forward merges their gaps
d_ik = W_ik − Z_i,pos into the kernels' i2t row statistics (:func:`merge`: δ' = logaddexp(δ,
LSE_k d_ik), the softmax-weighted mean, Σ d, the kept count), and the operators save the merged
statistics: the kernels' backward then reads δ' (and, with masking, ε/n_i' from the merged kept
count), so its P_ij is normalised over all N + K_i columns with no kernel change. Their own
share, dS_ik = g_i (P_ik − ε/n_i), is :func:`grads`. The finishers' positive term reads σ(δ')
and the merged mean and Σ d, so dL/dτ covers the columns too; without masking the row's
smoothing spreads ε over n_i = N + M + K_i classes (``classes``). ``reduction="directions"``
differentiates :func:`block` by autograd and reads :func:`merge` for its statistics
(:mod:`.directions`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..numerics import ieee_float32
from . import softmax
from .epilogue import inv_norms as row_inv_norms
from .epilogue import unnormalize_grad


class OwnBlock(NamedTuple):
    """The own columns of every row: ``gaps`` (N, K) d_ik = W_ik − Z_i,pos in the compute dtype
    (0 where not kept), ``keep`` (N, K) bool, ``n_hat`` (N, K, D) the normalised negatives."""

    gaps: Tensor
    keep: Tensor
    n_hat: Tensor


def present(own_negatives: Tensor) -> bool:
    """Does the operator input hold own negatives (an absent one is (0, 0, D))?"""
    return own_negatives.dim() == 3 and own_negatives.shape[1] > 0


def inv_norms(own: Tensor, normalize: bool, dt: torch.dtype) -> Tensor:
    """(N, K) inverse norms of the own negatives (ones without ``normalize``), as
    :func:`~hnclip_kernels.backends.epilogue.inv_norms` forms them row by row."""
    return row_inv_norms(own.reshape(-1, own.shape[-1]), normalize, dt).reshape(own.shape[:2])


def block(v_hat, a_hat, own, own_mask, pos, inv_tau, gamma, normalize: bool, threshold=None, t_cos=None) -> OwnBlock:
    """The own columns' gaps. ``v_hat`` (N, D) the normalised images, ``a_hat`` (N, D) the
    margin's query factor (``v_hat`` itself for "image_text"), ``own`` (N, K, D), ``own_mask``
    (N, K) bool or (0, 0), ``pos`` (N,) Z_i,pos, ``inv_tau``, ``gamma`` 0-dim tensors;
    ``threshold`` (a float, or None) drops d_ik whose caption cosine t̂_i·n̂_ik (``t_cos``: the
    unit captions (N, D)) reaches it. Products in IEEE float32 (float64 for float64 inputs).
    Differentiable by autograd in ``v_hat``, ``own``, ``pos`` and ``inv_tau`` (the margin detached)."""
    dt = v_hat.dtype
    n_hat = own.to(dt) * inv_norms(own, normalize, dt)[..., None]
    with ieee_float32(v_hat.device):
        score = torch.einsum("nkd,nd->nk", n_hat, v_hat)
        # sg(h): a no-op inside the operators, the stop-gradient where autograd differentiates the
        # block (reduction="directions", backends.directions.own_rows)
        margin = (score if a_hat is v_hat else torch.einsum("nkd,nd->nk", n_hat, a_hat)).detach()
        keep = torch.ones(own.shape[:2], dtype=torch.bool, device=own.device) if own_mask.numel() == 0 else own_mask
        if threshold is not None:
            unit = own.to(dt) * inv_norms(own, True, dt)[..., None]
            keep = keep & (torch.einsum("nkd,nd->nk", unit, t_cos) < threshold)
    logits = (score + gamma.to(dt) * margin) * inv_tau.to(dt)
    gaps = (logits - pos.to(dt)[:, None]).masked_fill(~keep, 0.0)
    return OwnBlock(gaps, keep, n_hat)


def merge(stats: softmax.RowStats, own: OwnBlock) -> softmax.RowStats:
    """``stats`` (the kernels' i2t rows) merged with the own columns: δ' = logaddexp(δ, LSE_k d_ik),
    mean' = e^(δ−δ')·mean + Σ_k e^(d_ik−δ')·d_ik, dsum' = dsum + Σ_k d_ik, kept' = kept + K_i."""
    gaps, keep = own.gaps.to(stats.delta.dtype), own.keep
    omega = torch.logsumexp(gaps.masked_fill(~keep, float("-inf")), dim=1)
    delta = torch.logaddexp(stats.delta, omega)
    live = torch.isfinite(delta)  # a row with no negative at all keeps δ = −inf and its mean
    safe = torch.where(live, delta, torch.zeros_like(delta))
    w_old = torch.where(live, torch.exp(stats.delta - safe), torch.zeros_like(delta))
    w_own = torch.exp(gaps - safe[:, None]).masked_fill(~keep | ~live[:, None], 0.0)
    old = torch.where(w_old > 0, w_old * stats.mean_neg, torch.zeros_like(delta))
    mean = torch.where(live, old + (w_own * gaps).sum(dim=1), stats.mean_neg)
    dsum = stats.dsum + gaps.sum(dim=1)
    kept = None if stats.kept is None else stats.kept + keep.sum(dim=1).to(stats.kept.dtype)
    return softmax.RowStats(stats.pos, delta, mean, dsum, kept)


def classes(stats: softmax.RowStats, n_keys: int, own: Optional[OwnBlock]):
    """The classes of each i2t row for its smoothing: the shared ``n_keys`` plus the row's own
    kept K_i (without masking; with masking the merged ``kept`` already counts them)."""
    if own is None or stats.kept is not None:
        return n_keys
    return n_keys + own.keep.sum(dim=1).to(stats.delta.dtype)


def grads(stats: softmax.RowStats, g, own: OwnBlock, v_hat, eps, n_keys: int, shifted: bool, shift=None):
    """(dL/dv̂ share (N, D), dL/dn̂ (N, K, D)), times τ as the kernels' shares: dS_ik = g_i·(P_ik − ε/n_i)
    on the kept own columns, P from the merged ``stats`` (:func:`softmax.row_factors`: subnormal
    rows in logs), n_i the row's classes. ``shifted``: the kernels' masked smoothing mode.

    A multi-positive row (``group_mode`` "supcon" / "mil_nce"): ``stats`` with δ' and ``shift`` (M,)
    ε/|C(i)| from :func:`softmax.positive_factors` (the negatives' kernels' own), so that P is the
    softmax over every class C(i) and the own columns' dS the negatives' g_i·(P_ik − ε/|C(i)|)."""
    gaps = own.gaps.to(stats.delta.dtype)
    lse, weight = softmax.row_factors(stats, g, shifted)
    ds = torch.exp(gaps - lse[:, None]) * weight[:, None]
    if shift is not None:
        ds = ds - (shift.to(ds.dtype) * g)[:, None]
    elif softmax.smooths(eps):
        n = softmax.classes(stats, classes(stats, n_keys, own))
        ds = ds - (eps / n * g)[:, None] if isinstance(n, Tensor) else ds - (eps / n) * g[:, None]
    ds = ds.masked_fill(~own.keep, 0.0).to(v_hat.dtype)
    d_v = torch.einsum("nk,nkd->nd", ds, own.n_hat)
    d_n = ds[..., None] * v_hat[:, None, :]
    return d_v, d_n


def unnormalize(own: Tensor, d_n_hat: Tensor, inv_tau, normalize: bool) -> Tensor:
    """dL/d own (N, K, D) in its dtype from dL/dn̂ (times τ)."""
    flat = own.reshape(-1, own.shape[-1])
    rn = inv_norms(own, normalize, d_n_hat.dtype).reshape(-1)
    d = unnormalize_grad(flat, rn, d_n_hat.reshape(flat.shape) * inv_tau, normalize)
    return d.reshape(own.shape).to(own.dtype).contiguous()
