"""The margin in logit units, and the plug-in recipe for a published global term (docs/index.md,
"The margin in logit units"; docs/distributed.md, "GOAL's and StructXLIP's global term").

* Z(s, γ) = s·v tᵀ + sγ·sg(t tᵀ)(1 − I): the margin's logits depend on s and γ only through sγ.
  Checked on every backend without reading Z (the fused backends never form it): the loss at
  (s', γ·s/s') on images rescaled by s/s' (``normalize=False``) is the loss at (s, γ), value and
  gradients (dL/dv scaled back by s/s'); the same images at (s', γ) give another loss (another
  margin) and at (s', γ·s/s') unscaled another one (the loss is not invariant, only the margin).
* ``HNClipLoss(local_loss=False, gather_with_grad=True)`` on features normalised as GOAL and
  StructXLIP do (``F.normalize(x + 1e-8)``) is their ``clip_loss(s · x_i @ x_tᵀ)`` at γ = 0 and
  the float64 oracle (``helpers.hn_clip_loss_f64``) at γ = 0.5, in value and in the gradients of
  the raw embeddings and of ``logit_scale``; ``normalize=True`` on those unit rows changes neither.

Tolerances: float64 (torch, cpp) 1e-12 relative; float32 (triton, under the interpreter) 1e-5
for values, 1e-4 for gradients. Bound: well under a second per case.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from cases import ALL_BACKENDS
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import HNClipLoss, hn_clip_loss

N, D = 9, 16
S = math.exp(3.5)  # StructXLIP's bound: logit_scale clamped to 3.5 after every step
S_PRIME = 100.0  # CLIP's trained scale, open_clip's clamp


def unit_features(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(N, D, generator=g, dtype=torch.float64), dim=1).to(dtype)


def tol(backend):
    return (1e-12, 1e-12) if backend != "triton" else (1e-5, 1e-4)


def loss_and_grads(v, t, s, gamma, backend):
    v, t = v.clone().requires_grad_(True), t.clone().requires_grad_(True)
    with warnings.catch_warnings():  # rows of norm s/s' ≠ 1 on purpose (normalize=False)
        warnings.simplefilter("ignore", RuntimeWarning)
        loss = hn_clip_loss(v, t, 1.0 / s, gamma=gamma, normalize=False, backend=backend)
    loss.backward()
    return loss.detach(), v.grad, t.grad


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("gamma", [0.5, 0.2])
def test_the_margin_enters_the_logits_as_s_times_gamma(backend, gamma):
    dtype = torch.float32 if backend == "triton" else torch.float64
    value_tol, grad_tol = tol(backend)
    v, t = unit_features(1, dtype), unit_features(2, dtype)
    ratio = S / S_PRIME
    loss, dv, dt = loss_and_grads(v, t, S, gamma, backend)
    # (s', γ·s/s'), images rescaled by s/s': s'·(ratio·v)tᵀ = s·v tᵀ and s'·(γ·ratio)·H = sγ·H
    same, dv_same, dt_same = loss_and_grads(v * ratio, t, S_PRIME, gamma * ratio, backend)
    assert_close_rel(same, loss, value_tol, "loss at (s', γ·s/s')")
    assert_close_rel(dv_same * ratio, dv, grad_tol, "dL/dv")
    assert_close_rel(dt_same, dt, grad_tol, "dL/dt")
    # the statement is not vacuous: γ unchanged at s' is another margin, and the loss itself
    # is not invariant (s·v tᵀ is not the same logits at s')
    other_margin, _, _ = loss_and_grads(v * ratio, t, S_PRIME, gamma, backend)
    other_scale, _, _ = loss_and_grads(v, t, S_PRIME, gamma * ratio, backend)
    assert abs(other_margin - loss) > 0.1 * loss and abs(other_scale - loss) > 0.1 * loss


def test_the_documented_figures():
    """docs/index.md's numbers: s = e^3.5, sγ at γ = 0.5 there and at s = 100, and γ' = γ·s/s'."""
    assert round(S, 1) == 33.1 and round(0.5 * S, 1) == 16.6 and 0.5 * S_PRIME == 50.0
    assert round(0.5 * S / S_PRIME, 3) == 0.166 and round(0.5 * S_PRIME / S, 2) == 1.51


def structxlip_global_term(x_i, x_t, scale):
    """StructXLIP's and GOAL's global term on one process: clip_loss(s · x_i @ x_tᵀ)."""
    logits = scale * x_i @ x_t.T
    target = torch.arange(len(logits))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("gamma", [0.0, 0.5])
@pytest.mark.parametrize("normalize", [False, True])
def test_plug_in_global_term(backend, gamma, normalize):
    dtype = torch.float32 if backend == "triton" else torch.float64
    value_tol, grad_tol = tol(backend)
    g = torch.Generator().manual_seed(3)
    raw = [torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2)]

    def run(use_package):
        emb_i, emb_t = (x.clone().requires_grad_(True) for x in raw)
        log_scale = torch.tensor(3.5, dtype=dtype, requires_grad=True)
        x_i, x_t = F.normalize(emb_i + 1e-8, dim=-1), F.normalize(emb_t + 1e-8, dim=-1)
        if use_package:
            loss_fn = HNClipLoss(
                local_loss=False, gather_with_grad=True, gamma=gamma, normalize=normalize, backend=backend
            )
            loss = loss_fn(x_i, x_t, log_scale.exp())
        elif gamma == 0:
            loss = structxlip_global_term(x_i.double(), x_t.double(), log_scale.double().exp())
        else:
            loss = hn_clip_loss_f64(x_i, x_t, 1 / log_scale.double().exp(), gamma=gamma, normalize=False)
        loss.backward()
        return loss.detach(), emb_i.grad, emb_t.grad, log_scale.grad

    got, want = run(True), run(False)
    assert_close_rel(got[0], want[0], value_tol, "loss")
    for name, a, b in zip(("dL/d emb_i", "dL/d emb_t", "dL/d logit_scale"), got[1:], want[1:]):
        assert_close_rel(a, b, grad_tol, name)
