"""Property-based sweep (hypothesis): random shapes and options, every backend vs float64."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import ALL_BACKENDS, check_against_truth
from hnclip_kernels import hn_clip_loss


@pytest.mark.parametrize("backend", ALL_BACKENDS)
# τ up to 2 on purpose: the "tau > 1 looks like a logit_scale" warning is expected here
@pytest.mark.filterwarnings("ignore:hn_clip_loss got tau")
# derandomize: CI sees the same examples every run (a random sweep is for local exploration)
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 20),
    gamma=st.floats(0.0, 3.0),
    tau=st.floats(0.02, 2.0),
    eps=st.sampled_from([0.0, 0.05, 0.3]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    normalize=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_configurations(backend, n, d, gamma, tau, eps, reduction, normalize, seed):
    if normalize and d == 1:
        d = 2  # unit vectors in 1-D are ±1: zero gradient, see test_one_dimensional_features
    gen = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    if not normalize:  # the caller's features are unit rows
        img, txt = (torch.nn.functional.normalize(x, dim=1) for x in (img, txt))
    check_against_truth(backend, n, d, torch.float32, gamma, tau, eps, reduction, normalize=normalize, img=img, txt=txt)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_one_dimensional_features(backend):
    # D = 1: normalised features are ±1, so the loss is flat in the inputs (gradient 0 up to rounding,
    # which a relative check cannot judge) but not in τ.
    img = torch.tensor([[2.0], [-0.5], [1.5]], requires_grad=True)
    txt = torch.tensor([[1.0], [3.0], [-2.0]], requires_grad=True)
    tau = torch.tensor(0.5, requires_grad=True)
    from helpers import assert_close_rel, hn_clip_loss_f64

    loss = hn_clip_loss(img, txt, tau, backend=backend)
    loss.backward()
    assert img.grad.abs().max() <= 1e-6 and txt.grad.abs().max() <= 1e-6  # float32 rounding noise at most
    ref_tau = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    ref = hn_clip_loss_f64(img.detach(), txt.detach(), ref_tau)
    ref.backward()
    assert_close_rel(loss, ref, 1e-6, "loss")
    assert_close_rel(tau.grad, ref_tau.grad, 1e-5, "d tau")
