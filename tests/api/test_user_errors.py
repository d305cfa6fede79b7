"""Mistakes a new user makes, each answered by an error or a warning that names it: positional
ClipLoss flags, ``hn_clip_loss``'s statistics, and where the τ > 1 warning points. Bound: a few
small batches per backend, under a minute."""

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from cases import ALL_BACKENDS, make_pair
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.diagnostics import SaturationReport, saturation_report


@pytest.mark.parametrize(
    "args, name",
    [
        ((0.0,), "local_loss"),  # meant as γ = 0: silently local_loss=0.0 with γ = 0.5 before
        ((True, 1), "gather_with_grad"),
        ((True, True, "yes"), "cache_labels"),
        ((False, False, False, 0, 1, None), "use_horovod"),
    ],
)
def test_positional_clip_loss_flags_must_be_bools(args, name):
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got .*keyword-only \(HNClipLoss\(gamma=0.0\)"):
        HNClipLoss(*args)


@pytest.mark.parametrize(
    "kwargs, name", [(dict(rank=0.0), "rank"), (dict(world_size="2"), "world_size"), (dict(rank=True), "rank")]
)
def test_rank_and_world_size_must_be_ints(kwargs, name):
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        HNClipLoss(**kwargs)


def test_open_clip_style_positional_call_still_works():
    loss = HNClipLoss(False, False, True, 0, 1, False, gamma=0.0)
    assert (loss.local_loss, loss.cache_labels, loss.gamma) == (False, True, 0.0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("eps, reduction", [(0.0, "mean"), (0.1, "none")])
def test_hn_clip_loss_return_stats_is_the_module_report(backend, eps, reduction):
    """The same report HNClipLoss(return_stats=True) keeps, and the same loss as without stats."""
    img, txt = make_pair(14, 8, seed=5, aligned=0.9)
    plain = hn_clip_loss(img, txt, 0.03, label_smoothing=eps, reduction=reduction, backend=backend)
    loss, report = hn_clip_loss(
        img, txt, 0.03, label_smoothing=eps, reduction=reduction, backend=backend, return_stats=True
    )
    assert torch.equal(loss, plain)
    module = HNClipLoss(label_smoothing=eps, backend=backend, normalize=True, return_stats=True)
    module(img, txt, 1 / 0.03)
    assert isinstance(report, SaturationReport) and report.rows == 28
    for field in ("loss", "saturated_rows", "effective_negatives"):
        assert math.isclose(getattr(report, field), getattr(module.last_stats, field), rel_tol=1e-6), field
    assert math.isclose(report.loss, loss.mean().item(), rel_tol=1e-6)
    full = saturation_report(img, txt, 0.03, backend="torch")
    assert report.saturated_rows == full.saturated_rows
    assert math.isclose(report.effective_negatives, full.effective_negatives, rel_tol=1e-4)


def test_hn_clip_loss_return_stats_keeps_gradients_and_validates():
    img, txt = make_pair(6, 4, seed=2)
    img.requires_grad_(True)
    loss, _ = hn_clip_loss(img, txt, 0.07, return_stats=True)
    loss.backward()
    assert img.grad is not None and torch.isfinite(img.grad).all()
    with pytest.raises(TypeError, match="return_stats must be True or False"):
        hn_clip_loss(img, txt, 0.07, return_stats="yes")
    meta = torch.empty(6, 4, device="meta")
    loss, report = hn_clip_loss(meta, meta, 0.07, backend="torch", return_stats=True)
    assert loss.device.type == "meta" and report is None


def test_saturation_report_tau_warning_names_it_and_points_at_the_caller(monkeypatch):
    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())
    img, txt = make_pair(6, 4, seed=17)
    img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saturation_report(img, txt, 14.3)  # line below: the warning points here
        line = sys._getframe().f_lineno - 1
    assert len(caught) == 1, [str(w.message) for w in caught]  # once: its inner hn_clip_loss stays quiet
    message = str(caught[0].message)
    assert message.startswith("saturation_report got tau = 14.3 > 1") and "logit_scale" in message
    assert caught[0].filename == __file__ and caught[0].lineno == line
