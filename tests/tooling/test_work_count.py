"""Matmul work of the Triton loss, counted by tools/work.py (tl.dot in the interpreter, under
the GPU launch configuration, plus torch's matmuls): the counter is exact on a known kernel, and
the loss stays within its budget of N×N×D products."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    # conftest interprets Triton only without CUDA; importing the counter would switch the
    # interpreter on for every later test. Run `python -m tools.work` there instead.
    pytest.skip("the work counter needs a session that interprets Triton (TRITON_INTERPRET=1)", allow_module_level=True)


import triton
import triton.language as tl

from tools.work import count_matmul_flops, count_products


@triton.jit
def _two_dots_kernel(a_ptr, b_ptr, ab_ptr, aat_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One block of rows: A·B and A·Aᵀ (diagonal block), K walked in BK steps, masked edges."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    ab = tl.zeros((BM, BN), tl.float32)
    aat = tl.zeros((BM, BM), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_k[:, None] * N + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        ab = tl.dot(a, b, ab, input_precision="ieee")
        aat = tl.dot(a, tl.trans(a), aat, input_precision="ieee")
    tl.store(ab_ptr + offs_m[:, None] * N + offs_n[None, :], ab, mask=mask_m[:, None] & mask_n[None, :])
    tl.store(aat_ptr + offs_m[:, None] * BM + tl.arange(0, BM)[None, :], aat, mask=mask_m[:, None])


def test_counter_is_exact_on_a_known_kernel_and_torch_mm():
    m, n, k, bm, bn, bk = 40, 12, 40, 32, 16, 16  # 2 row blocks (the second masked), 3 K steps (the last masked)
    a, b = torch.randn(m, k), torch.randn(k, n)
    ab, aat = torch.zeros(m, n), torch.zeros(m, bm)
    x, y = torch.randn(8, 12), torch.randn(12, 5)
    with count_matmul_flops() as count:
        _two_dots_kernel[(triton.cdiv(m, bm),)](a, b, ab, aat, m, n, k, BM=bm, BN=bn, BK=bk)
        xy = torch.mm(x, y)
    torch.testing.assert_close(ab, a @ b)  # the kernel really ran
    torch.testing.assert_close(xy, x @ y)
    blocks, steps = triton.cdiv(m, bm), triton.cdiv(k, bk)
    # full padded tiles, as the GPU executes them: (32×16×16) and (32×32×16) per step and block
    assert count.dot_flops == blocks * steps * (2 * bm * bn * bk + 2 * bm * bm * bk)
    assert count.dot_tiles == {(bm, bn, bk): blocks * steps, (bm, bm, bk): blocks * steps}
    assert count.torch_flops == 2 * 8 * 5 * 12
    with count_matmul_flops() as empty:  # nothing leaks from the previous count
        torch.mm(x, y)
    assert empty.dot_flops == 0 and empty.torch_flops == 2 * 8 * 5 * 12


def assert_work_within(case: dict, max_x_useful: float) -> None:
    """Fail with the counter's breakdown when a case exceeds ``max_x_useful`` × the useful work."""
    assert case["x_useful"] <= max_x_useful, (
        f"{case['kind']} N={case['n']} D={case['d']} {case['dtype']} γ={case['gamma']:g}: "
        f"{case['products']:.2f} products of N×N×D = {case['x_useful']:.2f}× the useful {case['useful_products']} "
        f"(budget {max_x_useful}×): tl.dot {case['dot_products']:.2f}, torch {case['torch_products']:.2f}; "
        f"tl.dot tiles (MxNxK:calls) {case['dot_tiles']}"
    )


@pytest.mark.parametrize("d", [512, 768])
@pytest.mark.parametrize("gamma, budget", [(0.5, 1.84), (0.0, 1.34)], ids=["margin", "infonce"])
def test_loss_matmul_work_within_budget(d, gamma, budget):
    # one forward+backward at N = 256, bf16, GPU tiles: forward 1 (1.75 with the margin's t tᵀ, shared
    # by tile pairs), dS 1 (1.75, the same tile pairs over chunk pairs), and the backward's 2 torch
    # GEMMs (one float16 dS against k and q, float16 copies), which the counter sees inside the opaque
    # custom operator: 5.5 and 4 products (N = 1024: 5.125 with the margin, 1.71x)
    assert_work_within(count_products(n=256, d=d, dtype="bfloat16", gamma=gamma, kind="loss"), budget)


@pytest.mark.parametrize("gamma, budget", [(0.5, 1.67), (0.0, 1.34)], ids=["margin", "infonce"])
def test_rank_matmul_work_within_budget(gamma, budget):
    # a distributed rank's two directions (M = 128 local rows against N = 512, bf16, GPU tiles) in one
    # op: forward 3 products (v tᵀ_all, t v_allᵀ and the shared margin t tᵀ_all; 2 without it), dS the
    # same 3, and 4 torch GEMMs (each direction's dS against its keys and its queries): 10 (8) of the
    # useful 6, 1.67x (1.33x); two directional ops took 12 (2x) with the margin
    case = count_products(n=512, d=512, dtype="bfloat16", gamma=gamma, kind="rank", m=128)
    assert case["torch_products"] == 4.0, case
    assert_work_within(case, budget)


def test_torch_gemms_inside_the_operators_are_counted():
    case = count_products(n=256, d=512, dtype="bfloat16", gamma=0.5, kind="loss")
    assert case["torch_products"] == 2.0, case  # the backward's 2 GEMMs, run by torch in the custom op
    # forward 1.75 (tile pairs share the margin's G: at N = 256 two diagonal 128-row super-tiles at 2
    # products each and one pair at 3, 7 super-tile products for 4) + dS 1.75 (the same pairs, one
    # square chunk)
    assert case["dot_products"] == 3.5, case


# ---- FlopCounterMode's formulas (hnclip_kernels/backends/triton/flops.py) beside the counted work
FORMULA_CASES = {
    "loss bf16 γ=0": dict(kind="loss", gamma=0.0),
    "loss bf16 γ=0.5": dict(kind="loss", gamma=0.5),
    "loss bf16 γ=0 masked": dict(kind="loss", gamma=0.0, false_negative_threshold=0.9),
    "loss fp16 γ=0.5 masked": dict(kind="loss", gamma=0.5, dtype="float16", false_negative_threshold=0.9),
    "loss float32 γ=0.5 (tf32x3)": dict(kind="loss", gamma=0.5, dtype="float32"),
    "directional bf16 γ=0.5": dict(kind="directional", gamma=0.5, m=128),
    "directional fp16 γ=0 masked": dict(
        kind="directional", gamma=0.0, m=128, dtype="float16", false_negative_threshold=0.9
    ),
    "rank bf16 γ=0": dict(kind="rank", gamma=0.0, m=128),
    "rank bf16 γ=0.5 masked": dict(kind="rank", gamma=0.5, m=128, false_negative_threshold=0.9),
    # the hard-negative family (hnclip::triton_symmetric_nll with negatives): the N×N walk plus the N×M block; whole
    # tiles: 16-bit M a multiple of 128 (the block's columns), float32 N = 128 (64-row tiles)
    "family bf16 γ=0.5 M=N/2": dict(kind="family", gamma=0.5, m=128),
    "family bf16 γ=0.5 M=3N ids": dict(kind="family", gamma=0.5, n=128, m=384, ids=2),
    "family bf16 γ=0 M=0 ids masked": dict(kind="family", gamma=0.0, m=0, ids=2, false_negative_threshold=0.9),
    "family fp16 γ=0.5 M=N/2 image_text ids": dict(
        kind="family", gamma=0.5, m=128, dtype="float16", margin="image_text", ids=2
    ),
    "family float32 γ=0.5 M=N/2 (tf32x3)": dict(kind="family", gamma=0.5, n=128, m=64, dtype="float32"),
    "family float32 γ=0 M=3N masked": dict(
        kind="family", gamma=0.0, n=128, m=384, dtype="float32", false_negative_threshold=0.9
    ),
    "family float32 γ=0.5 M=0 ids image_text": dict(
        kind="family", gamma=0.5, n=128, m=0, dtype="float32", ids=4, margin="image_text"
    ),
    # each row's own negatives (K = 8): the N·K logits' useful 3·2·N·K·D beside the N×N loss's
    "own bf16 γ=0.5 K=8": dict(kind="own", gamma=0.5, m=8),
    # reduction="directions": two directional ops (float32 walks), i2t over N + M columns
    "directions bf16 γ=0.5 M=N/2": dict(kind="directions", gamma=0.5, m=128),
}


@pytest.mark.parametrize(
    "margin, threshold, einsums",
    [("text", None, 5), ("image_text", None, 3), ("text", 0.9, 7)],
    ids=["text", "image_text", "text threshold"],
)
def test_own_negatives_block_einsums_are_counted(margin, threshold, einsums):
    # the own block runs its N·K·D products as torch.einsum inside the opaque operator: forward v̂·n̂
    # (and t̂·n̂ for the "text" margin, t̂·n̂ for a threshold's caption cosines), the backward the
    # block again plus dS·n̂ (dS ⊗ v̂ is elementwise, no matmul); the N×N loss's 2 torch GEMMs beside
    n, k, d = 128, 8, 64
    kw = dict(n=n, d=d, dtype="bfloat16", gamma=0.5, margin=margin, false_negative_threshold=threshold)
    own, plain = count_products(kind="own", m=k, **kw), count_products(kind="family", m=0, **kw)
    assert own["torch_flops"] - plain["torch_flops"] == einsums * 2 * n * k * d, (own, plain)
    assert own["formula_flops"] - plain["formula_flops"] == 3 * 2 * n * k * d


@pytest.mark.parametrize(
    "margin, threshold, einsums",
    [
        ("text", None, 4),
        pytest.param("image_text", None, 3, marks=pytest.mark.slow),
        pytest.param("text", 0.9, 5, marks=pytest.mark.slow),
    ],
    ids=["text", "image_text", "text threshold"],
)
def test_directions_own_negatives_block_einsums_are_counted(margin, threshold, einsums):
    # reduction="directions" with each row's K own negatives: the same two directional walks (i2t over
    # the N captions) plus the own columns' autograd einsums on the host: forward v̂·n̂ (and t̂·n̂ for
    # the "text" margin, t̂·n̂ for a threshold's caption cosines), backward dL/dn̂ and dL/dv̂; the
    # hnclip:: formulas state the walks alone, FlopCounterMode counts the einsums as torch matmuls
    n, k, d = 128, 8, 64
    kw = dict(n=n, d=d, dtype="bfloat16", gamma=0.5, false_negative_threshold=threshold)
    own = count_products(kind="directions_own", m=k, margin=margin, **kw)
    plain = count_products(kind="directions", m=0, **kw)
    assert own["torch_flops"] - plain["torch_flops"] == einsums * 2 * n * k * d, (own, plain)
    assert own["formula_flops"] == plain["formula_flops"] and own["dot_flops"] == plain["dot_flops"]
    assert own["useful_products"] == 3 * (2 * n + k) / n


@pytest.mark.parametrize("case", list(FORMULA_CASES), ids=list(FORMULA_CASES))
def test_flop_formulas_state_the_useful_work(case):
    # the formulas that FlopCounterMode applies to the hnclip:: operators state the useful products
    # of the real shapes (S = q kᵀ, dS·k, dSᵀ·q: tools.work's useful_products), the same as the C++
    # operators' (tests/backends/test_flop_formulas.py); the kernels' tl.dot work plus the backward's
    # torch GEMMs (margin and mask products, recomputation, fp16 tails, float32 passes) is never less
    row = count_products(**{"n": 256, "d": 64, "dtype": "bfloat16", **FORMULA_CASES[case]})
    assert row["formula_flops"] == round(row["useful_products"] * row["product_flops"]), row
    assert row["formula_flops"] <= row["total_flops"], row


def test_flop_formulas_leave_tile_padding_out():
    # N = 200 is no whole number of 128-row blocks: the GPU runs the padded tiles, the formula states
    # the products of the 200 × 200 logits
    row = count_products(n=200, d=64, dtype="bfloat16", gamma=0.5, kind="loss")
    assert row["formula_flops"] == 3 * 2 * 200 * 200 * 64 < row["total_flops"], row


def test_flop_formulas_under_the_interpreter_tiles_and_a_tau_only_backward():
    # the interpreter's own launch (32-row diagonal super-tiles, 32-wide chunks) changes the work, not
    # the formula; a backward that wants dτ alone runs no kernel and states 0
    import hnclip_kernels

    gen = torch.Generator().manual_seed(3)
    img, txt = (torch.randn(96, 32, generator=gen).bfloat16() for _ in range(2))
    for grads in ("features", "tau only"):
        tau = torch.tensor(0.07, requires_grad=True)
        x, y = (t.clone().requires_grad_(grads == "features") for t in (img, txt))
        with count_matmul_flops() as count:
            hnclip_kernels.hn_clip_loss(x, y, tau, gamma=0.5, backend="triton").backward()
        products = 3 if grads == "features" else 1
        assert count.formula_flops == products * 2 * 96 * 96 * 32 <= count.dot_flops + count.torch_flops, (
            grads,
            vars(count),
        )
