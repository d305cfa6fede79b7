"""The Triton kernels under the GPU's launch configuration, with the GPU's operand rounding.

The interpreter multiplies exactly in float32; ``_dot`` rounds the operands as tensor cores
do (tf32 truncation, bf16 to nearest even, multi-pass splits), so these runs compute what a
GPU computes. ``HNCLIP_TRITON_LAUNCH=gpu`` gives the GPU's tiles, warps and column splits.
"""

import pytest
import torch
import triton
import triton.language as tl

from cases import TOL_F32_LOSS_SATURATED, case_id, check_against_truth, covering_cases, saturated_pair
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton import precision as tk

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: emulated operand rounding")


@pytest.fixture
def gpu_launch(monkeypatch):
    monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    assert cfg.launch_mode() == "gpu"


@pytest.mark.parametrize("case", covering_cases()[::2], ids=case_id)
def test_matrix_gpu_launch(gpu_launch, case):
    n, d, dtype, gamma, tau, eps, reduction = case
    check_against_truth("triton", n, d, dtype, gamma, tau, eps, reduction, tau_grad=True, seed=3)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_saturated_gpu_launch(gpu_launch, gamma, seed):
    img, txt = saturated_pair(seed)
    loss = check_against_truth(
        "triton", 0, 0, torch.float32, gamma, 0.01, 0.0, "none", img=img, txt=txt, loss_tol=TOL_F32_LOSS_SATURATED
    )
    assert (loss > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_in_chunks(monkeypatch, dtype):
    # an 8 KiB workspace: dS is materialised in 5 × 5 square chunks (32 × 32), 15 chunk pairs, both
    # gradients accumulated over them
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 8192)
    assert cfg.chunk_shape(130, 130) == (32, 64)
    assert cfg.chunk_shape(130, 130, square=True) == (32, 32)  # the symmetric loss: chunk pairs
    check_against_truth("triton", 130, 40, dtype, 0.5, 0.05, 0.1, "none", upstream=torch.linspace(0.5, 2, 130))


def test_forward_splits_columns(monkeypatch):
    # more column splits than row blocks: every row's statistics are merged from partials
    monkeypatch.setattr(cfg, "sm_count", lambda device: 64)
    assert cfg.column_splits(5, 130, torch.device("cpu"))[0] == 5
    check_against_truth("triton", 130, 24, torch.float32, 2.0, 0.07, 0.1, "mean")


# ---------------------------------------------------------------- operand rounding, kernel level
@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, PREC: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    c = tk._dot(a, b, tl.zeros((N, N), tl.float32), PREC)
    tl.store(c_ptr + r[:, None] * N + r[None, :], c)


def _tf32(x, nearest=False):
    bits = x.view(torch.int32)
    if nearest:
        bits = bits + 0x1000
    return (bits & ~0x1FFF).view(torch.float32)


def _bf16(x):
    return x.to(torch.bfloat16).float()  # torch rounds to nearest even, as the GPU does


def _emulated(a, b, prec):
    """What the tensor cores compute for float32 a @ b in each input precision (float64 sums)."""
    mm = lambda x, y: x.double() @ y.double()  # noqa: E731
    if prec == "ieee":
        return mm(a, b)
    if prec == "tf32":
        return mm(_tf32(a), _tf32(b))
    if prec == "tf32x3":
        ah, bh = _tf32(a, True), _tf32(b, True)
        return mm(_tf32(a - ah), bh) + mm(ah, _tf32(b - bh)) + mm(ah, bh)
    a1, b1 = _bf16(a), _bf16(b)
    a2, b2 = _bf16(a - a1), _bf16(b - b1)
    if prec == "bf16x3":
        return mm(a2, b1) + mm(a1, b2) + mm(a1, b1)
    a3, b3 = _bf16(a - a1 - a2), _bf16(b - b1 - b2)
    return mm(a1, b3) + mm(a2, b2) + mm(a3, b1) + mm(a1, b2) + mm(a2, b1) + mm(a1, b1)


@pytest.mark.parametrize(
    "prec, max_rel", [("ieee", 1e-6), ("tf32x3", 1e-6), ("bf16x6", 1e-6), ("bf16x3", 2e-5), ("tf32", 2e-3)]
)
def test_dot_emulates_tensor_cores(prec, max_rel):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)
    c = torch.empty(32, 32)
    _dot_kernel[(1,)](a, b, c, PREC=prec, N=32)
    want = _emulated(a, b, prec)
    # the kernel's float32 sums against the emulation's float64 ones: float32 rounding only
    assert ((c.double() - want).norm() / want.norm()).item() < 1e-6
    # and each mode's distance from the exact product is what the mode promises
    exact = a.double() @ b.double()
    err = ((c.double() - exact).norm() / exact.norm()).item()
    assert err < max_rel
    if prec in ("tf32", "bf16x3"):
        assert err > 1e-7  # the rounding really happened


def test_bf16_store_rounds_to_nearest_even():
    # the interpreter's own float32 → bf16 conversion truncates; the GPU rounds to nearest even
    @triton.jit
    def k(x_ptr, y_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(y_ptr + r, tk._round_bf16(tl.load(x_ptr + r)).to(tl.bfloat16))

    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    x[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    y = torch.empty(4096, dtype=torch.bfloat16)
    k[(1,)](x, y, N=4096)
    assert torch.equal(y[3:], x[3:].to(torch.bfloat16))
    assert torch.isnan(y[0]) and y[1] == float("inf") and y[2] == -float("inf")


def test_autotune_drops_the_dscore_tile_that_spills_with_masked_smoothing():
    # false-negative masking with label smoothing (SHIFT): the fp16 directional dS at 128x64 / 4
    # warps spills on sm_90a, so the pruner leaves it out there and nowhere else (bf16 fits)
    from hnclip_kernels.backends.triton import config as cfg

    prune = cfg.pruner("dscore", "q_ptr")
    half, single, shifts = torch.empty(1, dtype=torch.float16), torch.empty(1), torch.empty(1)
    configs = cfg.all_candidates("dscore")
    # SHIFT derives from s_ptr (the rows' ε/n, None without it): the pruner reads the pointer
    plain = prune(configs, {"q_ptr": half, "s_ptr": None})
    shifted = prune(configs, {"q_ptr": half, "s_ptr": shifts})
    assert len(plain) == 2 and len(shifted) == 1
    assert (shifted[0].kwargs["BLOCK_M"], shifted[0].num_warps) == (64, 8)
    assert prune(configs, {"q_ptr": single, "s_ptr": shifts}) == prune(configs, {"q_ptr": single, "s_ptr": None})
    bf16 = torch.empty(1, dtype=torch.bfloat16)
    assert len(prune(configs, {"q_ptr": bf16, "s_ptr": shifts})) == 2
