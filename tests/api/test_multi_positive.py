"""Multi-positive targets: ``group_mode="supcon"`` / ``"mil_nce"`` of ``hn_clip_loss`` and
``HNClipLoss`` (docs/hard_negatives.md, "Multi-positive targets").

Every value and gradient (img, txt, negatives, τ) per row against the float64 oracle
``tests/positives_oracle.py`` (written from the formulas, independently of the reference), with
an uneven upstream gradient per row (so a wrong row weight cannot hide in a mean), on every
backend (torch, cpp where the extension is built, and Triton). Tolerances
(relative, per row, :func:`row_error`, rows floored at 1e-4 of the largest): float64 inputs 1e-10
(another order of the same sums; measured ≤ 1.3e-15 on torch, ≤ 1.3e-14 on cpp), float32 inputs
1e-4 (float32's gradient bound of the README, measured ≤ 2.7e-6 on torch, ≤ 1.3e-6 on cpp, ≤ 4.7e-6 on
Triton, which runs float32 only: the interpreter's default-tier draws are few, more under slow). The
16-bit features (rows within 1e-5, gradients within their own rounding), the
singleton-group reduction to the plain loss, the all-one-group edge, every refusal and the
default's bit-identity are checked here too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from family_oracle import features
from helpers import rel_err
from hnclip_kernels import HNClipLoss, LossOptions, hn_clip_loss
from hnclip_kernels.backends import cpp_directional, rank_losses
from hnclip_kernels.margin import Margin
from hnclip_kernels.validation_family import Family
from positives_oracle import positives_f64

MODES = ["supcon", "mil_nce"]
# every backend runs the positive modes (cpp where the extension is built; Triton in float32 and 16-bit only)
BACKENDS = ["torch"] + (["cpp"] if cpp_directional() is not None else []) + ["triton"]
N, D = 7, 8
IDS = torch.tensor([0, 3, 0, 1, 3, 3, 5])  # groups of 2, 3, 1 and 1
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def widest(backend: str) -> torch.dtype:
    """The widest dtype ``backend`` runs: float64, float32 for Triton."""
    return torch.float32 if backend == "triton" else torch.float64


FLOOR = 1e-4  # a row's norm floor, relative to the largest row's (row_error)
# float32 draws: 1e-2. A D = 2, s = 50 draw's d txt row at 3.6e-4 of the largest carries 2.8e-5 of
# float32 cancellation (5.9e-4 of itself) on torch, cpp and Triton alike; the same draws in float64
# keep FLOOR (torch, cpp)
FLOOR_F32_DRAWS = 1e-2


def run_rows(img, txt, neg, tau, ids, mode, dtype=torch.float64, backend="torch", **kw):
    """(rows, grads) of ``hn_clip_loss(reduction="none")`` and of the oracle on the same values,
    both weighted by the same uneven upstream per row."""
    img, txt = img.to(dtype), txt.to(dtype)
    neg = None if neg is None else neg.to(dtype)
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt) + (() if neg is None else (neg,))]
    tau_t = torch.tensor(tau, dtype=dtype, requires_grad=True)
    api = dict(kw)
    if "threshold" in api:
        api["false_negative_threshold"] = api.pop("threshold")
    got = hn_clip_loss(
        leaves[0], leaves[1], tau_t, negatives=leaves[2] if neg is not None else None, group_ids=ids,
        group_mode=mode, reduction="none", backend=backend, **api,
    )  # fmt: skip
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64)
    got_grads = torch.autograd.grad((got.double() * upstream).sum(), leaves + [tau_t])
    ref = [x.detach().double().requires_grad_(True) for x in leaves]
    ref_tau = torch.tensor(float(tau_t.detach()), dtype=torch.float64, requires_grad=True)
    want = positives_f64(ref[0], ref[1], ref_tau, ids, mode, ref[2] if neg is not None else None, **kw)
    want_grads = torch.autograd.grad((want * upstream).sum(), ref + [ref_tau])
    names = ["img", "txt"] + (["negatives"] if neg is not None else []) + ["tau"]
    return got, want, dict(zip(names, got_grads)), dict(zip(names, want_grads))


def row_error(got: torch.Tensor, want: torch.Tensor, floor_share: float = FLOOR) -> float:
    """The worst row's ‖got_i − want_i‖ / ‖want_i‖, each row's norm floored at ``FLOOR`` of the largest
    row's (a gradient row that is a cancellation remnant, e.g. ~1e-12 of a row whose raw gradient is
    along the feature and projected out by the normalisation, carries both sides' rounding of the
    large terms); the relative error for a scalar."""
    got, want = got.double(), want.double()
    if want.dim() == 0:
        return rel_err(got, want)
    got, want = got.reshape(want.shape[0], -1), want.reshape(want.shape[0], -1)
    norms = want.norm(dim=1)
    floor = floor_share * norms.max().clamp_min(1e-300)
    return ((got - want).norm(dim=1) / torch.maximum(norms, floor)).max().item()


def rows_agree(got, want, gg, wg, tol, floor_share=FLOOR):
    """Rows and every gradient per row within ``tol`` (:func:`row_error`)."""
    errors = worst(got, want, gg, wg, floor_share)
    assert all(e <= tol for e in errors.values()), errors


def worst(got, want, gg, wg, floor_share=FLOOR):
    """The worst per-row relative error (:func:`row_error`) of the rows and of every gradient."""
    out = {"loss": row_error(got, want, floor_share)}
    out.update({f"d {name}": row_error(gg[name], wg[name], floor_share) for name in gg})
    return out


CASES = {
    "plain": dict(),
    "negatives": dict(m=5),
    "smoothing": dict(m=5, label_smoothing=0.1),
    "threshold": dict(m=5, threshold=0.3),
    "image_text": dict(m=5, margin="image_text", gamma=2.0),
    "unnormalized": dict(m=3, normalize=False, label_smoothing=0.2),
    "gamma0": dict(gamma=0.0, label_smoothing=0.1, threshold=0.3),
}


def _case(name, seed=1):
    kw = dict(CASES[name])
    m = kw.pop("m", 0)
    img, txt, neg = features(N, D, seed), features(N, D, seed + 1), features(m, D, seed + 2)
    if kw.get("normalize") is False:
        img, txt, neg = (F.normalize(x.double(), dim=1) * 1.01 for x in (img, txt, neg))
    if "threshold" in kw:  # every caption cosine away from the threshold (float32 vs float64 compare)
        xs = F.normalize(torch.cat([txt, neg]).double(), dim=1)
        assert ((F.normalize(txt.double(), dim=1) @ xs.T - kw["threshold"]).abs() > 1e-4).all()
    return img, txt, neg if m else None, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_rows_and_gradients_match_the_oracle(mode, case, dtype, backend):
    if dtype == torch.float64 and backend == "triton":
        pytest.skip("backend='triton' takes no float64 (a TypeError naming backend='torch')")
    img, txt, neg, kw = _case(case)
    got, want, gg, wg = run_rows(img, txt, neg, 0.1, IDS, mode, dtype, backend, **kw)
    rows_agree(got, want, gg, wg, TOL[dtype])


# a 16-bit gradient is its float32 value rounded once: within the unit roundoff u per element, so a
# row within u of its norm, plus float32's 1e-4; the rows come back in float32 (1e-5)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_16bit_features_match_the_oracle(mode, dtype, backend):
    # the oracle on the 16-bit values; measured over every case: rows ≤ 8.0e-7, gradients ≤ 2.8e-3
    # (bf16) and ≤ 3.8e-4 (fp16) on every backend, the gradients' own rounding
    for case in CASES:
        img, txt, neg, kw = _case(case)
        got, want, gg, wg = run_rows(img, txt, neg, 0.1, IDS, mode, dtype, backend, **kw)
        assert got.dtype == torch.float32
        errors = worst(got, want, gg, wg)
        assert errors["loss"] <= 1e-5, (case, errors)
        assert all(e <= UNIT_ROUNDOFF[dtype] + 1e-4 for e in errors.values()), (case, errors)


def _drawn(backend, n, d, m, tau, gamma, eps, n_groups, margin, threshold, mode, seed):
    """One drawn case against the oracle: float64 within 1e-10; Triton's float32 within 1e-4 up to a
    logit scale s = (1 + γ)/τ of 20, s/20 · 1e-4 beyond: a float32 logit carries s·2^-24, which a
    gradient row that is a small remnant of its terms magnifies (a D = 2 draw at s = 150: d img
    3.0e-4 on torch and cpp in float32 alike, 3.1e-4 on Triton)."""
    img, txt, neg = features(n, d, seed), features(n, d, seed + 1), features(m, d, seed + 2)
    if threshold is not None:
        xs = F.normalize(torch.cat([txt, neg]).double(), dim=1)
        assume(((F.normalize(txt.double(), dim=1) @ xs.T - threshold).abs() > 1e-4).all())
    ids = torch.randint(0, n_groups, (n,), generator=torch.Generator().manual_seed(seed))
    kw = dict(margin=margin, gamma=gamma, label_smoothing=eps, threshold=threshold)
    dtype = widest(backend)
    got, want, gg, wg = run_rows(img, txt, neg if m else None, tau, ids, mode, dtype, backend, **kw)
    if dtype == torch.float64:
        rows_agree(got, want, gg, wg, TOL[dtype])
    else:  # a gradient row under 1% of the largest is a remnant of terms of the largest's size
        rows_agree(got, want, gg, wg, TOL[dtype] * max(1.0, (1 + gamma) / tau / 20), FLOOR_F32_DRAWS)


DRAWS = dict(
    n=st.integers(1, 7),
    d=st.integers(2, 6),
    m=st.integers(0, 6),
    tau=st.sampled_from([0.02, 0.07, 0.3, 1.0]),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
    eps=st.sampled_from([0.0, 0.1]),
    n_groups=st.sampled_from([1, 2, 3, 8]),
    margin=st.sampled_from(["text", "image_text"]),
    threshold=st.sampled_from([None, 0.4]),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@settings(max_examples=40, deadline=None)
@given(**DRAWS)
def test_drawn_group_structures_match_the_oracle(backend, **draw):
    """Random group structures (1 group … all singletons), sizes, τ, γ, ε, margins, thresholds."""
    _drawn(backend, **draw)


@settings(max_examples=6, deadline=None)
@given(**DRAWS)
@example(n=4, d=2, m=2, tau=0.02, gamma=0.0, eps=0.0, n_groups=8, margin="text", threshold=None, mode="supcon",
         seed=367)  # fmt: skip
def test_drawn_group_structures_match_the_oracle_on_triton(**draw):
    """The draws above on Triton (float32; the interpreter: a few draws in the default tier)."""
    _drawn("triton", **draw)


@pytest.mark.slow  # the interpreter: about 1.5 s a draw on 2 loaded cores
@settings(max_examples=60, deadline=None)
@given(**DRAWS)
def test_many_drawn_group_structures_on_triton(**draw):
    _drawn("triton", **draw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("mode", MODES)
def test_rank_rows_match_the_oracle(mode, margin, backend):
    """A distributed rank's rows without ranks: ``backends.rank_losses`` (the directional operator
    twice) for local rows 2…4 against all N pairs and M negatives, groups reaching outside the rows,
    are the oracle's rows 2…4 (values, and gradients of an uneven weighting into every input and τ,
    float64 within 1e-10; Triton float32 within 1e-4)."""
    dtype = widest(backend)
    img, txt, neg, _ = _case("negatives", seed=20)
    img, txt, neg = (x.to(dtype).requires_grad_(True) for x in (img, txt, neg))
    tau = torch.tensor(0.1, dtype=dtype, requires_grad=True)
    kw = dict(gamma=1.5, label_smoothing=0.1, false_negative_threshold=0.3)
    options = LossOptions(backend=backend, group_mode=mode, margin=margin, **kw).resolved(img)
    family = Family(neg, IDS, Margin.parse(margin))
    rows = rank_losses(img[2:5], txt[2:5], img, txt, tau, 2, options, family=family)
    upstream = torch.tensor([0.5, 1.25, 2.0], dtype=torch.float64)
    got = torch.autograd.grad((rows.double() * upstream).sum(), [img, txt, neg, tau])
    leaves = [x.detach().double().requires_grad_(True) for x in (img, txt, neg, tau)]
    oracle_kw = dict(gamma=1.5, label_smoothing=0.1, threshold=0.3, margin=margin)
    want = positives_f64(leaves[0], leaves[1], leaves[3], IDS, mode, leaves[2], **oracle_kw)[2:5]
    wanted = torch.autograd.grad((want * upstream).sum(), leaves)
    assert row_error(rows, want) <= TOL[dtype]
    for name, g, w in zip(("img", "txt", "negatives", "tau"), got, wanted):
        assert row_error(g, w) <= TOL[dtype], name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kw", [dict(), dict(label_smoothing=0.1, false_negative_threshold=0.3)], ids=["plain", "eps"])
def test_singleton_groups_are_the_plain_loss(mode, kw, backend):
    """Every pair its own group: both modes are today's loss on the same backend (values and
    gradients, float64 within 1e-13; Triton float32 within 1e-6: the loss from two statistics'
    softplus forms against one's)."""
    dtype = widest(backend)
    img, txt, neg = features(N, D, 3, dtype), features(N, D, 4, dtype), features(4, D, 5, dtype)
    out = []
    for extra in (dict(group_ids=torch.arange(N), group_mode=mode), dict()):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        rows = hn_clip_loss(*leaves[:2], 0.1, negatives=leaves[2], reduction="none", backend=backend, **kw, **extra)
        out.append((rows.detach(), *torch.autograd.grad((rows * torch.linspace(0.5, 1.5, N)).sum(), leaves)))
    for name, got, want in zip(("rows", "d img", "d txt", "d negatives"), *out):
        assert rel_err(got, want) <= (1e-13 if dtype == torch.float64 else 1e-6), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_one_group(mode, backend):
    """Every pair in one group: without negatives and ε, MIL-NCE's rows are 0 (every class a
    positive) and SupCon's are LSE_i − mean_k Z_ik > 0 (the oracle); with negatives both are the oracle's."""
    img, txt, neg = features(N, D, 6), features(N, D, 7), features(3, D, 8)
    ids = torch.zeros(N, dtype=torch.long)
    dtype = widest(backend)
    got, want, gg, wg = run_rows(img, txt, None, 0.07, ids, mode, dtype, backend)
    if mode == "mil_nce":  # exactly 0 here; the oracle's log-softmax form leaves rounding (≤ 1e-13)
        assert torch.equal(got, torch.zeros_like(got))
        assert all(torch.count_nonzero(g) == 0 for g in gg.values())
        assert want.abs().max() < 1e-13 and all(w.abs().max() < 1e-12 for w in wg.values())
    else:
        assert (got > 0).all()
        rows_agree(got, want, gg, wg, TOL[dtype])
    rows_agree(*run_rows(img, txt, neg, 0.07, ids, mode, dtype, backend, label_smoothing=0.1), TOL[dtype])


@pytest.mark.parametrize("mode", MODES)
def test_module_is_the_function(mode):
    """``HNClipLoss(group_mode=...)`` (one process, logit_scale = 1/τ) is hn_clip_loss's mean, and
    its attribute is the typed option (repr, assignment validated)."""
    img, txt = features(N, D, 9, torch.float64), features(N, D, 10, torch.float64)
    module = HNClipLoss(normalize=True, group_mode=mode)
    want = hn_clip_loss(img, txt, 0.05, group_ids=IDS, group_mode=mode)
    assert torch.equal(module(img, txt, 20.0, group_ids=IDS), want)
    assert f"group_mode='{mode}'" in repr(module) and module.group_mode == mode
    with pytest.raises(ValueError, match="group_mode must be one of"):
        module.group_mode = "positives"
    assert module.group_mode == mode


def test_default_is_bit_identical():
    """group_mode="mask" (given or not) is today's call, bit for bit, with and without ids."""
    img, txt = features(N, D, 11), features(N, D, 12)
    for backend in BACKENDS:
        for ids in (None, IDS):
            out = []
            for extra in (dict(), dict(group_mode="mask")):
                leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
                loss = hn_clip_loss(*leaves, 0.07, group_ids=ids, backend=backend, **extra)
                out.append((loss, *torch.autograd.grad(loss, leaves)))
            assert all(torch.equal(a, b) for a, b in zip(*out)), (backend, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_saturated_rows_keep_their_value(backend):
    """τ = 0.01, each group's pairs near one centre: rows far below float32's epsilon keep their
    value in float32 (the softplus forms), per row against the oracle within 1e-5 (measured 1.9e-7 on
    torch and cpp); on Triton within 3e-5 (measured 9.9e-6, MIL-NCE): a saturated row's relative loss
    error is its gap's absolute error, and the kernels' tile logits and the host's positive logit
    Z_i,pos round apart by about an ulp of |Z| ≤ 1/τ = 100 (7.6e-6). The gradients within 1e-3
    (measured 2.3e-4 on torch, 2.7e-4 on cpp, 2.6e-4 on Triton): within a group they are p_ip −
    1/|P(i)| (SupCon) of positives whose logits differ by O(1) at τ = 0.01, so float32's rounding of
    the logits (2.5/τ·2^-24 ≈ 1.5e-5 absolute) is a 1e-4 relative error of that difference:
    conditioning, the same on any float32 implementation."""
    centres = F.normalize(features(4, 16, 13, torch.float64), dim=1)
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    img = (centres[ids] + 0.01 * features(8, 16, 14, torch.float64)).float()
    txt = (centres[ids] + 0.01 * features(8, 16, 15, torch.float64)).float()
    for mode in MODES:
        got, want, gg, wg = run_rows(img, txt, None, 0.01, ids, mode, torch.float32, backend, gamma=0.0)
        if mode == "mil_nce":
            assert want.min() < 1e-12  # saturated: below float32's epsilon
        errors = worst(got, want, gg, wg)
        loss_tol = 3e-5 if backend == "triton" else 1e-5
        assert errors.pop("loss") <= loss_tol and all(e <= 1e-3 for e in errors.values()), (mode, errors)


# ----------------------------------------------------------------------------- the refusals


def test_refusals_name_the_option():
    img, txt = features(N, D, 16), features(N, D, 17)
    with pytest.raises(ValueError, match="group_mode must be one of.*'positive' is hn_siglip_loss's"):
        hn_clip_loss(img, txt, 0.07, group_ids=IDS, group_mode="positive")
    with pytest.raises(TypeError, match="group_mode must be a string"):
        LossOptions(group_mode=1)
    with pytest.raises(ValueError, match="group_mode='supcon'.*no group_ids were passed"):
        hn_clip_loss(img, txt, 0.07, group_mode="supcon")
    with pytest.raises(ValueError, match="group_mode='mil_nce'.*no group_ids were passed"):
        HNClipLoss(normalize=True, group_mode="mil_nce")(img, txt, 14.0)
    with pytest.raises(ValueError, match="return_stats=True is not supported with group_mode='supcon'"):
        hn_clip_loss(img, txt, 0.07, group_ids=IDS, group_mode="supcon", return_stats=True)
    with pytest.raises(ValueError, match="return_stats=True is not supported with group_mode='mil_nce'"):
        HNClipLoss(normalize=True, group_mode="mil_nce", return_stats=True)(img, txt, 14.0, group_ids=IDS)
    with pytest.raises(TypeError, match="backend='triton' supports float16, bfloat16 and float32"):
        hn_clip_loss(img.double(), txt.double(), 0.07, group_ids=IDS, group_mode="supcon", backend="triton")


@pytest.mark.skipif(cpp_directional() is None, reason="the C++ extension is not built")
def test_cpp_refusals():
    """The cpp entries check what LossOptions checks (a direct call), and the raw positives' kernel
    range-checks the mode's code once (registration.cpp)."""
    from hnclip_kernels.backends.cpp.ops import directional_nll_cpp, hn_clip_pairs_cpp
    from hnclip_kernels.group_mode import GroupMode

    img, txt = features(N, D, 16), features(N, D, 17)
    common = dict(tau=torch.tensor(0.07), gamma=0.5, label_smoothing=0.0, normalize=True)
    with pytest.raises(ValueError, match="group_mode='supcon' needs group ids"):
        hn_clip_pairs_cpp(img, txt, group_mode=GroupMode.SUPCON, **common)
    with pytest.raises(ValueError, match="return_stats=True is not supported with group_mode='mil_nce'"):
        directional_nll_cpp(
            img, txt, query_txt=txt, key_txt=txt, offset=0, query_groups=IDS, key_groups=IDS,
            group_mode=GroupMode.MIL_NCE, return_stats=True, **common,
        )  # fmt: skip
    ids = IDS.to(torch.long)
    args = (img, txt, torch.zeros(N), torch.tensor(10.0), 0, ids, ids, torch.zeros(4, N), torch.ones(N), 0.0)
    for code, message in ((3, "unknown group mode code 3"), (0, "take group mode 1 .supcon. or 2 .mil_nce., got 0")):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.hnclip.cpp_raw_positive_bwd(*args, code)


def test_triton_refusals():
    """The Triton entries check what LossOptions checks (a direct call: the one check both fused
    backends' entries share, ``backends.positives.check_positives``); the host pass refuses "mask"."""
    from hnclip_kernels.backends.triton.ops import directional_nll_triton, hn_clip_pairs_triton
    from hnclip_kernels.group_mode import GroupMode

    img, txt = features(N, D, 16), features(N, D, 17)
    common = dict(tau=torch.tensor(0.07), gamma=0.5, label_smoothing=0.0, normalize=True)
    with pytest.raises(ValueError, match="group_mode='supcon' needs group ids"):
        hn_clip_pairs_triton(img, txt, group_mode=GroupMode.SUPCON, **common)
    with pytest.raises(ValueError, match="return_stats=True is not supported with group_mode='mil_nce'"):
        directional_nll_triton(
            img, txt, query_txt=txt, key_txt=txt, offset=0, query_groups=IDS, key_groups=IDS,
            group_mode=GroupMode.MIL_NCE, return_stats=True, **common,
        )  # fmt: skip
    args = (img, txt, torch.zeros(N), torch.tensor(10.0), 0, IDS, IDS, torch.zeros(4, N), torch.ones(N))
    with pytest.raises(ValueError, match="takes group_mode 1 .supcon. or 2 .mil_nce., got 0"):
        torch.ops.hnclip.host_positive_bwd(*args, torch.tensor(0.0), 0)


def test_auto_picks_a_positive_backend():
    """backend="auto" runs the positive modes where it would run "mask" when that backend has them
    (float32 on CPU: cpp where built), else on the torch reference (float64 on CPU): the same bits
    as naming that backend."""
    cpu32 = "cpp" if cpp_directional() is not None else "torch"
    for dtype, backend in ((torch.float32, cpu32), (torch.float64, "torch")):
        img, txt = features(N, D, 18, dtype), features(N, D, 19, dtype)
        for mode in MODES:
            auto = hn_clip_loss(img, txt, 0.07, group_ids=IDS, group_mode=mode)
            assert torch.equal(auto, hn_clip_loss(img, txt, 0.07, group_ids=IDS, group_mode=mode, backend=backend))
