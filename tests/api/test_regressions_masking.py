"""Regression tests of false-negative masking and the options around it: the minimal inputs of
defects a hostile review found (NumPy, Fraction and tensor options, all-masked rows, the
consensus of −0.0, the exact-duplicate hint), one test each. N ≤ 12, well under a second per
backend."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from cases import ALL_BACKENDS, TOL_F32_GRAD, make_pair, masked_case
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.distributed import consensus


def _leaves(*xs):
    return [x.clone().requires_grad_(True) for x in xs]


# ---- a 0-dim NumPy array threshold reached the torch reference unconverted ('>=' Tensor vs ndarray)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_numpy_array_threshold(backend):
    img, txt, c = masked_case("near", dtype=torch.float32)
    want = hn_clip_loss(img, txt, 0.07, false_negative_threshold=c, backend=backend)
    got = hn_clip_loss(img, txt, 0.07, false_negative_threshold=np.array(c), backend=backend)
    assert torch.equal(got, want)
    module = HNClipLoss(false_negative_threshold=np.array(c), backend=backend, normalize=True)
    assert type(module.options.false_negative_threshold) is float
    assert torch.equal(
        module(img, txt, 1 / 0.07), hn_clip_loss(img, txt, 1 / (1 / 0.07), false_negative_threshold=c, backend=backend)
    )


# ---- a Fraction passed validation, then every backend failed on Tensor op Fraction
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_fraction_threshold_and_gamma(backend):
    img, txt, _ = masked_case("near", dtype=torch.float32)
    got = hn_clip_loss(img, txt, 0.07, gamma=Fraction(1, 2), false_negative_threshold=Fraction(9, 10), backend=backend)
    want = hn_clip_loss_f64(img.double(), txt.double(), 0.07, 0.5, false_negative_threshold=0.9)
    assert_close_rel(got, want, 1e-5, "loss")


# ---- torch reference: a row whose negatives are all masked made logsumexp's backward NaN
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_masked_row_under_anomaly_mode(backend):
    img, txt, c = masked_case("all_masked", dtype=torch.float32)
    leaves = _leaves(img, txt)
    tau = torch.tensor(0.07, requires_grad=True)
    with pytest.warns(UserWarning, match="Anomaly Detection"), torch.autograd.detect_anomaly():
        loss = hn_clip_loss(*leaves, tau, false_negative_threshold=c, backend=backend)
        loss.backward()
    ref_leaves = _leaves(img.double(), txt.double())
    ref_tau = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    hn_clip_loss_f64(*ref_leaves, ref_tau, false_negative_threshold=c).backward()
    for got, want, name in zip((*leaves, tau), (*ref_leaves, ref_tau), ("d img", "d txt", "d tau")):
        assert_close_rel(got.grad, want.grad, TOL_F32_GRAD, name)


def test_all_masked_rows_only_under_anomaly_mode():
    # every caption the same: every row's negatives are masked, loss 0 and no gradient
    img = torch.randn(4, 8, requires_grad=True)
    txt = torch.randn(1, 8).repeat(4, 1)
    with pytest.warns(UserWarning, match="Anomaly Detection"), torch.autograd.detect_anomaly():
        loss = hn_clip_loss(img, txt, 0.1, false_negative_threshold=0.9, backend="torch")
        loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(img.grad, torch.zeros_like(img))


# ---- HNClipLoss(return_stats=True) passed its raw tensor ε to the report
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_stats_with_tensor_label_smoothing(backend):
    img, txt = make_pair(6, 8, seed=3)
    module = HNClipLoss(label_smoothing=torch.tensor(0.1), return_stats=True, backend=backend, normalize=True)
    loss = module(img, txt, 1 / 0.07)
    _, report = hn_clip_loss(img, txt, 1 / (1 / 0.07), label_smoothing=0.1, return_stats=True, backend=backend)
    assert module.last_stats is not None
    assert module.last_stats.loss == pytest.approx(report.loss, rel=1e-6)
    assert_close_rel(loss, hn_clip_loss_f64(img, txt, 0.07, label_smoothing=0.1), 1e-5, "loss")


# ---- distributed consensus: -0.0 carried the bits reserved for "no threshold"
def test_consensus_threshold_minus_zero_is_zero_not_none():
    img, txt = make_pair(3, 4, seed=0)

    def field(threshold):
        return consensus._meta_row(0, img, txt, 0, 0.5, 0.0, 2, threshold=threshold)[consensus._THRESHOLD]

    assert field(-0.0) == field(0.0) != field(None) == consensus.NO_THRESHOLD
    assert field(0.9) != field(None)


def test_threshold_error_suggests_below_one_for_exact_duplicates():
    img, txt = make_pair(3, 4, seed=0)
    with pytest.raises(ValueError, match="false_negative_threshold.*0.9999"):
        hn_clip_loss(img, txt, 0.07, false_negative_threshold=1.5)
