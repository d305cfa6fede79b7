"""``reduction="directions"`` across 2 gloo ranks (rank 0 holds 5 pairs, rank 1 holds 3), with
``gather_with_grad=True``:

* ``local_loss=True``: each rank's :class:`~hnclip_kernels.DirectionRows` are its own rows of the
  concatenated batch's; each rank backpropagates Σ_{i on r} w·rows_i with the global batch's
  random signed per-row weights w (four of them, one per output), so the gradients summed through
  the gather are those of Σ_i w·rows_i over the whole batch: each rank's feature (and negative)
  gradients equal the oracle's rows of its own slice, the ranks' dτ add up to the oracle's;
* ``local_loss=False``: each rank's rows are all N rows (the same on both); each backpropagates
  Σ_i w·rows_i, so the gather sums W copies: its feature gradients are W × the oracle's, its dτ
  the oracle's.

The oracle is ``direction_oracle.direction_rows_f64`` on the concatenated batch (pairs, negatives
and ids in rank order), float64. Cases: plain (no family), the family (rank 0 two negatives,
rank 1 three, ids repeating across ranks, ε = 0.1, ``margin="image_text"``), and each row's own
negatives with the same options (rank 0 (5, 3, D) with a row of none, rank 1 (3, 2, D); the
oracle's (8, 3, D) padded with masked-out slots; own negatives are never gathered with
``local_loss=True``, gathered with grad otherwise), and the family with ``group_mode="supcon"`` /
``"mil_nce"`` (the ids as positives, groups 0 and 2 spanning the ranks), through
``distributed_hn_clip_loss`` and ``HNClipLoss`` alternately, on torch and cpp in float64
(tolerance 1e-9 per row, the one-process float64 bound) and on triton in float32 (1e-4 per row,
gradients relative to max(row, 1% of the largest row) as ``direction_oracle`` states).

Bound: about 15 s for torch and cpp (two spawned ranks, every case in one spawn); triton's
interpreted case about 20 s more, in the full tier (slow).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import direction_oracle as oracle
from family_oracle import features
from helpers import spawn_gloo_ranks
from hnclip_kernels import HNClipLoss
from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.distributed import distributed_hn_clip_loss

SIZES, NEG_SIZES, OWN_K, D, TAU = (5, 3), (2, 3), (3, 2), 8, 0.1
IDS = torch.tensor([0, 1, 1, 2, 3, 2, 4, 0])
FAMILY = dict(label_smoothing=0.1, margin="image_text", gamma=0.5)


def _batch(dtype):
    n, m = sum(SIZES), sum(NEG_SIZES)
    return features(n, D, 50, dtype), features(n, D, 51, dtype), features(m, D, 52, dtype)


def _own(dtype):
    """Each row's own negatives (8, 3, D) and their mask: rank 1's rows have K = 2 slots, row 1 none."""
    n, k = sum(SIZES), max(OWN_K)
    mask = torch.rand(n, k, generator=torch.Generator().manual_seed(53)) < 0.7
    mask[1], mask[SIZES[0] :, OWN_K[1] :] = False, False
    own = features(n * k, D, 54, dtype).reshape(n, k, D).masked_fill(~mask[..., None], 0.0)
    return own, mask


POSITIVE_MODES = ("supcon", "mil_nce")


def _cases(backends, families=(False, True, "own")):
    return [(b, local, family) for b in backends for local in (True, False) for family in families]


def _rank_body(rank, world, cases, dtype):
    """Each case on this rank: (rows (4, R), d img, d txt, d negatives or None, dτ) as numpy."""
    img, txt, neg = _batch(dtype)
    start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    n_start, n_stop = sum(NEG_SIZES[:rank]), sum(NEG_SIZES[: rank + 1])
    w = oracle.weights(sum(SIZES), 7)
    out = []
    for k, (backend, local, family) in enumerate(cases):
        leaves = [x[start:stop].clone().requires_grad_(True) for x in (img, txt)]
        neg_r = neg[n_start:n_stop].clone().requires_grad_(True) if family else None
        extra = dict(negatives=neg_r, group_ids=IDS[start:stop]) if family else {}
        if family == "own":
            own, mask = _own(dtype)
            neg_r = own[start:stop, : OWN_K[rank]].clone().requires_grad_(True)
            extra.update(negatives=neg_r, negatives_mask=mask[start:stop, : OWN_K[rank]])
        options = dict(FAMILY) if family else {}
        if family in POSITIVE_MODES:  # the ids as positives; groups 0 and 2 span both ranks
            options["group_mode"] = family
        tau = torch.tensor(TAU, dtype=dtype, requires_grad=True)
        common = dict(local_loss=local, gather_with_grad=True, backend=backend, normalize=True, reduction="directions")
        if k % 2 == 0:
            rows = distributed_hn_clip_loss(*leaves, tau, rank=rank, world_size=world, **common, **options, **extra)
        else:  # the module takes s = 1/τ: dτ from ds by the chain rule
            scale = (1.0 / tau.detach()).clone().requires_grad_(True)
            loss_fn = HNClipLoss(rank=rank, world_size=world, **common, **options)
            rows = loss_fn(*leaves, scale, **extra)
        mine = slice(start, stop) if local else slice(None)
        objective = sum((x.double() * wi[mine]).sum() for x, wi in zip(rows, w))
        objective.backward()
        d_tau = tau.grad if k % 2 == 0 else -scale.grad / tau.detach() ** 2
        out.append(
            (
                np.stack([x.detach().double().numpy() for x in rows]),
                *(x.grad.double().numpy() for x in leaves),
                None if neg_r is None else neg_r.grad.double().numpy(),
                float(d_tau),
            )
        )
    return out


def _check(results, cases, dtype, tol):
    img, txt, neg = (x.double() for x in _batch(dtype))
    w = oracle.weights(sum(SIZES), 7)
    for k, (backend, local, family) in enumerate(cases):
        own, mask = _own(dtype)
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, own.double() if family == "own" else neg)]
        tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
        kw = dict(FAMILY, negatives=leaves[2], group_ids=IDS) if family else {}
        if family in POSITIVE_MODES:
            kw["group_mode"] = family
        if family == "own":
            kw.update(negatives=None, own=leaves[2], own_mask=mask)
        want = oracle.direction_rows_f64(leaves[0], leaves[1], tau, **kw)
        grads = torch.autograd.grad(sum((x * wi).sum() for x, wi in zip(want, w)), leaves + [tau], allow_unused=True)
        copies = 1 if local else len(SIZES)
        d_tau_sum = 0.0
        for rank, per_case in results.items():
            rows, d_img, d_txt, d_neg, d_tau = per_case[k]
            start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
            mine = slice(start, stop) if local else slice(None)
            got_rows = [torch.from_numpy(r) for r in rows]
            got = {"img": torch.from_numpy(d_img), "txt": torch.from_numpy(d_txt), "tau": torch.tensor(0.0)}
            ref = {"img": copies * grads[0][start:stop], "txt": copies * grads[1][start:stop], "tau": torch.tensor(0.0)}
            if family == "own":
                got["negatives"], ref["negatives"] = (
                    torch.from_numpy(d_neg),
                    copies * grads[2][start:stop, : OWN_K[rank]],
                )
            elif family:
                n_start, n_stop = sum(NEG_SIZES[:rank]), sum(NEG_SIZES[: rank + 1])
                got["negatives"], ref["negatives"] = torch.from_numpy(d_neg), copies * grads[2][n_start:n_stop]
            errs = oracle.row_errors(got_rows, [x[mine].detach() for x in want], got, ref)
            errs.pop("d tau")
            what = f"{backend} local_loss={local} family={family} rank {rank}"
            assert max(errs.values()) <= tol, f"{what}: {errs}"
            d_tau_sum += d_tau if local else d_tau / len(SIZES)
        assert abs(d_tau_sum - grads[3].item()) <= tol * abs(grads[3].item()), f"{backend} {local} {family} dτ"


@pytest.mark.slow
def test_two_ranks_rows_and_gradients(tmp_path):
    backends = ["torch"] + (["cpp"] if cpp_directional() is not None else [])
    cases = _cases(backends)
    results = spawn_gloo_ranks(_rank_body, tmp_path, cases, torch.float64)
    _check(results, cases, torch.float64, 1e-9)


@pytest.mark.slow
def test_two_ranks_triton(tmp_path):
    cases = _cases(["triton"])
    results = spawn_gloo_ranks(_rank_body, tmp_path, cases, torch.float32)
    _check(results, cases, torch.float32, 1e-4)


@pytest.mark.slow
def test_two_ranks_positive_modes(tmp_path):
    # group_mode="supcon" / "mil_nce" with the family's options (negatives, ε, "image_text"), groups
    # spanning the ranks: torch and cpp in float64, triton in float32
    backends = ["torch"] + (["cpp"] if cpp_directional() is not None else [])
    cases = _cases(backends, POSITIVE_MODES)
    results = spawn_gloo_ranks(_rank_body, tmp_path, cases, torch.float64)
    _check(results, cases, torch.float64, 1e-9)
    cases = _cases(["triton"], POSITIVE_MODES)
    results = spawn_gloo_ranks(_rank_body, tmp_path, cases, torch.float32)
    _check(results, cases, torch.float32, 1e-4)
