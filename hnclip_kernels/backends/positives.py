"""The multi-positive targets' pass over the same-group pairs, in torch on the features' device
(``group_mode="supcon"`` / ``"mil_nce"``, ``docs/hard_negatives.md#multi-positive-targets``): what
``csrc/positives.cpp`` is to the C++ backend, for the Triton backend (whose kernels run as under
"mask": each row's statistics over its negatives, the group's columns masked).

A row i's positives are its own column offset + i and every column j < K (the keys with an id)
whose id equals the row's. The logit tiles cannot give their logits (a tile's entries carry the
margin, a positive does not), so each positive's margin-free logit Z_ij = (q̂_i·k̂_j)/τ is formed
here from one row dot (float32 accumulation for float32 and 16-bit features, float64 for float64),
by :func:`_chunks`' one function in the forward and the backward: the same pairs in the same
chunks, the same bits. The pairs are found without an M × K comparison: the key ids sorted once,
each row's same-id keys a range of them (``searchsorted``), O(|P| + (M + K)·log K) for the |P|
same-group pairs, in row chunks of at most :data:`CHUNK_ELEMENTS` gathered entries each; sums per
row and per column are segment sums (``torch.segment_reduce``: deterministic, no atomics).

* ``hnclip::host_positive_fwd(q_hat, k_hat, pos, inv_tau, offset, qg, kg)`` → (4, M): per row the
  other positives' (P(i) ∖ {own}) LSE of the gaps d = Z_ij − Z_i,pos, their softmax-mean gap, Σ d
  and count (the negatives' statistics' layout; no other positive: −inf, 0, 0, 0);
* ``hnclip::host_positive_bwd(q_hat, k_hat, pos, inv_tau, offset, qg, kg, factors, g, eps,
  group_mode)`` → (dL/dq̂ (M, D), dL/dk̂ (N, D), Σ_p dS·d per row (M,)): every positive's dS (the
  row's own included) from :func:`..softmax.positive_factors`' (4, M) rows, by :func:`positive_dz`.

Both are ``torch.library.custom_op``s with fakes: their outputs' shapes are fixed while the pairs'
count is data-dependent, so a traced operator (Triton's ``triton_op`` under ``torch.compile``)
sees fixed shapes. :func:`check_positives` is the fused backends' entries' check of a positive mode.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..group_mode import GroupMode

# the most gathered feature entries (pairs × D) of one chunk: two (pairs, D) gathers of 128 MiB in float32
CHUNK_ELEMENTS = 1 << 25


def check_positives(group_mode: GroupMode, ids, return_stats: bool) -> None:
    """A positive ``group_mode`` needs the ids and gives no row statistics (``LossOptions``' callers
    checked both already; a direct call of a fused backend's entries gets the same errors).

    Raises: ValueError naming ``group_mode`` (no ids), or ``return_stats``."""
    if not group_mode.positives:
        return
    if ids is None:
        raise ValueError(f"group_mode={group_mode.value!r} needs group ids (the ids of its positives)")
    if return_stats:
        raise ValueError(
            f"return_stats=True is not supported with group_mode={group_mode.value!r}: the row statistics assume "
            "one positive per row; use group_mode='mask' for the report"
        )


def _chunks(q_hat: Tensor, k_hat: Tensor, pos: Tensor, inv_tau: Tensor, offset: int, qg: Tensor, kg: Tensor):
    """Yield, chunk by chunk of rows [r0, r1), ``(r0, r1, rows, cols, gaps)``: the chunk's other
    positives' pairs (rows ascending, each row's columns in the sorted ids' order; ``rows``
    absolute), and their gaps d_ij = (q̂_i·k̂_j)·(1/τ) − Z_i,pos, in q̂'s dtype. A row's pairs are
    never split across chunks."""
    m = q_hat.shape[0]
    qg, kg = qg.long(), kg.long()
    keys, order = torch.sort(kg, stable=True)
    lo = torch.searchsorted(keys, qg)
    counts = torch.searchsorted(keys, qg, right=True) - lo  # same-id keys per row (its own among them if < K)
    ends = torch.cumsum(counts, 0)
    budget = max(1, CHUNK_ELEMENTS // max(1, q_hat.shape[1]))
    r0 = 0
    while r0 < m:
        done = 0 if r0 == 0 else int(ends[r0 - 1])
        r1 = max(r0 + 1, int(torch.searchsorted(ends, done + budget, right=True)))
        r1 = min(r1, m)
        n_pairs = int(ends[r1 - 1]) - done
        local = torch.repeat_interleave(torch.arange(r1 - r0, device=qg.device), counts[r0:r1], output_size=n_pairs)
        starts = ends[r0:r1] - counts[r0:r1] - done  # each row's first pair in the chunk
        rank = torch.arange(n_pairs, device=qg.device) - starts[local]
        rows = local + r0
        cols = order[lo[rows] + rank]
        other = cols != rows + offset
        rows, cols = rows[other], cols[other]
        gaps = (q_hat[rows] * k_hat[cols]).sum(dim=1) * inv_tau - pos[rows]
        yield r0, r1, rows, cols, gaps
        r0 = r1


def _segment_sum(x: Tensor, lengths: Tensor) -> Tensor:
    """Σ of consecutive segments of ``x`` (along dim 0) of ``lengths`` (empty: 0)."""
    return torch.segment_reduce(x, "sum", lengths=lengths, axis=0, unsafe=True, initial=0.0)


@torch.library.custom_op("hnclip::host_positive_fwd", mutates_args=())
def positive_fwd(
    q_hat: Tensor, k_hat: Tensor, pos: Tensor, inv_tau: Tensor, offset: int, qg: Tensor, kg: Tensor
) -> Tensor:
    """(4, M) in q̂'s dtype: per row the other positives' LSE of the gaps, softmax-mean gap, Σ gap,
    count (the module's docstring). ``q_hat`` (M, D), ``k_hat`` (N, D) the normalised features, ``pos``
    (M,) Z_i,pos, ``inv_tau`` 1/τ (one element), ``qg`` (M,) and ``kg`` (K ≤ N,) integer ids."""
    m, dt = q_hat.shape[0], q_hat.dtype
    out = torch.zeros((4, m), device=q_hat.device, dtype=dt)
    out[0] = -torch.inf
    for r0, r1, rows, _, d in _chunks(q_hat, k_hat, pos.to(dt), inv_tau.to(dt), offset, qg, kg):
        lengths = torch.bincount(rows - r0, minlength=r1 - r0)
        top = torch.segment_reduce(d, "max", lengths=lengths, unsafe=True)  # −inf for a row without any
        e = torch.exp(d - top.repeat_interleave(lengths, output_size=d.shape[0]))
        total = _segment_sum(e, lengths)
        some = total > 0
        out[0, r0:r1] = torch.where(some, top + torch.log(total), -torch.inf)
        out[1, r0:r1] = torch.where(some, _segment_sum(e * d, lengths) / torch.where(some, total, 1.0), 0.0)
        out[2, r0:r1] = _segment_sum(d, lengths)
        out[3, r0:r1] = lengths.to(dt)
    return out


@positive_fwd.register_fake
def _(q_hat, k_hat, pos, inv_tau, offset, qg, kg):
    return q_hat.new_empty((4, q_hat.shape[0]))


def positive_dz(group_mode: GroupMode, d: Tensor, factors: Tensor, eps: Tensor) -> Tensor:
    """dL/dZ_ip / g_i of positives at gaps ``d`` (the row's own: 0) from their rows' ``factors``
    (4, P): L_P, σ(L_K − L_P), |P(i)|, ε/|C(i)| (:func:`..softmax.positive_factors`), as
    ``csrc/factors.h``'s positive_dz: with u = e^(d − L_P), SupCon (u − 1/|P|) − u·σ + (ε/|P| − ε/|C|),
    MIL-NCE u·(ε − σ) − ε/|C| (neither subtracts the nearly equal softmax and target of a saturated row)."""
    lse_p, neg_mass, count, shift = factors
    u = torch.exp(d - lse_p)
    if group_mode is GroupMode.SUPCON:
        return (u - 1.0 / count) - u * neg_mass + (eps / count - shift)
    if group_mode is GroupMode.MIL_NCE:
        return u * (eps - neg_mass) - shift
    raise ValueError(f"group_mode {group_mode.value!r} has no positives; take 'supcon' or 'mil_nce'")


@torch.library.custom_op("hnclip::host_positive_bwd", mutates_args=())
def positive_bwd(
    q_hat: Tensor,
    k_hat: Tensor,
    pos: Tensor,
    inv_tau: Tensor,
    offset: int,
    qg: Tensor,
    kg: Tensor,
    factors: Tensor,
    g: Tensor,
    eps: Tensor,
    group_mode: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dq̂ (M, D), dL/dk̂ (N, D), Σ_p dS_ip·d_ip per row (M,)) in q̂'s dtype, the positives'
    shares (times τ): dS_ip = g_i·:func:`positive_dz`. ``factors`` (4, M), ``g`` (M,) the rows'
    upstream gradient, ``eps`` ε (one element), ``group_mode`` the mode's code
    (:attr:`GroupMode.code`: 1 supcon, 2 mil_nce; 0 raises ValueError); the rest as :func:`positive_fwd`."""
    mode = GroupMode.from_code(group_mode)
    if not mode.positives:
        raise ValueError(f"hnclip::host_positive_bwd takes group_mode 1 (supcon) or 2 (mil_nce), got {group_mode}")
    (m, dim), n, dt = q_hat.shape, k_hat.shape[0], q_hat.dtype
    factors, g, eps = factors.to(dt), g.to(dt), eps.to(dt).reshape(())
    # the rows' own positives (d = 0), whatever their ids
    own = g * positive_dz(mode, torch.zeros_like(g), factors, eps)
    d_q = own[:, None] * k_hat[offset : offset + m]
    d_k = torch.zeros((n, dim), device=q_hat.device, dtype=dt)
    d_k[offset : offset + m] = own[:, None] * q_hat
    dz_d = torch.zeros(m, device=q_hat.device, dtype=dt)
    for r0, r1, rows, cols, d in _chunks(q_hat, k_hat, pos.to(dt), inv_tau.to(dt), offset, qg, kg):
        ds = g[rows] * positive_dz(mode, d, factors[:, rows], eps)
        lengths = torch.bincount(rows - r0, minlength=r1 - r0)
        d_q[r0:r1] += _segment_sum(ds[:, None] * k_hat[cols], lengths)
        dz_d[r0:r1] += _segment_sum(ds * d, lengths)
        by_col = torch.argsort(cols, stable=True)  # the columns' segments, in the rows' order within each
        d_k += _segment_sum(ds[by_col, None] * q_hat[rows[by_col]], torch.bincount(cols, minlength=n))
    return d_q, d_k, dz_d


@positive_bwd.register_fake
def _(q_hat, k_hat, pos, inv_tau, offset, qg, kg, factors, g, eps, group_mode):
    return q_hat.new_empty(q_hat.shape), k_hat.new_empty(k_hat.shape), q_hat.new_empty((q_hat.shape[0],))
