"""Each row's own negatives, ``hn_clip_loss(negatives=(N, K, D), negatives_mask=(N, K))``, on every
backend: the float64 oracle of own_oracle.py (per-row losses and every gradient: img, txt, the own
negatives, τ) over hypothesis draws of N, K, D, mask patterns (rows with no real negative, all
real), scales and options (ε, margin, threshold, ids); own negatives identical on every row equal
shared (M, D) negatives; K = 0 is today's call bit for bit; the refusals.

Tolerances (per row, relative to that row; ``row_errors``): torch and cpp on float64 inputs 1e-10;
triton on float32 inputs 1e-4 (the README's float32 gradient bound; the losses 1e-5). A gradient
row below 1e-6 of its tensor's largest row is compared absolutely against that bound (a padded
negative's zero row, a saturated row's gradient). Under normalisation a feature row's error is taken
relative to the float64 magnitudes its float32 value is a difference of: |dL/dx̂|/|x| before the
normalisation's projection (which cancels where dL/dx̂ ∥ x̂), with ε split into the hard target's
part and the uniform target's (dS = g(P − ε/n) cancels where P ≈ ε/n), as in a D = 3, K = 1 draw.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cases import ALL_BACKENDS
from hnclip_kernels import HNClipLoss, hn_clip_loss
from own_oracle import difference_bounds, own_cases, own_inputs, own_rows_f64, row_error

# the unnormalized option's features are off unit norm on purpose
pytestmark = pytest.mark.filterwarnings("ignore:normalize=False:RuntimeWarning")

TOL = {"torch": (1e-10, 1e-10), "cpp": (1e-10, 1e-10), "triton": (1e-5, 1e-4)}  # (loss, gradients)
NAMES = ("img", "txt", "negatives", "tau")


def run(backend, img, txt, own, mask, tau=0.1, **kw):
    """(per-row losses, gradients of Σ w_i·row_i) of one backend; the upstream w is not uniform."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt, own)]
    t = torch.tensor(tau, dtype=img.dtype if img.dtype == torch.float64 else torch.float32, requires_grad=True)
    rows = hn_clip_loss(*leaves[:2], t, negatives=leaves[2], negatives_mask=mask, reduction="none", backend=backend,
                        **kw)  # fmt: skip
    w = torch.linspace(0.5, 1.5, rows.shape[0], dtype=rows.dtype)
    return rows.detach(), torch.autograd.grad((rows * w).sum(), [*leaves, t])


def oracle(img, txt, own, mask, tau=0.1, *, normalize=True, false_negative_threshold=None, **kw):
    leaves = [x.detach().double().requires_grad_(True) for x in (img, txt, own)]
    t = torch.tensor(tau, dtype=torch.float64, requires_grad=True)
    v, c, o = leaves
    if normalize:
        v, c, o = F.normalize(v, dim=1), F.normalize(c, dim=1), F.normalize(o, dim=2)
    rows = own_rows_f64(v, c, o, mask, t, threshold=false_negative_threshold, **kw)
    w = torch.linspace(0.5, 1.5, rows.shape[0], dtype=torch.float64)
    if not normalize:
        return rows.detach(), torch.autograd.grad((rows * w).sum(), [*leaves, t])
    *grads, d_v, d_c, d_o = torch.autograd.grad((rows * w).sum(), [*leaves, t, v, c, o], retain_graph=True)
    plain = lambda: own_rows_f64(v, c, o, mask, t, threshold=false_negative_threshold, **{**kw, "label_smoothing": 0.0})  # noqa: E731
    bounds = difference_bounds(leaves, [v, c, o], [d_v, d_c, d_o], w, kw.get("label_smoothing", 0.0), plain)
    return rows.detach(), grads, bounds


def row_errors(got, want):
    """The largest per-row relative error of the losses and of each gradient (by name)."""
    rows, grads = got
    ref_rows, ref_grads, *bounds = want
    bounds = bounds[0] if bounds else [None] * 3
    out = {"loss": row_error(rows, ref_rows)}
    for name, g, r, b in zip(NAMES, grads, ref_grads, [*bounds, None]):
        out[name] = row_error(g, r, b)
    return out


def check(backend, errors):
    loss_tol, grad_tol = TOL[backend]
    assert errors["loss"] <= loss_tol, errors
    assert all(errors[name] <= grad_tol for name in NAMES), errors


OPTIONS = {
    "plain": {},
    "eps": dict(label_smoothing=0.1),
    "image_text": dict(margin="image_text", label_smoothing=0.1),
    "threshold": dict(false_negative_threshold=0.3, label_smoothing=0.1),
    "ids": dict(label_smoothing=0.1),  # group ids drawn per case
    "unnormalized": dict(normalize=False, gamma=0.3),
}


def _case(backend, case, options, scale):
    n, k, d, pattern, seed = case
    dtype = torch.float32 if backend == "triton" else torch.float64
    img, txt, own, mask = own_inputs(n, k, d, pattern, seed, dtype, scale if options != "unnormalized" else 0.5)
    kw = dict(OPTIONS[options])
    if options == "ids":
        kw["group_ids"] = torch.arange(n) % max(1, n // 2)
    return row_errors(run(backend, img, txt, own, mask, **kw), oracle(img, txt, own, mask, **kw))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=own_cases(), scale=st.sampled_from([1e-3, 1.0, 30.0]), options=st.sampled_from(sorted(OPTIONS)))
@example(case=(9, 1, 3, "all", 198), scale=1.0, options="image_text")  # a slow-tier draw: 1.1e-4 on Triton
def test_matches_the_float64_oracle(backend, options, case, scale):
    # the default tier's draws; the sweep below draws every option on every backend
    check(backend, _case(backend, case, options, scale))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("options", sorted(OPTIONS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=own_cases(max_n=12, max_k=6), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_matches_the_float64_oracle_sweep(backend, options, case, scale):
    check(backend, _case(backend, case, options, scale))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("options", ["plain", "eps", "image_text", "threshold"])
def test_identical_rows_equal_shared_negatives(backend, options):
    # every row owning the same M negatives, all real, is the shared (M, D) loss: same columns per row
    dtype = torch.float32 if backend == "triton" else torch.float64
    img, txt, shared, _ = own_inputs(6, 4, 8, "all", 3, dtype)
    shared = shared[0]
    own = shared.expand(6, -1, -1).contiguous()
    kw = OPTIONS[options]
    rows_own, grads_own = run(backend, img, txt, own, None, **kw)
    leaves = [x.clone().requires_grad_(True) for x in (img, txt, shared)]
    t = torch.tensor(0.1, dtype=dtype, requires_grad=True)
    rows = hn_clip_loss(*leaves[:2], t, negatives=leaves[2], reduction="none", backend=backend, **kw)
    w = torch.linspace(0.5, 1.5, 6, dtype=rows.dtype)
    grads = torch.autograd.grad((rows * w).sum(), [*leaves, t])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert torch.allclose(rows_own, rows.detach(), rtol=tol, atol=tol)
    for got, want in zip((grads_own[0], grads_own[1], grads_own[2].sum(dim=0), grads_own[3]), grads):
        assert torch.allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_unused_is_todays_call(backend):
    # K = 0 is no negatives, bit for bit; a mask with no real entry is the loss without negatives
    img, txt, own, _ = own_inputs(5, 3, 8, "all", 1, torch.float32)
    base = hn_clip_loss(img, txt, 0.1, reduction="none", backend=backend, label_smoothing=0.1)
    empty = hn_clip_loss(img, txt, 0.1, reduction="none", backend=backend, label_smoothing=0.1, negatives=own[:, :0],
                         negatives_mask=torch.zeros(5, 0, dtype=torch.bool))  # fmt: skip
    assert torch.equal(base, empty)
    none = torch.zeros(5, 3, dtype=torch.bool)
    masked = hn_clip_loss(img, txt, 0.1, reduction="none", backend=backend, label_smoothing=0.1, negatives=own,
                          negatives_mask=none)  # fmt: skip
    assert torch.allclose(base, masked, rtol=1e-6, atol=0)


def test_padding_rows_get_no_gradient_and_no_small_row_error():
    # a collator pads with zero rows: they are no columns, so normalize=True does not refuse them
    img, txt, own, mask = own_inputs(4, 3, 8, "first-empty", 2, torch.float64)
    _, grads = run("torch", img, txt, own, mask)
    assert torch.equal(grads[2][~mask], torch.zeros_like(grads[2][~mask]))


def test_module_and_stats():
    img, txt, own, mask = own_inputs(5, 3, 8, "random", 4, torch.float64)
    loss = HNClipLoss(normalize=True, return_stats=True)(img, txt, 10.0, negatives=own, negatives_mask=mask)
    want = hn_clip_loss(img, txt, 0.1, negatives=own, negatives_mask=mask, backend="torch")
    assert torch.allclose(loss, want, rtol=1e-12)
    loss, report = hn_clip_loss(img, txt, 0.1, negatives=own, negatives_mask=mask, label_smoothing=0.1,
                                return_stats=True, backend="torch")  # fmt: skip
    assert abs(report.loss - loss.item()) <= 1e-9 * abs(loss.item())


def test_refusals():
    img, txt, own, mask = own_inputs(4, 3, 8, "random", 0, torch.float32)
    with pytest.raises(ValueError, match="negatives_mask is the mask of per-row negatives"):
        hn_clip_loss(img, txt, 0.1, negatives=own[0], negatives_mask=mask)
    with pytest.raises(ValueError, match=r"negatives_mask must have shape \(N, K\) = \(4, 3\)"):
        hn_clip_loss(img, txt, 0.1, negatives=own, negatives_mask=mask[:, :2])
    with pytest.raises(TypeError, match="negatives_mask must be a bool"):
        hn_clip_loss(img, txt, 0.1, negatives=own, negatives_mask=mask.long())
    with pytest.raises(ValueError, match="one row per pair, N = 4"):
        hn_clip_loss(img, txt, 0.1, negatives=own[:3])
    with pytest.raises(ValueError, match="negatives_mask is the mask"):
        hn_clip_loss(img, txt, 0.1, negatives_mask=mask)


def test_refused_by_the_sigmoid_loss():
    # across ranks: tests/distributed/test_own_distributed.py
    from hnclip_kernels import hn_siglip_loss
    from hnclip_kernels.margin import Margin
    from hnclip_kernels.validation_family import family_of

    img, txt, own, _ = own_inputs(4, 3, 8, "all", 0, torch.float32)
    words = r"\(N, K, D\) negatives, each row's own, are taken by the softmax loss only \(hn_clip_loss"
    with pytest.raises(ValueError, match=words):
        family_of(img, txt, own, None, Margin.TEXT, own=False)  # the sigmoid loss's checks
    with pytest.raises(ValueError, match=words):
        hn_siglip_loss(img, txt, 10.0, -10.0, negatives=own)
