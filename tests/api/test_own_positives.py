"""Each row's own negatives under the multi-positive targets, ``hn_clip_loss(negatives=(N, K, D),
negatives_mask=, group_ids=, group_mode="supcon" | "mil_nce")``, on every backend, against the float64
oracle ``positives_oracle.own_positive_rows_f64`` (the i2t classes P(i) ∪ K(i) ∪ the row's real own
columns; the own columns extra negatives with the margin, masked by the threshold, counted by ε):
per-row losses and every gradient (img, txt, the own negatives, τ) under a non-uniform upstream
gradient, over supcon and mil_nce, ε, the threshold, margin="image_text" and rows with no real own
negative (fixed cases and hypothesis draws; more draws in the slow tier).

Tolerances (per row, relative to that row, as tests/api/test_own_negatives.py: a gradient row below
1e-6 of its tensor's largest row compared absolutely against that bound; triton's feature rows
relative to |dL/dx̂|/|x| before the normalisation's projection, ε's uniform part apart): torch and cpp
on float64 inputs 1e-10; triton (interpreter) on float32 inputs 1e-5 (losses) and 1e-4 (gradients).
Measured (the fixed cases below, every case on every backend, largest over loss and gradients):
torch ≤ 1.1e-14, cpp ≤ 1.1e-14, triton ≤ 2.2e-6 (the own negatives' gradient; losses ≤ 8.5e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import ALL_BACKENDS
from hnclip_kernels import hn_clip_loss
from own_oracle import difference_bounds, own_cases, own_inputs, row_error
from positives_oracle import own_positive_rows_f64

TOL = {"torch": (1e-10, 1e-10), "cpp": (1e-10, 1e-10), "triton": (1e-5, 1e-4)}  # (loss, gradients)
NAMES = ("img", "txt", "negatives", "tau")
OPTIONS = {
    "plain": {},
    "eps": dict(label_smoothing=0.1),
    "threshold": dict(false_negative_threshold=0.3, label_smoothing=0.1),
    "image_text": dict(margin="image_text", label_smoothing=0.1),
    "image_text_threshold": dict(margin="image_text", false_negative_threshold=0.2),
}


def _weights(n, dtype):
    return torch.linspace(0.5, 1.5, n, dtype=dtype)


def run(backend, img, txt, own, mask, ids, mode, tau=0.1, **kw):
    """(per-row losses, gradients of Σ w_i·row_i) of one backend; the upstream w is not uniform."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt, own)]
    t = torch.tensor(tau, dtype=img.dtype if img.dtype == torch.float64 else torch.float32, requires_grad=True)
    rows = hn_clip_loss(*leaves[:2], t, negatives=leaves[2], negatives_mask=mask, group_ids=ids, group_mode=mode,
                        reduction="none", backend=backend, **kw)  # fmt: skip
    return rows.detach(), torch.autograd.grad((rows * _weights(rows.shape[0], rows.dtype)).sum(), [*leaves, t])


def oracle(img, txt, own, mask, ids, mode, tau=0.1, *, false_negative_threshold=None, **kw):
    """(rows, gradients, the feature rows' error bounds) in float64 from the formula."""
    leaves = [x.detach().double().requires_grad_(True) for x in (img, txt, own)]
    t = torch.tensor(tau, dtype=torch.float64, requires_grad=True)
    v, c, o = F.normalize(leaves[0], dim=1), F.normalize(leaves[1], dim=1), F.normalize(leaves[2], dim=2)
    kw = dict(kw, threshold=false_negative_threshold, mode=mode)
    rows = own_positive_rows_f64(v, c, o, mask, t, ids, **kw)
    w = _weights(rows.shape[0], torch.float64)
    *grads, d_v, d_c, d_o = torch.autograd.grad((rows * w).sum(), [*leaves, t, v, c, o], retain_graph=True)
    plain = lambda: own_positive_rows_f64(v, c, o, mask, t, ids, **{**kw, "label_smoothing": 0.0})  # noqa: E731
    bounds = difference_bounds(leaves, [v, c, o], [d_v, d_c, d_o], w, kw.get("label_smoothing", 0.0), plain)
    return rows.detach(), grads, bounds


def errors(backend, case, mode, options, scale=1.0):
    """The largest per-row relative error of the losses and of each gradient (by name)."""
    n, k, d, pattern, seed = case
    dtype = torch.float32 if backend == "triton" else torch.float64
    img, txt, own, mask = own_inputs(n, k, d, pattern, seed, dtype, scale)
    ids = torch.arange(n) % max(1, (n + 1) // 2)  # groups of two (and a singleton with odd N)
    kw = OPTIONS[options]
    rows, grads = run(backend, img, txt, own, mask, ids, mode, **kw)
    ref_rows, ref_grads, bounds = oracle(img, txt, own, mask, ids, mode, **kw)
    out = {"loss": row_error(rows, ref_rows)}
    for name, g, r, b in zip(NAMES, grads, ref_grads, [*bounds, None]):
        out[name] = row_error(g, r, b if backend == "triton" else None)
    return out


def check(backend, errs):
    loss_tol, grad_tol = TOL[backend]
    assert errs["loss"] <= loss_tol, errs
    assert all(errs[name] <= grad_tol for name in NAMES), errs


# (N, K, D, mask pattern, seed): "first-empty" has rows with no real own negative, "none" no row any
CASES = [(5, 3, 8, "first-empty", 1), (4, 2, 17, "none", 2), (6, 3, 3, "random", 3)]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mode", ["supcon", "mil_nce"])
@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_own_positives_match_the_oracle(backend, mode, options):
    for case in CASES if backend != "triton" else CASES[:1]:
        check(backend, errors(backend, case, mode, options))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=own_cases(max_n=5, max_k=3),
    mode=st.sampled_from(["supcon", "mil_nce"]),
    options=st.sampled_from(sorted(OPTIONS)),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
)
def test_own_positives_draws(backend, case, mode, options, scale):
    check(backend, errors(backend, case, mode, options, scale))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=own_cases(),
    mode=st.sampled_from(["supcon", "mil_nce"]),
    options=st.sampled_from(sorted(OPTIONS)),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
)
def test_own_positives_draws_slow(backend, case, mode, options, scale):
    check(backend, errors(backend, case, mode, options, scale))


def test_own_columns_are_never_positives():
    """Own negatives equal to the row's own caption (γ = 0: the same logit as its positive): a twin
    counted as a negative, so every row's loss rises over the call without them (as a positive,
    MIL-NCE's rows would fall)."""
    n, d = 4, 8
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 2])
    for mode in ("supcon", "mil_nce"):
        base = hn_clip_loss(img, txt, 0.1, group_ids=ids, group_mode=mode, gamma=0.0, reduction="none", backend="torch")
        twin = hn_clip_loss(img, txt, 0.1, negatives=txt[:, None].clone(), group_ids=ids, group_mode=mode,
                            gamma=0.0, reduction="none", backend="torch")  # fmt: skip
        assert (twin > base).all()
