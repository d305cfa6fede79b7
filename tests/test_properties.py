"""Property-based sweep (hypothesis): random shapes and options, every backend vs float64."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import ALL_BACKENDS, check_against_truth


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
    gen = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    if not normalize:  # the caller's features are unit rows
        img, txt = (torch.nn.functional.normalize(x, dim=1) for x in (img, txt))
    check_against_truth(backend, n, d, torch.float32, gamma, tau, eps, reduction, normalize=normalize,
                        img=img, txt=txt)
