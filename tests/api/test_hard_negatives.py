"""The hard-negative family (``negatives``, ``group_ids``, ``margin``) on backend="torch" against
an independent float64 oracle of the formula (docs/hard_negatives.md).

The oracle below forms the dense N × (N + M) image→text and N × N text→image logits straight
from the formula, in float64, without calling the package. Loss and every gradient (img, txt,
negatives, τ) are compared, per pair row where the batch is saturated.

Tolerances (relative, float64 norms; ``helpers.rel_err``): float64 inputs 1e-10 (gradients 1e-9); float32 inputs
loss 1e-5, gradients 1e-4 (the README's float32 bounds); 16-bit inputs (the oracle evaluated on
the 16-bit values) loss 1e-5, gradients 2^-7 (bf16) / 2^-10 (fp16): the result is rounded once
to the input dtype. Per-row checks: each row against the oracle's row, relative to that row.

Bound: about 10 s on 2 shared cores (hypothesis ``derandomize=True``, max_examples 100).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cases import ALL_BACKENDS
from helpers import rel_err
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.backends import resolve_backend


def family_f64(
    img,
    txt,
    tau,
    negatives=None,
    group_ids=None,
    margin="text",
    gamma=0.5,
    label_smoothing=0.0,
    normalize=True,
    threshold=None,
):
    """Per-pair rows ½(CE_i2t_i + CE_t2i_i), float64, dense, from the formula (autograd kept).

    i2t row i over x ∈ [t_1..t_N, n_1..n_M]: Z_ix = (v_i·x + γ·h(i, x)·[x ≠ t_i]) / τ with
    h = sg(t_i·x) ("text") or sg(v_i·x) ("image_text"); t2i row k over the images:
    Z_ki = (t_k·v_i + γ·h'(k, i)·[i ≠ k]) / τ with h' = sg(t_k·t_i) or sg(v_i·t_k). Dropped:
    the captions' cosine ≥ threshold, equal group ids (caption columns only); ε spreads over
    each row's kept classes (the positive included)."""
    v, t = img.double(), txt.double()
    d = v.shape[1]
    n = torch.zeros(0, d, dtype=torch.float64) if negatives is None else negatives.double()
    tau = tau.double() if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float64)
    if normalize:
        v, t, n = (F.normalize(x, dim=1) for x in (v, t, n))
    big_n, m = v.shape[0], n.shape[0]
    x = torch.cat([t, n])
    eye_x = torch.zeros(big_n, big_n + m, dtype=torch.bool)
    eye_x[:, :big_n] = torch.eye(big_n, dtype=torch.bool)
    eye = torch.eye(big_n, dtype=torch.bool)
    h_i2t = ((t if margin == "text" else v) @ x.T).detach().masked_fill(eye_x, 0.0)
    h_t2i = (t @ (t if margin == "text" else v).T).detach().masked_fill(eye, 0.0)
    z_i2t = (v @ x.T + gamma * h_i2t) / tau
    z_t2i = (t @ v.T + gamma * h_t2i) / tau
    drop_i2t, drop_t2i = eye_x.clone(), eye.clone()
    if threshold is not None:
        # the captions' cosine, also with normalize=False
        tu = F.normalize(txt.double().detach(), dim=1)
        xu = tu if negatives is None else torch.cat([tu, F.normalize(negatives.double().detach(), dim=1)])
        drop_i2t |= tu @ xu.T >= threshold
        drop_t2i |= tu @ tu.T >= threshold
    if group_ids is not None:
        same = group_ids[:, None] == group_ids[None, :]
        drop_i2t[:, :big_n] |= same
        drop_t2i |= same
    rows = []
    for z, drop in ((z_i2t, drop_i2t), (z_t2i, drop_t2i)):
        pos = z.diagonal()  # column i of row i: t_i for i2t, v_i for t2i
        gaps = z - pos[:, None]
        empty = drop.all(dim=1)
        lse = torch.logsumexp(gaps.masked_fill(drop, float("-inf")).masked_fill(empty[:, None], 0.0), dim=1)
        nll = torch.logaddexp(torch.zeros_like(pos), lse.masked_fill(empty, float("-inf")))
        kept = (~drop).sum(dim=1) + 1
        kept_mean = (z.masked_fill(drop, 0.0).sum(dim=1) + pos) / kept
        rows.append(nll + label_smoothing * (pos - kept_mean))
    return 0.5 * (rows[0] + rows[1])


def features(n, d, seed, dtype=torch.float32, clusters=None, spread=0.05):
    """(n, d) random features; ``clusters``: rows near that many centres (near-duplicates)."""
    gen = torch.Generator().manual_seed(seed)
    if clusters is None:
        x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    else:
        centres = torch.randn(clusters, d, generator=gen, dtype=torch.float64)
        x = centres[torch.arange(n) % clusters] + spread * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x.to(dtype)


GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
LOSS_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


def run_both(img, txt, neg, tau, *, reduction="mean", backend="torch", **kw):
    """(loss, grads) of hn_clip_loss(backend=backend) and of the oracle on the same values."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    if neg is not None:
        leaves.append(neg.detach().clone().requires_grad_(True))
    tau_t = torch.tensor(tau, dtype=torch.float64 if img.dtype == torch.float64 else torch.float32, requires_grad=True)
    got = hn_clip_loss(
        leaves[0], leaves[1], tau_t, negatives=leaves[2] if neg is not None else None, reduction=reduction,
        backend=backend, **_api(kw),
    )  # fmt: skip
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).reshape(got.shape)
    # M = 0 is None: the empty negatives take no part (no gradient, not even zeros)
    got_grads = torch.autograd.grad((got.double() * upstream).sum(), leaves + [tau_t], allow_unused=True)
    got_grads = [torch.zeros_like(x) if g is None else g for g, x in zip(got_grads, leaves + [tau_t])]
    ref_leaves = [x.detach().double().requires_grad_(True) for x in leaves]
    ref_tau = torch.tensor(float(tau_t.detach()), dtype=torch.float64, requires_grad=True)
    rows = family_f64(ref_leaves[0], ref_leaves[1], ref_tau, ref_leaves[2] if neg is not None else None, **kw)
    want = {"mean": rows.mean(), "sum": rows.sum(), "none": rows}[reduction]
    want_grads = torch.autograd.grad((want * upstream).sum(), ref_leaves + [ref_tau])
    names = ["img", "txt"] + (["negatives"] if neg is not None else []) + ["tau"]
    return got, want, dict(zip(names, got_grads)), dict(zip(names, want_grads))


def _api(kw):
    out = dict(kw)
    if "threshold" in out:
        out["false_negative_threshold"] = out.pop("threshold")
    return out


def worst_errors(img, txt, neg, tau, backend="torch", **kw):
    """{"loss": rel err, "d img": ..., ...} of ``backend`` against the oracle."""
    got, want, gg, wg = run_both(img, txt, neg, tau, backend=backend, **kw)
    errs = {"loss": rel_err(got, want)}
    errs.update({f"d {k}": rel_err(gg[k], wg[k]) for k in gg})
    return errs


def check(img, txt, neg, tau, dtype=torch.float32, backend="torch", **kw):
    errs = worst_errors(img, txt, neg, tau, backend, **kw)
    for name, err in errs.items():
        tol = LOSS_TOL[dtype] if name == "loss" else GRAD_TOL[dtype]
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} ({kw})"
    return errs


N, D = 6, 8
GROUPS = {
    "random": torch.tensor([0, 2, 0, 1, 2, 5]),
    "one": torch.zeros(N, dtype=torch.long),
    "distinct": torch.arange(N, dtype=torch.int32),
}


@pytest.mark.parametrize("m", [0, 1, 7, N, 3 * N + 1])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_negatives_match_the_oracle(m, margin):
    img, txt, neg = features(N, D, 1), features(N, D, 2), features(m, D, 3)
    check(img, txt, neg, 0.07, margin=margin)


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("m", [0, 7])
def test_group_ids_match_the_oracle(groups, margin, m):
    img, txt, neg = features(N, D, 4), features(N, D, 5), features(m, D, 6)
    check(img, txt, neg if m else None, 0.1, group_ids=GROUPS[groups], margin=margin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "options",
    [
        dict(threshold=0.3),
        dict(label_smoothing=0.1),
        dict(normalize=False),
        dict(threshold=0.3, label_smoothing=0.1, normalize=False, group_ids=GROUPS["random"]),
        dict(gamma=0.0, label_smoothing=0.2, group_ids=GROUPS["one"]),
    ],
    ids=["threshold", "smoothing", "unnormalized", "all", "gamma0-one-group"],
)
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_combinations_and_dtypes(dtype, options, margin):
    img, txt, neg = (features(n, D, s, dtype) for n, s in ((N, 7), (N, 8), (5, 9)))
    if options.get("normalize") is False:  # near-unit rows: dot products of the given features
        img, txt, neg = (F.normalize(x.double(), dim=1).to(dtype) for x in (img, txt, neg))
    if "threshold" in options:  # every caption cosine away from the threshold (float32 vs float64 compare)
        xs = F.normalize(torch.cat([txt, neg]).double(), dim=1)
        assert ((F.normalize(txt.double(), dim=1) @ xs.T - options["threshold"]).abs() > 1e-4).all()
    check(img, txt, neg, 0.05, dtype, margin=margin, **options)


@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("with_ids", [False, True])
def test_saturated_near_duplicates_per_row(margin, with_ids):
    # τ = 0.01, each pair near its own centre (saturated rows, losses down to e^-100), pairs 0-2
    # near one centre (near-duplicate captions: unsaturated rows), negatives near the first
    # centres (hard): the rows' losses span many orders of magnitude; each row and each gradient
    # row must match. With ids, the near-duplicates share an id.
    n, d, m = 12, 16, 9
    centre_of = torch.tensor([0, 0, 0] + list(range(1, n - 2)))
    centres = F.normalize(features(n, d, 10, torch.float64), dim=1)[centre_of]
    img = (centres + 0.02 * features(n, d, 11, torch.float64)).float()
    txt = (centres + 0.02 * features(n, d, 12, torch.float64)).float()
    neg = (centres[3 : 3 + m] + 0.3 * features(m, d, 13, torch.float64)).float()
    ids = centre_of if with_ids else None
    got, want, gg, wg = run_both(img, txt, neg, 0.01, reduction="none", margin=margin, group_ids=ids)
    assert want.min() < 1e-10 and want.max() > 1.0  # saturated and unsaturated rows in one batch
    # a row's float32 logit gaps, up to (2 + γ)/τ = 250, carry ~(2 + γ)/τ · 2^-24 of absolute
    # rounding, which is the relative error of its loss and gradient (measured: 2.3e-5): 4×
    tol = 4 * (2 + 0.5) / 0.01 * 2.0**-24
    for i in range(n):
        assert rel_err(got[i], want[i]) <= tol, f"row {i}: {got[i].item():.6e} vs {want[i].item():.6e}"
    for name in gg:
        g, w = gg[name].double(), wg[name].double()
        if g.dim() == 0:
            assert rel_err(g, w) <= tol, name
            continue
        for i in range(g.shape[0]):
            assert rel_err(g[i], w[i]) <= tol or (g[i] - w[i]).norm() <= 1e-30, f"d {name} row {i}"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_threshold_one_masks_identical_captions_with_ids(backend):
    # captions 1 and 4 the same one-hot row: their cosine is exactly 1.0 in every dtype, so the
    # threshold 1.0 masks the pair ("at or above"); with group ids (distinct for 1 and 4) the mask is
    # the family's union of both rules, where a `>` would keep the pair (cpp vs torch 1.87 apart).
    img, txt, neg = features(N, D, 24), features(N, D, 25), features(3, D, 26)
    txt[1] = txt[4] = F.one_hot(torch.tensor(2), D).float()
    ids = torch.tensor([0, 1, 0, 2, 3, 5])
    check(img, txt, neg, 0.1, backend=backend, group_ids=ids, threshold=1.0)
    check(img, txt, None, 0.1, backend=backend, group_ids=ids, threshold=1.0)


def test_return_stats_cover_the_negative_columns():
    img, txt, neg = features(N, D, 12), features(N, D, 13), features(4, D, 14)
    loss, report = hn_clip_loss(img, txt, 0.1, negatives=neg, backend="torch", return_stats=True, label_smoothing=0.1)
    assert report.rows == 2 * N and report.masked_pairs is None
    assert abs(report.loss - loss.item()) <= 1e-5 * loss.item()
    loss, report = hn_clip_loss(
        img, txt, 0.1, negatives=neg, group_ids=GROUPS["random"], backend="torch", return_stats=True
    )
    assert abs(report.loss - loss.item()) <= 1e-5 * loss.item()
    # ids (0, 2, 0, 1, 2, 5): two pairs of equal ids, each pair masked in both entries of both directions
    assert report.masked_pairs == 4


def test_module_matches_the_function():
    img, txt, neg = features(N, D, 15), features(N, D, 16), features(3, D, 17)
    module = HNClipLoss(backend="torch", normalize=True, margin="image_text")
    got = module(img, txt, 10.0, negatives=neg, group_ids=GROUPS["random"])
    want = hn_clip_loss(img, txt, 0.1, negatives=neg, group_ids=GROUPS["random"], margin="image_text", backend="torch")
    assert torch.equal(got, want)
    assert "margin='image_text'" in repr(module)


def test_auto_runs_todays_auto_backend_and_inputs_are_not_mutated():
    # "auto" picks as today's loss does (cpp on CPU where the extension is built, else torch)
    img, txt, neg = features(N, D, 18), features(N, D, 19), features(3, D, 20)
    ids = GROUPS["random"].clone()
    copies = [x.clone() for x in (img, txt, neg, ids)]
    auto = hn_clip_loss(img, txt, 0.1, negatives=neg, group_ids=ids, margin="image_text")
    picked = resolve_backend("auto", img)
    assert picked == ("cpp" if "cpp" in ALL_BACKENDS else "torch")
    want = hn_clip_loss(img, txt, 0.1, negatives=neg, group_ids=ids, margin="image_text", backend=picked)
    assert torch.equal(auto, want)
    for x, c in zip((img, txt, neg, ids), copies):
        assert torch.equal(x, c)


# the hypothesis draws of every backend's oracle test (test_hard_negatives_cpp.py draws the same)
FAMILY_DRAWS = dict(
    n=st.integers(1, 7),
    d=st.integers(2, 6),
    m=st.integers(0, 9),
    tau=st.sampled_from([0.02, 0.07, 0.3, 1.0]),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
    eps=st.sampled_from([0.0, 0.1]),
    n_groups=st.sampled_from([None, 1, 2, 4]),
    margin=st.sampled_from(["text", "image_text"]),
    threshold=st.sampled_from([None, 0.4]),
    seed=st.integers(0, 2**16),
)


def check_draw(backend, n, d, m, tau, gamma, eps, n_groups, margin, threshold, seed):
    """One :data:`FAMILY_DRAWS` draw against the oracle on ``backend`` (pairs within 1e-4 of the
    threshold are drawn again: their mask flips with rounding)."""
    img, txt, neg = features(n, d, seed), features(n, d, seed + 1), features(m, d, seed + 2)
    if threshold is not None:
        xs = F.normalize(torch.cat([txt, neg]).double(), dim=1)
        assume(((F.normalize(txt.double(), dim=1) @ xs.T - threshold).abs() > 1e-4).all())
    ids = None if n_groups is None else torch.randint(0, n_groups, (n,), generator=torch.Generator().manual_seed(seed))
    kw = dict(margin=margin, gamma=gamma, label_smoothing=eps, threshold=threshold, group_ids=ids)
    check(img, txt, neg if m else None, tau, backend=backend, **kw)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**FAMILY_DRAWS)
def test_hypothesis_draws_match_the_oracle(**draw):
    check_draw("torch", **draw)


def test_compile_fullgraph():
    torch._dynamo.reset()
    img, txt, neg = features(N, D, 21), features(N, D, 22), features(4, D, 23)
    ids = GROUPS["random"]

    def fn(a, b, c, tau):
        return hn_clip_loss(
            a, b, tau, negatives=c, group_ids=ids, margin="image_text", false_negative_threshold=0.5, backend="torch"
        )

    tau = torch.tensor(0.1)
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(img, txt, neg, tau), fn(img, txt, neg, tau), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_gradcheck_float64(margin, backend):
    # γ = 0: the margin is off, so finite differences see every input (img, txt, negatives, τ)
    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} cannot run here")
    img, txt, neg = (features(n, 4, s, torch.float64).requires_grad_(True) for n, s in ((3, 24), (3, 25), (2, 26)))
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 1, 0])

    def fn(a, b, c, s):
        return hn_clip_loss(
            a, b, s, negatives=c, group_ids=ids, gamma=0.0, label_smoothing=0.1, margin=margin,
            reduction="none", backend=backend,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (img, txt, neg, tau))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_gradcheck_directional_with_mask_captions_and_groups(backend):
    # the directional protocol's family keywords (the reference's, and the C++ family operator's):
    # with the margin factors and mask captions constants, every input of a direction is
    # checkable with γ > 0
    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} cannot run here")
    if backend == "cpp":
        from hnclip_kernels.backends.cpp.family import family_directional_nll_cpp as directional
    else:
        from hnclip_kernels.backends.pytorch.reference import directional_nll_torch as directional

    q, k = features(3, 4, 27, torch.float64).requires_grad_(True), features(5, 4, 28, torch.float64)
    k.requires_grad_(True)
    a, b = features(3, 4, 29, torch.float64), features(5, 4, 30, torch.float64)
    a2, b2 = features(3, 4, 31, torch.float64), features(5, 4, 32, torch.float64)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)

    def fn(q_, k_, s):
        return directional(
            q_, k_, query_txt=a2, key_txt=b2, mask_query=a, mask_key=b, tau=s, offset=1,
            gamma=0.7, label_smoothing=0.1, normalize=True, false_negative_threshold=0.2,
            query_groups=torch.tensor([0, 1, 1]), key_groups=torch.tensor([0, 1, 2, 1]),
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (q, k, tau))


def assert_compiled_equals_eager(backend: str):
    """``hn_clip_loss`` with every family option under ``torch.compile(fullgraph=True)``
    (aot_eager: the fused operators are opaque custom ops on CPU; a graph break raises): loss and
    every gradient equal to eager, to the bit."""
    torch._dynamo.reset()
    img, txt, neg = features(N, D, 21), features(N, D, 22), features(4, D, 23)
    ids = GROUPS["random"]

    def fn(a, b, c, tau):
        return hn_clip_loss(
            a, b, tau, negatives=c, group_ids=ids, margin="image_text", false_negative_threshold=0.5,
            label_smoothing=0.1, backend=backend,
        )  # fmt: skip

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = []
    for f in (fn, compiled):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        tau = torch.tensor(0.1, requires_grad=True)
        loss = f(*leaves, tau)
        out.append((loss.detach(), *torch.autograd.grad(loss, [*leaves, tau])))
    for name, x, y in zip(("loss", "d img", "d txt", "d neg", "d tau"), *out):
        assert torch.equal(x, y), name
