"""Public API behaviour shared by every backend: bad input, edge cases, open_clip parity."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from cases import ALL_BACKENDS, check_against_truth, make_pair
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends import resolve_backend

X = torch.randn(4, 3)

BAD_INPUTS = [
    (dict(img=torch.randn(4)), ValueError, "img must be 2-D"),
    (dict(txt=torch.randn(2, 4, 3)), ValueError, "txt must be 2-D"),
    (dict(txt=torch.randn(5, 3)), ValueError, "same shape"),
    (dict(txt=torch.randn(4, 2)), ValueError, "same shape"),
    (dict(img=torch.randn(0, 3), txt=torch.randn(0, 3)), ValueError, "N = 0"),
    (dict(img=torch.randn(4, 0), txt=torch.randn(4, 0)), ValueError, "D = 0"),
    (dict(txt=torch.randn(4, 3, dtype=torch.float64)), TypeError, "same dtype"),
    (dict(img=torch.ones(4, 3, dtype=torch.int64), txt=torch.ones(4, 3, dtype=torch.int64)), TypeError, "dtype"),
    (dict(img=[[1.0]]), TypeError, "img must be a torch.Tensor"),
    (dict(txt=torch.randn(4, 3, device="meta")), ValueError, "same device"),
    (dict(tau=0.0), ValueError, "tau"),
    (dict(tau=-0.07), ValueError, "tau"),
    (dict(tau=float("nan")), ValueError, "tau"),
    (dict(tau=float("inf")), ValueError, "tau"),
    (dict(tau=torch.tensor(-1.0)), ValueError, "tau"),
    (dict(tau=torch.tensor([0.1, 0.2])), ValueError, "tau must be a scalar"),
    (dict(tau=torch.tensor(1)), TypeError, "tau tensor must be floating"),
    (dict(tau="0.07"), TypeError, "tau must be a real number"),
    (dict(tau=1e-50), ValueError, "overflow"),
    (dict(tau=torch.tensor(1e-50, dtype=torch.float64)), ValueError, "overflow"),
    (dict(gamma=10**400), ValueError, "gamma"),
    (dict(normalize=None), TypeError, "normalize"),
    (dict(normalize="no"), TypeError, "normalize"),
    (dict(gamma=-0.1), ValueError, "gamma"),
    (dict(gamma=float("nan")), ValueError, "gamma"),
    (dict(gamma=None), TypeError, "gamma"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(backend="triton", img=X.double(), txt=X.double()), TypeError, "float64"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS, ids=[f"{i}-{m}" for i, (_, _, m) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_clear_error(kwargs, exc, match):
    args = dict(img=X, txt=torch.randn(4, 3), tau=0.07)
    args.update(kwargs)
    img, txt, tau = args.pop("img"), args.pop("txt"), args.pop("tau")
    with pytest.raises(exc, match=match):
        hn_clip_loss(img, txt, tau, **args)


def test_triton_on_cpu_without_interpreter_raises():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch, hnclip_kernels as h\n"
        "try:\n    h.hn_clip_loss(torch.randn(3, 4), torch.randn(3, 4), 0.1, backend='triton')\n"
        "except ValueError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("OK") and "TRITON_INTERPRET" in out.stdout, out.stdout + out.stderr


def test_auto_backend_on_cpu():
    from hnclip_kernels.backends import cpp_directional

    assert resolve_backend("auto", X) == ("cpp" if cpp_directional() is not None else "torch")
    assert resolve_backend("auto", X.double()) == "torch"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_single_pair_is_zero_with_zero_grads(backend):
    img, txt = make_pair(1, 5)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    tau = torch.tensor(0.05, requires_grad=True)
    loss = hn_clip_loss(img, txt, tau, label_smoothing=0.1, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    for g in (img.grad, txt.grad, tau.grad):
        assert torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("where", ["img", "txt"])
def test_nan_propagates(backend, where):
    img, txt = make_pair(17, 8)
    (img if where == "img" else txt)[5, 2] = float("nan")
    for reduction in ("mean", "sum"):
        assert torch.isnan(hn_clip_loss(img, txt, 0.07, reduction=reduction, backend=backend))
    rows = hn_clip_loss(img, txt, 0.07, reduction="none", backend=backend)
    assert torch.isnan(rows).all()  # every row's LSE sees the NaN row or column


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_inputs_not_mutated(backend):
    img, txt = make_pair(16, 8, torch.bfloat16)
    img_before, txt_before = img.clone(), txt.clone()
    img.requires_grad_(True)
    txt.requires_grad_(True)
    hn_clip_loss(img, txt, 0.07, label_smoothing=0.1, backend=backend).backward()
    assert torch.equal(img.detach(), img_before) and torch.equal(txt.detach(), txt_before)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_non_contiguous_inputs_and_upstream_grad(backend):
    n, d = 17, 8
    img = torch.randn(d, n).T  # column-major view
    txt = torch.randn(n, 2 * d)[:, ::2]  # strided view
    assert not img.is_contiguous() and not txt.is_contiguous()
    upstream = torch.linspace(-1.0, 2.0, n)
    check_against_truth(backend, n, d, torch.float32, 0.5, 0.07, 0.1, "none", upstream=upstream, img=img, txt=txt)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tau_float_equals_tau_tensor(backend):
    img, txt = make_pair(15, 8)
    a = hn_clip_loss(img, txt, 0.07, backend=backend)
    b = hn_clip_loss(img, txt, torch.tensor(0.07), backend=backend)
    assert_close_rel(a, b, 1e-7, "loss")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_normalize_false_trusts_caller(backend):
    img, txt = (F.normalize(x, dim=1) for x in make_pair(15, 8, seed=9))
    check_against_truth(backend, 15, 8, torch.float32, 0.5, 0.07, 0.1, "mean", normalize=False, img=img, txt=txt)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_gamma_zero_equals_open_clip(backend):
    open_clip_loss = pytest.importorskip("open_clip.loss")
    img, txt = make_pair(12, 16, torch.float32, seed=5)
    logit_scale = torch.tensor(14.3, requires_grad=True)
    ours_in = [x.clone().requires_grad_(True) for x in (img, txt)]
    theirs_in = [x.clone().requires_grad_(True) for x in (img, txt)]
    ours = hn_clip_loss(*ours_in, 1.0 / logit_scale, gamma=0.0, backend=backend)
    ours.backward()
    ours_scale_grad = logit_scale.grad.clone()
    logit_scale.grad = None
    theirs = open_clip_loss.ClipLoss()(
        F.normalize(theirs_in[0], dim=-1), F.normalize(theirs_in[1], dim=-1), logit_scale
    )
    theirs.backward()
    assert_close_rel(ours, theirs, 1e-6, "loss")
    assert_close_rel(ours_in[0].grad, theirs_in[0].grad, 1e-5, "d img")
    assert_close_rel(ours_in[1].grad, theirs_in[1].grad, 1e-5, "d txt")
    assert_close_rel(ours_scale_grad, logit_scale.grad, 1e-5, "d logit_scale")


def test_margin_raises_loss_of_similar_captions():
    # γ > 0 raises the negatives' logits by γ·cos(t_i, t_j)/τ: with near-duplicate captions the
    # loss must grow. (That G carries no gradient is checked by every comparison with the truth.)
    img, txt = make_pair(9, 6, seed=11)
    txt = txt + 2.0
    for backend in ALL_BACKENDS:
        assert hn_clip_loss(img, txt, 0.1, gamma=0.5, backend=backend) > hn_clip_loss(
            img, txt, 0.1, gamma=0.0, backend=backend
        )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_autocast_does_not_lower_the_accumulation(backend):
    img, txt = make_pair(16, 8, seed=13)
    plain = hn_clip_loss(img, txt, 0.07, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = hn_clip_loss(img, txt, 0.07, backend=backend)
    assert inside.dtype == torch.float32
    assert_close_rel(inside, plain, 1e-6, "loss under autocast")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_torch_backend_second_derivative_matches_float64(dtype, tol):
    # a gradient penalty P = ‖dL/dimg‖² + (dL/dτ)², differentiated again: the torch backend's
    # backward is plain autograd, so d P/d(img, txt, τ) must match float64 autograd of the formula
    img, txt = make_pair(12, 16, dtype, seed=21)
    upstream = torch.linspace(0.5, 2.0, 12, dtype=torch.float64)

    def penalty_grads(loss_fn, leaves):
        img_l, txt_l, tau_l = leaves
        rows = loss_fn(img_l, txt_l, tau_l)
        loss = (rows * upstream.to(rows.dtype)).sum()  # a non-uniform upstream gradient
        d_img, d_tau = torch.autograd.grad(loss, [img_l, tau_l], create_graph=True)
        penalty = d_img.pow(2).sum() + d_tau.pow(2)
        return torch.autograd.grad(penalty, leaves)

    kw = dict(gamma=0.5, label_smoothing=0.1, reduction="none")
    ours = penalty_grads(
        lambda a, b, t: hn_clip_loss(a, b, t, backend="torch", **kw),
        [
            img.clone().requires_grad_(True),
            txt.clone().requires_grad_(True),
            torch.tensor(0.07, dtype=dtype, requires_grad=True),
        ],
    )
    truth = penalty_grads(
        lambda a, b, t: hn_clip_loss_f64(a, b, t, **kw),
        [
            img.double().requires_grad_(True),
            txt.double().requires_grad_(True),
            torch.tensor(0.07, dtype=dtype).double().requires_grad_(True),
        ],
    )
    for got, want, what in zip(ours, truth, ("d penalty / d img", "d penalty / d txt", "d penalty / d tau")):
        assert got.dtype == dtype
        assert_close_rel(got, want, tol, what)


FUSED = [b for b in ALL_BACKENDS if b != "torch"]


def _second_derivative_entry_points(backend):
    """Every public way into a backend, as (name, fn(img, txt, tau) -> loss)."""
    from hnclip_kernels import HNClipLoss
    from hnclip_kernels.distributed import distributed_hn_clip_loss

    return [
        ("hn_clip_loss", lambda a, b, t: hn_clip_loss(a, b, t, backend=backend)),
        (
            "hn_clip_loss none",
            lambda a, b, t: (
                hn_clip_loss(a, b, t, reduction="none", backend=backend) * torch.linspace(0.5, 2.0, a.shape[0])
            ).sum(),
        ),
        ("HNClipLoss", lambda a, b, t: HNClipLoss(backend=backend, normalize=True)(a, b, 1.0 / t)),
        ("distributed, world_size=1", lambda a, b, t: distributed_hn_clip_loss(a, b, t, world_size=1, backend=backend)),
    ]


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("wrt", ["img", "txt", "tau", "loss + penalty"])
def test_fused_second_derivative_raises_one_clear_error(backend, wrt):
    # the fused backwards are not themselves differentiable: every way of asking for a second
    # derivative raises one error naming backend="torch", never a silently partial answer
    # (a gradient with no graph would let (loss + penalty).backward() drop the penalty's kernel part)
    for (name, fn), (_, torch_fn) in zip(
        _second_derivative_entry_points(backend), _second_derivative_entry_points("torch")
    ):
        img, txt = make_pair(8, 4, seed=14)
        img.requires_grad_(True)
        txt.requires_grad_(True)
        tau = torch.tensor(0.1, requires_grad=True)
        loss = fn(img, txt, tau)
        d_img, d_txt, d_tau = torch.autograd.grad(loss, [img, txt, tau], create_graph=True)  # first order: fine
        truth = torch.autograd.grad(torch_fn(img, txt, tau), [img, txt, tau])
        for got, want, what in zip((d_img, d_txt, d_tau), truth, ("d img", "d txt", "d tau")):
            assert_close_rel(got, want, 1e-4, f"{name}: {what} taken with create_graph=True")
        penalty = d_img.pow(2).sum() + d_txt.pow(2).sum() + d_tau.pow(2)
        with pytest.raises(RuntimeError, match='second derivatives .* backend="torch"') as info:
            if wrt == "loss + penalty":
                (loss + penalty).backward()
            else:
                torch.autograd.grad(penalty, {"img": img, "txt": txt, "tau": tau}[wrt])
        assert f'backend="{backend}"' in str(info.value), name


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("transform", ["jacrev(jacrev)", "hessian"])
def test_fused_hessian_through_torch_func_raises_clear_error(backend, transform):
    # torch.func reaches the fused backends' second derivative and gets the same clear error
    img, txt = make_pair(6, 4, seed=16)

    def loss(a):
        return hn_clip_loss(a, txt, 0.1, backend=backend)

    hessian = torch.func.jacrev(torch.func.jacrev(loss)) if transform == "jacrev(jacrev)" else torch.func.hessian(loss)
    with pytest.raises(RuntimeError, match=r"(second derivatives|forward-mode).*backend=\"torch\""):
        hessian(img)


def test_compile_fullgraph_with_changing_floats():
    # dynamo turns floats that change between calls into symbolic values: the checks must not break the graph
    backend = "cpp" if "cpp" in ALL_BACKENDS else "torch"
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, tau, gamma: hn_clip_loss(a, b, tau, gamma=gamma, backend=backend), fullgraph=True)
    img, txt = make_pair(12, 8, seed=15)
    for tau, gamma in ((0.05, 0.5), (0.06, 0.7), (0.07, 0.9)):
        assert_close_rel(
            fn(img, txt, tau, gamma),
            hn_clip_loss(img, txt, tau, gamma=gamma, backend=backend),
            1e-6,
            f"compiled loss at tau={tau}",
        )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("n,gamma,tau", [(16, 1e4, 1e-4), (64, 1e3, 0.07)])
def test_huge_logits(backend, n, gamma, tau):
    # |Z| up to 1e8: a backward that recomputes a tile with other rounding than the forward's
    # statistics were made from turns an ulp of Z (8 at 1e8) into a factor e^8 on P
    check_against_truth(backend, n, 16, torch.float32, gamma, tau, 0.0, "mean", seed=3)


@pytest.mark.parametrize(
    "bad,exc",
    [
        (torch.tensor(float("nan")), ValueError),
        (torch.tensor(0.0), ValueError),
        (torch.ones(2), ValueError),
        ("100", TypeError),
    ],
)
def test_hn_clip_loss_module_names_logit_scale(bad, exc):
    from hnclip_kernels import HNClipLoss

    img, txt = make_pair(4, 3)
    with pytest.raises(exc, match="logit_scale"):
        HNClipLoss()(img, txt, bad)


# ---- rough edges: meta inputs, option validation


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("reduction,shape", [("mean", ()), ("sum", ()), ("none", (5,))])
@pytest.mark.parametrize("tau_kind", ["float", "cpu tensor", "meta tensor"])
def test_meta_inputs_give_meta_result(backend, reduction, shape, tau_kind):
    # meta inputs give a meta result of the reduction's shape and a meta gradient
    img = torch.empty(5, 3, device="meta", requires_grad=True)
    txt = torch.empty(5, 3, device="meta")
    tau = {"float": 0.07, "cpu tensor": torch.tensor(0.07), "meta tensor": torch.empty((), device="meta")}[tau_kind]
    out = hn_clip_loss(img, txt, tau, reduction=reduction, backend=backend)
    assert out.device.type == "meta" and out.shape == shape and out.dtype == torch.float32
    (grad,) = torch.autograd.grad(out.sum(), img)
    assert grad.device.type == "meta" and grad.shape == img.shape
    assert hn_clip_loss(img.double(), txt.double(), tau, backend=backend).dtype == torch.float64


def test_meta_inputs_through_hn_clip_loss_module():
    from hnclip_kernels import HNClipLoss

    img = torch.empty(5, 3, device="meta")
    out = HNClipLoss(backend="torch")(img, img, torch.empty((), device="meta"))
    assert out.device.type == "meta" and out.shape == ()


@pytest.mark.parametrize("backend", FUSED)
def test_meta_inputs_on_fused_backend_raise_clear_error(backend):
    img = torch.empty(5, 3, device="meta")
    with pytest.raises(ValueError, match="meta"):
        hn_clip_loss(img, img, 0.07, backend=backend)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(gamma=-1), ValueError, "gamma"),
        (dict(gamma=float("inf")), ValueError, "gamma"),
        (dict(gamma="0.5"), TypeError, "gamma"),
        (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(normalize="yes"), TypeError, "normalize"),
        (dict(normalize=None), TypeError, "normalize"),
        (dict(precision="tf32"), ValueError, "precision"),
    ],
)
def test_hn_clip_loss_module_validates_options_at_construction(kwargs, exc, match):
    # a bad option raises at construction, not at the first forward
    from hnclip_kernels import HNClipLoss

    with pytest.raises(exc, match=match):
        HNClipLoss(**kwargs)


def test_tau_above_one_warns_once(monkeypatch):
    # τ > 1 is almost always open_clip's logit_scale passed in place of 1 / logit_scale
    import warnings

    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())
    img, txt = make_pair(6, 4, seed=17)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hn_clip_loss(img, txt, 0.07)
        hn_clip_loss(img, txt, 1.0)  # τ = 1 is a legitimate (if warm) temperature
        assert not caught, [str(w.message) for w in caught]
        hn_clip_loss(img, txt, 14.3)  # line below: the warning points at the caller
        line = sys._getframe().f_lineno - 1
        hn_clip_loss(img, txt, torch.tensor(100.0))
    assert len(caught) == 1, [str(w.message) for w in caught]
    warning = caught[0]
    assert warning.category is RuntimeWarning
    message = str(warning.message)
    assert "logit_scale" in message and "1/tau = 0.0699301" in message and "14.3" in message
    assert warning.filename == __file__ and warning.lineno == line


def test_tau_above_one_under_compile_does_not_break_graph(monkeypatch):
    import warnings

    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: hn_clip_loss(a, b, 14.3, backend="torch"), fullgraph=True)
    img, txt = make_pair(6, 4, seed=18)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(img, txt)
    assert not [w for w in caught if "logit_scale" in str(w.message)]


# ---- the τ overflow bound counts γ on every backend and entry point


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tau_overflow_check_accounts_for_gamma(backend):
    # 6 pairs' (2 + γ)/τ summed by the mean, 2·6·1002/τ = 1.2e40, overflows float32 although
    # 1/τ = 1e36 does not. Before, the paths through
    # distributed.py (HNClipLoss, distributed_hn_clip_loss) checked 1/τ only: inf on torch, NaN on cpp
    from hnclip_kernels import HNClipLoss
    from hnclip_kernels.distributed import distributed_hn_clip_loss

    img, txt = make_pair(6, 4, seed=19)
    calls = {
        "hn_clip_loss": lambda: hn_clip_loss(img, txt, 1e-36, gamma=1e3, backend=backend),
        "hn_clip_loss tensor tau": lambda: hn_clip_loss(img, txt, torch.tensor(1e-36), gamma=1e3, backend=backend),
        "distributed_hn_clip_loss": lambda: distributed_hn_clip_loss(
            img, txt, 1e-36, gamma=1e3, world_size=1, backend=backend
        ),
        "HNClipLoss": lambda: HNClipLoss(gamma=1e3, backend=backend, normalize=True)(img, txt, torch.tensor(1e36)),
    }
    for name, call in calls.items():
        try:
            value = call()
        except ValueError as exc:
            assert re.search(r"overflow.*use tau > 3\.5\de-35", str(exc)), f"{name}: {exc}"
        else:
            pytest.fail(f"{name} returned {value} instead of raising ValueError")
    # γ = 0 at the same τ is fine (2·6·2/τ = 2.4e37): the bound counts γ, it is not a fixed floor
    assert torch.isfinite(hn_clip_loss(img, txt, 1e-36, gamma=0.0, backend=backend))
