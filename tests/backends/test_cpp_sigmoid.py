"""The fused C++ sigmoid (SigLIP) loss, ``hnclip::cpp_sigmoid_nll`` (``sigmoid_pairs_cpp``), against
the float64 oracle (tests/sigmoid_oracle.py), row by row: the loss rows and every gradient row
(img, txt, negatives) plus dL/ds and dL/db, in float64, float32 and 16-bit features (the oracle
on the 16-bit values); both margins, γ 0 / 0.5, M 0 / 1 / N + 3, group ids masked and positive,
a rank's rows (R < C at an offset), normalize on and off; saturated pairs; the tile grid past one
tile; opcheck, torch.compile, FlopCounterMode and the non-finite rule. The hypothesis sweep is in
the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sigmoid_cases import assert_rows, features, run, saturated

from hnclip_kernels import hn_siglip_loss
from hnclip_kernels.backends.pytorch.sigmoid_pairs import sigmoid_pairs_torch

cpp = pytest.importorskip("hnclip_kernels.backends.cpp.sigmoid_pairs", exc_type=ImportError)
fn = cpp.sigmoid_pairs_cpp

R, C, D = 5, 9, 7
IDS = (torch.tensor([0, 1, 1, 2, 0]), torch.tensor([0, 0, 1, 1, 2, 1, 0, 3, 3]))  # rows 2..6 of C
# (name, kwargs of run besides the dtype and margin): every axis of the brief at least once
CASES = {
    "plain": dict(m=0, gamma=0.5),
    "gamma0": dict(m=1, gamma=0.0),
    "negatives": dict(m=C + 3, gamma=0.5, offset=2),
    "ids-mask": dict(m=1, gamma=0.5, offset=2, ids=IDS),
    "ids-positive": dict(m=C + 3, gamma=0.5, offset=2, ids=IDS, positive=True),
    "ids-positive-gamma0": dict(m=0, gamma=0.0, offset=1, ids=IDS, positive=True),
    "unnormalized": dict(m=C + 3, gamma=0.5, offset=4, normalize=False, ids=IDS, scale=0.5, bias=1.0),
    "no-bias": dict(m=1, gamma=0.5, offset=3, bias=None),
}


def _case(dtype, margin, m=0, offset=0, scale=10.0, bias=-5.0, seed=0, **kw):
    img, txt, neg = features(R, D, seed, dtype), features(C, D, seed + 1, dtype), features(m, D, seed + 2, dtype)
    if kw.get("normalize") is False:  # unnormalised rows of norm ~1, so the logits stay moderate
        img, txt, neg = (x / (D**0.5) for x in (img, txt, neg))
    return run(fn, img, txt, neg, scale, bias, offset=offset, margin=margin, seed=seed, **kw), scale, C + m


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("name", list(CASES))
def test_rows_and_gradients_match_float64(name, margin, dtype):
    result, scale, columns = _case(dtype, margin, **CASES[name])
    assert result[0].dtype == dtype and result[0].shape == (R,)
    assert_rows(*result, dtype, scale, columns)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["negatives", "ids-positive", "ids-mask"])
def test_16bit_features_rows_within_their_rounding(name, dtype):
    result, scale, columns = _case(dtype, "text", **CASES[name])
    assert result[0].dtype == torch.float32
    assert_rows(*result, dtype, scale, columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_saturated_pairs_keep_their_gradient(margin, dtype):
    """s = 100, b = −80: positives at z ≈ 20, whose dL/dz ≈ −2e-9 is 0 in a float32 σ(z) − 1; every
    row of d img and d txt (near-duplicate caption clusters, a rank's rows, negatives) per row."""
    img, txt, neg = saturated(12, 15, 4, 64, dtype, offset=2)
    result = run(fn, img, txt, neg, 100.0, -80.0, offset=2, gamma=0.5, margin=margin)
    want = result[1]
    assert (want < 1e-8).any() and (want > 1.0).any(), f"not a mixed saturated batch: {want}"
    assert_rows(*result, dtype, 100.0, 19, floor=False)


def test_tile_grid_past_one_tile_matches_the_reference():
    """R = 150 rows (two tile-rows at most 128), 530 + 5 columns (two column tiles of 512), a rank's
    offset, ids positive under the text margin (the margin-free tile beside the logit tile): float64
    loss rows and every gradient equal to the torch reference's to 1e-12."""
    r, c, m, d = 150, 530, 5, 12
    img, txt, neg = features(r, d, 1, torch.float64), features(c, d, 2, torch.float64), features(m, d, 3, torch.float64)
    qg, kg = torch.arange(r) % 7, torch.arange(c) % 7
    out = []
    for f in (fn, sigmoid_pairs_torch):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        s, b = torch.tensor(10.0, dtype=torch.float64, requires_grad=True), torch.tensor(-6.0, dtype=torch.float64,
                                                                                         requires_grad=True)  # fmt: skip
        rows = f(leaves[0], leaves[1], s, b, offset=300, gamma=0.5, negatives=leaves[2], query_groups=qg,
                 key_groups=kg, groups_positive=True)  # fmt: skip
        u = torch.linspace(0.5, 1.5, r, dtype=torch.float64)
        out.append((rows, *torch.autograd.grad((rows * u).sum(), [*leaves, s, b])))
    for name, a, e in zip(("rows", "img", "txt", "neg", "s", "b"), *out):
        assert (a - e).abs().max() <= 1e-12 * e.abs().max(), name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_hn_siglip_loss_on_cpp_equals_torch(reduction):
    img, txt, neg = features(6, 5, 3), features(6, 5, 4), features(2, 5, 5)
    ids = torch.tensor([0, 1, 0, 2, 1, 3])
    kw = dict(negatives=neg, group_ids=ids, group_mode="positive", reduction=reduction)
    for bias in (-2.0, None):
        got = hn_siglip_loss(img, txt, 5.0, bias, backend="cpp", **kw)
        want = hn_siglip_loss(img, txt, 5.0, bias, backend="torch", **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    """γ = 0: gradcheck's finite differences would also move the detached margin."""
    img, txt, neg = (features(n, 4, k, torch.float64).requires_grad_() for k, n in enumerate((3, 5, 2)))
    s = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    ids = (torch.tensor([0, 1, 0]), torch.tensor([1, 0, 1, 0, 2]))

    def f(img, txt, neg, s, b):
        return fn(img, txt, s, b, offset=1, gamma=0.0, negatives=neg, query_groups=ids[0], key_groups=ids[1])

    assert torch.autograd.gradcheck(f, (img, txt, neg, s, b))


def test_opcheck():
    img, txt, neg = features(4, 6, 1), features(7, 6, 2), features(2, 6, 3)
    args = (
        img.requires_grad_(), txt.requires_grad_(), neg.requires_grad_(), torch.tensor([0, 1, 0, 2]),
        torch.tensor([2, 0, 1, 0, 2, 1, 1]), torch.tensor(4.0, requires_grad=True),
        torch.tensor(-2.0, requires_grad=True), torch.tensor(0.5, dtype=torch.float64), 2, True, 1, True,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.hnclip.cpp_sigmoid_nll.default, args)
    raw = (img.detach(), torch.cat([txt, neg]).detach(), torch.zeros(4), torch.tensor(4.0), torch.tensor(-2.0))
    torch.library.opcheck(torch.ops.hnclip.cpp_raw_sigmoid_fwd.default, (*raw, 2, 7, 0.5, 1))
    torch.library.opcheck(torch.ops.hnclip.cpp_raw_sigmoid_bwd.default, (*raw, torch.ones(4), 2, 7, 0.5, 0))


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    img, txt, neg = features(6, 5, 21), features(6, 5, 22), features(3, 5, 23)
    ids = torch.tensor([0, 1, 0, 2, 1, 3])

    def f(a, t, n, s, b):
        return hn_siglip_loss(a, t, s, b, negatives=n, group_ids=ids, margin="image_text", backend="cpp")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = []
    for g in (f, compiled):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        s, b = torch.tensor(7.0, requires_grad=True), torch.tensor(-3.0, requires_grad=True)
        loss = g(*leaves, s, b)
        out.append((loss.detach(), *torch.autograd.grad(loss, [*leaves, s, b])))
    for name, x, y in zip(("loss", "img", "txt", "neg", "s", "b"), *out):
        assert torch.equal(x, y), name


def test_flop_counts():
    """FlopCounterMode states the useful products: forward 2·R·(C + M)·D, backward twice that."""
    from torch.utils.flop_counter import FlopCounterMode

    r, c, m, d = 4, 6, 3, 8
    img, txt, neg = features(r, d, 1).requires_grad_(), features(c, d, 2).requires_grad_(), features(m, d, 3)
    s = torch.tensor(5.0, requires_grad=True)
    with FlopCounterMode(display=False) as mode:
        fn(img, txt, s, None, offset=1, negatives=neg).sum().backward()
    assert mode.get_total_flops() == 6 * r * (c + m) * d
    img.grad = txt.grad = None
    img.requires_grad_(False), txt.requires_grad_(False)
    with FlopCounterMode(display=False) as mode:  # s alone: the forward's row sums, no backward sweep
        fn(img, txt, s, None, offset=1, negatives=neg).sum().backward()
    assert mode.get_total_flops() == 2 * r * (c + m) * d and s.grad is not None


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_gives_non_finite_loss(bad, normalize):
    """A non-finite feature: a non-finite loss row, never a finite loss with non-finite gradients."""
    for where in ("img", "txt"):
        img, txt = features(4, 5, 1).requires_grad_(False), features(4, 5, 2)
        (img if where == "img" else txt)[1, 2] = bad
        leaves = [img.requires_grad_(), txt.requires_grad_()]
        s, b = torch.tensor(5.0, requires_grad=True), torch.tensor(-1.0, requires_grad=True)
        rows = fn(*leaves, s, b, normalize=normalize)
        grads = torch.autograd.grad(rows.sum(), [*leaves, s, b])
        assert not torch.isfinite(rows.sum()), (where, rows)
        if torch.isfinite(rows.sum()):
            assert all(torch.isfinite(g).all() for g in grads)


def test_bad_arguments_raise():
    img, txt = features(3, 4, 1), features(4, 4, 2)
    s, b = torch.tensor(1.0), torch.tensor(0.0)
    with pytest.raises(ValueError, match="offset"):
        fn(img, txt, s, b, offset=2)
    with pytest.raises(RuntimeError, match="unknown margin code"):
        torch.ops.hnclip.cpp_raw_sigmoid_fwd(img, txt, torch.zeros(3), s, b, 0, 4, 0.5, 2)
    with pytest.raises(RuntimeError, match="qg must be"):
        fn(img, txt, s, b, query_groups=torch.zeros(2, dtype=torch.long), key_groups=torch.zeros(4, dtype=torch.long))


DRAWS = dict(
    r=st.integers(1, 9),
    extra=st.integers(0, 5),
    d=st.integers(1, 9),
    m=st.sampled_from([0, 1, 4, 12]),
    scale=st.sampled_from([1.0, 10.0, 100.0]),
    bias=st.floats(-15.0, 5.0),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
    margin=st.sampled_from(["text", "image_text"]),
    groups=st.sampled_from([None, 1, 2, 4]),
    positive=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
    profile=st.sampled_from(["uniform", "clustered"]),
    seed=st.integers(0, 10_000),
)


def _draw(r, extra, d, m, scale, bias, gamma, margin, groups, positive, dtype, profile, seed):
    """One draw against the oracle: R rows at an offset into C = R + extra captions (non-tile sizes)."""
    # D = 1: z = s·(±1 ± γ·(±1)) + b, exactly 0 for b a multiple of s/2, where the oracle's
    # autograd takes softplus's derivative at its kink (clamp_min, |x|) as 0, not ½
    assume(d > 1 or 2 * bias / scale != round(2 * bias / scale))
    c = r + extra
    offset = seed % (extra + 1)
    clusters = None if profile == "uniform" else max(1, c // 3)
    txt = features(c, d, seed + 1, dtype, clusters=clusters)
    img = features(c, d, seed, dtype, clusters=clusters)[offset : offset + r]
    neg = features(m, d, seed + 2, dtype)
    ids = None if groups is None else (torch.arange(offset, offset + r) % groups, torch.arange(c) % groups)
    result = run(fn, img, txt, neg, scale, bias, offset=offset, gamma=gamma, margin=margin, ids=ids,
                 positive=positive, seed=seed)  # fmt: skip
    assert_rows(*result, dtype, scale, c + m)


@settings(max_examples=25, deadline=None)
@given(**DRAWS)
def test_hypothesis_draws_match_float64(**draw):
    _draw(**draw)


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(**DRAWS)
def test_hypothesis_draws_match_float64_full(**draw):
    _draw(**draw)
