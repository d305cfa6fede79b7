"""examples/fastclip_u_estimator.py: its FastCLIP-style step (per-sample moving estimates u of each
direction's normaliser from ``reduction="directions"``'s LSE, the rows' softmax weighted by g/u)
against the materialised float64 step the example writes out (dense logits, logsumexp, nothing of
the package): objective, every tower gradient and every updated u_i within the example's ``TOL``
(1e-4 relative; measured 1e-8 to 2.4e-6) on every backend, with γ_u = 0.8 and with γ_u = 1 (the
plain mini-batch gradient), and the check's teeth: a step without the 1/u weighting fails it.

Bound: about 3 s (the Triton interpreter's two steps included).
"""

from __future__ import annotations

import pytest

import fastclip_u_estimator as example
from cases import ALL_BACKENDS


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("gamma_u", [0.8, 1.0])
def test_step_equals_the_materialised_float64_step(backend, gamma_u):
    errs = example.check_step(backend, gamma_u=gamma_u)
    assert max(errs.values()) <= example.TOL, errs


def test_the_check_has_teeth(monkeypatch):
    def unweighted(rows, u, index, *, shift, gamma_u):  # the plain loss: no 1/u on the softmax
        _, updated = real(rows, u, index, shift=shift, gamma_u=gamma_u)
        return 0.5 * (rows.i2t + rows.t2i).double().mean(), updated

    real = example.step_objective
    monkeypatch.setattr(example, "step_objective", unweighted)
    errs = example.check_step("torch", gamma_u=0.8)
    assert errs["d image.weight"] > 100 * example.TOL, errs


def test_main_runs(capsys):
    assert example.main(["--backend", "torch", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("check: ") and "step 2:" in out
