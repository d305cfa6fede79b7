"""The hard-negative family across 2 gloo ranks (``negatives``, ``group_ids``, ``margin``).

Rank 0 holds 5 pairs, rank 1 holds 3; negatives per rank M = (4, 0), (0, 0) and (2, 7) (a rank's
M = 0 passed as None or as a (0, D) tensor); group ids repeat within and across ranks; caption 7
duplicates caption 0 and negative 0 duplicates caption 3 (what the threshold masks). Every case
runs on backends torch and cpp, in the four modes (local_loss × gather_with_grad), through
``HNClipLoss`` (grad of ``logit_scale``) and ``distributed_hn_clip_loss`` (grad of τ) alternately;
each rank scales its loss by w_r = 1 + r before backward (a symmetric weight would hide summation
bugs). The parent compares each rank's loss and gradients (images, captions, its negatives, the
scale) with the single-process family loss of the concatenated batch (pairs, negatives, ids in
rank order), ``hn_clip_loss(backend="torch")`` in float64:

* local_loss, gather_with_grad:     L_r = (W/N)·Σ_{i on r} ℓ_i; grads of Σ_r' w_r' L_r';
* local_loss, no gather_with_grad:  same L_r; only the query-side gradient (gathered keys, the
  negatives included, are constants: the dense float64 oracle ``family_oracle.family_rows_f64``, with
  separate query and key copies, checked against hn_clip_loss on the value);
* full batch, no gather_with_grad:  L_r = L; grads w_r·dL/d(own features and negatives);
* full batch, gather_with_grad:     L_r = L; grads (Σ w)·dL/d(own features and negatives).

Tolerance (relative, float64 norms; ``helpers.rel_err``): everything in float64, 1e-10 for the
losses; gradients 1e-12 on torch (the same ops as the reference, another order of sums) and
5e-9 on cpp: the fused family operator's float64 gradients differ from the torch reference by up
to 6e-10 on these batches on one process already (tests/api/test_hard_negatives.py bounds them by
1e-9), and the distributed paths add nothing measurable to that.

backend="triton" (``test_two_ranks_triton_family_equal_the_concatenated_batch``): the same ranks,
oracle and modes on float32, bfloat16 and float16 features with D = 16, fewer cases (the
interpreter is slow), each gradient checked per row (``TRITON_TOL`` states the bounds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from family_oracle import family_rows_f64
from helpers import rel_err, spawn_gloo_ranks
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.distributed import distributed_hn_clip_loss

N_SIZES = (5, 3)
D = 8
IDS = [0, 1, 1, 2, 3, 2, 4, 0]  # 1 twice on rank 0; 2 and 0 on both ranks
MODES = [(True, True), (True, False), (False, False), (False, True)]  # (local_loss, gather_with_grad)
M_SIZES = [(4, 0), (0, 0), (2, 7)]
OPTIONS = [dict(threshold=None, eps=0.0), dict(threshold=0.99, eps=0.0), dict(threshold=0.99, eps=0.1)]
LOSS_TOL, GRAD_TOL = 1e-10, {"torch": 1e-12, "cpp": 5e-9}
TRITON_D = 16
# backend="triton", relative to the float64 oracle of the values the ranks hold, gradients per row
# (loss, d img, d txt, d negatives, d scale). float32: 1e-5 (measured ≤ 1.9e-6: float32 kernels). 16-bit
# features: the loss and dτ as float32 (they run in float32); a feature's gradient is rounded to its
# dtype once, ‖error‖/‖row‖ ≤ u (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4), measured 2.1e-3 and 2.6e-4;
# gathered in bf16 (no float32 gather) the bf16 rows reach 3.7e-3, over the bound set here
TRITON_TOL = {
    "float32": (1e-5,) * 5,
    "bfloat16": (1e-5, 3e-3, 3e-3, 3e-3, 1e-5),
    "float16": (1e-5, 4e-4, 4e-4, 4e-4, 1e-5),
}
S0 = 1 / 0.07


def _backends():
    return ["torch"] + (["cpp"] if cpp_directional() is not None else [])


def cases():
    """Every case: sizes of negatives, margin, backend, mode, options, ids on/off, API, M = 0 as None."""
    out = []
    for m_sizes in M_SIZES:
        for margin in ("text", "image_text"):
            for backend in _backends():
                for mode in MODES:
                    k = len(out)
                    out.append(
                        dict(
                            m_sizes=m_sizes, margin=margin, backend=backend, mode=mode, **OPTIONS[k % 3],
                            ids=k % 4 != 3, module=k % 2 == 0, empty_as_none=k % 5 < 3, gamma=0.5,
                        )
                    )  # fmt: skip
    return out


def global_data(m_total, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    n = sum(N_SIZES)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    t = 0.6 * v + torch.randn(n, d, generator=g, dtype=torch.float64)
    t[n - 1] = t[0]  # a duplicate caption across ranks
    neg = 0.5 * t[torch.arange(m_total) % n] + torch.randn(m_total, d, generator=g, dtype=torch.float64)
    if m_total:
        neg[0] = 1.5 * t[3]  # a negative that is caption 3 (same cosine): masked by the threshold
    scale = lambda x: x * torch.rand(x.shape[0], 1, generator=g, dtype=torch.float64).add(0.5)  # noqa: E731
    return scale(v), scale(t), scale(neg)


def _slices(sizes):
    offs = [sum(sizes[:r]) for r in range(len(sizes))]
    return [slice(o, o + s) for o, s in zip(offs, sizes)]


# ----------------------------------------------------------------------------- the ranks


def _rank(rank, world, all_cases, checks=True):
    """Every case on this rank: {case index: loss, grads (numpy, float64)}; with ``checks`` the
    errors of the collective checks and today's path."""
    out = {}
    for k, case in enumerate(all_cases):
        dtype = getattr(torch, case.get("dtype", "float64"))
        v, t, neg = global_data(sum(case["m_sizes"]), seed=k, d=case.get("d", D))
        rows, negs = _slices(N_SIZES)[rank], _slices(case["m_sizes"])[rank]
        img = v[rows].to(dtype).requires_grad_()
        txt = t[rows].to(dtype).requires_grad_()
        mine = neg[negs].to(dtype).requires_grad_()
        negatives = None if mine.shape[0] == 0 and case["empty_as_none"] else mine
        ids = torch.tensor(IDS)[rows] if case["ids"] else None
        local_loss, gather_with_grad = case["mode"]
        common = dict(gamma=case["gamma"], label_smoothing=case["eps"], backend=case["backend"], normalize=True)
        common.update(false_negative_threshold=case["threshold"], margin=case["margin"])
        p_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the scale as a model keeps it
        if case["module"]:
            p = torch.tensor(S0, dtype=p_dtype, requires_grad=True)  # logit_scale
            loss_fn = HNClipLoss(local_loss, gather_with_grad, False, rank, world, **common)
            loss = loss_fn(img, txt, p, negatives=negatives, group_ids=ids)
        else:
            p = torch.tensor(1 / S0, dtype=p_dtype, requires_grad=True)  # τ
            loss = distributed_hn_clip_loss(
                img, txt, p, local_loss=local_loss, gather_with_grad=gather_with_grad, negatives=negatives,
                group_ids=ids, **common,
            )  # fmt: skip
        ((1 + rank) * loss).backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (img, txt, mine, p)]
        out[k] = (loss.item(), *(x.detach().double().numpy() for x in grads))
    if not checks:
        return dict(cases=out)
    return dict(cases=out, errors=_errors(rank, world), today=_today_unchanged(rank, world))


def _errors(rank, world):
    """The collective checks: each raises on every rank (type and message head)."""
    v, t, _ = global_data(0)
    img, txt = v[_slices(N_SIZES)[rank]], t[_slices(N_SIZES)[rank]]
    got = {}
    tries = {
        "ids on rank 0 only": lambda: HNClipLoss(rank=rank, world_size=world, backend="torch", normalize=True)(
            img, txt, S0, group_ids=torch.arange(img.shape[0]) if rank == 0 else None
        ),
        "triton on float64 on rank 1": lambda: HNClipLoss(rank=rank, world_size=world, backend="triton")(
            *((img, txt) if rank == 1 else (img.float(), txt.float())), S0, negatives=txt.float()[:2] if rank else None
        ),
        "margins differ": lambda: distributed_hn_clip_loss(
            img, txt, 0.07, margin="image_text" if rank else "text", backend="torch"
        ),
        "negatives of another D on rank 1": lambda: distributed_hn_clip_loss(
            img, txt, 0.07, negatives=torch.zeros(2, D + (rank == 1), dtype=img.dtype), backend="torch"
        ),
    }
    for name, call in tries.items():
        try:
            call()
            got[name] = None
        except (TypeError, ValueError) as exc:
            got[name] = (type(exc).__name__, str(exc)[:400])
    return got


def _today_unchanged(rank, world):
    """Without the new arguments (or with None / M = 0 on every rank and margin "text") the
    distributed loss is today's, bit for bit (it takes today's path)."""
    v, t, _ = global_data(0)
    img, txt = v[_slices(N_SIZES)[rank]].float(), t[_slices(N_SIZES)[rank]].float()
    loss = HNClipLoss(True, True, False, rank, world, backend="cpp" if cpp_directional() else "torch", normalize=True)
    today = loss(img, txt, S0)
    return [
        torch.equal(today, loss(img, txt, S0, negatives=None, group_ids=None)),
        torch.equal(today, loss(img, txt, S0, negatives=txt[:0])),
    ]


# ----------------------------------------------------------------------------- the truth


def expected(case, k, rank):
    """Float64 (loss, d img, d txt, d negatives, d scale) of ``rank`` in ``case``, from the values
    the ranks hold (features rounded to the case's dtype, the scale to float32 with them)."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    v0, t0, n0 = global_data(sum(case["m_sizes"]), seed=k, d=case.get("d", D))
    v, t, n = (x.to(dtype).double().requires_grad_() for x in (v0, t0, n0))
    p_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    p0 = torch.tensor(S0 if case["module"] else 1 / S0, dtype=p_dtype).double()
    p = p0.clone().requires_grad_()
    tau = 1 / p if case["module"] else p
    ids = torch.tensor(IDS) if case["ids"] else None
    world, n_total = len(N_SIZES), sum(N_SIZES)
    w = [1.0 + r for r in range(world)]
    sl, nsl = _slices(N_SIZES), _slices(case["m_sizes"])
    rows = hn_clip_loss(
        v, t, tau, negatives=n if n.shape[0] else None, group_ids=ids, margin=case["margin"], gamma=case["gamma"],
        label_smoothing=case["eps"], false_negative_threshold=case["threshold"], reduction="none", backend="torch",
    )  # fmt: skip
    local_loss, with_grad = case["mode"]
    if local_loss and not with_grad:  # the query side only: keys are constants
        sides = (F.normalize(x, dim=1) for x in (v, t, v.detach(), t.detach(), n.detach()))
        kw = dict(label_smoothing=case["eps"], threshold=case["threshold"], group_ids=ids)
        q_rows = family_rows_f64(*sides, tau, margin=case["margin"], gamma=case["gamma"], **kw)
        assert rel_err(q_rows, rows) < 1e-12, "the dense oracle disagrees with hn_clip_loss"
        loss_r = (world / n_total) * q_rows[sl[rank]].sum()
        obj = w[rank] * loss_r
    elif local_loss:
        loss_r = (world / n_total) * rows[sl[rank]].sum()
        obj = sum(w[r] * (world / n_total) * rows[sl[r]].sum() for r in range(world))
    else:
        loss_r = rows.mean()
        obj = (sum(w) if with_grad else w[rank]) * rows.mean()
    (dp,) = torch.autograd.grad(w[rank] * loss_r, [p], retain_graph=True)
    gv, gt, gn = torch.autograd.grad(obj, [v, t, n], allow_unused=True)
    gn = torch.zeros_like(n) if gn is None else gn
    return loss_r.item(), gv[sl[rank]], gt[sl[rank]], gn[nsl[rank]], dp


# ----------------------------------------------------------------------------- the tests


def _name(case):
    mode = {(True, True): "local+gwg", (True, False): "local", (False, False): "full", (False, True): "full+gwg"}
    return f"M={case['m_sizes']} {case['margin']} {case['backend']} {mode[case['mode']]}"


def _compare(reports, all_cases, grad_error, tolerances, name):
    """Each rank's (loss, d img, d txt, d negatives, d scale) of every case against :func:`expected`:
    the failures (one line each), after printing each case's worst errors. ``grad_error(got, want)``
    measures a gradient, ``tolerances(case)`` gives the five bounds, ``name(case)`` its label."""
    failures, worst = [], {}
    for rank, report in reports.items():
        for k, case in enumerate(all_cases):
            got = report["cases"][k]
            want = expected(case, k, rank)
            errs = [abs(got[0] - want[0]) / abs(want[0])]
            errs += [grad_error(torch.from_numpy(np.asarray(g)), w) for g, w in zip(got[1:], want[1:])]
            key = name(case)
            worst[key] = [max(a, b) for a, b in zip(worst.get(key, [0.0] * 5), errs)]
            for what, e, tl in zip(("loss", "d img", "d txt", "d negatives", "d scale"), errs, tolerances(case)):
                if not e <= tl:
                    failures.append(f"rank {rank} case {k} ({key}, {case}): {what} rel err {e:.3e} > {tl:g}")
    print("\n".join(f"{k}: worst rel err (loss, d img, d txt, d neg, d scale) {e}" for k, e in worst.items()))
    return failures


def test_two_ranks_unequal_n_and_m_equal_the_concatenated_batch(tmp_path):
    """Loss and every gradient of each rank, every case, against the float64 single-process family
    loss of the concatenated batch; the collective checks raise on every rank; today's path kept."""
    all_cases = cases()
    reports = spawn_gloo_ranks(_rank, tmp_path, all_cases, timeout=300)
    failures = _compare(reports, all_cases, rel_err, lambda c: [LOSS_TOL] + [GRAD_TOL[c["backend"]]] * 4, _name)
    for rank, report in reports.items():
        assert report["today"] == [True, True], f"rank {rank}: today's loss changed: {report['today']}"
    assert not failures, "\n".join(failures)
    for name, kinds in (
        ("ids on rank 0 only", ("ValueError", "ValueError")),
        ("triton on float64 on rank 1", ("ValueError", "TypeError")),  # rank 1's own error, rank 0 names rank 1
        ("margins differ", ("ValueError", "ValueError")),
        ("negatives of another D on rank 1", ("ValueError", "ValueError")),
    ):
        for rank, report in reports.items():
            err = report["errors"][name]
            assert err is not None and err[0] == kinds[rank], f"rank {rank}, {name}: {err}"
    assert "use backend='torch' for float64" in reports[1]["errors"]["triton on float64 on rank 1"][1]
    assert "rank 1" in reports[0]["errors"]["triton on float64 on rank 1"][1]


def triton_cases():
    """backend="triton" on float32 (and 16-bit) features, D = 16: every mode, both margins, M = 0 on
    one rank (as None and as a (0, D) tensor), on both, and on neither; threshold, ε and ids mixed."""
    base = dict(backend="triton", d=TRITON_D, gamma=0.5, dtype="float32")
    rows = [  # (M per rank, margin, mode, threshold, ε, ids, module, M = 0 as None)
        ((4, 0), "text", (True, True), 0.99, 0.0, True, True, True),
        ((2, 7), "image_text", (True, True), 0.99, 0.1, True, False, True),
        ((0, 0), "text", (True, False), None, 0.1, True, True, False),
        ((0, 5), "image_text", (True, False), 0.99, 0.0, False, False, False),
        ((2, 7), "text", (False, False), 0.99, 0.1, True, True, True),
        ((4, 0), "image_text", (False, True), None, 0.0, True, False, True),
    ]
    out = [
        dict(base, m_sizes=m, margin=mg, mode=mode, threshold=c, eps=e, ids=i, module=mod, empty_as_none=none)
        for m, mg, mode, c, e, i, mod, none in rows
    ]
    out.append(dict(out[1], dtype="bfloat16"))  # 16-bit: image_text, M = (2, 7), ids, threshold, ε
    out.append(dict(out[0], dtype="float16"))  # 16-bit: text, M = (4, 0), ids, threshold
    return out


def row_errors(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst row's ‖got_i − want_i‖ / ‖want_i‖ (each row's norm floored at 1e-3 of the largest:
    a masked negative's gradient is 0); the relative error for a scalar."""
    if want.dim() == 0 or want.numel() == 0:
        return rel_err(got, want) if want.numel() else 0.0
    norms = want.norm(dim=1)
    floor = 1e-3 * norms.max().clamp_min(1e-300)
    return ((got - want).norm(dim=1) / torch.maximum(norms, floor)).max().item()


def test_two_ranks_triton_family_equal_the_concatenated_batch(tmp_path):
    """backend="triton" across 2 gloo ranks (N = 5 and 3, M_r unequal and 0): each rank's loss and
    every gradient, per row, against the float64 single-process family loss of the concatenated
    batch (the same oracle as the torch/cpp test, on the values the ranks hold)."""
    all_cases = triton_cases()
    reports = spawn_gloo_ranks(_rank, tmp_path, all_cases, False, timeout=300)
    failures = _compare(reports, all_cases, row_errors, lambda c: TRITON_TOL[c["dtype"]],
                        lambda c: f"{_name(c)} {c['dtype']}")  # fmt: skip
    assert not failures, "\n".join(failures)


def test_gather_rows_without_peers(tmp_path):
    """The variable-length gather on a 1-rank gloo group (no spawn): zero rows everywhere start no
    collective and keep ``like``'s dtype and width; rows come back in order, differentiable;
    ids come back as int64."""
    import torch.distributed as dist

    from hnclip_kernels.distributed.gather import gather_ids, gather_rows

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        like = torch.zeros(3, 5, dtype=torch.float64)
        empty = gather_rows(None, [0], 0, with_grad=True, keep_local=False, like=like)
        assert empty.shape == (0, 5) and empty.dtype == torch.float64
        x = torch.randn(4, 5, requires_grad=True)
        for with_grad, keep_local in ((True, False), (False, True)):
            got = gather_rows(x, [4], 0, with_grad=with_grad, keep_local=keep_local, like=like)
            assert torch.equal(got, x)
            (g,) = torch.autograd.grad(got.sum(), [x])
            assert torch.equal(g, torch.ones_like(x))
        ids = gather_ids(torch.tensor([3, 1], dtype=torch.int32), [2])
        assert ids.dtype == torch.int64 and ids.tolist() == [3, 1]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_one_process_function_takes_the_family(margin):
    """``distributed_hn_clip_loss`` with ``world_size=1`` is the single-process family loss."""
    v, t, n = global_data(3)
    ids = torch.tensor(IDS)
    kw = dict(negatives=n, group_ids=ids, margin=margin, backend="torch")
    got = distributed_hn_clip_loss(v, t, 0.07, world_size=1, **kw)
    assert torch.equal(got, hn_clip_loss(v, t, 0.07, **kw))


@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_one_process_function_takes_the_triton_family(margin):
    """``distributed_hn_clip_loss(world_size=1)`` on backend="triton" is the single-process Triton
    family loss, bit for bit (it refused the family before the rank path had Triton)."""
    v, t, n = (x.float() for x in global_data(3, d=TRITON_D))  # Triton's dtypes
    kw = dict(negatives=n, group_ids=torch.tensor(IDS), margin=margin, backend="triton", false_negative_threshold=0.99)
    got = distributed_hn_clip_loss(v, t, 0.07, world_size=1, **kw)
    assert torch.equal(got, hn_clip_loss(v, t, 0.07, **kw))
