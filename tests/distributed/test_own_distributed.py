"""Each row's own negatives (``negatives`` (n_r, K_r, D) with ``negatives_mask``) across 2 gloo ranks.

Rank 0 holds 5 pairs (unit rows) with K = 3 own slots (some masked out, one row with none), rank 1 holds 3
pairs with K = 2, or none (``None``). Every tensor is float64; each rank scales its loss by
w_r = 1 + r before backward. The parent compares each rank's loss and gradients (its images,
captions, own negatives, τ) with the single-process loss of the concatenated batch
(``hn_clip_loss(negatives=(N, 3, D), negatives_mask=, reduction="none", backend="torch")``, the
ranks' slots padded to K = 3 with masked-out zeros), itself within 1e-12 of the float64 oracle
``own_oracle.own_rows_f64``:

* local_loss, gather_with_grad:     L_r = (W/N)·Σ_{i on r} ℓ_i; grads of Σ_r' w_r' L_r';
* local_loss, no gather_with_grad:  the same L_r and the own negatives' gradient w_r·dL_r/dn (they
  are never gathered); the features' query-side gradients are not checked here
  (tests/distributed/test_family_distributed.py checks that mode's gather);
* full batch, no gather_with_grad:  L_r = L; grads w_r·dL/d(this rank's features and negatives);
* full batch, gather_with_grad:     L_r = L; grads (Σ w)·dL/d(this rank's features and negatives).

With ``group_mode="supcon"`` / ``"mil_nce"`` (group ids spanning the ranks, their pairs positives;
the own negatives extra negative columns) the same comparisons, the single-process loss itself within
1e-12 of ``positives_oracle.own_positive_rows_f64``.

dτ on each rank: w_r·dL_r/dτ. Tolerance: 1e-10 relative (float64 norms; ``helpers.rel_err``), on
backend torch in every mode and cpp with local_loss=False (every backend's one-process operator on
the gathered batch); cpp with local_loss=True raises on every rank, naming backend='torch'. Bound:
one spawn of two interpreters (about 10 s on 2 loaded cores).
"""

from __future__ import annotations

import numpy as np
import torch

from helpers import rel_err, spawn_gloo_ranks
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.distributed import distributed_hn_clip_loss
from own_oracle import own_rows_f64
from positives_oracle import own_positive_rows_f64

N_SIZES, K_SIZES, D, TAU = (5, 3), (3, 2), 8, 0.07
MODES = [(True, True), (True, False), (False, False), (False, True)]  # (local_loss, gather_with_grad)
TOL = 1e-10


def _inputs(rank_one_none: bool):
    g = torch.Generator().manual_seed(11)
    n = sum(N_SIZES)
    img, txt = (torch.randn(n, D, generator=g, dtype=torch.float64) for _ in range(2))
    own = torch.randn(n, 3, D, generator=g, dtype=torch.float64)
    mask = torch.rand(n, 3, generator=g) < 0.7
    mask[1] = False  # a row of rank 0 with no own negative
    mask[5:, 2] = False  # rank 1 has K = 2 slots
    if rank_one_none:
        mask[5:] = False
    unit = torch.nn.functional.normalize  # unit rows (the losses normalise them again)
    return unit(img, dim=-1), unit(txt, dim=-1), unit(own, dim=-1).masked_fill(~mask[..., None], 0.0), mask


def cases():
    backends = ["torch"] + (["cpp"] if cpp_directional() is not None else [])
    out = []
    for backend in backends:
        for mode in MODES:
            out.append(dict(backend=backend, mode=mode, none=len(out) % 3 == 2, module=len(out) % 2 == 0,
                            gamma=0.5, eps=0.1 * (len(out) % 2)))  # fmt: skip
    for backend in backends:  # the ids as positives (groups spanning the ranks)
        for i, mode in enumerate(MODES):
            out.append(dict(backend=backend, mode=mode, none=i == 2, module=i % 2 == 1, gamma=0.5, eps=0.1 * (i % 2),
                            group_mode=("supcon", "mil_nce")[i % 2]))  # fmt: skip
    return out


def _ids():
    return torch.arange(sum(N_SIZES)) % 4  # rank 0 holds ids 0 1 2 3 0, rank 1 ids 1 2 3


def _rank_slice(rank):
    start = sum(N_SIZES[:rank])
    return slice(start, start + N_SIZES[rank])


def _body(rank, world, case_list):
    reports = []
    for c in case_list:
        img, txt, own, mask = _inputs(c["none"])
        rows = _rank_slice(rank)
        k = K_SIZES[rank]
        img_r, txt_r = img[rows].clone().requires_grad_(), txt[rows].clone().requires_grad_()
        own_r = None if c["none"] and rank == 1 else own[rows, :k].clone().requires_grad_()
        mask_r = None if own_r is None else mask[rows, :k].clone()
        tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
        local, gwg = c["mode"]
        group_mode = c.get("group_mode", "mask")
        ids = _ids()[rows] if "group_mode" in c else None
        try:
            if c["module"]:
                fn = HNClipLoss(local_loss=local, gather_with_grad=gwg, rank=rank, world_size=world, gamma=c["gamma"],
                                label_smoothing=c["eps"], backend=c["backend"], normalize=True,
                                group_mode=group_mode)  # fmt: skip
                loss = fn(img_r, txt_r, 1.0 / tau, negatives=own_r, negatives_mask=mask_r, group_ids=ids)
            else:
                loss = distributed_hn_clip_loss(img_r, txt_r, tau, local_loss=local, gather_with_grad=gwg, rank=rank,
                                                world_size=world, gamma=c["gamma"], label_smoothing=c["eps"],
                                                backend=c["backend"], negatives=own_r, negatives_mask=mask_r,
                                                group_ids=ids, group_mode=group_mode)  # fmt: skip
        except ValueError as exc:
            reports.append(("raised", str(exc)))
            continue
        ((1.0 + rank) * loss).backward()
        grad = None if own_r is None else own_r.grad.numpy()
        reports.append((loss.item(), img_r.grad.numpy(), txt_r.grad.numpy(), grad, tau.grad.item()))
    return reports


def _expected(c, rank):
    """(L_r, d img_r, d txt_r, d own_r, dτ) from the single-process loss of the concatenated batch."""
    img, txt, own, mask = (x.clone() for x in _inputs(c["none"]))
    for x in (img, txt, own):
        x.requires_grad_()
    tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
    positive = dict(group_ids=_ids(), group_mode=c["group_mode"]) if "group_mode" in c else {}
    ell = hn_clip_loss(img, txt, tau, negatives=own, negatives_mask=mask, gamma=c["gamma"], label_smoothing=c["eps"],
                       reduction="none", backend="torch", **positive)  # fmt: skip
    unit = torch.nn.functional.normalize
    units = (unit(img, dim=-1), unit(txt, dim=-1), unit(own, dim=-1).masked_fill(~mask[..., None], 0.0), mask, tau)
    if positive:
        oracle = own_positive_rows_f64(*units, _ids(), mode=c["group_mode"], gamma=c["gamma"], label_smoothing=c["eps"])
    else:
        oracle = own_rows_f64(*units, gamma=c["gamma"], label_smoothing=c["eps"])
    assert rel_err(ell, oracle) <= 1e-12
    n, w = ell.shape[0], len(N_SIZES)
    local, gwg = c["mode"]
    weights = [1.0 + r for r in range(w)]
    per_rank = [ell[_rank_slice(r)].sum() * (w / n) if local else ell.mean() for r in range(w)]
    if local and gwg:
        total = sum(wr * lr for wr, lr in zip(weights, per_rank))
    elif local:
        total = weights[rank] * per_rank[rank]
    else:
        total = (sum(weights) if gwg else weights[rank]) * ell.mean()
    (dimg, dtxt, down) = torch.autograd.grad(total, (img, txt, own), retain_graph=True)
    (dtau,) = torch.autograd.grad(weights[rank] * per_rank[rank], tau)
    rows = _rank_slice(rank)
    return per_rank[rank].item(), dimg[rows], dtxt[rows], down[rows, : K_SIZES[rank]], dtau.item()


def test_two_ranks_own_negatives_equal_the_concatenated_batch(tmp_path):
    case_list = cases()
    results = spawn_gloo_ranks(_body, tmp_path, case_list)  # reduction="directions": test_directions_distributed
    for i, c in enumerate(case_list):
        local, gwg = c["mode"]
        for rank in range(2):
            got = results[rank][i]
            if c["backend"] != "torch" and local:
                assert got[0] == "raised" and "backend='torch'" in got[1] or "another rank" in got[1], (c, got)
                continue
            assert got[0] != "raised", (c, rank, got)
            want = _expected(c, rank)
            where = f"case {c} rank {rank}"
            assert abs(got[0] - want[0]) <= TOL * abs(want[0]), where
            if got[3] is None:
                assert c["none"] and rank == 1, where
            else:
                assert rel_err(torch.from_numpy(got[3]), want[3]) <= TOL, f"{where}: d own"
            if local and not gwg:
                continue  # the features' query-side gradient: test_family_distributed's oracle
            for name, g, e in (("d img", got[1], want[1]), ("d txt", got[2], want[2])):
                assert rel_err(torch.from_numpy(np.asarray(g)), e) <= TOL, f"{where}: {name}"
            assert abs(got[4] - want[4]) <= TOL * abs(want[4]), f"{where}: d tau"
