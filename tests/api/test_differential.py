"""Differential harness: every backend and entry point answers every call flavour alike.

For random small problems and random *call flavours* (dtype, strides, which inputs require
grad, how the tensors were made, the form of τ / logit_scale / γ / ε, reduction and label
smoothing, anomaly mode, deterministic algorithms, autocast, copied or pickled modules), each
backend (``cases.ALL_BACKENDS``) through each entry point (``hn_clip_loss``, ``HNClipLoss``,
``distributed_hn_clip_loss`` on one process) must either

* match a float64 evaluation of the formula on the values the call received within the
  README's bounds (loss: 1e-5 float32 / float64, 1e-3 16-bit features; gradients: 1e-4, or for
  a 16-bit leaf 2× the error of rounding the true gradient to its dtype + 2e-3; a scalar leaf
  (τ, logit_scale) stored in 16 bits: 1e-3 + 2× its rounding), or
* raise, on every backend that runs these tensors, the same exception type with a message
  naming the argument.

The τ the truth uses is the one the caller meant: the value of ``tau`` as passed, and for
``HNClipLoss`` 1/s in float64 from the value of ``logit_scale`` as passed (a 16-bit s is a
16-bit *scale*, not a 16-bit τ).

Bound: N ≤ 8, D ≤ 8, every example runs all backends (Triton in its interpreter); hypothesis
runs ``derandomize=True`` (the same examples in every CI run) with the ``max_examples`` below:
about 50 s for the whole file on 2 shared cores (measured 46 s in pytest, 51 s wall with imports, 25 s CPU,
at load average 5), within the 60–90 s budget.
"""

from __future__ import annotations

import contextlib
import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cases import ALL_BACKENDS, TOL_F32_GRAD, TOL_F32_LOSS, TOL_F32_LOSS_SATURATED, TOL_LOWP_LOSS
from helpers import hn_clip_loss_f64, rel_err
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.distributed import distributed_hn_clip_loss

LOWP = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "offset")
MADE = ("plain", "no_grad", "inference_mode", "detached_view")
FORMS = ("float", "int", "numpy", "tensor0", "tensor1", "tensor16")
CONTEXTS = ("none", "anomaly", "deterministic", "autocast_forward", "autocast_backward", "autocast_both")
ENTRIES = ("hn_clip_loss", "HNClipLoss", "distributed")
# names an error message may carry: the arguments of the three entry points
ARGUMENTS = (
    "img",
    "txt",
    "tau",
    "gamma",
    "label_smoothing",
    "reduction",
    "logit_scale",
    "image_features",
    "text_features",
    "backend",
    "normalize",
)

# no shrinking: a failing example already names its flavour and problem, and shrinking through
# every backend (Triton interpreted) would take minutes
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ------------------------------------------------------------------ making the inputs
def _features(n, d, dtype, seed, aligned):
    gen = torch.Generator().manual_seed(seed)
    img = torch.randn(n, d, generator=gen, dtype=torch.float64)
    txt = torch.randn(n, d, generator=gen, dtype=torch.float64)
    if aligned:  # captions near their images: the saturated regime, where τ's rounding shows most
        txt = img + 0.1 * txt
    return img.to(dtype), txt.to(dtype)


def _laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values with the given strides (the values are unchanged)."""
    if layout == "transposed":
        return x.T.contiguous().T
    if layout == "sliced":  # every other column of a wider buffer
        wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
        wide[:, ::2] = x
        return wide[:, ::2]
    if layout == "offset":
        flat = torch.zeros(x.numel() + 3, dtype=x.dtype)
        flat[3:] = x.reshape(-1)
        return flat[3:].view(x.shape)
    return x.contiguous()


def _expanded_rows(x: torch.Tensor) -> torch.Tensor:
    """Row 0 of ``x`` repeated with stride 0 (identical rows: the loss is still defined)."""
    return x[:1].expand(x.shape[0], x.shape[1])


def _made(x: torch.Tensor, made: str) -> torch.Tensor:
    if made == "no_grad":
        with torch.no_grad():
            return x.clone()
    if made == "inference_mode":  # a frozen tower computed under inference_mode (LiT-style)
        with torch.inference_mode():
            return x.clone()
    if made == "detached_view":
        return (x * 1).detach()[:, :]
    return x.clone()


def _number(value: float, form: str, dtype16=torch.bfloat16):
    """``value`` in the given form; returns (argument, its value as the callee sees it)."""
    if form == "int":
        return int(round(value)) or 1, float(int(round(value)) or 1)
    if form == "numpy":
        x = np.float32(value)
        return x, float(x)
    if form == "tensor0":
        x = torch.tensor(value, dtype=torch.float32)
        return x, float(x)
    if form == "tensor1":
        x = torch.tensor([value], dtype=torch.float32)
        return x, float(x)
    if form == "tensor16":
        x = torch.tensor(value, dtype=dtype16)
        return x, float(x)
    return float(value), float(value)


# ------------------------------------------------------------------ contexts
@contextlib.contextmanager
def _deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _contexts(context: str):
    """(around the forward, around the backward)."""
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    return {
        "none": (contextlib.nullcontext, contextlib.nullcontext),
        "anomaly": (torch.autograd.detect_anomaly, torch.autograd.detect_anomaly),
        "deterministic": (_deterministic, _deterministic),
        "autocast_forward": (autocast, contextlib.nullcontext),
        "autocast_backward": (contextlib.nullcontext, autocast),
        "autocast_both": (autocast, autocast),
    }[context]


# ------------------------------------------------------------------ one call and its judgement
def _rounding_floor(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative error of rounding the float64 ``truth`` to ``dtype``."""
    if dtype == torch.float64:
        return 0.0
    return float((truth.to(dtype).double() - truth).norm() / truth.norm().clamp_min(1e-300))


def _grad_tol(leaf_dtype, feature_dtype, truth, scalar: bool) -> float:
    if scalar:  # τ / logit_scale: the loss's bound for 16-bit features, 1e-4 otherwise, plus its own rounding
        base = TOL_LOWP_LOSS if feature_dtype in LOWP or leaf_dtype in LOWP else TOL_F32_GRAD
        return base + 2 * _rounding_floor(truth, leaf_dtype)
    if leaf_dtype in LOWP:
        return 2 * _rounding_floor(truth, leaf_dtype) + 2e-3
    return TOL_F32_GRAD


def _within(got: torch.Tensor, truth: torch.Tensor, tol: float) -> bool:
    """‖got − truth‖ ≤ tol·‖truth‖, or, for a truth so small that float32 (float64 for float64
    results) cannot hold it to ``tol`` (below its smallest normal / tol: a saturated loss of
    1e-65 is 0 in float32), within that absolute floor."""
    floor = torch.finfo(torch.float64 if got.dtype == torch.float64 else torch.float32).tiny / tol
    diff = float((got.detach().double() - truth.detach().double()).norm())
    return bool(torch.isfinite(got).all()) and diff <= tol * float(truth.detach().double().norm()) + floor


def _call(entry, backend, img, txt, tau_arg, gamma, eps, reduction, module_copy=None):
    if entry == "hn_clip_loss":
        return hn_clip_loss(img, txt, tau_arg, gamma=gamma, label_smoothing=eps, reduction=reduction, backend=backend)
    if entry == "distributed":
        return distributed_hn_clip_loss(
            img, txt, tau_arg, gamma=gamma, label_smoothing=eps, backend=backend, world_size=1, rank=0
        )
    module = HNClipLoss(gamma=gamma, label_smoothing=eps, backend=backend, normalize=True)
    if module_copy is not None:
        module = module_copy(module)
    return module(img, txt, tau_arg)  # tau_arg is logit_scale here


def _outcome(entry, backend, flavour, problem):
    """None when the call matched the float64 truth within bound, else (exception type, message)."""
    n, d, tau, gamma, eps, seed, aligned = problem
    dtype, layout, made, grads, form, context, reduction = (
        flavour[k] for k in ("dtype", "layout", "made", "grads", "form", "context", "reduction")
    )
    if entry != "hn_clip_loss":
        reduction = "mean"  # HNClipLoss and the distributed loss return the mean
    img0, txt0 = _features(n, d, dtype, seed, aligned)
    img = _laid_out(img0, layout)
    txt = _expanded_rows(txt0) if layout == "expanded" else _laid_out(txt0, layout)
    img = _made(img, made)
    if "img" in grads and made != "inference_mode":  # an inference tensor cannot require grad
        img.requires_grad_(True)
    if "txt" in grads:
        txt.requires_grad_(True)
    if entry == "HNClipLoss":
        scale_dtype = flavour["scale_dtype"]
        value = 1.0 / tau
        if form in ("tensor0", "tensor16"):
            tau_arg = torch.tensor(value, dtype=scale_dtype)
        elif form == "tensor1":
            tau_arg = torch.tensor([value], dtype=scale_dtype)
        else:
            tau_arg, _ = _number(value, form if form != "int" else "float")
        tau_truth = 1.0 / torch.tensor(float(tau_arg), dtype=torch.float64)  # 1/s of the s passed
    else:
        tau_arg, tau_value = _number(tau, form, flavour["tau16"])
        tau_truth = torch.tensor(tau_value, dtype=torch.float64)
    scalar_leaf = isinstance(tau_arg, torch.Tensor) and "tau" in grads
    if scalar_leaf:
        tau_arg.requires_grad_(True)
    before = [x.detach().clone() for x in (img, txt)]

    fwd, bwd = _contexts(context)
    try:
        with fwd():
            loss = _call(entry, backend, img, txt, tau_arg, gamma, eps, reduction, flavour.get("module_copy"))
        leaves = [
            (name, x)
            for name, x in (("img", img), ("txt", txt), ("tau", tau_arg))
            if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        grads_got = {}
        if leaves and loss.requires_grad:
            upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
            with bwd():
                got = torch.autograd.grad(loss, [x for _, x in leaves], upstream)
            grads_got = {name: g for (name, _), g in zip(leaves, got)}
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
        return type(exc), str(exc)

    # the truth, on the values the call received
    ref_img, ref_txt = (x.detach().double().requires_grad_(True) for x in (img, txt))
    ref_tau = tau_truth.clone().requires_grad_(True)
    ref = hn_clip_loss_f64(
        ref_img, ref_txt, ref_tau, gamma=float(gamma), label_smoothing=float(eps), reduction=reduction
    )
    problems = []
    want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if loss.dtype != want_dtype:
        problems.append(f"loss dtype {loss.dtype} != {want_dtype}")
    loss_tol = TOL_LOWP_LOSS if dtype in LOWP else TOL_F32_LOSS
    if dtype not in LOWP and float(ref.abs().max()) < 1e-20:  # README: the saturated regime
        loss_tol = TOL_F32_LOSS_SATURATED
    if not _within(loss, ref, loss_tol):
        problems.append(
            f"loss relative error {rel_err(loss, ref):.3e} > {loss_tol:.0e} "
            f"(got {loss.detach().reshape(-1)[:4].tolist()}, want {ref.detach().reshape(-1)[:4].tolist()})"
        )
    if grads_got:
        upstream = torch.linspace(0.5, 1.5, ref.numel(), dtype=torch.float64).reshape(ref.shape)
        truths = dict(zip(("img", "txt", "tau"), torch.autograd.grad(ref, [ref_img, ref_txt, ref_tau], upstream)))
        if entry == "HNClipLoss":  # d logit_scale = dτ · dτ/ds = −τ² dτ
            truths["tau"] = -truths["tau"] * ref_tau.detach() ** 2
        for name, g in grads_got.items():
            leaf = dict(leaves)[name]
            if g.dtype != leaf.dtype:
                problems.append(f"d {name} dtype {g.dtype} != its dtype {leaf.dtype}")
            truth = truths[name].reshape(g.shape)
            tol = _grad_tol(leaf.dtype, dtype, truth, scalar=name == "tau")
            if not _within(g, truth, tol):
                problems.append(f"d {name} relative error {rel_err(g, truth):.3e} > {tol:.1e}")
    for x, x0, name in zip((img, txt), before, ("img", "txt")):
        if not torch.equal(x.detach(), x0):
            problems.append(f"{name} was written to")
    return None if not problems else (AssertionError, "; ".join(problems))


def _runs_here(backend, dtype) -> bool:
    """Whether ``backend`` takes these features at all (its documented dtypes)."""
    return not (backend == "triton" and dtype == torch.float64)


def check_flavour(flavour, problem, entries=ENTRIES):
    """Every entry × backend: within bound, or one exception type naming an argument, the
    same on every backend that runs these tensors."""
    failures = []
    for entry in entries:
        outcomes = {}
        for backend in ALL_BACKENDS:
            if not _runs_here(backend, flavour["dtype"]):
                with pytest.raises(TypeError, match="triton"):
                    _call(entry, backend, *_features(2, 2, torch.float64, 0, False), 0.1, 0.5, 0.0, "mean")
                continue
            outcomes[backend] = _outcome(entry, backend, flavour, problem)
        for backend, outcome in outcomes.items():
            if outcome is None:
                continue
            kind, message = outcome
            if kind in (AssertionError, RuntimeError) or not any(name in message for name in ARGUMENTS):
                failures.append(f"{entry}/{backend}: {kind.__name__}: {message[:300]}")
        kinds = {b: (None if o is None else o[0].__name__) for b, o in outcomes.items()}
        if len(set(kinds.values())) > 1:
            failures.append(f"{entry}: backends disagree: {kinds}")
    assert not failures, f"flavour {flavour}, problem {problem}:\n" + "\n".join(failures)


# ------------------------------------------------------------------ strategies
problems = st.tuples(
    st.sampled_from([1, 2, 5, 8]),  # N (1 first: hypothesis tries the first value most)
    st.sampled_from([3, 8]),  # D
    st.sampled_from([0.05, 0.01, 0.3]),  # τ
    st.sampled_from([0.5, 0.0, 2.0]),  # γ
    st.sampled_from([0.0, 0.1]),  # ε
    st.integers(0, 2**16),  # seed
    st.booleans(),  # captions near their images
)


def flavours(**fixed):
    base = dict(
        dtype=st.sampled_from(DTYPES),
        layout=st.just("contiguous"),
        made=st.just("plain"),
        grads=st.sampled_from([("img", "txt", "tau"), ("img",), ("txt",), ("tau",), ()]),
        form=st.just("tensor0"),
        context=st.just("none"),
        reduction=st.sampled_from(["mean", "sum", "none"]),
        scale_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
        tau16=st.sampled_from(LOWP),
    )
    base.update({k: (v if isinstance(v, st.SearchStrategy) else st.just(v)) for k, v in fixed.items()})
    return st.fixed_dictionaries(base)


# ------------------------------------------------------------------ the harness
@pytest.mark.filterwarnings("ignore:hn_clip_loss got tau")
@settings(max_examples=14, **SETTINGS)
@given(flavour=flavours(form=st.sampled_from(FORMS)), problem=problems)
def test_hyperparameter_forms(flavour, problem):
    """τ (``hn_clip_loss``, the distributed loss) and logit_scale (``HNClipLoss``) in every form and
    float dtype, with every feature dtype."""
    check_flavour(flavour, problem)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=3, **SETTINGS)
@given(flavour=flavours(dtype=st.sampled_from(DTYPES[:3]), made=st.sampled_from(MADE)), problem=problems)
def test_strides_and_how_tensors_were_made(layout, flavour, problem):
    check_flavour(dict(flavour, layout=layout), problem, entries=("hn_clip_loss", "HNClipLoss"))


@pytest.mark.parametrize("made", MADE)
@settings(max_examples=3, **SETTINGS)
@given(flavour=flavours(dtype=st.sampled_from(DTYPES[:3]), grads=st.just(("txt", "tau"))), problem=problems)
def test_frozen_image_tower(made, flavour, problem):
    """The image features made under no_grad / inference_mode / as a detached view, the text
    tower and τ trainable (LiT-style)."""
    check_flavour(dict(flavour, made=made), problem)


@pytest.mark.parametrize("context", CONTEXTS[1:])
@settings(max_examples=3, **SETTINGS)
@given(flavour=flavours(dtype=st.sampled_from(DTYPES[:3]), grads=st.just(("img", "txt", "tau"))), problem=problems)
def test_global_modes(context, flavour, problem):
    """detect_anomaly, use_deterministic_algorithms(True), autocast around forward and/or backward."""
    check_flavour(dict(flavour, context=context), problem, entries=("hn_clip_loss", "HNClipLoss"))


@pytest.mark.parametrize("kind", ["gamma", "label_smoothing"])
@pytest.mark.parametrize("form", FORMS)
def test_gamma_and_smoothing_forms(kind, form):
    """γ and ε as a Python float, int, NumPy scalar, 0-dim / one-element / 16-bit tensor: the right
    value on every backend and entry point, or one error naming the argument."""
    value = 0.5 if kind == "gamma" else 0.1
    arg, seen = _number(value, form)
    if form == "int":
        arg, seen = (1, 1.0) if kind == "gamma" else (0, 0.0)
    gamma, eps = (arg, 0.1) if kind == "gamma" else (0.5, arg)
    flavour = dict(
        dtype=torch.float32,
        layout="contiguous",
        made="plain",
        grads=("img", "txt", "tau"),
        form="tensor0",
        context="none",
        reduction="none",
        scale_dtype=torch.float32,
        tau16=torch.bfloat16,
    )
    for entry in ENTRIES:
        outcomes = {}
        for backend in ALL_BACKENDS:
            problem = (5, 8, 0.07, gamma, eps, 3, False)
            outcomes[backend] = _outcome(entry, backend, flavour, problem)
        kinds = {b: None if o is None else o[0].__name__ for b, o in outcomes.items()}
        assert len(set(kinds.values())) == 1, (entry, outcomes)
        for backend, o in outcomes.items():
            assert o is None or (o[0] in (TypeError, ValueError) and kind in o[1]), (entry, backend, o)


def _process_group():
    """A one-process gloo group, without initialising the default group."""
    return torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)


@pytest.mark.parametrize("with_group", [False, True], ids=["no_group", "group"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "averaged_model"])
def test_copied_module(how, with_group):
    """The module deep-copied, pickled, or wrapped by ``AveragedModel`` (EMA/SWA), with and
    without a process group: the copy computes the loss as the original does."""
    group = _process_group() if with_group else None

    def module_copy(module):
        module.group = group
        model = torch.nn.Sequential(module)
        if how == "deepcopy":
            copied = copy.deepcopy(model)
        elif how == "pickle":
            copied = pickle.loads(pickle.dumps(model))
        else:
            copied = torch.optim.swa_utils.AveragedModel(model).module
        if how == "deepcopy" or how == "averaged_model":
            assert copied[0].group is group  # a process group is shared, not copied
        return copied[0]

    flavour = dict(
        dtype=torch.float32,
        layout="contiguous",
        made="plain",
        grads=("img", "txt", "tau"),
        form="tensor0",
        context="none",
        reduction="mean",
        scale_dtype=torch.float32,
        tau16=torch.bfloat16,
        module_copy=module_copy,
    )
    check_flavour(flavour, (5, 8, 0.07, 0.5, 0.1, 1, False), entries=("HNClipLoss",))


@pytest.mark.parametrize("entry, form", [(e, "numpy") for e in ENTRIES] + [("hn_clip_loss", "tensor0")])
def test_compiled_hyperparameter_forms(entry, form):
    """``torch.compile(fullgraph=True)`` over a schedule of τ (logit_scale), γ and ε given as Python
    floats, NumPy scalars or (τ only) tensors: every backend compiles the step, matches the float64
    truth, and needs no more graphs than the same schedule as Python floats (at most 2: the first
    value, then one dynamic graph). Dynamo's "eager" backend: the graphs, not Inductor, are tested."""
    import torch._dynamo.testing

    img, txt = _features(5, 8, torch.float32, 7, False)
    schedule = [(0.05, 0.5, 0.1), (0.06, 0.7, 0.2), (0.07, 0.9, 0.05)]
    failures = []
    for backend in ALL_BACKENDS:
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()

        @torch.compile(fullgraph=True, backend=counter)
        def step(a, b, tau, gamma, eps, backend=backend):
            if entry == "HNClipLoss":
                return HNClipLoss(gamma=gamma, label_smoothing=eps, backend=backend, normalize=True)(a, b, 1 / tau)
            return _call(entry, backend, a, b, tau, gamma, eps, "mean")

        try:
            for tau, gamma, eps in schedule:
                hyper = (lambda x: np.float64(x)) if form == "numpy" else float
                tau_arg = torch.tensor(tau) if form == "tensor0" else hyper(tau)
                got = step(img, txt, tau_arg, hyper(gamma), hyper(eps))
                want = hn_clip_loss_f64(img, txt, tau, gamma, eps)
                if not _within(got, want, TOL_F32_LOSS):
                    failures.append(f"{backend}: loss {float(got)} != {float(want)}")
        except Exception as exc:  # noqa: BLE001 - every backend's outcome is reported
            failures.append(f"{backend}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        if counter.frame_count > 2:
            failures.append(f"{backend}: {counter.frame_count} graphs for a schedule of 3 values (floats: ≤ 2)")
    torch._dynamo.reset()
    assert not failures, f"{entry}, {form}:\n" + "\n".join(failures)
