"""The loss composes with the rest of PyTorch on every backend: torch.func, torch.compile, autocast.

Each test is parametrised over the backends, so a new backend is one line in
``cases.ALL_BACKENDS``. Truths are float64 autograd of the formula (``helpers.hn_clip_loss_f64``)
or the same backend called eagerly; tolerances are relative norms.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

from cases import ALL_BACKENDS, make_pair, masked_case
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss

F32_GRAD = 2e-5  # float32 gradients against float64 (measured ≤ 1e-6 at these sizes)


def _leaves(n=12, d=16, seed=0):
    img, txt = make_pair(n, d, seed=seed)
    return img, txt, torch.tensor(0.07)


# ---- torch.func --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_grad_matches_autograd(backend):
    # torch.func.grad goes through every backend's autograd (cpp's register_autograd, triton's Functions)
    img, txt, tau = _leaves()

    def loss(a, b, t):
        return hn_clip_loss(a, b, t, gamma=0.5, label_smoothing=0.1, backend=backend)

    got = torch.func.grad(loss, argnums=(0, 1, 2))(img, txt, tau)
    leaves = [x.clone().requires_grad_() for x in (img, txt, tau)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    truth = torch.autograd.grad(hn_clip_loss_f64(*[x.double() for x in leaves], 0.5, 0.1), leaves)
    for name, g, w, t in zip(("img", "txt", "tau"), got, want, truth):
        assert_close_rel(g, w, 1e-6, f"torch.func.grad d{name} vs autograd")
        assert_close_rel(g, t, F32_GRAD, f"torch.func.grad d{name} vs float64")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_vmap_over_batches(backend):
    # a stack of B independent batches: vmap must equal a Python loop over them
    stack_img = torch.stack([make_pair(9, 8, seed=s)[0] for s in range(3)])
    stack_txt = torch.stack([make_pair(9, 8, seed=s)[1] for s in range(3)])

    def loss(a, b):
        return hn_clip_loss(a, b, 0.05, gamma=0.5, backend=backend)

    got = torch.func.vmap(loss)(stack_img, stack_txt)
    want = torch.stack([loss(a, b) for a, b in zip(stack_img, stack_txt)])
    assert_close_rel(got, want, 1e-6, "vmap vs loop")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_vmap_over_a_batch_of_temperatures(backend):
    # the τ check reads each entry of a vmapped τ (never .item() on the batched tensor, which vmap refuses)
    stack_img = torch.stack([make_pair(6, 4, seed=20 + s)[0] for s in range(3)])
    stack_txt = torch.stack([make_pair(6, 4, seed=20 + s)[1] for s in range(3)])
    taus = torch.tensor([0.05, 0.07, 0.1])

    def loss(a, b, t):
        return hn_clip_loss(a, b, t, gamma=0.5, backend=backend)

    got = torch.func.vmap(loss)(stack_img, stack_txt, taus)
    want = torch.stack([loss(a, b, t) for a, b, t in zip(stack_img, stack_txt, taus)])
    assert_close_rel(got, want, 1e-6, "vmap over (img, txt, tau)")
    with pytest.raises(ValueError, match="tau"):
        torch.func.vmap(loss)(stack_img, stack_txt, torch.tensor([0.05, -1.0, 0.1]))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_vmap_of_grad(backend):
    # per-batch gradients in one call (the functorch pattern of per-example gradients and ensembles)
    stack_img = torch.stack([make_pair(7, 8, seed=10 + s)[0] for s in range(2)])
    stack_txt = torch.stack([make_pair(7, 8, seed=10 + s)[1] for s in range(2)])

    def loss(a, b):
        return hn_clip_loss(a, b, 0.05, gamma=0.5, backend=backend)

    got = torch.func.vmap(torch.func.grad(loss))(stack_img, stack_txt)
    for i in range(2):
        a = stack_img[i].clone().requires_grad_()
        (want,) = torch.autograd.grad(loss(a, stack_txt[i]), [a])
        assert_close_rel(got[i], want, 1e-6, f"vmap(grad) batch {i}")


# ---- torch.compile with a temperature schedule -------------------------------------------------
# (tau, gamma, label_smoothing) at step k of a 12-step schedule: τ and γ, then γ and ε
SCHEDULES = {
    "tau_gamma": lambda k: (0.07 * (1.0 - k / 24), 0.5 + 0.05 * k, 0.0),
    "gamma_eps": lambda k: (0.05, 0.5 + 0.05 * k, 0.02 + 0.03 * k),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_compile_schedule_compiles_at_most_twice(backend, schedule):
    # τ, γ and ε reach the ops without a guard on their values (γ and ε as tensors on both fused
    # backends): a 12-step schedule compiles at most twice. aot_eager runs the pass that
    # specialises any non-arithmetic use of a float: a backend that returns gm.forward would hide
    # such recompiles
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(
        lambda a, b, t, g, e: hn_clip_loss(a, b, t, gamma=g, label_smoothing=e, backend=backend),
        fullgraph=True,
        backend=counter,
    )
    img, txt = make_pair(10, 8, seed=3)
    for step in range(12):
        tau, gamma, eps = SCHEDULES[schedule](step)
        a, b = img.clone().requires_grad_(), txt.clone().requires_grad_()
        got = fn(a, b, tau, gamma, eps)
        got.backward()
        a2, b2 = img.clone().requires_grad_(), txt.clone().requires_grad_()
        want = hn_clip_loss(a2, b2, tau, gamma=gamma, label_smoothing=eps, backend=backend)
        want.backward()
        assert_close_rel(got, want, 1e-6, f"compiled loss, step {step}")
        assert_close_rel(a.grad, a2.grad, 1e-6, f"compiled d img, step {step}")
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs compiled over a 12-step {schedule} schedule"


# ---- autocast around the backward --------------------------------------------------------------
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_backward_inside_autocast_keeps_float32_accuracy(backend):
    # the backward's matmuls run in float32 under a bf16 autocast (bf16 would give d img errors ~3e-3)
    img, txt, tau = _leaves(n=64, d=32, seed=4)
    leaves = [x.clone().requires_grad_() for x in (img, txt, tau)]
    truth = torch.autograd.grad(hn_clip_loss_f64(*[x.double() for x in leaves], 0.5), leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = hn_clip_loss(*leaves, gamma=0.5, backend=backend)
        loss.backward()
    for name, x, t in zip(("img", "txt", "tau"), leaves, truth):
        assert x.grad.dtype == torch.float32
        assert_close_rel(x.grad, t, F32_GRAD, f"d{name} with backward() under autocast")


def test_compiled_backward_inside_autocast_keeps_float32_accuracy():
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: hn_clip_loss(a, b, 0.05, backend="torch"), backend="aot_eager")
    img, txt, _ = _leaves(n=32, d=16, seed=5)
    a = img.clone().requires_grad_()
    (truth,) = torch.autograd.grad(hn_clip_loss_f64(a.double(), txt.double(), 0.05), [a])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn(a, txt).backward()
    assert_close_rel(a.grad, truth, F32_GRAD, "compiled d img with backward() under autocast")


def test_second_derivative_inside_autocast_keeps_float32_accuracy():
    # the torch backend's backward is itself differentiable: a gradient penalty under autocast
    img, txt, _ = _leaves(n=16, d=8, seed=6)
    a = img.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (g,) = torch.autograd.grad(hn_clip_loss(a, txt, 0.1, backend="torch"), [a], create_graph=True)
        (got,) = torch.autograd.grad(g.pow(2).sum(), [a])
    a64 = img.double().requires_grad_()
    (g64,) = torch.autograd.grad(hn_clip_loss_f64(a64, txt.double(), 0.1), [a64], create_graph=True)
    (want,) = torch.autograd.grad(g64.pow(2).sum(), [a64])
    assert_close_rel(got, want, 1e-4, "gradient penalty's gradient under autocast")


# ---- one answer whatever the backend -----------------------------------------------------------
FMAX32 = torch.finfo(torch.float32).max


def _opposite_pair():
    """Three pairs whose second image points away from its caption: the gap (2 + γ)/τ is reached."""
    return torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tau_whose_opposite_pair_gap_overflows_raises(backend):
    # the check bounds the gaps by (2 + γ)/τ: a τ with (1 + γ)/τ < fmax < (2 + γ)/τ raises, no inf or NaN
    gamma = 0.5
    tau = (1.0 + gamma) / FMAX32 * 1.2
    img, txt = _opposite_pair()
    with pytest.raises(ValueError, match=r"\(2 \+ gamma\) / tau"):
        hn_clip_loss(img, txt, tau, gamma=gamma, backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tau_just_inside_the_bound_is_finite_and_exact(backend):
    gamma = 0.5
    tau = (2.0 + gamma) / FMAX32 * 4.0
    img, txt = _opposite_pair()
    got = hn_clip_loss(img, txt, tau, gamma=gamma, backend=backend, reduction="none")
    assert torch.isfinite(got).all()
    assert_close_rel(got, hn_clip_loss_f64(img, txt, tau, gamma, reduction="none"), 1e-6, "loss near the bound")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_label_smoothing_bound_counts_the_columns(backend):
    # label smoothing sums N gaps per row: the bound is N (2 + γ)/τ
    img, txt = make_pair(8, 4, seed=7)
    tau = 8 * 2.5 / FMAX32 * 0.5
    with pytest.raises(ValueError, match="label smoothing"):
        hn_clip_loss(img, txt, tau, gamma=0.5, label_smoothing=0.1, backend=backend, reduction="none")
    # without smoothing the per-pair losses are fine (a mean would add up 8 of them: that raises too)
    assert torch.isfinite(hn_clip_loss(img, txt, tau, gamma=0.5, backend=backend, reduction="none")).all()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_unnormalized_features_that_overflow_raise(backend):
    # finite features of norm 1e20 with normalize=False raise instead of giving NaN
    img, txt = make_pair(4, 3, seed=8)
    with pytest.raises(ValueError, match="normalize=True"):
        hn_clip_loss(img * 1e20, txt * 1e20, 0.1, backend=backend, normalize=False)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_unnormalized_large_features_agree_with_float64(backend):
    img, txt = make_pair(6, 5, seed=9)
    img, txt = img * 1e3, txt * 3e2  # logits ~ 1e6: finite, far from normalised
    got = hn_clip_loss(img, txt, 0.5, gamma=0.5, backend=backend, normalize=False, reduction="none")
    assert_close_rel(
        got, hn_clip_loss_f64(img, txt, 0.5, 0.5, normalize=False, reduction="none"), 1e-5, "unnormalised loss"
    )


def test_hn_clip_loss_module_normalize_false_overflow_raises():
    from hnclip_kernels import HNClipLoss

    img, txt = make_pair(4, 3, seed=8)
    with pytest.raises(ValueError, match="normalize=True"):
        HNClipLoss()(img * 1e20, txt * 1e20, torch.tensor(10.0))


def _edge_cases():
    """Inputs where backends are most likely to part ways: one pair, D = 2, zero rows,
    antiparallel pairs, a non-contiguous view, label smoothing, γ = 0."""
    one = make_pair(1, 4, seed=1)
    d2 = make_pair(5, 2, seed=2)  # D = 1 has a zero true feature gradient: only round-off to compare
    zero_row = [x.clone() for x in make_pair(6, 4, seed=3)]
    zero_row[0][2].zero_()
    anti = make_pair(5, 3, seed=4)
    anti = (anti[0], -anti[0])
    base = make_pair(7, 10, seed=5)
    strided = (base[0][:, ::2], base[1][:, 1::2])
    return [
        ("one-pair", one, dict(gamma=0.5)),
        ("d=2", d2, dict(gamma=0.5, label_smoothing=0.1)),
        ("zero-row", tuple(zero_row), dict(gamma=0.5)),
        ("antiparallel", anti, dict(gamma=2.0)),
        ("strided", strided, dict(gamma=0.0, label_smoothing=0.2)),
    ]


@pytest.mark.parametrize("name,pair,options", _edge_cases(), ids=[c[0] for c in _edge_cases()])
def test_every_backend_gives_the_same_answer(name, pair, options):
    results = {}
    for backend in ALL_BACKENDS:
        leaves = [x.clone().requires_grad_() for x in (*pair, torch.tensor(0.05))]
        loss = hn_clip_loss(*leaves, backend=backend, reduction="none", **options)
        loss.backward(torch.linspace(0.5, 1.5, loss.numel()))
        results[backend] = (loss.detach(), *[x.grad for x in leaves])
    leaves = [x.double().requires_grad_() for x in (*pair, torch.tensor(0.05))]
    truth_loss = hn_clip_loss_f64(
        *leaves, options.get("gamma", 0.5), options.get("label_smoothing", 0.0), reduction="none"
    )
    truth_loss.backward(torch.linspace(0.5, 1.5, truth_loss.numel(), dtype=torch.float64))
    truth = (truth_loss.detach(), *[x.grad for x in leaves])
    for backend, got in results.items():
        for what, g, t in zip(("loss", "d img", "d txt", "d tau"), got, truth):
            assert math.isfinite(g.double().norm().item()), f"{backend} {what} not finite"
            assert_close_rel(g, t, F32_GRAD, f"{name}: {backend} {what}")


def test_func_hessian_on_the_torch_backend():
    # forward-mode over reverse-mode (jacfwd(jacrev)) goes through the float32-safe matmul's jvp
    img, txt = make_pair(5, 4, dtype=torch.float64, seed=11)

    def loss(a):
        return hn_clip_loss(a, txt, 0.1, gamma=0.5, backend="torch")

    got = torch.func.hessian(loss)(img)
    want = torch.autograd.functional.hessian(lambda a: hn_clip_loss_f64(a, txt, 0.1, 0.5), img)
    assert_close_rel(got, want, 1e-10, "torch.func.hessian")


# ---- one code path ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_single_process_is_the_fused_symmetric_op(backend, dtype):
    # HNClipLoss in one process is hn_clip_loss's path bit for bit: one fused symmetric op (not the
    # directional op twice) with the same bf16 upcast
    from hnclip_kernels import HNClipLoss

    img, txt = make_pair(20, 12, dtype=dtype, seed=12)
    scale = torch.tensor(1 / 0.05)
    results = []
    for call in (
        lambda a, b, s: HNClipLoss(gamma=0.5, backend=backend)(a, b, s),
        lambda a, b, s: HNClipLoss(local_loss=True, gather_with_grad=True, gamma=0.5, backend=backend)(a, b, s),
        lambda a, b, s: hn_clip_loss(a, b, s.reciprocal(), gamma=0.5, backend=backend, normalize=False),
    ):
        leaves = [x.clone().requires_grad_() for x in (img, txt, scale)]
        loss = call(*leaves)
        loss.backward()
        results.append((loss.detach(), *[x.grad for x in leaves]))
    for other in results[:2]:
        for what, got, want in zip(("loss", "d img", "d txt", "d logit_scale"), other, results[2]):
            assert torch.equal(got, want), f"{what}: HNClipLoss differs from hn_clip_loss"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_directional_protocol_is_keyword_only(backend):
    # only q and k are positional: a and b swapped in a positional call cannot go unnoticed
    from hnclip_kernels.backends import directional_fn

    fn = directional_fn(backend)
    q, k = make_pair(4, 3, seed=13)
    with pytest.raises(TypeError):
        fn(q, k, k, k, torch.tensor(0.1), 0, 0.5, 0.0, True)
    rows = fn(
        q, k, query_txt=k, key_txt=k, tau=torch.tensor(0.1), offset=0, gamma=0.5, label_smoothing=0.0, normalize=True
    )
    assert rows.shape == (4,)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_torch_export_matches_eager(backend):
    class Loss(torch.nn.Module):
        def forward(self, a, b):
            return hn_clip_loss(a, b, 0.07, gamma=0.5, backend=backend)

    img, txt = make_pair(8, 4, seed=14)
    exported = torch.export.export(Loss(), (img, txt))
    assert_close_rel(exported.module()(img, txt), Loss()(img, txt), 1e-6, "exported loss")


# ---- hostile inputs: each raises or gives the right answer ---------------------------------------
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mean_of_huge_rows_overflow_raises(backend):
    # the check counts the pair sum and the mean's sum of N rows, not only each row's gap: finite
    # features (norms 1.1e19, normalize=False) whose mean overflows raise instead of giving inf
    u = torch.nn.functional.normalize(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    w = torch.nn.functional.normalize(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), dim=1)
    with pytest.raises(ValueError, match="normalize=True"):
        hn_clip_loss(u * 1.1e19, w * 1.1e19, 1.0, gamma=0.0, normalize=False, backend=backend)
    img, txt = make_pair(8, 4, seed=15)
    with pytest.raises(ValueError, match="overflow"):
        hn_clip_loss(img, txt, 1.05 * 2.5 / FMAX32, reduction="none", backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_unnormalized_margin_product_overflow_raises(backend):
    # the check bounds the raw t·tᵀ product before γ scales it: an overflowing product raises
    v, t = make_pair(8, 4, seed=16)
    v, t = torch.nn.functional.normalize(v, dim=1), torch.nn.functional.normalize(t, dim=1) * 2e19
    with pytest.raises(ValueError, match="normalize=True"):
        hn_clip_loss(v, t, 1.0, gamma=0.01, normalize=False, backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_vmap_with_normalize_false(backend):
    # under vmap the range check runs on each unbatched entry (batched τ included) and raises where
    # eager raises, instead of reading a batched tensor's data or skipping the check
    stack_img = torch.stack([make_pair(6, 4, seed=30 + s)[0] for s in range(2)])
    stack_txt = torch.stack([make_pair(6, 4, seed=30 + s)[1] for s in range(2)])

    def loss(a, b, t):
        return hn_clip_loss(a, b, t, normalize=False, backend=backend)

    got = torch.func.vmap(loss, in_dims=(0, 0, None))(stack_img, stack_txt, torch.tensor(0.07))
    want = torch.stack([loss(a, b, torch.tensor(0.07)) for a, b in zip(stack_img, stack_txt)])
    assert_close_rel(got, want, 1e-6, "vmap with normalize=False")
    with pytest.raises(ValueError, match="normalize=True"):
        torch.func.vmap(loss)(stack_img * 1e19, stack_txt * 1e19, torch.tensor([0.05, 0.1]))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize(
    "m,offset,exc", [(1, 10, ValueError), (2, 9, ValueError), (2, -1, ValueError), (1, 2.0, TypeError)]
)
def test_directional_offset_is_checked(backend, m, offset, exc):
    # every backend checks offset before launching: offset + M > N, a negative offset and a float
    # offset raise a clear error (no out-of-bounds read, no wrap-around to the last column)
    from hnclip_kernels.backends import directional_fn

    keys, key_txt = make_pair(10, 6, seed=17)
    queries, query_txt = make_pair(m, 6, seed=18)
    with pytest.raises(exc, match="offset"):
        directional_fn(backend)(
            queries,
            keys,
            query_txt=query_txt,
            key_txt=key_txt,
            tau=torch.tensor(0.07),
            offset=offset,
            gamma=0.5,
            label_smoothing=0.0,
            normalize=True,
        )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_rows_with_entries_beyond_float32_norm_range(backend):
    # row norms are taken in float64: a finite row with entries ~2e19 normalises to a unit row (its
    # float32 norm overflows), so the loss is 12.03, not log N with zero gradients (Triton: its
    # kernels' raw products overflowed, NaN, until its wrappers scaled such rows: params.tamed)
    img, txt = make_pair(8, 4, seed=19)
    img, txt = img * 2e19, txt * 2e19
    a = img.clone().requires_grad_()
    loss = hn_clip_loss(a, txt, 0.07, backend=backend)
    loss.backward()
    a64 = img.double().requires_grad_()
    truth = hn_clip_loss_f64(a64, txt.double(), 0.07)
    truth.backward()
    assert_close_rel(loss, truth, 1e-6, "loss with rows of norm 4e19")
    assert_close_rel(a.grad, a64.grad, F32_GRAD, "d img with rows of norm 4e19")


# ---- false-negative masking composes like the other options ----------------------------------------
def _masked_leaves():
    img, txt, threshold = masked_case("duplicates", 12, 16, dtype=torch.float32)
    return img, txt, torch.tensor(0.07), threshold


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_masked_func_grad_and_vmap(backend):
    # torch.func.grad through the masked loss equals autograd and float64; vmap equals a loop
    img, txt, tau, threshold = _masked_leaves()

    def loss(a, b, t):
        return hn_clip_loss(
            a, b, t, gamma=0.5, label_smoothing=0.1, backend=backend, false_negative_threshold=threshold
        )

    got = torch.func.grad(loss, argnums=(0, 1, 2))(img, txt, tau)
    leaves = [x.clone().requires_grad_() for x in (img, txt, tau)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    truth = torch.autograd.grad(
        hn_clip_loss_f64(*[x.double() for x in leaves], 0.5, 0.1, false_negative_threshold=threshold), leaves
    )
    for name, g, w, t in zip(("img", "txt", "tau"), got, want, truth):
        assert_close_rel(g, w, 1e-6, f"masked torch.func.grad d{name} vs autograd")
        assert_close_rel(g, t, F32_GRAD, f"masked torch.func.grad d{name} vs float64")
    stack = torch.stack([img, img.flip(0)]), torch.stack([txt, txt.flip(0)])
    batched = torch.func.vmap(lambda a, b: loss(a, b, tau))(*stack)
    assert_close_rel(batched, torch.stack([loss(a, b, tau) for a, b in zip(*stack)]), 1e-6, "masked vmap vs loop")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_masked_threshold_schedule_compiles_at_most_twice(backend):
    # the threshold reaches the ops as a tensor (like γ and ε): a changing threshold reuses the graph
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(
        lambda a, b, c: hn_clip_loss(a, b, 0.07, gamma=0.5, backend=backend, false_negative_threshold=c),
        fullgraph=True,
        backend=counter,
    )
    img, txt, _, _ = _masked_leaves()
    for step in range(6):
        threshold = 0.95 + 0.008 * step
        a, b = img.clone().requires_grad_(), txt.clone().requires_grad_()
        got = fn(a, b, threshold)
        got.backward()
        a2, b2 = img.clone().requires_grad_(), txt.clone().requires_grad_()
        want = hn_clip_loss(a2, b2, 0.07, gamma=0.5, backend=backend, false_negative_threshold=threshold)
        want.backward()
        assert_close_rel(got, want, 1e-6, f"compiled masked loss, step {step}")
        assert_close_rel(a.grad, a2.grad, 1e-6, f"compiled masked d img, step {step}")
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs compiled over a 6-step threshold schedule"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_masked_torch_export_matches_eager(backend):
    img, txt, _, threshold = _masked_leaves()

    class Loss(torch.nn.Module):
        def forward(self, a, b):
            return hn_clip_loss(a, b, 0.07, gamma=0.5, backend=backend, false_negative_threshold=threshold)

    exported = torch.export.export(Loss(), (img, txt))
    assert_close_rel(exported.module()(img, txt), Loss()(img, txt), 1e-6, "exported masked loss")
