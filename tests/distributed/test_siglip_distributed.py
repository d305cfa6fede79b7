"""The sigmoid (SigLIP) loss across gloo ranks: ``HNSigLipLoss`` and ``distributed_siglip_loss``.

* open_clip equality (γ = 0): on 2 and 3 ranks with equal local batches (open_clip needs them),
  float64 features, every rank's loss and the gradients of its images, captions, ``logit_scale``
  and ``logit_bias`` equal open_clip 3.3.0's ``SigLipLoss`` for each ``dist_impl`` ("bidir",
  "shift", "reduce", "gather") to 1e-12 (measured: ≤ 4e-15 absolute). Each rank scales its loss by
  w_r = 1 + r before backward (a symmetric weight would hide a gradient routed to the wrong rank).
* The global loss (γ = 0.5, both margins, negatives with M_r differing and 0 on some rank, group ids
  in both modes, repeated within and across ranks): unequal local batches (5, 3) and (4, 1, 3);
  rank r's loss is (W/N)·Σ_{i on r} r_i of the float64 single-process oracle
  (``sigmoid_oracle.sigmoid_rows_f64`` over the concatenated batch), every rank's gradients (its
  images, captions, negatives, s and b) those of Σ_r w_r·L_r, to 1e-10 relative; ds and db, sums
  over a rank's pairs, relative to Σ|term| (the bound of a float sum: with float32 features one
  rank's ds cancels to 0.4% of Σ|term| and misses 2e-5 of itself).
* The consensus: an invalid input on one rank, ids on one rank only, options that differ: every
  rank raises (no hang).

Backends: each of ``backends.sigmoid_fn``'s that imports here (torch; cpp and triton once their
sigmoid ops exist: triton runs float32 features against the same float64 oracle at 2e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sigmoid_oracle import sigmoid_rows_f64

from helpers import spawn_gloo_ranks
from hnclip_kernels import HNSigLipLoss
from hnclip_kernels.backends import sigmoid_fn
from hnclip_kernels.distributed import distributed_siglip_loss

D = 8
S0, B0 = 10.0, -10.0
DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
SIZES = {2: (5, 3), 3: (4, 1, 3)}
NEG_SIZES = {2: [(2, 0), (0, 3)], 3: [(2, 0, 1), (0, 0, 0)]}


def backends():
    """The sigmoid backends that import here (the fused ones once their ops exist)."""
    out = []
    for name in ("torch", "cpp", "triton"):
        try:
            sigmoid_fn(name)
        except (ImportError, ValueError):
            continue
        out.append(name)
    return out


def _slices(sizes):
    offs = np.cumsum((0,) + tuple(sizes))
    return [slice(int(a), int(b)) for a, b in zip(offs[:-1], offs[1:])]


def global_batch(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, D, generator=g, dtype=torch.float64)
    t = 0.7 * v + 0.5 * torch.randn(n, D, generator=g, dtype=torch.float64)
    neg = 0.6 * t[torch.arange(m) % n] + 0.5 * torch.randn(m, D, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 1, 1, 2, 3, 2, 4, 0][:n])  # repeats within a rank and across ranks
    return v, t, neg, ids


def oracle_cases(world):
    out = []
    for k, (margin, mode, m_sizes) in enumerate(
        (mg, md, ms) for mg in ("text", "image_text") for md in ("mask", "positive") for ms in NEG_SIZES[world]
    ):
        out.append(dict(margin=margin, group_mode=mode, m_sizes=m_sizes, ids=k % 4 != 3, module=k % 2 == 0))
    return out


# ----------------------------------------------------------------------------- the ranks


def _open_clip_rank(rank, world, backend):
    """Every dist_impl on this rank: {dist_impl: (open_clip's (loss, grads), ours)}; features in float64."""
    from open_clip.loss import SigLipLoss

    v, t, _, _ = global_batch(3 * world, 0, seed=1)
    own = _slices((3,) * world)[rank]
    out = {}
    for impl in DIST_IMPLS:
        results = []
        for loss_fn in (
            SigLipLoss(rank=rank, world_size=world, dist_impl=impl),
            HNSigLipLoss(rank=rank, world_size=world, dist_impl=impl, gamma=0.0, backend=backend),
        ):
            img = torch.nn.functional.normalize(v[own], dim=-1).requires_grad_()
            txt = torch.nn.functional.normalize(t[own], dim=-1).requires_grad_()
            s = torch.tensor(S0, dtype=torch.float64, requires_grad=True)
            b = torch.tensor(B0, dtype=torch.float64, requires_grad=True)
            loss = loss_fn(img, txt, s, b)
            ((1 + rank) * loss).backward()
            results.append([loss.item()] + [x.grad.numpy().copy() for x in (img, txt, s, b)])
        out[impl] = results
    return out


def _oracle_rank(rank, world, backend, dtype_name):
    dtype = getattr(torch, dtype_name)
    sizes = SIZES[world]
    out = []
    for k, case in enumerate(oracle_cases(world)):
        v, t, neg, ids = global_batch(sum(sizes), sum(case["m_sizes"]), seed=10 + k)
        rows, negs = _slices(sizes)[rank], _slices(case["m_sizes"])[rank]
        img, txt, mine = (x.to(dtype).requires_grad_() for x in (v[rows], t[rows], neg[negs]))
        s = torch.tensor(S0, dtype=dtype, requires_grad=True)
        b = torch.tensor(B0, dtype=dtype, requires_grad=True)
        common = dict(gamma=0.5, margin=case["margin"], group_mode=case["group_mode"], backend=backend)
        negatives = mine if mine.shape[0] else None
        group_ids = ids[rows] if case["ids"] else None
        if case["module"]:
            loss_fn = HNSigLipLoss(rank=rank, world_size=world, normalize=True, **common)
            loss = loss_fn(img, txt, s, b, negatives=negatives, group_ids=group_ids)
        else:
            loss = distributed_siglip_loss(img, txt, s, b, negatives=negatives, group_ids=group_ids, **common)
        ((1 + rank) * loss).backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (img, txt, mine, s, b)]
        out.append([loss.item()] + [x.double().numpy() for x in grads])
    return dict(cases=out, errors=_errors(rank, world))


def _errors(rank, world):
    """Each bad call raises on every rank: {name: (exception type, message head)}."""
    v, t, _, _ = global_batch(sum(SIZES[world]), 0, seed=3)
    own = _slices(SIZES[world])[rank]
    img, txt = v[own], t[own]
    tries = {
        "negatives of another D on rank 1": lambda: distributed_siglip_loss(
            img, txt, S0, B0, negatives=torch.zeros(2, D + (rank == 1), dtype=img.dtype), backend="torch"
        ),
        "ids on rank 0 only": lambda: HNSigLipLoss(rank=rank, world_size=world, backend="torch")(
            img, txt, S0, B0, group_ids=torch.arange(img.shape[0]) if rank == 0 else None
        ),
        "margins differ": lambda: distributed_siglip_loss(
            img, txt, S0, B0, margin="image_text" if rank else "text", backend="torch"
        ),
        "logit_scale <= 0 on rank 0": lambda: distributed_siglip_loss(
            img, txt, -1.0 if rank == 0 else S0, B0, backend="torch"
        ),
        "rank passed wrong": lambda: HNSigLipLoss(rank=(rank + 1) % world, world_size=world, backend="torch")(
            img, txt, S0, B0
        ),
    }
    got = {}
    for name, call in tries.items():
        try:
            call()
            got[name] = None
        except (TypeError, ValueError) as exc:
            got[name] = (type(exc).__name__, str(exc)[:60])
    return got


# ----------------------------------------------------------------------------- the tests


def _impl_figures(reports, world):
    """{dist_impl: [per rank: (|Δloss|, max |Δ d img|, |Δ d txt|, |Δ ds|, |Δ db|)]}."""
    figures = {}
    for impl in DIST_IMPLS:
        figures[impl] = []
        for r in range(world):
            theirs, ours = reports[r][impl]
            figures[impl].append(
                tuple(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(theirs, ours))
            )
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", [b for b in backends() if b != "triton"])
def test_equals_open_clip_siglip_for_every_dist_impl(tmp_path, world, backend):
    reports = spawn_gloo_ranks(_open_clip_rank, tmp_path, backend, world=world)
    figures = _impl_figures(reports, world)
    print(f"world {world}, {backend}: max abs diff (loss, d img, d txt, ds, db) per rank:", figures)
    for impl, per_rank in figures.items():
        for r, diffs in enumerate(per_rank):
            assert max(diffs) < 1e-12, (impl, r, diffs)
    # the check has teeth: a rank's caption gradients are nonzero and differ across ranks
    assert np.abs(reports[0]["gather"][1][2]).max() > 1e-3


def _oracle(world, case, k):
    sizes = SIZES[world]
    v, t, neg, ids = global_batch(sum(sizes), sum(case["m_sizes"]), seed=10 + k)
    v, t, neg = (x.clone().requires_grad_() for x in (v, t, neg))
    s = torch.tensor(S0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(B0, dtype=torch.float64, requires_grad=True)
    g = ids if case["ids"] else None
    rows = sigmoid_rows_f64(v, t, s, b, negatives=neg, gamma=0.5, margin=case["margin"], query_groups=g,
                            key_groups=g, groups_positive=case["group_mode"] == "positive")  # fmt: skip
    n, w = sum(sizes), world
    losses = [rows[sl].sum() * (w / n) for sl in _slices(sizes)]
    total = sum((1 + r) * L for r, L in enumerate(losses))
    dv, dt, dneg = torch.autograd.grad(total, (v, t, neg), retain_graph=True, allow_unused=True)
    dneg = torch.zeros_like(neg) if dneg is None else dneg
    scalars = [torch.autograd.grad((1 + r) * L, (s, b), retain_graph=True) for r, L in enumerate(losses)]
    # each rank's ds, db is a sum over its pairs, which float32 gets to eps·Σ|term|: read the terms
    shape = (n, n + sum(case["m_sizes"]))
    s2, b2 = (torch.full(shape, x0, dtype=torch.float64, requires_grad=True) for x0 in (S0, B0))
    rows2 = sigmoid_rows_f64(v, t, s2, b2, negatives=neg, gamma=0.5, margin=case["margin"], query_groups=g,
                             key_groups=g, groups_positive=case["group_mode"] == "positive")  # fmt: skip
    scales = []
    for r, sl in enumerate(_slices(sizes)):
        terms = torch.autograd.grad((1 + r) * (w / n) * rows2[sl].sum(), (s2, b2), retain_graph=True)
        scales.append(tuple(x.abs().sum() for x in terms))
    return [L.item() for L in losses], dv, dt, dneg, scalars, scales


def _rel(a, b):
    a, b = torch.as_tensor(np.asarray(a, dtype=np.float64)), torch.as_tensor(np.asarray(b, dtype=np.float64))
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", backends())
def test_global_loss_and_gradients_on_unequal_batches(tmp_path, world, backend):
    dtype = "float32" if backend == "triton" else "float64"
    tol = 2e-5 if backend == "triton" else 1e-10
    reports = spawn_gloo_ranks(_oracle_rank, tmp_path, backend, dtype, world=world)
    sizes = SIZES[world]
    for k, case in enumerate(oracle_cases(world)):
        losses, dv, dt, dneg, scalars, scales = _oracle(world, case, k)
        for r in range(world):
            loss, g_img, g_txt, g_neg, g_s, g_b = reports[r]["cases"][k]
            rows, negs = _slices(sizes)[r], _slices(case["m_sizes"])[r]
            assert abs(loss - losses[r]) <= tol * abs(losses[r]), (case, r, loss, losses[r])
            for name, got, want in (("img", g_img, dv[rows]), ("txt", g_txt, dt[rows])):
                assert _rel(got, want) <= tol, (case, r, name, _rel(got, want))
            # ds, db: relative to the sum of |terms| (one rank's ds cancels to 0.4% of it in case 5)
            for name, got, want, scale in (
                ("s", g_s, scalars[r][0], scales[r][0]),
                ("b", g_b, scalars[r][1], scales[r][1]),
            ):
                err = abs(float(got) - float(want))
                assert err <= tol * float(scale), (case, r, name, err, float(scale), float(want))
            if dneg[negs].numel():
                assert _rel(g_neg, dneg[negs]) <= tol, (case, r, "negatives")
    for r in range(world):
        errors = reports[r]["errors"]
        for name, got in errors.items():
            assert got is not None, f"rank {r} did not raise for {name!r}"
        assert errors["negatives of another D on rank 1"][0] == "ValueError"
        if r != 1:
            assert "invalid input on another rank" in errors["negatives of another D on rank 1"][1]
        assert "inconsistent inputs" in errors["margins differ"][1]


def test_backends_list_has_the_reference():
    assert "torch" in backends()
