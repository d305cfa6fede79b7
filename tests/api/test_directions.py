"""``reduction="directions"``: each direction's per-row loss and LSE on every backend, against the
float64 oracle of ``direction_oracle.py`` (which states the tolerances): the four outputs row by
row, and the gradients (img, txt, negatives, τ) of a random signed weighting Σ a·i2t + b·lse_i2t +
c·t2i + d·lse_t2i, row by row. The options: γ, ε, negatives, group ids, the threshold, both margin
kinds, normalize=False, all at once; float64, float32 and 16-bit inputs; a saturated batch; the
hypothesis draws of the family's tests.

Bound: about 25 s on 2 shared cores (the Triton interpreter's share: the draws keep to 6 examples
on backend="triton").
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import direction_oracle as oracle
import family_oracle
from cases import ALL_BACKENDS
from family_oracle import GROUPS, D, N, features
from hnclip_kernels import DirectionRows, HNClipLoss, hn_clip_loss
from hnclip_kernels.distributed import distributed_hn_clip_loss

CASES = {
    "plain": dict(),
    "gamma0": dict(gamma=0.0),
    "gamma2-tau1": dict(gamma=2.0, tau=1.0),
    "smoothing": dict(label_smoothing=0.1),
    "negatives": dict(m=5),
    "negatives-smoothing": dict(m=5, label_smoothing=0.2),
    "group-ids": dict(group_ids=GROUPS["random"]),
    "one-group": dict(group_ids=GROUPS["one"], label_smoothing=0.1),  # every t2i row keeps only its positive
    "threshold": dict(threshold=0.3, m=3),
    "image-text": dict(margin="image_text", m=4),
    "unnormalized": dict(normalize=False),
    "all": dict(
        m=5, threshold=0.3, label_smoothing=0.1, normalize=False, group_ids=GROUPS["random"], margin="image_text"
    ),  # fmt: skip
}


def _inputs(case, dtype, seed=30):
    kw = dict(CASES[case])
    m, tau = kw.pop("m", 0), kw.pop("tau", 0.07)
    img, txt, neg = (
        features(N, D, seed, dtype),
        features(N, D, seed + 1, dtype),
        features(max(m, 1), D, seed + 2, dtype),
    )
    if kw.get("normalize") is False:  # near-unit rows: dot products of the given features
        img, txt, neg = (torch.nn.functional.normalize(x.double(), dim=1).to(dtype) for x in (img, txt, neg))
    return img, txt, (neg if m else None), tau, kw


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_and_gradients_match_the_oracle(backend, case):
    img, txt, neg, tau, kw = _inputs(case, torch.float32)
    if "threshold" in kw:  # every caption cosine away from the threshold (float32 vs float64 compare)
        xs = torch.nn.functional.normalize(torch.cat([txt] + ([neg] if neg is not None else [])).double(), dim=1)
        assert ((torch.nn.functional.normalize(txt.double(), dim=1) @ xs.T - kw["threshold"]).abs() > 1e-4).all()
    oracle.check(img, txt, neg, tau, backend=backend, **kw)


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
@pytest.mark.parametrize("case", ["plain", "all", "negatives-smoothing"])
def test_float64(backend, case):
    img, txt, neg, tau, kw = _inputs(case, torch.float64)
    oracle.check(img, txt, neg, tau, backend=backend, dtype=torch.float64, **kw)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_features(backend, dtype):
    img, txt, neg, tau, kw = _inputs("negatives-smoothing", dtype)
    got = oracle.check(img, txt, neg, tau, backend=backend, dtype=dtype, **kw)
    assert got  # the errors were computed


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_saturated_rows(backend):
    # τ = 0.01: i2t/t2i rows from 1e-40 to O(1) in one batch; LSE ≈ 100 next to rows far below its ulp
    img, txt, neg, centre_of = family_oracle.saturated_batch()
    got, want, gg, wg = oracle.run_both(img, txt, neg, 0.01, backend=backend, group_ids=centre_of, seed=3)
    assert want[0].min() < 1e-10 and want[0].max() > 1.0
    errs = oracle.row_errors(got, want, gg, wg)
    for name, err in errs.items():
        assert err <= family_oracle.SATURATED_TOL, f"{name}: {err:.3e}"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_pair_rows_are_the_mean_of_the_directions(backend):
    img, txt, neg, tau, kw = _inputs("all", torch.float32)
    rows = hn_clip_loss(img, txt, tau, negatives=neg, reduction="directions", backend=backend,
                        **{("false_negative_threshold" if k == "threshold" else k): v for k, v in kw.items()})  # fmt: skip
    none = hn_clip_loss(img, txt, tau, negatives=neg, reduction="none", backend=backend,
                        **{("false_negative_threshold" if k == "threshold" else k): v for k, v in kw.items()})  # fmt: skip
    assert isinstance(rows, DirectionRows)
    torch.testing.assert_close(0.5 * (rows.i2t + rows.t2i), none, rtol=1e-5, atol=1e-6)


DRAWS = dict(family_oracle.FAMILY_DRAWS, eps=st.sampled_from([0.0, 0.1, 0.3]))


def _draw(backend, n, d, m, tau, gamma, eps, n_groups, margin, threshold, seed):
    img, txt, neg = features(n, d, seed), features(n, d, seed + 1), features(m, d, seed + 2)
    if threshold is not None:
        xs = torch.nn.functional.normalize(torch.cat([txt, neg]).double(), dim=1)
        assume(((torch.nn.functional.normalize(txt.double(), dim=1) @ xs.T - threshold).abs() > 1e-4).all())
    gen = torch.Generator().manual_seed(seed)
    ids = None if n_groups is None else torch.randint(0, n_groups, (n,), generator=gen)
    kw = dict(margin=margin, gamma=gamma, label_smoothing=eps, threshold=threshold, group_ids=ids)
    oracle.check(img, txt, neg if m else None, tau, backend=backend, seed=seed, **kw)


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**DRAWS)
def test_draws(backend, **draw):
    _draw(backend, **draw)


# the interpreter runs Triton's kernels at about a second a call: fewer draws there
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**DRAWS)
def test_draws_triton(**draw):
    _draw("triton", **draw)


def test_module_single_process_equals_the_function():
    img, txt, neg, tau, kw = _inputs("negatives", torch.float32)
    loss = HNClipLoss(reduction="directions", backend="torch", normalize=True, gamma=0.5)
    got = loss(img, txt, 1.0 / tau, negatives=neg)
    want = hn_clip_loss(img, txt, torch.tensor(1.0 / (1.0 / tau)), negatives=neg, reduction="directions",
                        backend="torch")  # fmt: skip
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    plain = HNClipLoss(reduction="directions", backend="torch", normalize=True)(img, txt, 1.0 / tau)
    assert isinstance(plain, DirectionRows) and plain.i2t.shape == (N,)
    loss.reduction = "mean"
    assert loss(img, txt, 1.0 / tau).dim() == 0


def test_errors_name_the_option():
    img, txt = features(N, D, 1), features(N, D, 2)
    with pytest.raises(ValueError, match="reduction"):
        hn_clip_loss(img, txt, 0.1, reduction="direction")
    for bad in ("sum", "none"):
        with pytest.raises(ValueError, match="HNClipLoss takes reduction"):
            HNClipLoss(reduction=bad)
        with pytest.raises(ValueError, match="distributed_hn_clip_loss takes reduction"):
            distributed_hn_clip_loss(img, txt, 0.1, reduction=bad, world_size=1)
    loss = HNClipLoss(reduction="directions")
    with pytest.raises(ValueError, match="output_dict"):
        loss(img, txt, 10.0, output_dict=True)
    with pytest.raises(ValueError, match="HNClipLoss takes reduction"):
        loss.reduction = "sum"
    assert loss.reduction == "directions"


def test_distributed_entry_on_one_process():
    img, txt = features(N, D, 3), features(N, D, 4)
    got = distributed_hn_clip_loss(img, txt, 0.1, reduction="directions", world_size=1, backend="torch")
    want = hn_clip_loss(img, txt, 0.1, reduction="directions", backend="torch")
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
