"""The hard-negative family on backend="cpp" (``hnclip::cpp_symmetric_nll``, the single-process loss;
``hnclip::cpp_directional_nll``, the distributed loss's direction, with the family's inputs): the float64
oracle of family_oracle.py (loss and every gradient: img, txt, negatives, τ) on the fused C++
kernels, per row where saturated; cpp against torch per row; the operator's composability
(opcheck, torch.compile(fullgraph=True); gradcheck in float64 is test_hard_negatives.py's, run on
both backends); and its work count.

Tolerances: those of family_oracle.py. Bound: about 15 s on 2 shared cores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import family_oracle as oracle
from cases import ALL_BACKENDS
from family_oracle import GROUPS, D, N, family_f64, features, rows_agree, run_both
from helpers import rel_err
from hnclip_kernels import HNClipLoss, hn_clip_loss

pytestmark = pytest.mark.skipif("cpp" not in ALL_BACKENDS, reason="the C++ extension is not built")


@pytest.mark.parametrize("m", oracle.M_SIZES)
@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_negatives_match_the_oracle(m, margin):
    oracle.check_negatives("cpp", m, margin)


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("m", [0, 7])
def test_group_ids_match_the_oracle(groups, margin, m):
    oracle.check_group_ids("cpp", groups, margin, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("options", list(oracle.OPTIONS))
@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_combinations_and_dtypes(dtype, options, margin):
    oracle.check_combination("cpp", dtype, options, margin)


@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("with_ids", [False, True])
def test_saturated_near_duplicates_per_row(margin, with_ids):
    oracle.check_saturated_rows("cpp", margin, with_ids)


@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_matches_torch_per_row(margin, dtype):
    # the same two directional calls on both backends: each row and each gradient row agree
    oracle.check_backends_agree_per_row("torch", "cpp", margin, dtype)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**oracle.FAMILY_DRAWS)
def test_hypothesis_draws_match_the_oracle(**draw):
    oracle.check_draw("cpp", **draw)


def test_auto_runs_cpp_on_cpu_and_the_module_matches():
    img, txt, neg = features(N, D, 15), features(N, D, 16), features(3, D, 17)
    kw = dict(negatives=neg, group_ids=GROUPS["random"], margin="image_text")
    cpp = hn_clip_loss(img, txt, 0.1, backend="cpp", **kw)
    assert torch.equal(hn_clip_loss(img, txt, 0.1, **kw), cpp)  # "auto": float32 on CPU
    module = HNClipLoss(backend="cpp", normalize=True, margin="image_text")
    assert torch.equal(module(img, txt, 10.0, negatives=neg, group_ids=GROUPS["random"]), cpp)
    # float64 on "auto" stays torch, as today's loss
    img64, txt64, neg64 = (x.double() for x in (img, txt, neg))
    auto64 = hn_clip_loss(img64, txt64, 0.1, **{**kw, "negatives": neg64})
    assert torch.equal(auto64, hn_clip_loss(img64, txt64, 0.1, backend="torch", **{**kw, "negatives": neg64}))


def _family_args(masked=True, m=4, n=9, d=5, ids=True, mask_captions=True):
    gen = torch.Generator().manual_seed(3)
    q, a = torch.randn(m, d, generator=gen), torch.randn(m, d, generator=gen)
    k, b = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    mq, mk = (torch.randn(m, d, generator=gen), torch.randn(n, d, generator=gen)) if mask_captions else (
        torch.empty(0), torch.empty(0))  # fmt: skip
    qg, kg = (torch.tensor([0, 1, 1, 2]), torch.tensor([1, 0, 2, 1, 1, 0])) if ids else (
        torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))  # fmt: skip
    f64 = [torch.tensor(x, dtype=torch.float64) for x in (0.5, 0.1, 0.3 if masked else 0.0)]
    return q, k, a, b, mq, mk, qg, kg, f64


@pytest.mark.parametrize("case", ["threshold-ids-captions", "ids-alone", "none"])
def test_opcheck_family_operator(case):
    masked = case != "none"
    q, k, a, b, mq, mk, qg, kg, (gamma, eps, thr) = _family_args(
        ids=case != "none", mask_captions=case == "threshold-ids-captions"
    )
    if case == "ids-alone":
        thr = torch.tensor(float("inf"), dtype=torch.float64)
    q.requires_grad_(True)
    tau = torch.tensor(0.1, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, 3, True, masked, True)  # offset 3
    op = torch.ops.hnclip.cpp_directional_nll
    torch.library.opcheck(op.default, args, test_utils=checks)
    saved = [x.detach() for x in op(*args)[1:]]
    grad = torch.linspace(0.5, 1.0, 4)
    inputs = (q.detach(), k, a, b, mq, mk, qg, kg, tau.detach(), gamma, eps, thr)
    # offset, normalize, masked, need_grad, group mode 0 ("mask", the forward's default), need_qk
    bargs = (grad, *inputs, *saved, 3, True, masked, True, 0, True)
    torch.library.opcheck(torch.ops.hnclip.cpp_directional_nll_backward.default, bargs, test_utils=checks)


def test_compile_fullgraph():
    oracle.assert_compiled_equals_eager("cpp")


def test_flops_count_the_negative_columns_useful_products():
    # hnclip::cpp_symmetric_nll states the useful products of its N × (N + M) logits, S forward and dS·k,
    # dSᵀ·q backward, 2·D·3·N·(N + M), whatever the margin, ids or threshold make the kernels run
    # (tests/backends/test_cpp_symmetric_family.py records that work); today's loss states 2·D·3·N²
    n, m, d = 10, 7, 8
    count = oracle.flop_counter("cpp", features(n, d, 33), features(n, d, 34), features(m, d, 35))

    assert count(False) == 2 * d * 3 * n * n
    for kw in (dict(), dict(margin="image_text"), dict(group_ids=torch.arange(n)), dict(false_negative_threshold=0.5)):
        assert count(**kw) == 2 * d * 3 * n * (n + m), kw


def test_torch_func_grad_and_vmap():
    # the family operator under torch.func as the other C++ operators: grad equals autograd's,
    # vmap runs the kernels once per batch entry
    img, txt, neg = features(N, D, 36), features(N, D, 37), features(3, D, 38)
    kw = dict(group_ids=GROUPS["random"], margin="image_text", false_negative_threshold=0.5, backend="cpp")

    def loss(a, b, c):
        return hn_clip_loss(a, b, 0.1, negatives=c, **kw)

    got = torch.func.grad(loss, argnums=(0, 1, 2))(img, txt, neg)
    leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    batched = torch.func.vmap(loss, in_dims=(0, None, None))(torch.stack([img, 2 * img]), txt, neg)
    assert torch.equal(batched, torch.stack([loss(img, txt, neg), loss(2 * img, txt, neg)]))


@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_many_tiles_match_the_oracle_per_row(margin):
    # N = 600 captions and M = 200 negatives: the ids' last column (K = 600) falls inside the
    # second 512-column tile, the rows span several strips; float64, 40 ids (15 pairs per id).
    # (Measured: the kernels' float64 gradient rows are off the oracle by ~6e-15, the torch
    # reference's by ~1e-15 since its softplus keeps e^-δ above δ = 20 (numerics.softplus).)
    n, m, d = 600, 200, 8
    img, txt, neg = (features(r, d, s, torch.float64) for r, s in ((n, 39), (n, 40), (m, 41)))
    ids = torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(5))
    kw = dict(group_ids=ids, margin=margin, label_smoothing=0.1)
    upstream = torch.linspace(0.5, 1.5, n, dtype=torch.float64)
    out = []
    for backend in ("oracle", "cpp"):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
        if backend == "oracle":
            rows = family_f64(
                leaves[0], leaves[1], torch.tensor(0.05, dtype=torch.float64), leaves[2], threshold=0.6, **kw
            )
        else:
            rows = hn_clip_loss(leaves[0], leaves[1], 0.05, negatives=leaves[2], false_negative_threshold=0.6,
                                reduction="none", backend="cpp", **kw)  # fmt: skip
        grads = torch.autograd.grad((rows * upstream).sum(), leaves)
        out.append((rows.detach(), dict(zip(("img", "txt", "negatives"), grads))))
    rows_agree(out[1][0], out[0][0], out[1][1], out[0][1], 1e-10)  # float64's LOSS_TOL (the oracle's own rounding)


@pytest.mark.parametrize("m", [0, 200])
def test_many_tiles_ids_alone_float32_per_row(m):
    # float32, group ids without a threshold (the caption tile is not formed but set to 0 before
    # the ids' +inf go in): N = 600 captions span two 512-column tiles, so a tile left holding the
    # previous tile's +inf masks pairs whose ids differ. Every row and gradient row against the
    # float64 oracle on the float32 values: float32's 1e-4.
    n, d = 600, 8
    img, txt, neg = (features(r, d, s) for r, s in ((n, 45), (n, 46), (m, 47)))
    ids = torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(8))
    got, want, gg, wg = run_both(img, txt, neg if m else None, 0.05, reduction="none", backend="cpp", group_ids=ids,
                                 label_smoothing=0.1)  # fmt: skip
    rows_agree(got, want, gg, wg, 1e-4)


def test_thread_counts_agree():
    # 1 and 3 threads (three groups of strips, their key accumulators summed in order)
    n, m, d = 300, 100, 16
    img, txt, neg = (features(r, d, s) for r, s in ((n, 42), (n, 43), (m, 44)))
    ids = torch.randint(0, 30, (n,), generator=torch.Generator().manual_seed(6))
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            leaves = [x.clone().requires_grad_(True) for x in (img, txt, neg)]
            rows = hn_clip_loss(leaves[0], leaves[1], 0.05, negatives=leaves[2], group_ids=ids, reduction="none",
                                false_negative_threshold=0.5, backend="cpp")  # fmt: skip
            out.append((rows.detach(), *torch.autograd.grad((rows * upstream).sum(), leaves)))
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("rows", "d img", "d txt", "d neg"), *out):
        assert rel_err(a, b) <= 1e-6, name


def test_return_stats_match_torch():
    img, txt, neg = features(N, D, 12), features(N, D, 13), features(4, D, 14)
    kw = dict(negatives=neg, group_ids=GROUPS["random"], return_stats=True, label_smoothing=0.1)
    (loss_t, rep_t), (loss_c, rep_c) = (hn_clip_loss(img, txt, 0.1, backend=b, **kw) for b in ("torch", "cpp"))
    assert rel_err(loss_c, loss_t) <= 1e-6
    assert (rep_c.rows, rep_c.masked_pairs) == (rep_t.rows, rep_t.masked_pairs) == (2 * N, 4)
    assert abs(rep_c.effective_negatives - rep_t.effective_negatives) <= 1e-5 * rep_t.effective_negatives
