"""``HNClipLoss``'s attributes are its options (one copy, in ``self.options``), and the warnings
about a logit_scale or features that are valid but almost surely a mistake.

Bounds: batches of 12 pairs of dimension 16; two small ``torch.compile`` runs (a few seconds each).
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from cases import make_pair
from helpers import hn_clip_loss_f64, rel_err
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.distributed import distributed_hn_clip_loss

N, D = 12, 16
FUSED = "cpp" if cpp_directional() is not None else "triton"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())


def unit_pair(seed=0, dtype=torch.float32):
    img, txt = make_pair(N, D, seed=seed)
    txt[3] = txt[7]  # a duplicate caption: the threshold has something to mask
    return F.normalize(img, dim=1).to(dtype), F.normalize(txt, dim=1).to(dtype)


def loss_and_grads(module, img, txt, scale):
    img, txt = img.clone().requires_grad_(), txt.clone().requires_grad_()
    scale = torch.tensor(scale, dtype=torch.float32, requires_grad=True)
    loss = module(img, txt, scale)
    return (loss, *torch.autograd.grad(loss, (img, txt, scale)))


# (attribute, value assigned, constructor arguments of the module it is assigned on)
ASSIGNMENTS = [
    ("gamma", 0.3, {}),
    ("gamma", 0.0, {}),
    ("label_smoothing", 0.1, {}),
    ("false_negative_threshold", 0.999, {}),
    ("normalize", True, {}),
    ("backend", "torch", dict(backend=FUSED)),
    ("backend", FUSED, dict(backend="torch")),
    ("precision", "bf16x3", dict(backend="triton")),
]


@pytest.mark.filterwarnings("ignore:normalize=False")
@pytest.mark.parametrize("name, value, base", ASSIGNMENTS, ids=[f"{a[0]}={a[1]}" for a in ASSIGNMENTS])
def test_assigned_option_is_the_one_the_loss_uses(name, value, base):
    # before, loss.gamma = 0.3 changed repr and nothing else: the loss kept the constructor's γ
    img, txt = unit_pair()
    if name == "normalize":
        img, txt = 3 * img, 2 * txt  # features off unit norm: normalising changes the loss
    module = HNClipLoss(**base)
    before = loss_and_grads(module, img, txt, 20.0)
    setattr(module, name, value)
    assert getattr(module, name) == value and getattr(module.options, name) == value
    got = loss_and_grads(module, img, txt, 20.0)
    fresh = loss_and_grads(HNClipLoss(**{**base, name: value}), img, txt, 20.0)
    for g, f in zip(got, fresh):
        assert torch.equal(g, f), name
    if name == "precision":  # bf16x3 moves a float32 loss by a few ulps
        assert not torch.equal(got[0], before[0]), "assigning precision changed nothing"
    elif name != "backend":  # another backend agrees to rounding; every other option moves the loss
        assert (got[0] - before[0]).abs().item() > 1e-4, f"assigning {name} changed nothing"


def test_gamma_schedule_matches_the_float64_formula():
    # a γ warm-up written as an attribute assignment: loss and every gradient at each γ
    img, txt = unit_pair(seed=1)
    module = HNClipLoss(backend=FUSED, gamma=0.0)
    for gamma in (0.0, 0.25, 0.5):
        module.gamma = gamma
        loss, d_img, d_txt, d_scale = loss_and_grads(module, img, txt, 20.0)
        i64, t64 = img.double().requires_grad_(), txt.double().requires_grad_()
        s64 = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
        want = hn_clip_loss_f64(i64, t64, s64.reciprocal(), gamma=gamma, normalize=False)
        want_grads = torch.autograd.grad(want, (i64, t64, s64))
        assert rel_err(loss, want) <= 1e-6, gamma
        for got, expected in zip((d_img, d_txt, d_scale), want_grads):
            assert rel_err(got, expected) <= 1e-5, gamma


BAD = [
    ("gamma", -1.0),
    ("gamma", float("nan")),
    ("gamma", "0.5"),
    ("label_smoothing", 1.0),
    ("label_smoothing", None),
    ("backend", "cuda"),
    ("normalize", 1),
    ("precision", "fp8"),
    ("precision", 3),
    ("false_negative_threshold", 1.5),
    ("false_negative_threshold", "0.9"),
    ("return_stats", "yes"),
    ("local_loss", 0),
    ("gather_with_grad", None),
    ("cache_labels", "no"),
    ("use_horovod", True),
    ("rank", 1),
    ("rank", 0.0),
    ("world_size", 0),
    ("world_size", "2"),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_invalid_assignment_raises_the_constructors_error(name, value):
    with pytest.raises((TypeError, ValueError)) as at_construction:
        HNClipLoss(**{name: value})
    module = HNClipLoss()
    state = (module.options, dict(module.__dict__))
    with pytest.raises(at_construction.type) as at_assignment:
        setattr(module, name, value)
    assert str(at_assignment.value) == str(at_construction.value)
    assert (module.options, dict(module.__dict__)) == state  # nothing changed


def test_rank_and_world_size_assignment_keeps_the_layout_valid():
    module = HNClipLoss()
    module.world_size = 4
    module.rank = 3
    assert (module.rank, module.world_size) == (3, 4)
    with pytest.raises(ValueError, match="0 <= rank < world_size, got rank=3, world_size=2"):
        module.world_size = 2


def test_repr_shows_the_options_in_use():
    module = HNClipLoss(backend="torch")
    module.gamma, module.label_smoothing, module.false_negative_threshold = 0.3, 0.05, 0.9
    text = repr(module)
    assert "gamma=0.3," in text and "label_smoothing=0.05," in text and "false_negative_threshold=0.9" in text
    np = pytest.importorskip("numpy")
    module.gamma = np.float32(0.25)  # stored as the plain float the loss uses
    assert "gamma=0.25," in repr(module) and type(module.gamma) is float


@pytest.mark.parametrize("backend", sorted({"torch", FUSED}))
def test_compiled_module_follows_an_assigned_gamma(backend):
    # torch.compile may recompile on a new γ; it must never run a stale one
    torch._dynamo.reset()
    img, txt = unit_pair(seed=2)
    module = HNClipLoss(backend=backend)
    compiled = torch.compile(module)
    for gamma in (0.5, 0.1, 0.5):
        module.gamma = gamma
        got = compiled(img, txt, torch.tensor(20.0))
        want = HNClipLoss(backend=backend, gamma=gamma)(img, txt, torch.tensor(20.0))
        assert rel_err(got, want) <= 1e-6, gamma


def test_copies_and_pickles_keep_assigned_options():
    module = HNClipLoss(backend="torch")
    module.gamma, module.return_stats = 0.3, True
    img, txt = unit_pair(seed=7)
    want = HNClipLoss(backend="torch", gamma=0.3)(img, txt, 20.0)
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert (other.gamma, other.return_stats) == (0.3, True)
        assert other.options == module.options and torch.equal(other(img, txt, 20.0), want)
        other.gamma = 0.1  # a copy's options are its own
        assert module.gamma == 0.3
    assert module.state_dict() == {} and HNClipLoss().load_state_dict(module.state_dict()) == ([], [])


def test_a_module_pickled_by_the_previous_version_still_loads_and_copies():
    # its __dict__ held the options twice (plain gamma, ... and options) and rank before world_size
    module = HNClipLoss(rank=1, world_size=2, gamma=0.25, backend="torch")
    state = module.__getstate__()
    old = {k: v for k, v in state.items() if k not in ("rank", "world_size")}
    old = {"rank": 1, "world_size": 2, **old, "gamma": 0.25, "label_smoothing": 0.0, "backend": "torch"}
    restored = HNClipLoss.__new__(HNClipLoss)
    restored.__setstate__(old)
    for loss in (restored, copy.deepcopy(restored)):
        assert (loss.rank, loss.world_size, loss.gamma) == (1, 2, 0.25)
        loss.gamma = 0.3
        assert loss.options.gamma == 0.3 and "gamma=0.3," in repr(loss)


# ------------------------------------------------------------------ logit_scale plausibility


@pytest.mark.parametrize(
    "scale, words",
    [(0.07, "logit_scale = 0.07 < 1"), (torch.tensor(2.66), "log-scale"), (1.0, "log-scale"), (4.6, "log-scale")],
)
def test_implausible_logit_scale_warns_once_at_the_callers_line(scale, words):
    # τ (0.07) or open_clip's raw log-scale (log(1/0.07) = 2.66) trained at τ = 14.3 or 0.38, silently
    img, txt = unit_pair(seed=3)
    module = HNClipLoss(backend="torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module(img, txt, scale)  # line below: the warning points here, not inside the package
        line = sys._getframe().f_lineno - 1
        module(img, txt, scale)
        HNClipLoss(backend="torch")(img, txt, scale)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert issubclass(caught[0].category, RuntimeWarning)
    message = str(caught[0].message)
    assert words in message and ("exp()" in message or "1 / tau" in message)
    assert caught[0].filename == __file__ and caught[0].lineno == line


@pytest.mark.parametrize(
    "entry, words",
    [
        ("hn_clip_loss", r"^hn_clip_loss got tau = 14\.3 > 1: tau is the temperature"),
        ("saturation_report", r"^saturation_report got tau = 14\.3 > 1: tau is the temperature"),
        ("HNClipLoss 0.07", r"^HNClipLoss got logit_scale = 0\.07 < 1: logit_scale is 1/tau"),
        ("HNClipLoss 2.66", r"^HNClipLoss got logit_scale = 2\.66, in the range of open_clip's un-exponentiated"),
    ],
)
def test_scale_warnings_name_what_each_entry_point_was_passed(entry, words):
    # each entry point's warning speaks of its own argument: τ for the functions, logit_scale (and
    # open_clip's model.logit_scale it came from) for the module; clip_model_loss, which takes the
    # model, is tests/integrations/test_transformers.py's
    from hnclip_kernels.diagnostics import saturation_report

    img, txt = unit_pair(seed=3)
    calls = {
        "hn_clip_loss": lambda: hn_clip_loss(img, txt, 14.3, backend="torch"),
        "saturation_report": lambda: saturation_report(img, txt, 14.3, backend="torch"),
        "HNClipLoss 0.07": lambda: HNClipLoss(backend="torch")(img, txt, 0.07),
        "HNClipLoss 2.66": lambda: HNClipLoss(backend="torch")(img, txt, 2.66),
    }
    with pytest.warns(RuntimeWarning, match=words) as caught:
        calls[entry]()
    assert len(caught) == 1, [str(w.message) for w in caught]


def test_plausible_values_never_warn():
    # open_clip's s from 14.3 (init) to 100 (its clamp), in every form, with unit-norm features in
    # every dtype (16-bit rounding leaves norms within 0.4% of 1) and normalize=False
    module = HNClipLoss(backend="torch")
    np = pytest.importorskip("numpy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            img, txt = unit_pair(seed=4, dtype=dtype)
            for scale in (1 / 0.07, 4.7, 50.0, 100.0, torch.tensor(100.0, dtype=torch.bfloat16), np.float32(14.3)):
                module(img, txt, scale)
            hn_clip_loss(img, txt, 0.07, normalize=False)
            hn_clip_loss(img, txt, 1.0)  # τ = 1 stays a legitimate temperature for hn_clip_loss
            hn_clip_loss(3 * img, txt, 0.07, normalize=True)


# ------------------------------------------------------------------ normalize=False off unit norm


def _raw(seed=5):
    img, txt = make_pair(N, D, seed=seed)
    return 3 * F.normalize(img, dim=1), 0.9 * F.normalize(txt, dim=1)  # norms 3 and 0.9


@pytest.mark.parametrize("entry", ["HNClipLoss", "hn_clip_loss", "distributed_hn_clip_loss"])
def test_unnormalised_features_with_normalize_false_warn_once(entry):
    img, txt = _raw()
    call = {
        "HNClipLoss": lambda a, b: HNClipLoss(backend="torch")(a, b, 20.0),
        "hn_clip_loss": lambda a, b: hn_clip_loss(a, b, 0.05, normalize=False, backend="torch"),
        "distributed_hn_clip_loss": lambda a, b: distributed_hn_clip_loss(a, b, 0.05, normalize=False, backend="torch"),
    }[entry]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(img, txt)
        call(img, txt)
        call(F.normalize(img, dim=1), F.normalize(txt, dim=1))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "normalize=False" in message and "off 1 by up to 2" in message and "normalize=True" in message
    assert caught[0].filename == __file__


def test_slightly_off_unit_norm_is_quiet_and_beyond_five_percent_warns():
    img, txt = unit_pair(seed=6)
    module = HNClipLoss(backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(1.04 * img, 0.97 * txt, 20.0)
    with pytest.warns(RuntimeWarning, match="off 1 by up to 0.06"):
        module(img, 1.06 * txt, 20.0)


def test_overflowing_features_raise_and_leave_the_warning_for_later():
    # the overflow error already says "pass normalize=True": no warning on top, nor is its once spent
    img, txt = _raw()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="normalize=True"):
            hn_clip_loss(img * 1e20, txt * 1e20, 0.1, normalize=False, backend="torch")
    with pytest.warns(RuntimeWarning, match="normalize=False but the rows"):
        hn_clip_loss(img, txt, 0.1, normalize=False, backend="torch")
