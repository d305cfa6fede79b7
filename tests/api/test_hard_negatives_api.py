"""The hard-negative family's public surface: named errors, the backend policy (torch, cpp and
Triton run it on one process, "auto" runs cpp on CPU; world_size > 1: tests/distributed/), and
the bit-identity of every call without the new arguments on every backend (torch, cpp, Triton
in its interpreter). Bound: a few seconds."""

from __future__ import annotations

import pytest
import torch

from cases import ALL_BACKENDS
from hnclip_kernels import HNClipLoss, hn_clip_loss

N, D = 5, 6


def pair(seed=0, dtype=torch.float32, n=N, d=D):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, d, generator=gen).to(dtype) for _ in range(2))


def negs(m=3, seed=1, dtype=torch.float32, d=D):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(negatives=torch.randn(3)), ValueError, r"negatives must be 2-D \(M, D\)"),
        (
            dict(negatives=torch.randn(2, 3, D)),
            ValueError,
            r"negatives of shape \(N, K, D\) must have one row per pair, N = 5.*reshape\(-1, D\)",
        ),
        (
            dict(negatives=torch.randn(2, 3, 4, D)),
            ValueError,
            r"negatives must be 2-D.*or \(N, K, D\).*reshape\(-1, D\)",
        ),
        (dict(negatives=torch.randn(3, D + 1)), ValueError, r"negatives has D = 7 but txt has D = 6"),
        (dict(negatives=torch.randn(3, D, dtype=torch.float64)), TypeError, r"negatives \(torch.float64\) and txt"),
        (dict(negatives=torch.ones(3, D, dtype=torch.long)), TypeError, r"negatives has dtype torch.int64"),
        (dict(negatives=[[0.0] * D]), TypeError, r"negatives must be None or a torch.Tensor"),
        (dict(negatives=torch.randn(3, D, device="meta")), ValueError, r"negatives \(meta\) and txt \(cpu\)"),
        (dict(group_ids=torch.zeros(N, dtype=torch.bool)), TypeError, r"group_ids must be an integer tensor"),
        (dict(group_ids=torch.zeros(N)), TypeError, r"group_ids must be an integer tensor.*\.long\(\)"),
        (dict(group_ids=torch.zeros(N + 1, dtype=torch.long)), ValueError, r"group_ids must be 1-D of length N = 5"),
        (dict(group_ids=torch.zeros(N, 1, dtype=torch.long)), ValueError, r"group_ids must be 1-D"),
        (dict(group_ids=[0] * N), TypeError, r"group_ids must be None or a 1-D integer torch.Tensor"),
        (dict(group_ids=torch.zeros(N, dtype=torch.long, device="meta")), ValueError, r"group_ids \(meta\)"),
        (dict(margin="image"), ValueError, r"margin must be one of \('text', 'image_text'\)"),
        (dict(margin=None), TypeError, r"margin must be a string"),
    ],
)
def test_named_errors(kwargs, error, match):
    img, txt = pair()
    with pytest.raises(error, match=match):
        hn_clip_loss(img, txt, 0.1, backend="torch", **kwargs)


def test_module_errors():
    img, txt = pair()
    with pytest.raises(ValueError, match="margin must be one of"):
        HNClipLoss(margin="txt")
    module = HNClipLoss(backend="torch")
    with pytest.raises(ValueError, match="margin must be one of"):
        module.margin = "bad"
    assert module.margin == "text"
    with pytest.raises(ValueError, match=r"negatives has D = 7 but text_features has D = 6"):
        module(img, txt, 10.0, negatives=torch.randn(2, D + 1))
    with pytest.raises(TypeError, match="group_ids must be an integer tensor"):
        module(img, txt, 10.0, group_ids=torch.zeros(N))


@pytest.mark.parametrize("backend", ["cpp", "triton"])  # their oracle tests: test_hard_negatives_{cpp,triton}.py
@pytest.mark.parametrize(
    "kwargs",
    [dict(negatives=negs()), dict(group_ids=torch.arange(N)), dict(margin="image_text")],
    ids=["negatives", "group_ids", "image_text"],
)
def test_fused_backends_run_the_family(backend, kwargs):
    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} cannot run here")
    img, txt = pair()
    want = hn_clip_loss(img, txt, 0.1, backend="torch", **kwargs)
    assert torch.allclose(hn_clip_loss(img, txt, 0.1, backend=backend, **kwargs), want, rtol=1e-5, atol=0)
    extra = dict(negatives=kwargs.get("negatives"), group_ids=kwargs.get("group_ids"))
    got, want = (
        HNClipLoss(backend=b, margin=kwargs.get("margin", "text"))(img, txt, 10.0, **extra) for b in (backend, "torch")
    )
    assert torch.allclose(got, want, rtol=1e-5, atol=0)


def test_world_size_above_one_takes_the_distributed_path():
    # the family across ranks (tests/distributed/test_family_distributed.py): without a process
    # group it raises as today's distributed loss does
    img, txt = pair()
    module = HNClipLoss(backend="torch", rank=0, world_size=2)
    with pytest.raises(ValueError, match="not initialised"):
        module(img, txt, 10.0, negatives=negs())


def test_empty_negatives_are_none_on_every_backend():
    # M = 0 equals None: today's call, so the fused backends run it too
    img, txt = pair(3)
    for backend in ALL_BACKENDS:
        a = hn_clip_loss(img, txt, 0.1, backend=backend)
        b = hn_clip_loss(img, txt, 0.1, backend=backend, negatives=torch.empty(0, D))
        assert torch.equal(a, b), backend


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(false_negative_threshold=0.3, label_smoothing=0.1), dict(reduction="none", normalize=False)],
    ids=["plain", "masked-smoothed", "none-unnormalized"],
)
def test_no_new_arguments_is_bit_identical(backend, options):
    img, txt = (torch.nn.functional.normalize(x, dim=1) for x in pair(4))  # near-unit: no normalize=False warning
    upstream = torch.linspace(0.5, 1.5, N) if options.get("reduction") == "none" else torch.tensor(1.0)
    results = []
    for extra in (dict(), dict(negatives=None, group_ids=None, margin="text")):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau = torch.tensor(0.07, requires_grad=True)
        loss = hn_clip_loss(*leaves, tau, backend=backend, **options, **extra)
        grads = torch.autograd.grad((loss * upstream).sum(), [*leaves, tau])
        results.append((loss, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b), backend


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_module_without_new_arguments_is_bit_identical(backend):
    img, txt = pair(5)
    results = []
    for extra in (dict(), dict(negatives=None, group_ids=None)):
        module = HNClipLoss(backend=backend, return_stats=True, **({"margin": "text"} if extra else {}))
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        scale = torch.tensor(14.0, requires_grad=True)
        loss = module(*leaves, scale, **extra)
        results.append((loss, *torch.autograd.grad(loss, [*leaves, scale]), module.last_stats))
    assert results[0][-1] == results[1][-1]
    for a, b in zip(results[0][:-1], results[1][:-1]):
        assert torch.equal(a, b), backend


@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_unnormalized_negatives_that_overflow_are_named(margin):
    img, txt = (torch.nn.functional.normalize(x, dim=1) for x in pair(6))
    huge = negs() * 1e36  # finite, but their products with the images overflow float32
    with pytest.raises(ValueError, match=r"normalize=False.*captions and negatives.*pass normalize=True"):
        hn_clip_loss(img, txt, 0.1, negatives=huge, normalize=False, margin=margin, backend="torch")


# ------------------------------------------------ un-normalised negatives: the features' unit-norm rule


def _issue_repro():
    """issue 37's repro: unit image and caption rows, raw (un-normalised) negatives."""
    gen = torch.Generator().manual_seed(37)
    img, txt, raw = (torch.randn(n, 32, generator=gen) for n in (8, 8, 6))
    return torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1), raw


def _entry_points():
    from hnclip_kernels.distributed import distributed_hn_clip_loss

    return {  # each with normalize=False (HNClipLoss's default): the features are taken as given
        "HNClipLoss": lambda i, t, n: HNClipLoss(backend="torch")(i, t, 1 / 0.07, negatives=n),
        "hn_clip_loss": lambda i, t, n: hn_clip_loss(i, t, 0.07, negatives=n, normalize=False, backend="torch"),
        "distributed_hn_clip_loss": lambda i, t, n: distributed_hn_clip_loss(
            i, t, 0.07, negatives=n, normalize=False, backend="torch"
        ),  # world_size 1: the consensus checks every rank runs (family_checks), without a group
        "HNClipLoss(cpp)": lambda i, t, n: HNClipLoss(backend="cpp")(i, t, 1 / 0.07, negatives=n),
    }


@pytest.mark.parametrize("entry", ["HNClipLoss", "hn_clip_loss", "distributed_hn_clip_loss", "HNClipLoss(cpp)"])
def test_unnormalised_negatives_with_normalize_false_warn_once_as_the_features_do(entry, monkeypatch):
    import warnings

    from hnclip_kernels.backends import cpp_directional

    if entry.endswith("(cpp)") and cpp_directional() is None:
        pytest.skip("the C++ extension is not built")
    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())
    call = _entry_points()[entry]
    img, txt, raw = _issue_repro()
    unit = torch.nn.functional.normalize(raw, dim=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrong = call(img, txt, raw)
        call(img, txt, raw)  # once per process
        right = call(img, txt, unit)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "rows of negatives have norms off 1 by up to" in message and "normalize=True" in message, message
    assert caught[0].filename == __file__  # at the user's line
    assert wrong.item() > right.item() + 1.0  # what the warning is about: 11.9 against 5.9 in the issue
    # the features' own warning is separate: raw images after it still warn, naming the images
    with pytest.warns(RuntimeWarning, match="rows of (img/txt|image_features/text_features) have norms"):
        call(3 * img, txt, unit)


def test_negatives_near_unit_norm_and_normalize_true_stay_quiet():
    import warnings

    img, txt, raw = _issue_repro()
    unit = torch.nn.functional.normalize(raw, dim=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HNClipLoss(backend="torch")(img, txt, 1 / 0.07, negatives=1.04 * unit)  # within 5%: bf16 rounding and such
        # normalize=True normalises the negatives inside, as the features: the raw ones give the unit ones' loss
        a = hn_clip_loss(img, txt, 0.07, negatives=raw, backend="torch")
        b = hn_clip_loss(img, txt, 0.07, negatives=unit, backend="torch")
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_image_text_margin_that_overflows_is_named(backend):
    # normalize=False, γ = 10, images of norm 4e37, each caption the negated image direction and
    # each negative the image's own: margin="text" stays in float32 range (finite loss and
    # gradients), margin="image_text" adds γ·v·x to the gaps, (2 + 2γ)·4e37 = 8.8e38: the
    # documented ValueError (without the margin's bound torch returned inf, cpp and Triton NaN)
    unit = torch.nn.functional.normalize(pair(7)[0], dim=1)
    img, txt, neg = (unit * 4e37).requires_grad_(True), -unit, unit[:3].clone()
    kw = dict(negatives=neg, normalize=False, gamma=10.0, reduction="none", backend=backend)
    rows = hn_clip_loss(img, txt, 1.0, margin="text", **kw)
    (grad,) = torch.autograd.grad(rows.sum(), img)
    assert torch.isfinite(rows).all() and torch.isfinite(grad).all()
    with pytest.raises(ValueError, match=r"normalize=False.*captions and negatives.*pass normalize=True"):
        hn_clip_loss(img, txt, 1.0, margin="image_text", **kw)
