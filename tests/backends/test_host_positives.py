"""The host pass of the multi-positive targets (``hnclip_kernels/backends/positives.py``,
``hnclip::host_positive_fwd`` / ``hnclip::host_positive_bwd``, what the Triton backend runs beside its
kernels): against the C++ raw kernels of the same statistics and shares (``csrc/positives.cpp``, an
independent implementation: float64 within 1e-13), in row chunks (:data:`CHUNK_ELEMENTS` small) the
same values, groups reaching outside the query rows (a directional call, offset 2, the last keys
without ids), and the operators' schema and fakes (opcheck)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hnclip_kernels.backends import cpp_directional
from hnclip_kernels.backends import positives as host

M, N, D, OFFSET = 5, 10, 6, 2
KEY_IDS = torch.tensor([0, 1, 0, 2, 0, 1, 3, 3])  # K = 8 < N: the last two keys carry no id (negatives)


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(M, D, generator=g, dtype=torch.float64), dim=1).to(dtype)
    k = F.normalize(torch.randn(N, D, generator=g, dtype=torch.float64), dim=1).to(dtype)
    inv_tau = torch.tensor(10.0, dtype=dtype)
    pos = (q * k[OFFSET : OFFSET + M]).sum(1) * inv_tau
    qg = KEY_IDS[OFFSET : OFFSET + M]
    return q, k, pos, inv_tau, qg


def _factors(extra, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    mass = torch.rand(M, generator=g, dtype=torch.float64).to(dtype)
    return torch.stack([F.softplus(extra[0]), mass, extra[3] + 1, torch.full((M,), 0.02, dtype=dtype)])


def _run(q, k, pos, inv_tau, qg, mode):
    extra = torch.ops.hnclip.host_positive_fwd(q, k, pos, inv_tau, OFFSET, qg, KEY_IDS)
    factors, g = _factors(extra, q.dtype), torch.linspace(0.5, 1.5, M, dtype=q.dtype)
    eps = torch.tensor(0.1, dtype=torch.float64)
    return (
        extra,
        factors,
        torch.ops.hnclip.host_positive_bwd(q, k, pos, inv_tau, OFFSET, qg, KEY_IDS, factors, g, eps, mode),
    )


@pytest.mark.skipif(cpp_directional() is None, reason="the C++ extension is not built")
@pytest.mark.parametrize("mode", [1, 2], ids=["supcon", "mil_nce"])
def test_host_pass_is_the_cpp_kernels(mode):
    q, k, pos, inv_tau, qg = _inputs(torch.float64)
    extra, factors, grads = _run(q, k, pos, inv_tau, qg, mode)
    want = torch.ops.hnclip.cpp_raw_positive_fwd(q, k, pos, inv_tau, OFFSET, qg, KEY_IDS)
    assert torch.equal(torch.isinf(extra[0]), torch.isinf(want[0]))  # a row without other positives: −inf
    finite = torch.isfinite(want)
    assert torch.allclose(extra[finite], want[finite], rtol=1e-13, atol=1e-13)
    g = torch.linspace(0.5, 1.5, M, dtype=torch.float64)
    wanted = torch.ops.hnclip.cpp_raw_positive_bwd(q, k, pos, inv_tau, OFFSET, qg, KEY_IDS, factors, g, 0.1, mode)
    for name, got, ref in zip(("d q", "d k", "dz_d"), grads, wanted):
        assert torch.allclose(got, ref, rtol=1e-13, atol=1e-13), name
    assert grads[1][OFFSET + M].abs().max() > 0  # key 7: a positive of row 4 (id 3) outside the rows' keys
    assert torch.count_nonzero(grads[1][KEY_IDS.shape[0] :]) == 0  # the keys without an id: no positive


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_chunks_give_the_same_values(dtype, monkeypatch):
    """A chunk of one row at a time (every row's pairs whole in one chunk) against one chunk."""
    inputs = _inputs(dtype, seed=3)
    whole = _run(*inputs, 1)
    monkeypatch.setattr(host, "CHUNK_ELEMENTS", 1)
    chunked = _run(*inputs, 1)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    for got, want in zip((chunked[0], *chunked[2]), (whole[0], *whole[2])):
        assert torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("mode", [1, 2], ids=["supcon", "mil_nce"])
def test_opcheck(mode):
    q, k, pos, inv_tau, qg = _inputs(torch.float32)
    fwd = (q, k, pos, inv_tau, OFFSET, qg, KEY_IDS)
    torch.library.opcheck(torch.ops.hnclip.host_positive_fwd, fwd, test_utils=("test_schema", "test_faketensor"))
    extra = torch.ops.hnclip.host_positive_fwd(*fwd)
    bwd = (*fwd, _factors(extra, q.dtype), torch.ones(M), torch.tensor(0.1, dtype=torch.float64), mode)
    torch.library.opcheck(torch.ops.hnclip.host_positive_bwd, bwd, test_utils=("test_schema", "test_faketensor"))
