"""``reduction="directions"`` with each row's own negatives (``negatives`` (N, K, D),
``negatives_mask`` (N, K)) on every backend, against the float64 oracle
``direction_oracle.direction_rows_f64(own=, own_mask=)`` (i2t row i over its N captions plus its
own real K, t2i rows unchanged): the four outputs row by row, and the gradients (img, txt, the own
negatives, τ) of a random signed weighting Σ a·i2t + b·lse_i2t + c·t2i + d·lse_t2i, row by row
(the own negatives' gradient per (i, k) embedding). That oracle's ½(i2t + t2i) is checked against
the independent pair oracle ``own_oracle.own_rows_f64``.

Tolerances (relative per row, ``direction_oracle.row_errors``): torch and cpp on float64 inputs
1e-10 (values) and 1e-9 (gradients); triton on float32 inputs (the interpreter, N ≤ 7) 1e-5 and
1e-4; 16-bit inputs as ``direction_oracle`` states; the saturated batch within
``family_oracle.SATURATED_TOL``.

Bound: about 15 s on 2 shared cores (the Triton interpreter's share: a subset of the cases and 4
draws on backend="triton").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import direction_oracle as oracle
import family_oracle
from cases import ALL_BACKENDS
from hnclip_kernels import DirectionRows, HNClipLoss, hn_clip_loss
from own_oracle import own_cases, own_inputs, own_rows_f64

# the unnormalized case's features are off unit norm on purpose
pytestmark = pytest.mark.filterwarnings("ignore:normalize=False:RuntimeWarning")

N, K, D, TAU = 6, 3, 8, 0.1
CASES = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "image-text": dict(margin="image_text", label_smoothing=0.2),
    "threshold": dict(threshold=0.3, label_smoothing=0.1),
    "group-ids": dict(group_ids=torch.tensor([0, 2, 0, 1, 2, 5]), label_smoothing=0.1),
    "unnormalized": dict(normalize=False, gamma=0.3, label_smoothing=0.1),
    "no-real-own": dict(pattern="none", label_smoothing=0.1),  # every own slot padding: the plain rows
    "first-empty": dict(pattern="first-empty", gamma=2.0),
    "all": dict(
        threshold=0.3,
        label_smoothing=0.1,
        normalize=False,
        group_ids=torch.tensor([0, 2, 0, 1, 2, 5]),
        margin="image_text",
        pattern="one",
    ),
}
TRITON_CASES = ("all", "first-empty", "smoothing", "threshold")


def _dtype(backend):
    return torch.float32 if backend == "triton" else torch.float64


def _inputs(case, dtype, seed=40):
    kw = dict(CASES[case])
    pattern = kw.pop("pattern", "random")
    img, txt, own, mask = own_inputs(N, K, D, pattern, seed, dtype, 0.5 if kw.get("normalize") is False else 1.0)
    if "threshold" in kw:  # every caption cosine away from the threshold (float32 vs float64 compare)
        t = F.normalize(txt.double(), dim=1)
        cos = torch.cat([t @ t.T, torch.einsum("nd,nkd->nk", t, F.normalize(own.double(), dim=2))], dim=1)
        assert ((cos - kw["threshold"]).abs() > 1e-4).all()
    return img, txt, own, mask, kw


def _cases():
    return [(b, c) for b in ALL_BACKENDS for c in sorted(CASES) if b != "triton" or c in TRITON_CASES]


@pytest.mark.parametrize("backend,case", _cases())
def test_rows_and_gradients_match_the_oracle(backend, case):
    img, txt, own, mask, kw = _inputs(case, _dtype(backend))
    oracle.check(img, txt, own, TAU, backend=backend, dtype=_dtype(backend), negatives_mask=mask, **kw)


# own_rows_f64 takes unit rows: its threshold compares the rows it is given, so not with normalize=False
@pytest.mark.parametrize(
    "case", [c for c in sorted(CASES) if not ("threshold" in CASES[c] and "normalize" in CASES[c])]
)
def test_the_two_oracles_agree(case):
    # the direction oracle's ½(i2t + t2i) is the own-negatives pair oracle's row (written apart)
    img, txt, own, mask, kw = _inputs(case, torch.float64)
    tau = torch.tensor(TAU, dtype=torch.float64)
    rows = oracle.direction_rows_f64(img, txt, tau, own=own, own_mask=mask, **kw)
    if kw.pop("normalize", True):
        img, txt, own = F.normalize(img, dim=1), F.normalize(txt, dim=1), F.normalize(own, dim=2)
    pairs = own_rows_f64(img, txt, own, mask, tau, **kw)
    torch.testing.assert_close(0.5 * (rows[0] + rows[1]), pairs, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_pair_rows_are_the_mean_of_the_directions(backend):
    img, txt, own, mask, kw = _inputs("all", _dtype(backend))
    api = {("false_negative_threshold" if k == "threshold" else k): v for k, v in kw.items()}
    rows = hn_clip_loss(img, txt, TAU, negatives=own, negatives_mask=mask, reduction="directions", backend=backend,
                        **api)  # fmt: skip
    none = hn_clip_loss(img, txt, TAU, negatives=own, negatives_mask=mask, reduction="none", backend=backend, **api)
    tol = 1e-12 if backend != "triton" else 1e-5
    torch.testing.assert_close(0.5 * (rows.i2t + rows.t2i), none, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_report_equals_the_pair_rows_report(backend):
    # return_stats: the i2t statistics include the own columns (the report of reduction="none")
    img, txt, own, mask, kw = _inputs("smoothing", _dtype(backend))
    _, report = hn_clip_loss(img, txt, TAU, negatives=own, negatives_mask=mask, reduction="directions",
                             backend=backend, return_stats=True, **kw)  # fmt: skip
    _, want = hn_clip_loss(img, txt, TAU, negatives=own, negatives_mask=mask, reduction="none", backend=backend,
                           return_stats=True, **kw)  # fmt: skip
    tol = 1e-12 if backend != "triton" else 1e-5
    assert abs(report.loss - want.loss) <= tol * abs(want.loss), (report.loss, want.loss)
    assert report.saturated_rows == want.saturated_rows and report.rows == want.rows
    assert abs(report.effective_negatives - want.effective_negatives) <= tol * want.effective_negatives


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_features(backend, dtype):
    img, txt, own, mask, kw = _inputs("smoothing", dtype)
    oracle.check(img, txt, own, TAU, backend=backend, dtype=dtype, negatives_mask=mask, **kw)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_saturated_rows_with_every_row_owning_the_shared_negatives(backend, eps):
    # τ = 0.01: rows from 1e-40 to O(1) (ε = 0; ε = 0.1 adds ε·mean gap, O(10)); each row owning the M
    # shared negatives is the shared family's batch, so the oracle is checked with shared and own columns alike
    img, txt, neg, centre_of = family_oracle.saturated_batch()
    own = neg.expand(img.shape[0], -1, -1).contiguous()
    got, want, gg, wg = oracle.run_both(img, txt, own, 0.01, backend=backend, group_ids=centre_of, seed=3,
                                        label_smoothing=eps)  # fmt: skip
    tau = torch.tensor(float(torch.tensor(0.01)), dtype=torch.float64)  # τ as run_both passes it (float32)
    shared = oracle.direction_rows_f64(img.double(), txt.double(), tau,
                                       negatives=neg.double(), group_ids=centre_of, label_smoothing=eps)  # fmt: skip
    for x, y in zip(want, shared):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=0)
    if eps == 0.0:
        assert want[0].min() < 1e-10 and want[0].max() > 1.0
    for name, err in oracle.row_errors(got, want, gg, wg).items():
        assert err <= family_oracle.SATURATED_TOL, f"{name}: {err:.3e}"


DRAWS = dict(
    case=own_cases(max_n=7, max_k=4),
    tau=st.sampled_from([0.02, 0.07, 0.3, 1.0]),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
    eps=st.sampled_from([0.0, 0.1, 0.3]),
    margin=st.sampled_from(["text", "image_text"]),
    threshold=st.sampled_from([None, 0.2, 0.6]),
    with_ids=st.booleans(),
)


def _draw(backend, case, tau, gamma, eps, margin, threshold, with_ids):
    n, k, d, pattern, seed = case
    dtype = _dtype(backend)
    img, txt, own, mask = own_inputs(n, k, d, pattern, seed, dtype)
    if threshold is not None and dtype != torch.float64:
        t = F.normalize(txt.double(), dim=1)
        cos = torch.cat([t @ t.T, torch.einsum("nd,nkd->nk", t, F.normalize(own.double(), dim=2))], dim=1)
        assume(((cos - threshold).abs() > 1e-4).all())
    ids = torch.arange(n) % max(1, n // 2) if with_ids else None
    kw = dict(margin=margin, gamma=gamma, label_smoothing=eps, threshold=threshold, group_ids=ids)
    oracle.check(img, txt, own, tau, backend=backend, dtype=dtype, seed=seed, negatives_mask=mask, **kw)


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**DRAWS)
def test_draws(backend, **draw):
    _draw(backend, **draw)


# the interpreter runs Triton's kernels at about a second a call: fewer draws there
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**DRAWS)
def test_draws_triton(**draw):
    _draw("triton", **draw)


def test_module_single_process_equals_the_function():
    img, txt, own, mask, kw = _inputs("smoothing", torch.float64)
    got = HNClipLoss(reduction="directions", backend="torch", label_smoothing=0.1, normalize=True, gamma=0.5)(
        img, txt, 1.0 / TAU, negatives=own, negatives_mask=mask
    )
    want = hn_clip_loss(img, txt, 1.0 / (1.0 / TAU), negatives=own, negatives_mask=mask, reduction="directions",
                        backend="torch", label_smoothing=0.1)  # fmt: skip
    assert isinstance(got, DirectionRows)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=0)
