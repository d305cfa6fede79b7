"""Checks every backend must pass, one parametrised test each over ALL_BACKENDS (tests/cases.py):
the covering matrix against float64, the saturated regime, the offset/rectangular directional op
(the keyword-only protocol of ``hnclip_kernels.backends.directional_fn``) and bitwise determinism.

A backend added to ALL_BACKENDS runs all of them. Backend-specific tests (thread counts, opcheck of
the C++ operators, Triton tiles and launches, gradcheck of a registered op) stay in test_cpp.py,
test_triton*.py and test_reference.py.
"""

import itertools

import pytest
import torch

from cases import (
    ALL_BACKENDS,
    DTYPES,
    GAMMAS,
    MASKED_KINDS,
    REDUCTIONS,
    SMOOTHINGS,
    TAUS,
    TOL_F32_GRAD,
    TOL_F32_LOSS,
    TOL_F32_LOSS_SATURATED,
    TOL_LOWP_LOSS,
    case_id,
    check_against_truth,
    covering_cases,
    directional_case,
    make_pair,
    masked_case,
    naive_clip_loss,
    saturated_pair,
)
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends import directional_fn
from hnclip_kernels.backends.pytorch.reference import directional_nll_torch

# Tolerances are the same for every backend (cases.py says where each comes from): a float32 loss
# within TOL_F32_LOSS of float64 and gradients within TOL_F32_GRAD; fp16/bf16 inputs accumulated in
# float32 within TOL_LOWP_LOSS, their gradients (rounded to the input dtype) within LOWP_GRAD; the
# saturated regime's loss within TOL_F32_LOSS_SATURATED (|d|·2⁻²⁴ per logit, measured per backend).
LOWP_GRAD = 1e-2

# Triton runs here in its CPU interpreter (seconds a call where torch and cpp take milliseconds), so
# where a check has more cases than the interpreter can afford, Triton runs the subset it always ran
# (``interpreted=`` below). A backend added to ALL_BACKENDS gets every case.
INTERPRETED = {"triton"}


def over_backends(cases, interpreted=None, ids=str):
    """pytest params (backend, case) for every backend: ``cases``, or ``interpreted`` for Triton."""
    params = []
    for backend in ALL_BACKENDS:
        chosen = interpreted if backend in INTERPRETED and interpreted is not None else cases
        params += [pytest.param(backend, case, id=f"{backend}-{ids(case)}") for case in chosen]
    return params


def _dash(case):
    return "-".join(map(str, case))


# ------------------------------------------------------------------ values and gradients vs float64


@pytest.mark.parametrize("backend,case", over_backends(covering_cases(), ids=case_id))
def test_matrix_against_float64(backend, case):
    # every (N, D) twice, with dtypes (fp32/fp16/bf16), γ, τ, ε and reduction rotated through
    n, d, dtype, gamma, tau, eps, reduction = case
    check_against_truth(backend, n, d, dtype, gamma, tau, eps, reduction, tau_grad=(n + d) % 2 == 0)


@pytest.mark.parametrize(
    "backend,case",
    over_backends(list(itertools.product(GAMMAS, TAUS, SMOOTHINGS, REDUCTIONS)), interpreted=[], ids=_dash),
)
def test_float32_every_option(backend, case):
    # every γ × τ × ε × reduction at one size, τ a tensor that receives its gradient
    gamma, tau, eps, reduction = case
    check_against_truth(backend, 23, 11, torch.float32, gamma, tau, eps, reduction)


@pytest.mark.parametrize(
    "backend,case",
    over_backends(
        [(n, d, dtype) for (n, d) in [(1, 3), (2, 8), (17, 64), (130, 100)] for dtype in DTYPES],
        interpreted=[],
        ids=lambda c: f"N{c[0]}-D{c[1]}-{str(c[2]).split('.')[-1]}",
    ),
)
def test_sizes_and_dtypes(backend, case):
    n, d, dtype = case
    check_against_truth(backend, n, d, dtype, 0.5, 0.07, 0.1, "mean")


# ------------------------------------------------------------------ saturated regime


def _check_saturated(backend, img, txt, gamma, reduction, upstream=None):
    truth = hn_clip_loss_f64(img.double(), txt.double(), 0.01, gamma, 0.0, reduction)
    assert 0 < truth.mean().item() < 1e-20
    loss = check_against_truth(
        backend,
        0,
        0,
        torch.float32,
        gamma,
        0.01,
        0.0,
        reduction,
        img=img,
        txt=txt,
        upstream=upstream,
        loss_tol=TOL_F32_LOSS_SATURATED,
    )
    assert (loss > 0).all()  # tiny, and never rounded to 0


def _noise_pair():
    # txt = img + small noise; a different weight per row (the fused backwards' recompute path)
    gen = torch.Generator().manual_seed(11)
    img = torch.randn(48, 128, generator=gen)
    txt = img + 0.02 * torch.randn(48, 128, generator=gen)
    return img, txt, torch.rand(48, generator=gen) + 0.5


SATURATED = [
    (pair, gamma) for pair in ("seed0", "seed1", "seed2", "seed3", "aligned0.9", "noise") for gamma in (0.0, 0.5)
]


@pytest.mark.parametrize("backend,case", over_backends(SATURATED, interpreted=SATURATED[:8], ids=_dash))
def test_saturated_regime(backend, case):
    # τ = 0.01, well-separated pairs: the true loss is < 1e-20 and a naive float32 cross-entropy
    # returns exactly 0 with a 100% wrong gradient
    pair, gamma = case
    if pair == "noise":
        img, txt, upstream = _noise_pair()
        _check_saturated(backend, img, txt, gamma, "none", upstream=upstream)
        _check_saturated(backend, img, txt, gamma, "sum")
        return
    if pair.startswith("seed"):
        img, txt = saturated_pair(int(pair[4:]))
    else:
        img, txt = make_pair(40, 64, torch.float32, seed=1, aligned=0.9)
    assert naive_clip_loss(img, txt, 0.01, gamma).item() == 0.0
    for reduction in ("mean", "none"):
        _check_saturated(backend, img, txt, gamma, reduction)


# ------------------------------------------------------------------ the directional op: offset / rectangular


def _directional(backend, q, k, a, b, tau, offset, weights, dtype, normalize):
    """Rows and (d q, d k, d tau) of ``backend``'s directional op on (q, k, a, b) cast to ``dtype``."""
    fn = directional_fn(backend) if dtype != torch.float64 else directional_nll_torch
    qq, kk = (x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k))
    t = torch.tensor(tau, dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
    rows = fn(
        qq,
        kk,
        query_txt=a.to(dtype),
        key_txt=b.to(dtype),
        tau=t,
        offset=offset,
        gamma=0.5,
        label_smoothing=0.1,
        normalize=normalize,
    )
    (rows * weights.to(rows.dtype)).sum().backward()
    return rows, qq.grad, kk.grad, t.grad


DIRECTIONAL = list(itertools.product(("i2t", "t2i", "general"), (True, False)))


@pytest.mark.parametrize("backend,case", over_backends(DIRECTIONAL, interpreted=[("general", True)], ids=_dash))
def test_offset_and_rectangular_directional(backend, case):
    # local rows vs global columns (M = 5 queries, N = 19 keys, positives at 7..11), as a rank of a
    # distributed job sees them; a different weight per row
    kind, normalize = case
    q, k, a, b = directional_case(kind)
    weights = torch.arange(1.0, 6.0, dtype=torch.float64)
    got = _directional(backend, q, k, a, b, 0.05, 7, weights, torch.float32, normalize)
    want = _directional(backend, q, k, a, b, 0.05, 7, weights, torch.float64, normalize)
    assert got[0].dtype == torch.float32
    for name, x, y in zip(("rows", "d q", "d k", "d tau"), got, want):
        assert_close_rel(x, y, TOL_F32_LOSS if name == "rows" else TOL_F32_GRAD, name)


@pytest.mark.parametrize(
    "backend,case",
    over_backends(
        list(itertools.product((torch.float16, torch.bfloat16), ("i2t", "t2i", "general"))),
        interpreted=[],
        ids=lambda c: f"{str(c[0]).split('.')[-1]}-{c[1]}",
    ),
)
def test_low_precision_directional(backend, case):
    # the op itself takes fp16/bf16 (hn_clip_loss upcasts first): accumulated in float32, float32
    # rows, gradients in the input dtype
    dtype, kind = case
    q, k, a, b = directional_case(kind, m=6, n=21, d=16, offset=9, dtype=dtype, seed=5)
    weights = torch.ones(6, dtype=torch.float64)
    got = _directional(backend, q, k, a, b, 0.07, 9, weights, dtype, True)
    want = _directional(backend, q, k, a, b, 0.07, 9, weights, torch.float64, True)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
    for name, x, y in zip(("rows", "d q", "d k", "d tau"), got, want):
        assert_close_rel(x, y, LOWP_GRAD if name in ("d q", "d k") else TOL_LOWP_LOSS, name)


# ------------------------------------------------------------------ false-negative masking vs float64

# (kind, N, D, dtype, γ, τ, ε, reduction): every kind of masked batch (tests/cases.py, masked_case),
# with and without the margin and label smoothing, 16-bit inputs, and N = 40 (several Triton tiles)
MASKED = [
    ("duplicates", 12, 16, torch.float32, 0.5, 0.07, 0.0, "mean"),
    ("duplicates", 12, 16, torch.float32, 0.0, 0.05, 0.1, "none"),
    ("duplicates", 40, 48, torch.float32, 2.0, 0.01, 0.1, "mean"),
    ("near", 12, 16, torch.float32, 0.5, 0.07, 0.1, "mean"),
    ("near", 40, 48, torch.bfloat16, 0.5, 0.1, 0.0, "sum"),
    ("all_masked", 12, 16, torch.float32, 0.5, 0.07, 0.1, "none"),
    ("all_masked", 12, 16, torch.float16, 2.0, 0.07, 0.0, "mean"),
    ("all_masked", 40, 48, torch.float32, 0.0, 0.2, 0.1, "sum"),
]
assert {case[0] for case in MASKED} == set(MASKED_KINDS)


def _masked_id(case):
    kind, n, d, dtype, gamma, tau, eps, reduction = case
    return f"{kind}-N{n}-{str(dtype).split('.')[-1]}-g{gamma}-tau{tau}-ls{eps}-{reduction}"


@pytest.mark.parametrize("backend,case", over_backends(MASKED, ids=_masked_id))
def test_masked_against_float64(backend, case):
    # false-negative masking: loss and every gradient (img, txt, τ) against the float64 formula with
    # the same mask; a non-uniform upstream for "none" (the fused backwards' per-row path)
    kind, n, d, dtype, gamma, tau, eps, reduction = case
    img, txt, threshold = masked_case(kind, n, d, dtype=dtype)
    upstream = (
        torch.rand(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
        if reduction == "none"
        else None
    )
    check_against_truth(
        backend, n, d, dtype, gamma, tau, eps, reduction, img=img, txt=txt, threshold=threshold, upstream=upstream
    )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_masked_row_without_negatives_has_no_loss_and_no_gradient(backend):
    # "all_masked": row 0's negatives are all masked in both directions, so its pair has only its
    # positive left: loss exactly 0 (no smoothing) and exactly no gradient from it
    img, txt, threshold = masked_case("all_masked", 12, 16, dtype=torch.float32)
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    rows = hn_clip_loss(*leaves, 0.07, gamma=0.5, reduction="none", backend=backend, false_negative_threshold=threshold)
    assert rows[0].item() == 0.0 and (rows[1:] > 0).all()
    rows[0].backward()
    assert leaves[0].grad.abs().max().item() == 0.0 and leaves[1].grad.abs().max().item() == 0.0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_masking_a_pair_equals_removing_it_from_both_softmaxes(backend):
    # with γ = 0 and no smoothing, masking every pair equals N single-pair batches (loss 0), and
    # a threshold above every cosine equals no masking at all, bit for bit on the same backend
    img, txt = make_pair(9, 8, torch.float32, seed=21)
    plain = hn_clip_loss(img, txt, 0.1, gamma=0.5, reduction="none", backend=backend)
    loose = hn_clip_loss(img, txt, 0.1, gamma=0.5, reduction="none", backend=backend, false_negative_threshold=1.0)
    assert_close_rel(loose, plain, 1e-6, "threshold 1 on distinct captions")
    everything = hn_clip_loss(
        img, txt, 0.1, gamma=0.0, reduction="none", backend=backend, false_negative_threshold=-0.999
    )
    assert torch.equal(everything, torch.zeros_like(everything))


@pytest.mark.parametrize(
    "backend,case",
    over_backends(
        list(itertools.product(("i2t", "t2i", "general"), (0.0, 0.1))),
        interpreted=[("i2t", 0.1), ("general", 0.0)],
        ids=_dash,
    ),
)
def test_masked_directional_offset_and_rectangular(backend, case):
    # a rank's directional op with masking (M = 5 local rows against N = 19 keys, offset 7): the
    # margin factors' cosines decide; against the op in float64 on the torch backend
    kind, eps = case
    q, k, a, b = directional_case(kind)
    b = b.clone()
    b[3] = a[1] if kind != "t2i" else b[3]  # a caption of another rank duplicates local row 1's
    b[15] = a[4] + 1e-3 * b[15]
    weights = torch.arange(1.0, 6.0, dtype=torch.float64)
    cos = torch.nn.functional.normalize(a.double(), dim=1) @ torch.nn.functional.normalize(b.double(), dim=1).T
    threshold = 0.95
    assert ((cos - threshold).abs() > 1e-3).all() and (cos >= threshold).sum() >= 2

    def run(dtype):
        fn = directional_fn(backend) if dtype != torch.float64 else directional_nll_torch
        qq, kk = (x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k))
        t = torch.tensor(0.05, dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
        rows = fn(
            qq,
            kk,
            query_txt=a.to(dtype),
            key_txt=b.to(dtype),
            tau=t,
            offset=7,
            gamma=0.5,
            label_smoothing=eps,
            normalize=True,
            false_negative_threshold=threshold,
        )
        (rows * weights.to(rows.dtype)).sum().backward()
        return rows, qq.grad, kk.grad, t.grad

    got, want = run(torch.float32), run(torch.float64)
    for name, x, y in zip(("rows", "d q", "d k", "d tau"), got, want):
        assert_close_rel(x, y, TOL_F32_LOSS if name == "rows" else TOL_F32_GRAD, name)


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize(
    "backend,case", over_backends([(600, 40, "mean"), (600, 40, "none")], interpreted=[(130, 64, "mean")], ids=_dash)
)
def test_deterministic_bitwise(backend, case):
    # two runs, bit-identical loss and gradients. N = 600: several row blocks, column tiles and
    # thread groups of the C++ kernel; "none" with a non-uniform upstream: the recomputing backward
    n, d, reduction = case
    img, txt = make_pair(n, d, torch.float32, seed=7)
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    results = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau = torch.tensor(0.05, requires_grad=True)
        loss = hn_clip_loss(*leaves, tau, gamma=0.5, label_smoothing=0.1, reduction=reduction, backend=backend)
        loss.backward(upstream)
        results.append((loss, leaves[0].grad, leaves[1].grad, tau.grad))
    for name, a, b in zip(("loss", "d img", "d txt", "d tau"), *results):
        assert torch.equal(a, b), f"{name} differs between two identical runs"
