"""Saturated 16-bit batches, where the backward's staging W must not underflow: bf16 and fp16
features of a model that already separates its pairs, τ 0.01 / 0.012, true loss (at ε = 0)
1e-14 … 1e-30, on every backend.

Triton sized its 16-bit W = c·a·dS·b from max|g| as if |dS_ik| ~ g_i; here |dS_ik| = g_i·P_ik with
P_ik ~ the row's loss, so W fell below float16's subnormals and the rounding compensation put all of
dS back along the positive: loss right, d img / d txt 12-110% off. The symmetric loss, the directional
op and the rank op (at a non-zero offset), masked (near-duplicate caption clusters at c = 0.999) and
not, γ 0 / 0.5, ε 0 / 0.1, N not a tile multiple, against float64, with the suite's 16-bit bounds:
loss 1e-3, gradients 2× the error of rounding the float64 gradient to the dtype + 2e-3, d τ 1e-3.

The backward runs with a power-of-two loss scale S (a GradScaler's), chosen from the float64
gradient so that its largest entry is in [½, 1): a 1e-13 loss has float16 gradients of ~1e-15,
which float16 cannot hold at all. Bound: N ≤ 130, D 64; about a minute on two cores.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from cases import assert_within, fused_backends, op_errors, op_loss

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: CPU tensors, launch modes")

D, THRESHOLD = 64, 0.999
# (N, local rows M, offset) of each size: the directional and rank ops take M rows at the offset
SHAPES = {7: (3, 4), 65: (20, 40), 130: (50, 70)}
# (N, γ, ε, masked, τ): every value of each axis, with every op and dtype; ε = 0 every other case
# (ε's own gradient, exact in the epilogue, dwarfs the saturated dS where ε > 0)
CASES = [
    (65, 0.5, 0.0, False, 0.01),
    (7, 0.5, 0.1, True, 0.012),
    (130, 0.0, 0.0, True, 0.01),
    (65, 0.0, 0.1, False, 0.012),
]
OPS = ("symmetric", "directional", "rank")
DTYPES16 = (torch.bfloat16, torch.float16)
# Triton (interpreted, seconds a call): each (dtype, op) two consecutive cases (one with ε = 0), so
# each op meets three cases and each case three (dtype, op); torch and cpp take every combination
TRITON_CASES = [
    (dtype, op, case)
    for j, (dtype, op) in enumerate(itertools.product(DTYPES16, OPS))
    for case in (CASES[j % len(CASES)], CASES[(j + 1) % len(CASES)])
]


def saturated_batch(n: int, dtype, masked: bool, seed: int = 0):
    """Images near their captions (v = normalise(t + 0.03·noise)); ``masked``: the captions in
    clusters of 4 near-duplicates (cosine ≈ 0.9997, at least 2e-5 from THRESHOLD, asserted on the
    rounded features), which c = 0.999 masks."""
    gen = torch.Generator().manual_seed(seed)
    t = F.normalize(torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    if masked:
        centres = F.normalize(torch.randn((n + 3) // 4, D, generator=gen, dtype=torch.float64), dim=1)
        t = F.normalize(
            centres.repeat_interleave(4, 0)[:n] + 0.002 * torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1
        )
    v = F.normalize(t + 0.03 * torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1)
    img, txt = v.to(dtype), t.to(dtype)
    tn = F.normalize(txt.double(), dim=1)
    cos = (tn @ tn.T)[~torch.eye(n, dtype=torch.bool)]
    assert ((cos - THRESHOLD).abs() > 2e-5).all()
    assert (cos >= THRESHOLD).any() == (masked and n > 1)
    return img, txt


def check_saturated(op, backend, dtype, n, gamma, eps, masked, tau):
    """Loss and every gradient of ``op`` on ``backend`` against float64 (``cases.op_errors``)."""
    img, txt = saturated_batch(n, dtype, masked)
    threshold = THRESHOLD if masked else None
    m, offset = SHAPES[n]
    nll, _ = op_loss(op, "f64", img, txt, tau, gamma, 0.0, threshold, m, offset)
    assert 0 < nll.item() < 1e-12, f"not saturated: true loss {nll.item():.3g} at ε = 0"  # ε's own term is not
    assert_within(op_errors(op, backend, img, txt, tau, gamma, eps, threshold, m, offset), f"{op} {backend}")


def _case_id(case):
    n, gamma, eps, masked, tau = case
    return f"N{n}-g{gamma}-ls{eps}-{'masked' if masked else 'plain'}-tau{tau}"


def _dtype_id(dtype):
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@pytest.mark.parametrize(
    "dtype,op,case", TRITON_CASES, ids=[f"{_dtype_id(d)}-{op}-{_case_id(c)}" for d, op, c in TRITON_CASES]
)
def test_saturated_16bit_triton(launch, dtype, op, case):
    check_saturated(op, "triton", dtype, *case)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES16, ids=_dtype_id)
@pytest.mark.parametrize("backend", ["torch"] + [b for b in fused_backends() if b != "triton"])
def test_saturated_16bit_torch_and_cpp(backend, dtype, op, case):
    check_saturated(op, backend, dtype, *case)
