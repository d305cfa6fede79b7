"""HNClipLoss / gather_features on real torch.distributed process groups (gloo, CPU).

Each spawned group (2 and 3 ranks) runs many checks in one go, so the whole file costs
two spawns. Every rank holds different data and multiplies its loss by a rank-dependent
weight w_r = 1 + r before backward (a symmetric weight would hide summation bugs), and
the gradients are checked against the float64 formula on the concatenated global batch:

* local_loss, gather_with_grad (A):   rank r's loss L_r = (W/N)·Σ_{i on r} ℓ_i; feature grads
  of rank r = d(Σ_r' w_r' L_r')/d(own features); DDP-averaged grads = grad of (1/N)·Σ_i w(i) ℓ_i.
* local_loss, no grad gather (B):     same L_r; grads only through the rank's own queries.
* full batch, no grad gather (C):     L_r = L; feature grads = w_r · dL/d(own features).
* full batch, grad gather (D):        L_r = L; feature grads = (Σ w) · dL/d(own features).
* logit_scale (every mode):           rank r's grad = w_r · dL_r/ds.
* false-negative masking (every mode, unequal sizes): captions duplicated within and across
  ranks, masked at caption cosine 0.99, against the float64 formula with the same mask.

Workers record failed checks instead of raising, so one failure does not leave the other
ranks hanging in a collective; the parent joins with a deadline and kills stragglers.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hnclip_kernels
from helpers import assert_close_rel, collect_rank_reports, hn_clip_loss_f64
from hnclip_kernels import HNClipLoss, gather_features
from hnclip_kernels.backends import cpp_directional

MODES = [(True, True), (True, False), (False, False), (False, True)]  # (local_loss, gather_with_grad)
S0 = 1 / 0.07  # open_clip's initial exp(logit_scale)


# ----------------------------------------------------------------------------- launcher


def _entry(rank, world, init_method, worker_name, q):
    try:
        import warnings

        # open_clip's ClipLoss calls torch.distributed.nn.all_gather, deprecated in recent torch
        warnings.filterwarnings("ignore", message="torch.distributed.nn.functional", category=FutureWarning)
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=45)
        )
        failures, info = [], {}
        globals()[worker_name](rank, world, failures, info)
        q.put((rank, failures, None, info))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, None, traceback.format_exc(), {}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world, worker_name, tmp_path, timeout=150.0):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init_method = f"file://{tmp_path / f'pg_{world}'}"
    procs = [ctx.Process(target=_entry, args=(r, world, init_method, worker_name, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = collect_rank_reports(q, procs, world, timeout)
    missing = sorted(set(range(world)) - set(results))
    msgs = [f"rank {r} did not report within {timeout:.0f}s (hang or crash)" for r in missing]
    for r, (failures, tb, _) in sorted(results.items()):
        if tb:
            msgs.append(f"rank {r} crashed:\n{tb}")
        msgs.extend(f"rank {r}: {f}" for f in failures or [])
    assert not msgs, "\n".join(msgs)
    return {r: info for r, (_, _, info) in results.items()}


def _check(failures, name, fn, *args):
    """Run fn(*args); an AssertionError is recorded in failures under name (the rank goes on)."""
    try:
        fn(*args)
    except AssertionError as exc:
        failures.append(f"{name}: {exc}")


# ----------------------------------------------------------------------------- data and truth


def _global_data(sizes, d, seed, normalize, duplicates=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    v = torch.randn(n, d, generator=g)
    t = 0.6 * v + torch.randn(n, d, generator=g)  # correlated pairs: not a trivial loss
    if duplicates:  # caption 0 repeated on the last rank, caption 1 next to it (false negatives)
        t[n - 1] = t[0]
        t[2] = t[1]
    if normalize:  # raw features of varied norms; the loss normalises them
        v = v * torch.rand(n, 1, generator=g).add(0.5)
        t = t * torch.rand(n, 1, generator=g).add(0.5)
    else:
        v, t = F.normalize(v, dim=1), F.normalize(t, dim=1)
    return v, t


def _local_leaf(x, layout):
    """(leaf, local view, map from leaf grad to view grad) with the requested memory layout."""
    if layout == "strided":  # every other column of a wider buffer
        buf = torch.zeros(x.shape[0], 2 * x.shape[1])
        buf[:, 1::2] = x
        buf.requires_grad_()
        return buf, buf[:, 1::2], lambda g: g[:, 1::2]
    if layout == "colmajor":  # transposed storage
        buf = x.t().contiguous().requires_grad_()
        return buf, buf.t(), lambda g: g.t()
    leaf = x.clone().requires_grad_()
    return leaf, leaf, lambda g: g


def _ce_f64(q, k, a, b, s, offset, gamma, eps, normalize, threshold=None):
    """One direction in float64 via F.cross_entropy (B-mode truth, keys given as constants);
    with ``threshold``, cross-entropy over each row's kept classes written out."""
    if normalize:
        q, k, a, b = (F.normalize(x, dim=1) for x in (q, k, a, b))
    rows = torch.arange(q.shape[0])
    margin = (a @ b.T).detach().clone()
    cos = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T
    margin[rows, rows + offset] = 0.0
    z = (q @ k.T + gamma * margin) * s
    if threshold is None:
        return F.cross_entropy(z, rows + offset, reduction="none", label_smoothing=eps)
    dropped = cos.detach() >= threshold
    dropped[rows, rows + offset] = False  # the positive stays
    pos = z[rows, rows + offset]
    nll = torch.logsumexp(z.masked_fill(dropped, float("-inf")), dim=1) - pos
    kept_mean = z.masked_fill(dropped, 0.0).sum(dim=1) / (~dropped).sum(dim=1)
    return nll + eps * (pos - kept_mean)


def _expected(mode, V, T, sizes, rank, w, gamma, eps, normalize, threshold=None):
    """Float64 (loss_r, dImg_r, dTxt_r, ds_r) of rank r with upstream weights w, and the DDP truth."""
    local_loss, with_grad = mode
    W, N = len(sizes), sum(sizes)
    offs = [sum(sizes[:r]) for r in range(W)]
    sl = [slice(offs[r], offs[r] + sizes[r]) for r in range(W)]
    v = V.double().clone().requires_grad_()
    t = T.double().clone().requires_grad_()
    s = torch.tensor(S0, dtype=torch.float32).double().requires_grad_()
    V64, T64 = V.double(), T.double()
    if local_loss and not with_grad:
        i2t = _ce_f64(v[sl[rank]], T64, T64[sl[rank]], T64, s, offs[rank], gamma, eps, normalize, threshold)
        t2i = _ce_f64(t[sl[rank]], V64, T64[sl[rank]], T64, s, offs[rank], gamma, eps, normalize, threshold)
        loss_r = (W / N) * (0.5 * (i2t + t2i)).sum()
        obj = w[rank] * loss_r
        ddp_truth = None
    else:
        rows = hn_clip_loss_f64(v, t, 1 / s, gamma, eps, "none", normalize, false_negative_threshold=threshold)

        def rank_value(r):
            return (W / N) * rows[sl[r]].sum() if local_loss else rows.mean()

        loss_r = rank_value(rank)
        if local_loss:  # A
            obj = sum(w[r] * rank_value(r) for r in range(W))
            ddp_truth = sum(w[r] * rows[sl[r]].sum() for r in range(W)) / N
        elif with_grad:  # D
            obj = sum(w) * rows.mean()
            ddp_truth = (sum(w) / W) * rows.mean()
        else:  # C
            obj = w[rank] * rows.mean()
            ddp_truth = None
    (ds,) = torch.autograd.grad(w[rank] * loss_r, [s], retain_graph=True)
    gv, gt = torch.autograd.grad(obj, [v, t], retain_graph=ddp_truth is not None)
    out = dict(loss=loss_r.detach(), img=gv[sl[rank]], txt=gt[sl[rank]], s=ds)
    if ddp_truth is not None:
        dv, dt, dss = torch.autograd.grad(ddp_truth, [v, t, s])
        out["ddp"] = dict(loss=ddp_truth.detach(), img=dv[sl[rank]], txt=dt[sl[rank]], s=dss)
    return out


def _backends():
    return ["torch", "triton"] + (["cpp"] if cpp_directional() is not None else [])


def _run_case(
    rank,
    world,
    failures,
    *,
    sizes,
    mode,
    backend,
    gamma,
    eps,
    normalize,
    layout,
    seed,
    with_clip=False,
    tol=5e-5,
    tag="",
    threshold=None,
):
    from open_clip.loss import ClipLoss

    name = f"[{backend} sizes={sizes} mode={mode} γ={gamma} ε={eps} norm={normalize} {layout} {tag} c={threshold}]"
    w = [1.0 + r for r in range(world)]
    V, T = _global_data(sizes, 8, seed, normalize, duplicates=threshold is not None)
    off = sum(sizes[:rank])
    sl = slice(off, off + sizes[rank])
    lv, img, map_v = _local_leaf(V[sl], layout)
    lt, txt, map_t = _local_leaf(T[sl], "colmajor" if layout == "strided" else layout)
    s = torch.tensor(S0, dtype=torch.float32, requires_grad=True)
    loss_fn = HNClipLoss(
        local_loss=mode[0],
        gather_with_grad=mode[1],
        rank=rank,
        world_size=world,
        gamma=gamma,
        label_smoothing=eps,
        backend=backend,
        normalize=normalize,
        false_negative_threshold=threshold,
    )
    loss = loss_fn(img, txt, s)
    gv, gt, gs = torch.autograd.grad(w[rank] * loss, [lv, lt, s])
    gv, gt = map_v(gv), map_t(gt)
    exp = _expected(mode, V, T, sizes, rank, w, gamma, eps, normalize, threshold)
    _check(failures, name + " loss", lambda: assert_close_rel(loss, exp["loss"], 2e-6, "loss"))
    _check(failures, name + " dimg", lambda: assert_close_rel(gv, exp["img"], tol, "d image"))
    _check(failures, name + " dtxt", lambda: assert_close_rel(gt, exp["txt"], tol, "d text"))
    _check(failures, name + " ds", lambda: assert_close_rel(gs, exp["s"], tol, "d logit_scale"))
    if "ddp" in exp:  # the convention itself: DDP-averaged gradients = single-process gradients
        red = torch.stack([w[rank] * loss.detach(), gs.detach()])
        dist.all_reduce(red)
        red /= world
        ddp = exp["ddp"]
        _check(failures, name + " ddp loss", lambda: assert_close_rel(red[0], ddp["loss"], 2e-6, "avg weighted loss"))
        _check(failures, name + " ddp ds", lambda: assert_close_rel(red[1], ddp["s"], tol, "avg d logit_scale"))
        _check(failures, name + " ddp dimg", lambda: assert_close_rel(gv / world, ddp["img"], tol, "avg d image"))
        _check(failures, name + " ddp dtxt", lambda: assert_close_rel(gt / world, ddp["txt"], tol, "avg d text"))
    if with_clip:  # γ = 0 against open_clip's ClipLoss in the same group, same leaves and weights
        ref = ClipLoss(local_loss=mode[0], gather_with_grad=mode[1], rank=rank, world_size=world)
        ref_loss = ref(img, txt, s)
        rv, rt, rs = torch.autograd.grad(w[rank] * ref_loss, [lv, lt, s])
        rv, rt = map_v(rv), map_t(rt)
        # 2e-5: ClipLoss's float32 LSE − Z_pos cancels on small losses (ours uses softplus)
        _check(failures, name + " ClipLoss loss", lambda: assert_close_rel(loss, ref_loss, 2e-5, "loss vs ClipLoss"))
        _check(failures, name + " ClipLoss dimg", lambda: assert_close_rel(gv, rv, 2e-5, "d image vs ClipLoss"))
        _check(failures, name + " ClipLoss dtxt", lambda: assert_close_rel(gt, rt, 2e-5, "d text vs ClipLoss"))
        _check(failures, name + " ClipLoss ds", lambda: assert_close_rel(gs, rs, 2e-5, "d logit_scale vs ClipLoss"))


def _loss_checks(rank, world, failures, equal, unequal):
    seed = 100 * world
    for backend in _backends():
        for mode in MODES:
            seed += 1
            _run_case(
                rank,
                world,
                failures,
                sizes=equal,
                mode=mode,
                backend=backend,
                gamma=0.0,
                eps=0.0,
                normalize=False,
                layout="contig",
                seed=seed,
                with_clip=True,
            )
            _run_case(
                rank,
                world,
                failures,
                sizes=equal,
                mode=mode,
                backend=backend,
                gamma=0.0,
                eps=0.0,
                normalize=False,
                layout="strided",
                seed=seed + 1000,
                with_clip=True,
            )
            _run_case(
                rank,
                world,
                failures,
                sizes=equal,
                mode=mode,
                backend=backend,
                gamma=0.5,
                eps=0.1,
                normalize=True,
                layout="strided",
                seed=seed + 2000,
            )
            _run_case(
                rank,
                world,
                failures,
                sizes=unequal,
                mode=mode,
                backend=backend,
                gamma=0.5,
                eps=0.0,
                normalize=False,
                layout="colmajor",
                seed=seed + 3000,
            )
            _run_case(
                rank,
                world,
                failures,
                sizes=unequal,
                mode=mode,
                backend=backend,
                gamma=0.5,
                eps=0.1,
                normalize=True,
                layout="contig",
                seed=seed + 4000,
                threshold=0.99,
            )


def _both_autograd_gathers(fn):
    """Run ``fn`` with each differentiable all_gather the package may use."""
    import warnings

    import hnclip_kernels.distributed.gather as hd

    saved = hd.AUTOGRAD_GATHER
    impls = (["functional"] if hd._fc_all_gather is not None else []) + ["nn"]
    try:
        for impl in impls:
            hd.AUTOGRAD_GATHER = impl
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.distributed.nn's deprecation
                fn(impl)
    finally:
        hd.AUTOGRAD_GATHER = saved


def _gather_checks(rank, world, failures, sizes):
    _both_autograd_gathers(lambda impl: _gather_checks_one(rank, world, failures, sizes, impl))
    _both_autograd_gathers(
        lambda impl: [
            _run_case(
                rank,
                world,
                failures,
                sizes=sizes,
                mode=mode,
                backend="torch",
                gamma=0.5,
                eps=0.0,
                normalize=True,
                layout="strided",
                seed=7 + world,
                tag=impl,
            )
            for mode in MODES
            if mode[1]
        ]
    )


def _gather_checks_one(rank, world, failures, sizes, impl):
    """gather_features: rank order, stripping, gradient routing with unequal sizes."""
    off = sum(sizes[:rank])
    full = torch.arange(sum(sizes) * 3, dtype=torch.float32).reshape(-1, 3)
    for local_loss, with_grad in MODES:
        x = full[off : off + sizes[rank]].clone().requires_grad_()
        y = (2 * full[off : off + sizes[rank]]).clone().requires_grad_()
        gx, gy = gather_features(x, y, local_loss, with_grad, rank, world)
        name = f"gather_features(local_loss={local_loss}, with_grad={with_grad}, {impl})"
        _check(failures, name + " values", torch.testing.assert_close, gx.detach(), full)
        _check(failures, name + " values txt", torch.testing.assert_close, gy.detach(), 2 * full)
        if with_grad or not local_loss:
            # every rank weights rows by (1 + rank) · (row index + 1): owners get Σ over ranks
            (gx * (1.0 + rank) * torch.arange(1.0, gx.shape[0] + 1)[:, None]).sum().backward()
            factor = sum(1.0 + r for r in range(world)) if with_grad else 1.0 + rank
            want = factor * torch.arange(off + 1.0, off + sizes[rank] + 1)[:, None].expand(-1, 3)
            _check(failures, name + " grad", torch.testing.assert_close, x.grad, want)
        else:
            _check(failures, name + " no grad", _assert, not gx.requires_grad, "gathered has grad")


def _assert(cond, msg):
    assert cond, msg


def _expect_error_everywhere(rank, failures, name, call, exc_types=(ValueError,)):
    try:
        call()
    except exc_types as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        failures.append(f"{name}: raised {type(exc).__name__} instead of {exc_types}: {exc}")
        return None
    failures.append(f"{name}: rank {rank} did not raise")
    return None


def _error_checks(rank, world, failures):
    """Invalid or inconsistent input on one rank raises on every rank; the group stays usable."""
    s = torch.tensor(S0)
    base = F.normalize(torch.randn(3, 8), dim=1)

    def loss(img, txt, scale=s, **kw):
        return HNClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world, backend="torch", **kw)(
            img, txt, scale
        )

    d_bad = F.normalize(torch.randn(3, 10), dim=1) if rank == 1 else base
    msg = _expect_error_everywhere(rank, failures, "feature dim mismatch", lambda: loss(d_bad, d_bad))
    if msg is not None and "feature dims differ" not in msg:
        failures.append(f"feature dim mismatch: unclear message {msg!r}")
    shape_bad = base[:2] if rank == world - 1 else base
    _expect_error_everywhere(rank, failures, "img/txt shape mismatch", lambda: loss(shape_bad, base))
    empty = base[:0] if rank == 0 else base
    _expect_error_everywhere(rank, failures, "empty local batch", lambda: loss(empty, empty))
    nan_scale = torch.tensor(float("nan")) if rank == 1 else s
    _expect_error_everywhere(rank, failures, "nan logit_scale", lambda: loss(base, base, nan_scale))
    # every loss option that differs on one rank raises the same error on every rank
    differing = {
        "gamma differs": lambda: loss(base, base, gamma=0.3 if rank == 0 else 0.5),
        "label_smoothing differs": lambda: loss(base, base, label_smoothing=0.1 if rank == 1 else 0.0),
        "normalize differs": lambda: loss(base, base, normalize=rank == world - 1),
        "false_negative_threshold differs": lambda: loss(
            base, base, false_negative_threshold=0.9 if rank == 1 else None
        ),
        "local_loss differs": lambda: HNClipLoss(
            local_loss=rank != 0, gather_with_grad=True, rank=rank, world_size=world, backend="torch"
        )(base, base, s),
        "gather_with_grad differs": lambda: HNClipLoss(
            local_loss=True, gather_with_grad=rank != 0, rank=rank, world_size=world, backend="torch"
        )(base, base, s),
        # the precision is compared even where the backend ignores it: the ranks asked for different losses
        "precision differs": lambda: loss(base, base, precision="ieee" if rank == 1 else None),
    }
    for name, call in differing.items():
        msg = _expect_error_everywhere(rank, failures, name, call)
        if msg is not None and "differ across ranks" not in msg:
            failures.append(f"{name}: unclear message {msg!r}")
    # the τ overflow bound counts γ: (1 + γ)/τ = 1e40 overflows float32 where 1/τ = 1e37 does not
    huge_scale = torch.tensor(1e37) if rank == 1 else s
    msg = _expect_error_everywhere(
        rank, failures, "(1 + gamma) / tau overflows", lambda: loss(base, base, huge_scale, gamma=1e3)
    )
    want = "overflow" if rank == 1 else "invalid input on another rank"
    if msg is not None and want not in msg:
        failures.append(f"(1 + gamma) / tau overflows: rank {rank} expected {want!r} in {msg!r}")
    # normalize=False: one rank's features of norm 1e19 overflow the global batch's logits (the
    # other ranks' rows meet them through the gather): the metadata carries the norms, all raise
    big = base * 1e19 if rank == 1 else base
    msg = _expect_error_everywhere(rank, failures, "global logits overflow", lambda: loss(big, big))
    if msg is not None and "global batch" not in msg:
        failures.append(f"global logits overflow: unclear message {msg!r}")
    dt_bad = base.double() if rank == 1 else base
    _expect_error_everywhere(rank, failures, "dtype differs", lambda: loss(dt_bad, dt_bad))
    _expect_error_everywhere(
        rank,
        failures,
        "wrong rank argument",
        lambda: HNClipLoss(local_loss=True, rank=(rank + 1) % world, world_size=world, backend="torch")(base, base, s),
    )
    # still in sync afterwards: a valid call works
    val = loss(base, base)
    _check(failures, "usable after errors", lambda: _assert(torch.isfinite(val).item(), "non-finite"))


def _ddp_open_clip_step(rank, world, failures, info):
    """One DDP (gloo) step of a small random-init open_clip CLIP with HNClipLoss, unequal batches."""
    import open_clip
    from torch.nn.parallel import DistributedDataParallel as DDP

    sizes = [3, 2] if world == 2 else [2, 3, 1][:world]
    n_total, off = sum(sizes), sum(sizes[:rank])
    torch.manual_seed(0)
    model = open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=32,
        vision_cfg=dict(image_size=32, patch_size=8, width=32, head_width=16, layers=2, mlp_ratio=2.0),
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2, mlp_ratio=2.0),
    )
    single = copy.deepcopy(model)
    ddp = DDP(model)
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=16)
    words = ["cat", "dog", "red car", "small boat", "tall tree", "blue bird", "old house"]
    captions = [f"a photo of a {words[i % len(words)]}" for i in range(n_total)]
    texts = tokenizer(captions)
    images = torch.randn(n_total, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    sl = slice(off, off + sizes[rank])

    loss_fn = HNClipLoss(
        local_loss=True, gather_with_grad=True, rank=rank, world_size=world, gamma=0.5, backend="torch"
    )
    img_f, txt_f, scale = ddp(images[sl], texts[sl])
    loss = loss_fn(img_f, txt_f, scale)
    loss.backward()  # DDP averages the gradients over ranks

    ref_img, ref_txt, ref_scale = single(images, texts)
    ref_loss = HNClipLoss(gamma=0.5, backend="torch")(ref_img, ref_txt, ref_scale)
    ref_loss.backward()

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    _check(failures, "ddp mean loss", lambda: assert_close_rel(mean_loss, ref_loss, 1e-5, "mean loss"))
    worst = 0.0
    for (name, p), p_ref in zip(ddp.module.named_parameters(), single.parameters()):
        if p_ref.grad is None or p_ref.grad.abs().max() == 0:
            continue
        _check(failures, f"ddp grad {name}", assert_close_rel, p.grad, p_ref.grad, 1e-4, f"grad {name}")
        worst = max(worst, (p.grad - p_ref.grad).norm().item() / p_ref.grad.norm().item())
    info["worst_grad_rel_err"] = worst

    before = torch.cat([p.detach().reshape(-1).clone() for p in ddp.module.parameters()])
    torch.optim.SGD(ddp.parameters(), lr=0.5).step()
    torch.optim.SGD(single.parameters(), lr=0.5).step()
    after = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    all_after = [torch.empty_like(after) for _ in range(world)]
    dist.all_gather(all_after, after)
    _check(failures, "params changed", lambda: _assert(not torch.equal(before, after), "no update"))
    _check(
        failures,
        "params identical on all ranks",
        lambda: _assert(all(torch.equal(a, all_after[0]) for a in all_after), "ranks diverged"),
    )
    single_after = torch.cat([p.detach().reshape(-1) for p in single.parameters()])
    _check(
        failures,
        "params = single-process step",
        lambda: assert_close_rel(after - before, single_after - before, 1e-4, "update"),
    )


# ----------------------------------------------------------------------------- workers


def _worker_two(rank, world, failures, info):
    t0 = time.monotonic()
    _loss_checks(rank, world, failures, equal=[3, 3], unequal=[2, 5])
    _gather_checks(rank, world, failures, sizes=[2, 5])
    info["loss_checks_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    _ddp_open_clip_step(rank, world, failures, info)
    info["ddp_s"] = time.monotonic() - t0


def _worker_thresholds(rank, world, failures, info):
    """Two thresholds, 0.9 and 0.95 (both set: the values differ, not whether one is set), raise
    the consensus error on every rank; a rank that trained on would mask other pairs than its peers."""
    base = F.normalize(torch.randn(3, 8), dim=1)
    for backend in ("torch", "cpp") if cpp_directional() is not None else ("torch",):
        loss = HNClipLoss(
            local_loss=True,
            gather_with_grad=True,
            rank=rank,
            world_size=world,
            backend=backend,
            false_negative_threshold=0.9 if rank == 0 else 0.95,
        )
        msg = _expect_error_everywhere(
            rank, failures, f"{backend}: thresholds 0.9 / 0.95", lambda loss=loss: loss(base, base, torch.tensor(S0))
        )
        if msg is not None and "false_negative_threshold values differ across ranks: [0.9, 0.95]" not in msg:
            failures.append(f"{backend}: thresholds 0.9 / 0.95: unclear message {msg!r}")


def _worker_three(rank, world, failures, info):
    t0 = time.monotonic()
    _loss_checks(rank, world, failures, equal=[2, 2, 2], unequal=[3, 1, 2])
    _gather_checks(rank, world, failures, sizes=[1, 3, 2])
    _error_checks(rank, world, failures)
    info["loss_checks_s"] = time.monotonic() - t0


# ----------------------------------------------------------------------------- tests


def test_two_ranks_truth_clip_loss_and_open_clip_ddp_step(tmp_path):
    _spawn(2, "_worker_two", tmp_path)


def test_three_ranks_truth_clip_loss_unequal_and_errors(tmp_path):
    _spawn(3, "_worker_three", tmp_path)


def test_two_ranks_with_different_thresholds_raise_on_every_rank(tmp_path):
    _spawn(2, "_worker_thresholds", tmp_path, timeout=90.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_single_process_equals_clip_loss_and_hn_clip_loss(backend, mode):
    from open_clip.loss import ClipLoss

    V, T = _global_data([5], 8, 7, normalize=False)
    for gamma in (0.0, 0.5):
        v, t = V.clone().requires_grad_(), T.clone().requires_grad_()
        s = torch.tensor(S0, requires_grad=True)
        loss = HNClipLoss(local_loss=mode[0], gather_with_grad=mode[1], gamma=gamma, backend=backend)(v, t, s)
        got = torch.autograd.grad(loss, [v, t, s])
        v2, t2 = V.clone().requires_grad_(), T.clone().requires_grad_()
        s2 = torch.tensor(S0, requires_grad=True)
        if gamma == 0.0:
            ref = ClipLoss(local_loss=mode[0], gather_with_grad=mode[1])(v2, t2, s2)
        else:
            ref = hn_clip_loss_f64(v2, t2, 1 / s2, gamma=gamma, normalize=False)
        want = torch.autograd.grad(ref, [v2, t2, s2])
        assert_close_rel(loss, ref, 2e-6, "loss")
        for a, b, what in zip(got, want, ("d image", "d text", "d logit_scale")):
            assert_close_rel(a, b, 5e-5, what)


def test_output_dict_and_argument_errors():
    v = F.normalize(torch.randn(4, 8), dim=1)
    out = HNClipLoss(backend="torch")(v, v, torch.tensor(10.0), output_dict=True)
    assert set(out) == {"contrastive_loss"} and out["contrastive_loss"].dim() == 0
    float_scale = HNClipLoss(backend="torch")(v, v, 10.0)
    torch.testing.assert_close(float_scale, out["contrastive_loss"])
    with pytest.raises(ValueError, match="horovod"):
        HNClipLoss(use_horovod=True)
    with pytest.raises(ValueError, match="logit_bias"):
        HNClipLoss(backend="torch")(v, v, torch.tensor(10.0), logit_bias=torch.tensor(-10.0))
    with pytest.raises(ValueError, match="rank"):
        HNClipLoss(rank=2, world_size=2)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="not initialised"):
            HNClipLoss(rank=0, world_size=2, backend="torch")(v, v, torch.tensor(10.0))
    with pytest.raises(ValueError, match="tau"):
        HNClipLoss(backend="torch")(v, v, torch.tensor(-1.0))
    assert hnclip_kernels.HNClipLoss is HNClipLoss and "gather_features" in hnclip_kernels.__all__
