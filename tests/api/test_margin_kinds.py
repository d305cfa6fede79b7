"""Every member of the margin's kind (:class:`hnclip_kernels.margin.Margin`) on every backend,
against the float64 oracle of ``tests/family_oracle.py``: a new member fails here, loudly, until
the oracle writes its formula (``MARGIN_FACTORS``), ``margin_operands`` picks its operands and
every backend implements it (its code reaches the fused operators and ``csrc/``).

Tolerances: the family oracle's (float32: loss 1e-5, gradients 1e-4, relative).
"""

from __future__ import annotations

import pytest
import torch

from cases import ALL_BACKENDS
from family_oracle import MARGIN_FACTORS, check, features
from hnclip_kernels import LossOptions
from hnclip_kernels.margin import Margin, margin_operands


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("margin", list(Margin), ids=str)
def test_every_backend_runs_every_margin_kind(margin, backend):
    # negatives, ids and the threshold's cosine at once: every input the margin's operands meet
    img, txt, neg = features(12, 16, seed=1, clusters=4), features(12, 16, seed=2, clusters=4), features(5, 16, seed=3)
    ids = torch.arange(12) % 5
    check(img, txt, neg, 0.05, backend=backend, margin=margin, group_ids=ids, threshold=0.9)


@pytest.mark.parametrize("margin", list(Margin), ids=str)
def test_every_margin_kind_has_operands_an_oracle_and_a_code(margin):
    q, k, qt, kt = (torch.randn(3, 4) for _ in range(4))
    a, b, mask_a, mask_b = margin_operands(margin, q, k, qt, kt)
    assert a.shape == q.shape and b.shape == k.shape
    assert (mask_a is None) == (mask_b is None)
    assert str(margin) in MARGIN_FACTORS
    assert Margin.from_code(margin.code) is margin
    assert LossOptions(margin=str(margin)).margin is margin  # parsed once, into the typed option


@pytest.mark.parametrize(
    "bad, error, match",
    [(1, TypeError, "margin must be a string"), ("txt", ValueError, "margin must be one of")],
)
def test_an_unknown_margin_names_the_choices(bad, error, match):
    with pytest.raises(error, match=match):
        LossOptions(margin=bad)
