"""``reduction="directions"`` with the multi-positive targets (``group_mode="supcon"`` / ``"mil_nce"``)
on every backend, against the float64 oracle of ``direction_oracle.py`` (its positive modes, written
from docs/api.md's "Per-direction rows"; the tolerances are its own): the four outputs row by row and
the gradients (img, txt, negatives, τ) of a random signed weighting of all four, row by row. Cases:
groups of 2, 3 and singletons, one group for the batch, ε, the M negatives, the threshold,
``margin="image_text"``, normalize=False, all at once; float64 on torch and cpp, float32 on every
backend (Triton in the interpreter); ½(i2t + t2i) equals ``reduction="none"``'s rows; the oracle's
positive rows against ``positives_oracle.positives_f64`` (two independent writings); a few
hypothesis draws.

Measured (worst per-row relative error over the cases; gradients as ``direction_oracle.row_errors``
takes them): torch float64 rows ≤ 1.2e-15, gradients ≤ 3.2e-15; cpp float64 ≤ 2.4e-15 / 3.7e-15;
float32 torch ≤ 1.0e-6 / 1.7e-6, cpp ≤ 5.8e-7 / 1.1e-6, triton (interpreter) ≤ 5.8e-7 / 1.2e-6.

Bound: about 7 s on 2 shared cores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import direction_oracle as oracle
from cases import ALL_BACKENDS
from family_oracle import D, features
from hnclip_kernels import LossOptions, hn_clip_loss
from hnclip_kernels.backends import direction_losses
from hnclip_kernels.margin import Margin
from hnclip_kernels.validation_family import Family
from positives_oracle import positives_f64

N = 7
IDS = torch.tensor([0, 3, 0, 1, 3, 3, 5])  # groups of 2, 3 and two singletons
MODES = ("supcon", "mil_nce")
CASES = {
    "plain": dict(),
    "one-group": dict(group_ids=torch.zeros(N, dtype=torch.long)),
    "smoothing": dict(label_smoothing=0.2),
    "negatives": dict(m=4, label_smoothing=0.1),
    "threshold": dict(threshold=0.3, m=3),
    "all": dict(m=5, threshold=0.3, label_smoothing=0.1, normalize=False, margin="image_text", gamma=1.0),
}


def _inputs(case, dtype, seed=60):
    kw = {"group_ids": IDS, **CASES[case]}
    m = kw.pop("m", 0)
    img, txt, neg = (
        features(N, D, seed, dtype),
        features(N, D, seed + 1, dtype),
        features(max(m, 1), D, seed + 2, dtype),
    )
    if kw.get("normalize") is False:  # near-unit rows: dot products of the given features
        img, txt, neg = (torch.nn.functional.normalize(x.double(), dim=1).to(dtype) for x in (img, txt, neg))
    if "threshold" in kw:  # every caption cosine away from the threshold (float32 vs float64 compare)
        xs = torch.nn.functional.normalize(torch.cat([txt, neg]).double(), dim=1)
        assert ((torch.nn.functional.normalize(txt.double(), dim=1) @ xs.T - kw["threshold"]).abs() > 1e-4).all()
    return img, txt, (neg if m else None), kw


def _api(kw):
    return {("false_negative_threshold" if k == "threshold" else k): v for k, v in kw.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_oracle_rows_are_the_positives_oracle(mode, case):
    # two independent writings of the same definition: ½(i2t + t2i) of the directions' oracle is the
    # multi-positive oracle's row, values and gradients
    img, txt, neg, kw = _inputs(case, torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (img, txt) + ((neg,) if neg is not None else ())]
    family = dict(negatives=leaves[2]) if neg is not None else {}
    rows = oracle.direction_rows_f64(leaves[0], leaves[1], 0.1, group_mode=mode, **family, **kw)
    ids = kw.pop("group_ids")
    want = positives_f64(leaves[0], leaves[1], 0.1, ids, mode, **family, **kw)
    torch.testing.assert_close(0.5 * (rows[0] + rows[1]), want, rtol=1e-12, atol=1e-13)
    w = oracle.weights(N, 1)[0]
    got_g = torch.autograd.grad((0.5 * (rows[0] + rows[1]) * w).sum(), leaves, retain_graph=True)
    want_g = torch.autograd.grad((want * w).sum(), leaves)
    for g, h in zip(got_g, want_g):
        torch.testing.assert_close(g, h, rtol=1e-11, atol=1e-12)


# the interpreter's budget: Triton runs the plain and the all-options cases
PAIRS = [(b, c) for b in ALL_BACKENDS for c in sorted(CASES) if b != "triton" or c in ("plain", "all")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_rows_and_gradients_match_the_oracle(backend, case, mode):
    img, txt, neg, kw = _inputs(case, torch.float32)
    oracle.check(img, txt, neg, 0.1, backend=backend, group_mode=mode, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
@pytest.mark.parametrize("case", ["plain", "all", "one-group"])
def test_float64(backend, case, mode):
    img, txt, neg, kw = _inputs(case, torch.float64)
    oracle.check(img, txt, neg, 0.1, backend=backend, dtype=torch.float64, group_mode=mode, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_pair_rows_are_the_mean_of_the_directions(backend, mode):
    img, txt, neg, kw = _inputs("all", torch.float32)
    common = dict(negatives=neg, backend=backend, group_mode=mode, **_api(kw))
    rows = hn_clip_loss(img, txt, 0.1, reduction="directions", **common)
    none = hn_clip_loss(img, txt, 0.1, reduction="none", **common)
    torch.testing.assert_close(0.5 * (rows.i2t + rows.t2i), none, rtol=1e-5, atol=1e-6)


def test_own_negatives_with_positive_modes_are_refused_by_name():
    # own_rows' algebra assumes one positive a row: refused at the API (validation_family) and, for
    # when that accepts them for reduction="none", at direction_losses itself
    img, txt = features(N, D, 1), features(N, D, 2)
    own = features(N * 2, D, 3).reshape(N, 2, D)
    for mode in MODES:
        with pytest.raises(ValueError, match=rf"group_mode='{mode}'|own negatives \(N, K, D\)"):
            hn_clip_loss(img, txt, 0.1, negatives=own, group_ids=IDS, group_mode=mode, reduction="directions")
        options = LossOptions(group_mode=mode, reduction="directions", backend="torch")
        family = Family(None, IDS, Margin.TEXT, own, None)
        with pytest.raises(ValueError, match=rf"reduction='directions' does not take each row's own.*'{mode}'"):
            direction_losses(img, txt, img, txt, torch.tensor(0.1), 0, options, False, family)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 9),
    m=st.sampled_from([0, 3]),
    n_groups=st.integers(1, 4),
    eps=st.sampled_from([0.0, 0.2]),
    mode=st.sampled_from(MODES),
    backend=st.sampled_from([b for b in ALL_BACKENDS if b != "triton"]),
    threshold=st.sampled_from([None, 0.4]),
    seed=st.integers(0, 1000),
)
def test_draws(n, m, n_groups, eps, mode, backend, threshold, seed):
    img, txt, neg = features(n, D, seed), features(n, D, seed + 1), features(max(m, 1), D, seed + 2)
    if threshold is not None:
        xs = torch.nn.functional.normalize(torch.cat([txt, neg]).double(), dim=1)
        assume(((torch.nn.functional.normalize(txt.double(), dim=1) @ xs.T - threshold).abs() > 1e-4).all())
    ids = torch.randint(0, n_groups, (n,), generator=torch.Generator().manual_seed(seed))
    kw = dict(group_ids=ids, group_mode=mode, label_smoothing=eps, threshold=threshold)
    oracle.check(img, txt, neg if m else None, 0.1, backend=backend, seed=seed, **kw)
