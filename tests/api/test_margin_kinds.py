"""Every member of the margin's kind (:class:`hnclip_kernels.margin.Margin`) on every backend and
both loss kinds, against the float64 oracles of ``tests/family_oracle.py`` (softmax) and
``tests/sigmoid_oracle.py`` (sigmoid): a new member fails here, loudly, until both oracles write
its formula (``MARGIN_FACTORS``, ``SIGMOID_MARGIN``), ``margin_operands`` picks its operands and
every backend implements it for both kinds (its code reaches the fused operators and ``csrc/``).

Tolerances: the family oracle's (float32: loss 1e-5, gradients 1e-4, relative); the sigmoid
loss's per row (loss 1e-5 relative; gradient rows 1e-4 of their row's norm + 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from sigmoid_oracle import SIGMOID_MARGIN, sigmoid_rows_f64

from cases import ALL_BACKENDS
from family_oracle import MARGIN_FACTORS, check, features
from hnclip_kernels import LossOptions, hn_siglip_loss
from hnclip_kernels.margin import Margin, margin_operands


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("margin", list(Margin), ids=str)
def test_every_backend_runs_every_margin_kind(margin, backend):
    # negatives, ids and the threshold's cosine at once: every input the margin's operands meet
    img, txt, neg = features(12, 16, seed=1, clusters=4), features(12, 16, seed=2, clusters=4), features(5, 16, seed=3)
    ids = torch.arange(12) % 5
    check(img, txt, neg, 0.05, backend=backend, margin=margin, group_ids=ids, threshold=0.9)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("group_mode", ["mask", "positive"])
@pytest.mark.parametrize("margin", list(Margin), ids=str)
def test_every_backend_runs_every_margin_kind_in_the_sigmoid_loss(margin, group_mode, backend):
    img, txt, neg = features(12, 16, seed=1, clusters=4), features(12, 16, seed=2, clusters=4), features(5, 16, seed=3)
    ids = torch.arange(12) % 5
    leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
    s, b = torch.tensor(20.0, requires_grad=True), torch.tensor(-4.0, requires_grad=True)
    kw = dict(gamma=0.5, margin=str(margin), negatives=leaves[2], group_ids=ids, group_mode=group_mode)
    loss = hn_siglip_loss(leaves[0], leaves[1], s, b, backend=backend, **kw)
    got = torch.autograd.grad(loss, [*leaves, s, b])

    ref = [x.double().requires_grad_(True) for x in (img, txt, neg)]
    s64, b64 = (
        torch.tensor(20.0, dtype=torch.float64, requires_grad=True),
        torch.tensor(-4.0, dtype=torch.float64, requires_grad=True),
    )
    rows = sigmoid_rows_f64(ref[0], ref[1], s64, b64, negatives=ref[2], gamma=0.5, margin=str(margin),
                            query_groups=ids, key_groups=ids, groups_positive=group_mode == "positive")  # fmt: skip
    want_loss = rows.sum() / 12
    want = torch.autograd.grad(want_loss, [*ref, s64, b64])
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=0)
    for name, g, w in zip(("img", "txt", "negatives"), got[:3], want[:3]):
        err = (g.double() - w).norm(dim=1)
        bound = 1e-4 * w.norm(dim=1) + 1e-6
        assert (err <= bound).all(), f"d {name}: rows {torch.nonzero(err > bound).flatten().tolist()} off"
    for name, g, w in zip(("logit_scale", "logit_bias"), got[3:], want[3:]):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-7, msg=f"d {name}")


@pytest.mark.parametrize("margin", list(Margin), ids=str)
def test_every_margin_kind_has_operands_an_oracle_and_a_code(margin):
    q, k, qt, kt = (torch.randn(3, 4) for _ in range(4))
    a, b, mask_a, mask_b = margin_operands(margin, q, k, qt, kt)
    assert a.shape == q.shape and b.shape == k.shape
    assert (mask_a is None) == (mask_b is None)
    assert str(margin) in MARGIN_FACTORS and str(margin) in SIGMOID_MARGIN
    assert Margin.from_code(margin.code) is margin
    assert LossOptions(margin=str(margin)).margin is margin  # parsed once, into the typed option


@pytest.mark.parametrize(
    "bad, error, match",
    [(1, TypeError, "margin must be a string"), ("txt", ValueError, "margin must be one of")],
)
def test_an_unknown_margin_names_the_choices(bad, error, match):
    with pytest.raises(error, match=match):
        LossOptions(margin=bad)
