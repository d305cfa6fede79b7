"""Multi-positive targets across 3 gloo ranks (``group_mode="supcon"`` / ``"mil_nce"``), groups
spanning ranks.

Ranks hold 3, 2 and 3 pairs and 2, 0 and 1 negatives; group 0 has a pair on every rank, group 1
on ranks 0 and 2, group 2 two pairs on rank 1, the rest are singletons. Every case runs on each
backend (torch, cpp where the extension is built, Triton: their directional operator per rank) in
float64 (Triton: float32, the oracle then of the float32 values), in the four modes (local_loss × gather_with_grad), through ``HNClipLoss``
(grad of ``logit_scale``) and ``distributed_hn_clip_loss`` (grad of τ) alternately, with and
without ε and the threshold; each rank scales its loss by w_r = 1 + r before backward. The parent
compares each rank's loss and gradients (images, captions, its negatives, the scale) with the dense
float64 oracle ``tests/positives_oracle.py`` of the concatenated batch (separate query and key
copies: with ``local_loss`` and no ``gather_with_grad`` the keys are constants), per row of each
gradient (rows floored at 1e-4 of the largest): loss 1e-10, gradients 1e-9 (float64 against the
oracle's other form; measured on torch ≤ 2.5e-16 and ≤ 1.5e-15, on cpp ≤ 4.1e-16 and ≤ 5.0e-15);
Triton's float32 loss 1e-5, gradients 1e-4 (float32's bound; measured ≤ 2.6e-7 and ≤ 4.7e-6). The collective checks
(group_mode differing across ranks; a positive mode without ids on one rank) raise on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err, spawn_gloo_ranks
from hnclip_kernels import HNClipLoss
from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.distributed import distributed_hn_clip_loss
from positives_oracle import positive_rows_f64

N_SIZES, M_SIZES = (3, 2, 3), (2, 0, 1)
D = 6
IDS = [0, 1, 3, 2, 0, 1, 2, 0]  # rank 0: 0 1 3 | rank 1: 2 0 | rank 2: 1 2 0  (group 2: ranks 1 and 2)
MODES = [(True, True), (True, False), (False, False), (False, True)]
S0 = 1 / 0.1
FLOOR = 1e-4
TOLS = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-5, 1e-4)}  # (loss, gradients)
BACKENDS = ["torch"] + (["cpp"] if cpp_directional() is not None else []) + ["triton"]


def dtype_of(backend: str) -> torch.dtype:
    """The features' dtype on ``backend``: float64, float32 on Triton (which takes no float64)."""
    return torch.float32 if backend == "triton" else torch.float64


def cases():
    out = []
    for backend in BACKENDS:
        for group_mode in ("supcon", "mil_nce"):
            for k, mode in enumerate(MODES):
                extra = [dict(eps=0.0, threshold=None), dict(eps=0.1, threshold=0.95)][k % 2]
                module = (k + len(out)) % 2 == 0
                out.append(dict(group_mode=group_mode, mode=mode, module=module, backend=backend, **extra))
    return out


def global_data(seed):
    g = torch.Generator().manual_seed(seed)
    n, m = sum(N_SIZES), sum(M_SIZES)
    v = torch.randn(n, D, generator=g, dtype=torch.float64)
    t = 0.6 * v + torch.randn(n, D, generator=g, dtype=torch.float64)
    neg = 0.5 * t[:m] + torch.randn(m, D, generator=g, dtype=torch.float64)
    neg[0] = 2.0 * t[2]  # a negative that is caption 2 (cosine 1): masked by the threshold
    return v, t, neg


def _slices(sizes):
    offs = [sum(sizes[:r]) for r in range(len(sizes))]
    return [slice(o, o + s) for o, s in zip(offs, sizes)]


def _rank(rank, world, all_cases):
    out = {}
    for k, case in enumerate(all_cases):
        dt = dtype_of(case["backend"])
        v, t, neg = (x.to(dt) for x in global_data(k))
        img, txt = v[_slices(N_SIZES)[rank]].requires_grad_(), t[_slices(N_SIZES)[rank]].requires_grad_()
        mine = neg[_slices(M_SIZES)[rank]].requires_grad_()
        ids = torch.tensor(IDS)[_slices(N_SIZES)[rank]]
        local_loss, gather_with_grad = case["mode"]
        common = dict(label_smoothing=case["eps"], false_negative_threshold=case["threshold"], normalize=True)
        common.update(group_mode=case["group_mode"], backend=case["backend"])
        if case["module"]:
            p = torch.tensor(S0, dtype=dt, requires_grad=True)
            loss = HNClipLoss(local_loss, gather_with_grad, False, rank, world, **common)(
                img, txt, p, negatives=mine, group_ids=ids
            )
        else:
            p = torch.tensor(1 / S0, dtype=dt, requires_grad=True)
            loss = distributed_hn_clip_loss(
                img, txt, p, local_loss=local_loss, gather_with_grad=gather_with_grad, negatives=mine,
                group_ids=ids, **common,
            )  # fmt: skip
        ((1 + rank) * loss).backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (img, txt, mine, p)]
        out[k] = (loss.item(), *(x.detach().numpy() for x in grads))
    return dict(cases=out, errors=_errors(rank, world))


def _errors(rank, world):
    v, t, _ = global_data(0)
    img, txt = v[_slices(N_SIZES)[rank]], t[_slices(N_SIZES)[rank]]
    ids = torch.tensor(IDS)[_slices(N_SIZES)[rank]]
    tries = {
        "group_mode differs": lambda: distributed_hn_clip_loss(
            img, txt, 0.1, group_ids=ids, group_mode="mil_nce" if rank == 2 else "supcon", backend="torch"
        ),
        "no ids on rank 1": lambda: distributed_hn_clip_loss(
            img, txt, 0.1, group_ids=None if rank == 1 else ids, group_mode="supcon", backend="torch"
        ),
    }
    got = {}
    for name, call in tries.items():
        try:
            call()
            got[name] = None
        except (TypeError, ValueError) as exc:
            got[name] = (type(exc).__name__, str(exc)[:400])
    return got


def expected(case, k, rank):
    """Float64 (loss, d img, d txt, d negatives, d scale) of ``rank`` from the oracle (of the values
    the ranks hold: float32-rounded ones on Triton)."""
    dt = dtype_of(case["backend"])
    v0, t0, n0 = global_data(k)
    v, t, n = (x.to(dt).double().requires_grad_() for x in (v0, t0, n0))
    p0 = torch.tensor(S0 if case["module"] else 1 / S0, dtype=dt).item()
    p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    tau = 1 / p if case["module"] else p
    world, n_total = len(N_SIZES), sum(N_SIZES)
    w = [1.0 + r for r in range(world)]
    sl, nsl = _slices(N_SIZES), _slices(M_SIZES)
    local_loss, with_grad = case["mode"]
    vu, tu, nu = (F.normalize(x, dim=1) for x in (v, t, n))
    keys = (vu, tu, nu) if with_grad or not local_loss else (vu.detach(), tu.detach(), nu.detach())
    captions = (tu.detach(), tu.detach(), nu.detach())
    rows = positive_rows_f64(
        vu, tu, *keys, tau, torch.tensor(IDS), mode=case["group_mode"], label_smoothing=case["eps"],
        threshold=case["threshold"], captions=captions,
    )  # fmt: skip
    if local_loss:
        loss_r = (world / n_total) * rows[sl[rank]].sum()
        obj = w[rank] * loss_r if not with_grad else sum(w[r] * (world / n_total) * rows[sl[r]].sum() for r in range(3))
    else:
        loss_r = rows.mean()
        obj = (sum(w) if with_grad else w[rank]) * rows.mean()
    (dp,) = torch.autograd.grad(w[rank] * loss_r, [p], retain_graph=True)
    gv, gt, gn = torch.autograd.grad(obj, [v, t, n], allow_unused=True)
    gn = torch.zeros_like(n) if gn is None else gn
    return loss_r.item(), gv[sl[rank]], gt[sl[rank]], gn[nsl[rank]], dp


def row_error(got, want):
    if want.dim() == 0 or want.numel() == 0:
        return rel_err(got, want) if want.numel() else 0.0
    norms = want.norm(dim=1)
    return ((got - want).norm(dim=1) / torch.maximum(norms, FLOOR * norms.max().clamp_min(1e-300))).max().item()


@pytest.mark.slow  # 25 s per backend on 2 loaded cores (Triton: the interpreter, about as long): three spawned ranks
def test_three_ranks_groups_spanning_ranks_equal_the_oracle(tmp_path):
    all_cases = cases()
    reports = spawn_gloo_ranks(_rank, tmp_path, all_cases, world=3, timeout=300)
    failures, worst = [], {}
    for rank, report in reports.items():
        for k, case in enumerate(all_cases):
            got, want = report["cases"][k], expected(case, k, rank)
            errs = [abs(got[0] - want[0]) / abs(want[0])]
            errs += [row_error(torch.from_numpy(np.asarray(g)).double(), x) for g, x in zip(got[1:], want[1:])]
            key = f"{case['backend']} {case['group_mode']}"
            worst[key] = [max(a, b) for a, b in zip(worst.get(key, [0.0] * 5), errs)]
            loss_tol, grad_tol = TOLS[dtype_of(case["backend"])]
            for what, e, tol in zip(("loss", "d img", "d txt", "d neg", "d scale"), errs, [loss_tol] + [grad_tol] * 4):
                if not e <= tol:
                    failures.append(f"rank {rank} case {k} ({case}): {what} rel err {e:.3e} > {tol:g}")
    print("\n".join(f"{k}: worst rel err (loss, d img, d txt, d neg, d scale) {e}" for k, e in worst.items()))
    assert not failures, "\n".join(failures)
    for rank, report in reports.items():
        err = report["errors"]["group_mode differs"]
        assert err is not None and err[0] == "ValueError" and "group_mode differs across ranks" in err[1], err
        err = report["errors"]["no ids on rank 1"]
        assert err is not None and err[0] == "ValueError", err
        if rank == 1:
            assert "no group_ids were passed" in err[1], err
        else:
            assert "rank 1" in err[1], err
