"""The hard-negative family on backend="triton" (``hnclip::triton_symmetric_nll`` with the family's
inputs, and ``hnclip::triton_directional_nll`` with them, which the distributed path calls): the float64
oracle of family_oracle.py (loss and every gradient: img, txt, negatives, τ) on the Triton
kernels in both launch modes of the interpreter (its own small tiles, and the GPU's), per row where
saturated; triton against cpp per row; the operator's opcheck and torch.compile(fullgraph=True); and that the family operator
without family inputs is today's directional operator, bit for bit.

Tolerances: those of family_oracle.py. Sizes: N = 6 (family_oracle.N), the
interpreter is slow; the sweeps over options × dtypes × margins are in the full tier
(tests/conftest.py), one case of each kind stays in the default tier.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

import family_oracle as oracle
from cases import ALL_BACKENDS
from family_oracle import GROUPS, D, N, features, rows_agree, run_both
from helpers import rel_err
from hnclip_kernels import hn_clip_loss

pytestmark = pytest.mark.skipif("triton" not in ALL_BACKENDS, reason="triton cannot run here")


@pytest.mark.parametrize("m", oracle.M_SIZES)
@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_negatives_match_the_oracle(m, margin, launch):
    oracle.check_negatives("triton", m, margin)


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("m", [0, 7])
def test_group_ids_match_the_oracle(groups, margin, m, launch):
    oracle.check_group_ids("triton", groups, margin, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", sorted(oracle.OPTIONS))
@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_combinations_and_dtypes(dtype, options, margin, launch):
    oracle.check_combination("triton", dtype, options, margin)


@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_all_options_float32(margin, launch):
    # the default tier's case of the sweep above: threshold, ε, normalize=False and ids at once
    oracle.check_combination("triton", torch.float32, "all", margin)


@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("with_ids", [False, True])
def test_saturated_near_duplicates_per_row(margin, with_ids, launch):
    oracle.check_saturated_rows("triton", margin, with_ids)


@pytest.mark.skipif("cpp" not in ALL_BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_cpp_per_row(margin, dtype, launch):
    # the same design on both backends (the symmetric walk plus the negative block; cpp upcasts 16-bit
    # inputs, Triton keeps them): each row and each gradient row agree
    oracle.check_backends_agree_per_row("cpp", "triton", margin, dtype)


def test_group_ids_across_tiles_float32_per_row(launch):
    # float32 ids spanning several tiles (N = 70: three 32-row tiles under the interpreter's launch,
    # two 64-row ones under the GPU's), ids shared across tiles: the backward's symmetric walk forms
    # each off-diagonal tile pair and its mirror, both masked as the forward masks them. Every row
    # and gradient row against the float64 oracle: float32's 1e-4.
    n, m, d = 70, 9, 8
    img, txt, neg = (features(r, d, s) for r, s in ((n, 48), (n, 49), (m, 50)))
    ids = torch.randint(0, 12, (n,), generator=torch.Generator().manual_seed(9))
    got, want, gg, wg = run_both(img, txt, neg, 0.1, reduction="none", backend="triton", group_ids=ids)
    rows_agree(got, want, gg, wg, 1e-4)


def test_bf16_hard_negatives_near_their_captions_per_row(launch):
    # bf16, each row's negative a near-duplicate of its caption (distance ~0.003, τ = 0.01): the row's
    # image gradient ~ p·(n̂ − t̂)/τ is ~300× smaller than the negative block's dS entries, whose
    # float16 rounding (2^-12) the epilogue refers to the row's positive caption
    # (epilogue.add_rounding_compensation(positives=)). With it every d img row is within its
    # rounding to bf16 (measured: the rounding + 3.5e-5); without it, rounding + 1.2e-2.
    # Bound: each row's error ≤ the error of rounding the float64 row to bf16 + 1e-3.
    n, d = 12, 32
    gen = torch.Generator().manual_seed(0)
    txt = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
    img = F.normalize(txt + 0.3 * torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
    neg = F.normalize(txt + 0.003 * torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
    img, txt, neg = (x.to(torch.bfloat16) for x in (img, txt, neg))
    _, _, gg, wg = run_both(img, txt, neg, 0.01, reduction="none", backend="triton")
    want = wg["img"]
    norm = want.norm(dim=1)
    err = (gg["img"].double() - want).norm(dim=1) / norm
    floor = (want.to(torch.bfloat16).double() - want).norm(dim=1) / norm
    assert (err <= floor + 1e-3).all(), f"rows' error less their bf16 rounding: {(err - floor).tolist()}"


def _family_args(m=4, n=9, d=5, ids=True, mask_captions=True):
    gen = torch.Generator().manual_seed(3)
    q, a = torch.randn(m, d, generator=gen), torch.randn(m, d, generator=gen)
    k, b = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    mq, mk = (torch.randn(m, d, generator=gen), torch.randn(n, d, generator=gen)) if mask_captions else (
        torch.empty(0), torch.empty(0))  # fmt: skip
    qg, kg = (torch.tensor([0, 1, 1, 2]), torch.tensor([1, 0, 2, 1, 1, 0])) if ids else (
        torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))  # fmt: skip
    return q, k, a, b, mq, mk, qg, kg


@pytest.mark.parametrize("case", ["threshold-ids-captions", "ids-alone", "none", "ids-supcon", "ids-mil_nce"])
def test_opcheck_family_operator(case):
    import hnclip_kernels.backends.triton.ops  # noqa: F401  (registers the operator)
    from hnclip_kernels.group_mode import GroupMode

    masked = case == "threshold-ids-captions"
    mode = GroupMode(case[4:]).code if case.startswith("ids-") and case != "ids-alone" else 0
    q, k, a, b, mq, mk, qg, kg = _family_args(ids=case != "none", mask_captions=masked)
    q.requires_grad_(True)
    tau = torch.tensor(0.1, requires_grad=True)
    gamma, eps, thr = (torch.tensor(x, dtype=torch.float64) for x in (0.5, 0.1, 0.3 if masked else 0.0))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    # offset, normalize, masked, has_margin, smoothing, precision, group_mode
    flags = (3, True, masked, True, True, "ieee", mode)
    args = (q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, *flags)
    op = torch.ops.hnclip.triton_directional_nll
    torch.library.opcheck(op.default, args, test_utils=checks)
    saved = [x.detach() for x in op(*args)[1:]]
    grad = torch.linspace(0.5, 1.0, 4)
    bargs = (grad, q.detach(), k, a, b, mq, mk, qg, kg, tau.detach(), gamma, eps, thr, *saved, *flags, True)
    torch.library.opcheck(torch.ops.hnclip.triton_directional_nll_backward.default, bargs, test_utils=checks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_family_operator_without_family_inputs_is_the_directional_operator(dtype, launch):
    # absent family keywords and keywords that leave nothing to mask (mask captions without a
    # threshold, no key ids): the same kernels and arguments, every output and gradient bit-identical
    from hnclip_kernels.backends.triton.ops import directional_nll_triton

    q, k, a, b, mq, mk, _, _ = (x.to(dtype) for x in _family_args(ids=False, mask_captions=True))
    no_id = torch.empty(0, dtype=torch.long)
    for threshold in (None, 0.3):
        out = []
        nothing = {} if threshold is not None else dict(mask_query=mq, mask_key=mk)
        for family in ({}, dict(query_groups=torch.tensor([0, 1, 1, 2]), key_groups=no_id, **nothing)):
            leaves = [x.clone().requires_grad_(True) for x in (q, k)]
            tau = torch.tensor(0.07, requires_grad=True)
            loss, stats = directional_nll_triton(leaves[0], leaves[1], query_txt=a, key_txt=b, tau=tau, offset=3,
                                                 gamma=0.5, label_smoothing=0.1, normalize=True, return_stats=True,
                                                 false_negative_threshold=threshold, **family)  # fmt: skip
            grads = torch.autograd.grad((loss * torch.linspace(0.5, 1.0, 4)).sum(), [*leaves, tau])
            out.append((loss, *[x for x in stats if x is not None], *grads))
        for x, y in zip(*out):
            assert torch.equal(x, y), threshold


def test_int32_ids_alone_match_torch(launch):
    # int32 ids, no threshold (no caption product formed) and γ = 0: the rows as torch's
    ids = torch.tensor([0, 1, 0, 2, 1, 3], dtype=torch.int32)
    img, txt, neg = features(N, D, 50), features(N, D, 51), features(3, D, 52)
    kw = dict(negatives=neg, gamma=0.0, label_smoothing=0.1, reduction="none")
    got = hn_clip_loss(img, txt, 0.1, group_ids=ids, backend="triton", **kw)
    want = hn_clip_loss(img, txt, 0.1, group_ids=ids.long(), backend="torch", **kw)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("n", [10, 70])
def test_flops_count_the_negative_columns_useful_products(n):
    # hnclip::triton_symmetric_nll with negatives states the useful products of its N × (N + M) logits, S forward and
    # dS·k, dSᵀ·q backward, 2·D·3·N·(N + M), as the C++ operator: not the tile pairs past BLOCK_M, the
    # margin's or the mask's products, the GEMMs or the float32 passes the kernels run (tools.work
    # counts those); ids, margin and threshold change nothing. Today's loss states 2·D·3·N²
    m, d = 7, 8
    count = oracle.flop_counter("triton", features(n, d, 33), features(n, d, 34), features(m, d, 35))

    assert count(False) == count(False, gamma=0.0) == count(False, group_ids=torch.arange(n)) == 2 * d * 3 * n * n
    for kw in (
        dict(),
        dict(group_ids=torch.arange(n) % 3),
        dict(false_negative_threshold=0.5),
        dict(margin="image_text"),
        dict(false_negative_threshold=0.5, margin="image_text", precision="ieee"),
        dict(gamma=0.0, group_ids=torch.arange(n)),
    ):
        assert count(**kw) == 2 * d * 3 * n * (n + m), kw


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**oracle.FAMILY_DRAWS)
def test_hypothesis_draws_match_the_oracle(**draw):
    # shapes (N 1-7, M 0-9), τ 0.02-1, γ, ε, ids, margins, threshold: the interpreter's own tiles
    oracle.check_draw("triton", **draw)


def test_compile_fullgraph():
    oracle.assert_compiled_equals_eager("triton")


def _clustered_batch(n, m, dtype):
    # τ = 0.01, N = 200: 20 clusters of 3 near-duplicate pairs at rows k, k + 70, k + 140 (other 128-row
    # tiles: diagonal super-tiles and tile pairs, mirrors included), the other pairs distinct (saturated,
    # losses down to e^-100); ids group rows k and k + 140, so k + 70 stays a negative of both (their rows
    # unsaturated) and the masked entries sit in off-diagonal tile pairs; negatives near the clusters
    clusters = torch.arange(20)
    centre_of = torch.arange(n)
    centre_of[clusters + 70] = clusters
    centre_of[clusters + 140] = clusters
    centres = F.normalize(features(n, 64, 20, torch.float64), dim=1)[centre_of]
    img = (centres + 0.02 * features(n, 64, 21, torch.float64)).to(dtype)
    txt = (centres + 0.02 * features(n, 64, 22, torch.float64)).to(dtype)
    neg = (centres[torch.arange(m) % 20] + 0.1 * features(m, 64, 23, torch.float64)).to(dtype)
    ids = torch.arange(n)
    ids[clusters + 140] = clusters
    return img, txt, neg, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_16bit_clustered_batch_per_row_gpu_tiles_many_chunks(dtype, margin, monkeypatch):
    # the GPU's 16-bit tiles (BLOCK_M 128: diagonal super-tiles and tile pairs), 4 "SMs", a 1-byte dS budget
    # (ragged chunks in both walks), ids and a threshold: each row's loss and each gradient row against the
    # float64 oracle on the 16-bit values, relative to that row (half the batch saturated)
    from hnclip_kernels.backends.triton import config as cfg

    monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    monkeypatch.setattr(cfg, "sm_count", lambda device: 4)
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    img, txt, neg, ids = _clustered_batch(200, 150, dtype)
    got, want, gg, wg = run_both(
        img, txt, neg, 0.01, reduction="none", backend="triton", margin=margin, group_ids=ids, threshold=0.995
    )  # fmt: skip (no ε: it would lift every row)
    assert (want < 1e-12).sum() > 100 and (want > 0.1).sum() > 30, want  # saturated and unsaturated rows
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # family_oracle.py's 16-bit gradient bounds
    for i in range(got.shape[0]):  # a saturated row's loss e^δ moves with its float32 logits' rounding, |Z|·u
        assert rel_err(got[i], want[i]) <= 4 * (2 + 0.5) / 0.01 * 2.0**-24, f"row {i}"
    for name in gg:
        g, w = gg[name].double(), wg[name].double()
        if g.dim() == 0:
            assert rel_err(g, w) <= tol, name
            continue
        # fp16 holds no gradient below its subnormal grid 2^-24 (a saturated row's ~1e-20): rounding each of
        # the row's D entries to it errs by ≤ 2^-25, so fp16 rows also pass within that floor; bf16 has no floor
        floor = g.shape[1] ** 0.5 * 2.0**-25 if dtype == torch.float16 else 0.0
        errs = torch.tensor([rel_err(g[i], w[i]) for i in range(g.shape[0])])
        absolute = (g - w).norm(dim=1) - tol * w.norm(dim=1)
        bad = (errs > tol) & (absolute > floor)
        assert not bad.any(), (
            f"d {name}: rows {bad.nonzero().flatten().tolist()[:8]}, worst {errs.max():.3e} > {tol:.1e}"
        )
        if dtype == torch.bfloat16:  # the saturated rows' gradients are there, not flushed
            assert (w.norm(dim=1) < 1e-12).sum() > 20 and (errs[w.norm(dim=1) < 1e-12] <= tol).all()
