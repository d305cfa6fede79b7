"""Triton kernels (interpreted on CPU, compiled on a GPU) against the float64 formula."""
import pytest
import torch

from cases import (TOL_F32_GRAD, TOL_F32_LOSS, TOL_F32_LOSS_SATURATED, case_id, check_against_truth, covering_cases,
                   make_pair, naive_clip_loss, saturated_pair)
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.ops.hn_clip_triton import directional_nll_triton
from hnclip_kernels.reference import directional_nll_torch
from helpers import assert_close_rel, hn_clip_loss_f64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", covering_cases(), ids=case_id)
def test_matrix_against_float64(case):
    n, d, dtype, gamma, tau, eps, reduction = case
    check_against_truth("triton", n, d, dtype, gamma, tau, eps, reduction, tau_grad=(n + d) % 2 == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_backend(dtype):
    # both backends accumulate a tensor's gradient in float32 and round it once (bf16 included)
    img, txt = make_pair(65, 64, dtype, seed=2)
    tau = torch.tensor(0.07, requires_grad=True)
    out = {}
    for backend in ("torch", "triton"):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau.grad = None
        loss = hn_clip_loss(*leaves, tau, gamma=2.0, label_smoothing=0.1, backend=backend)
        loss.backward()
        out[backend] = (loss, leaves[0].grad.float(), leaves[1].grad.float(), tau.grad.clone())
    for name, a, b in zip(("loss", "d img", "d txt", "d tau"), out["triton"], out["torch"]):
        assert_close_rel(a, b, 1e-5 if name == "loss" else 1e-4, name)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_saturated_regime(gamma, seed):
    # τ = 0.01, well-separated pairs: the true loss is < 1e-20 and a naive float32
    # cross-entropy returns exactly 0 with a 100% wrong gradient.
    img, txt = saturated_pair(seed)
    assert naive_clip_loss(img, txt, 0.01, gamma).item() == 0.0
    truth = hn_clip_loss_f64(img.double(), txt.double(), 0.01, gamma)
    assert 0 < truth.item() < 1e-20
    for reduction in ("mean", "none"):
        loss = check_against_truth("triton", 0, 0, torch.float32, gamma, 0.01, 0.0, reduction, img=img, txt=txt,
                                   loss_tol=TOL_F32_LOSS_SATURATED)
        assert (loss > 0).all()


def test_offset_and_rectangular_directional():
    # local rows vs global columns, as a rank of a distributed job sees them
    gen = torch.Generator().manual_seed(4)
    q, a = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    k, b = torch.randn(19, 8, generator=gen), torch.randn(19, 8, generator=gen)
    k[7:12] = q + 0.1 * k[7:12]
    tau = torch.tensor(0.05, requires_grad=True)
    outs = []
    for fn in (directional_nll_triton, directional_nll_torch):
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        tau.grad = None
        rows = fn(qq, kk, a, b, tau, 7, 0.5, 0.1, True)
        (rows * torch.arange(1.0, 6.0)).sum().backward()
        outs.append((rows, qq.grad, kk.grad, tau.grad.clone()))
    for name, x, y in zip(("rows", "d q", "d k", "d tau"), *outs):
        assert_close_rel(x, y, TOL_F32_LOSS if name == "rows" else TOL_F32_GRAD, name)


def test_deterministic_bitwise():
    img, txt = make_pair(130, 64, torch.float32, seed=7)
    results = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        loss = hn_clip_loss(*leaves, 0.05, backend="triton")
        loss.backward()
        results.append((loss, leaves[0].grad, leaves[1].grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
