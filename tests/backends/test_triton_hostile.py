"""Hostile inputs for the Triton backend (interpreted on CPU): tile edges, chunked backward,
column splits, strided / aliased / expanded inputs, non-finite values, extreme norms.

Every test compares against the float64 truth (``hn_clip_loss_f64``) or the torch
reference of the directional op. Shapes are small: the interpreter pays per program.
"""

import pytest
import torch

from cases import TOL_F32_GRAD, TOL_F32_LOSS, check_against_truth, make_pair
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends.pytorch.reference import directional_nll_torch
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton.ops import directional_nll_triton

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: CPU tensors, launch modes")


def _grads(img, txt, tau=0.07, backend="triton", **kw):
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    loss = hn_clip_loss(*leaves, tau, backend=backend, **kw)
    loss.backward()
    return loss.detach(), leaves[0].grad, leaves[1].grad


# ---------------------------------------------------------------- huge-norm rows
@pytest.mark.parametrize("norm", [1e18, 1e19])
def test_huge_norm_rows_gradient(launch, norm):
    # normalize=True makes loss and gradient invariant to the feature scale, rows of norm
    # 1e18 (finite: ‖x‖² < 3.4e38) and 1e19 included. Unscaled, the dS workspace
    # W = r_q · dS · r_k (``_dscore_kernel``) is ~1e-36 · dS, float32 subnormal, and loses
    # its bits before ``_grad_gemm_kernel`` divides r_q back out (gradient errors 6e-4 at
    # 1e18, 4e-2 at 1e19, against 2e-7 for backend="torch"); the kernel first brings the
    # norms near 1 by exact powers of two.
    img, txt = make_pair(33, 40, seed=1)
    img = img / img.norm(dim=1, keepdim=True) * norm
    txt = txt / txt.norm(dim=1, keepdim=True) * norm
    check_against_truth("triton", 0, 0, torch.float32, 0.5, 0.07, 0.0, "mean", img=img, txt=txt)


def test_huge_norm_rows_gradient_bf16():
    # the same invariance with bfloat16 features of magnitude 1e18 (norm ~6e18): an unscaled W
    # gives a 9.8e-2 error, backend="torch" 1.6e-3, the bf16 rounding floor of
    # check_against_truth ~5e-3
    img, txt = make_pair(40, 36, torch.bfloat16, seed=3)
    img, txt = (img.float() * 1e18).bfloat16(), (txt.float() * 1e18).bfloat16()
    check_against_truth("triton", 0, 0, torch.bfloat16, 0.5, 0.07, 0.0, "mean", img=img, txt=txt)


def test_huge_norm_rows_torch_backend_is_fine():
    # guard for the test above: the scale is representable, the float32 torch path handles it
    img, txt = make_pair(33, 40, seed=1)
    img = img / img.norm(dim=1, keepdim=True) * 1e19
    txt = txt / txt.norm(dim=1, keepdim=True) * 1e19
    check_against_truth("torch", 0, 0, torch.float32, 0.5, 0.07, 0.0, "mean", img=img, txt=txt)


# ---------------------------------------------------------------- tile edges, chunks, splits
@pytest.mark.parametrize("n, d", [(1, 3), (2, 1), (31, 33), (33, 31), (64, 129), (65, 3), (129, 33)])
def test_tile_edges_nonuniform_upstream(launch, n, d):
    img, txt = make_pair(n, d, seed=n + d)
    check_against_truth(
        "triton", 0, 0, torch.float32, 0.5, 0.07, 0.1, "none", img=img, txt=txt, upstream=torch.linspace(-1.0, 2.0, n)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_chunks_and_many_splits_gpu_launch(monkeypatch, dtype):
    # GPU tiles, 1-byte workspace budget (128 × 128 chunks: 3 × 3, the last ragged), and an
    # sm_count so large that every column block is its own split
    monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    monkeypatch.setattr(cfg, "sm_count", lambda device: 10**6)
    assert cfg.chunk_shape(257, 257) == (128, 128)
    assert cfg.column_splits(3, 257, torch.device("cpu")) == (5, 64)
    check_against_truth(
        "triton", 257, 20, dtype, 2.0, 0.05, 0.1, "none", upstream=torch.linspace(-1.0, 3.0, 257), seed=9
    )


def test_tiny_workspace_interpret(monkeypatch):
    monkeypatch.delenv("HNCLIP_TRITON_LAUNCH", raising=False)
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    monkeypatch.setattr(cfg, "sm_count", lambda device: 1000)
    assert cfg.chunk_shape(70, 70) == (32, 32)
    check_against_truth(
        "triton", 70, 33, torch.float32, 0.5, 0.07, 0.1, "none", upstream=torch.linspace(-1.0, 3.0, 70), seed=5
    )


@pytest.mark.parametrize("m, n, d, offset", [(5, 19, 8, 14), (33, 100, 31, 40), (129, 300, 9, 171)])
def test_directional_offsets_against_torch(launch, monkeypatch, m, n, d, offset):
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)  # many ragged chunks
    gen = torch.Generator().manual_seed(m + n)
    q, a = torch.randn(m, d, generator=gen), torch.randn(m, d, generator=gen)
    k, b = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    up = torch.linspace(-1.0, 2.0, m)
    outs = []
    for fn, dt in ((directional_nll_triton, torch.float32), (directional_nll_torch, torch.float64)):
        qq, kk = q.to(dt).clone().requires_grad_(True), k.to(dt).clone().requires_grad_(True)
        tau = torch.tensor(0.05, dtype=dt, requires_grad=True)
        rows = fn(
            qq,
            kk,
            query_txt=a.to(dt),
            key_txt=b.to(dt),
            tau=tau,
            offset=offset,
            gamma=0.5,
            label_smoothing=0.1,
            normalize=True,
        )
        (rows * up.to(dt)).sum().backward()
        outs.append((rows, qq.grad, kk.grad, tau.grad))
    for name, x, y in zip(("rows", "d q", "d k", "d tau"), *outs):
        assert_close_rel(x, y, TOL_F32_LOSS if name == "rows" else TOL_F32_GRAD, name)


# ---------------------------------------------------------------- layouts and aliasing
def _check_leaves(leaf_img, leaf_txt, img_fn, txt_fn, tau=0.07, gamma=0.5):
    """Loss and leaf gradients of hn_clip_loss(img_fn(leaf_img), txt_fn(leaf_txt)) vs float64."""
    got = []
    for backend, dt in (("triton", None), ("f64", torch.float64)):
        li = leaf_img.detach().clone() if dt is None else leaf_img.detach().double()
        lt = li if leaf_txt is leaf_img else (leaf_txt.detach().clone() if dt is None else leaf_txt.detach().double())
        li.requires_grad_(True)
        lt.requires_grad_(True)
        if backend == "triton":
            loss = hn_clip_loss(img_fn(li), txt_fn(lt), tau, gamma=gamma, backend="triton")
        else:
            loss = hn_clip_loss_f64(img_fn(li), txt_fn(lt), tau, gamma)
        loss.backward()
        got.append((loss, li.grad, lt.grad))
    for name, x, y in zip(("loss", "d img leaf", "d txt leaf"), *got):
        assert_close_rel(x, y, TOL_F32_LOSS if name == "loss" else TOL_F32_GRAD, name)


def test_same_leaf_for_img_and_txt():
    x, _ = make_pair(37, 20, seed=12)
    _check_leaves(x, x, lambda v: v, lambda t: t, gamma=2.0)


def test_transposed_and_strided_leaves():
    gen = torch.Generator().manual_seed(1)
    big_t = torch.randn(33, 70, generator=gen)  # img = big_t.T: strides (1, 70)
    big = torch.randn(140, 99, generator=gen)  # txt = big[::2, 1::3]: strides (198, 3)
    _check_leaves(big_t, big, lambda v: v.t(), lambda t: t[::2, 1::3])


def test_expanded_leaves_stride_zero():
    # every image the same (1, D) leaf broadcast to N rows (row stride 0): the kernels read
    # stride-0 features, autograd sums the (N, D) gradient into the leaf
    gen = torch.Generator().manual_seed(3)
    row, txt = torch.randn(1, 33, generator=gen), torch.randn(70, 33, generator=gen)
    _check_leaves(row, txt, lambda v: v.expand(70, 33), lambda t: t, gamma=1.0)


def test_views_inside_nan_storage():
    # masked loads must never touch the NaNs around the views
    img, txt = make_pair(37, 20, seed=12)
    bi = torch.full((42, 27), float("nan"))
    bi[:37, :20] = img
    bt = torch.full((42, 27), float("nan"))
    bt[2:39, 3:23] = txt
    check_against_truth("triton", 0, 0, torch.float32, 0.5, 0.07, 0.1, "mean", img=bi[:37, :20], txt=bt[2:39, 3:23])


# ---------------------------------------------------------------- extreme values
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("gamma", [0.0, 0.5])
@pytest.mark.parametrize("normalize", [True, False])
def test_nonfinite_row_poisons_loss(launch, bad, gamma, normalize):
    img, txt = make_pair(37, 20, seed=12)
    txt[6, 3] = bad
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    tau = torch.tensor(0.07, requires_grad=True)
    rows = hn_clip_loss(*leaves, tau, gamma=gamma, reduction="none", normalize=normalize, backend="triton")
    # every pair sees caption 6 among its negatives: no row may come back silently finite
    assert not torch.isfinite(rows).any()
    rows.sum().backward()
    assert not torch.isfinite(tau.grad)


def test_zero_and_clamped_rows():
    img, txt = make_pair(33, 40, seed=1)
    img[3] = 0.0
    txt[5] = 0.0
    img[7] *= 1e-14  # ‖x‖ < 1e-12: x̂ = x / 1e-12, linear
    txt[9] *= 1e-13
    check_against_truth("triton", 0, 0, torch.float32, 0.5, 0.07, 0.1, "mean", img=img, txt=txt)


@pytest.mark.parametrize("tau, gamma", [(0.001, 0.5), (10.0, 0.5), (1e-5, 0.5), (0.07, 1e3), (0.001, 1e3)])
def test_extreme_tau_and_gamma(tau, gamma):
    img, txt = make_pair(33, 40, seed=1)
    check_against_truth("triton", 0, 0, torch.float32, gamma, tau, 0.0, "mean", img=img, txt=txt)


def test_duplicate_captions():
    # identical captions: margin exactly 1 between them, their logits tie. (With |Z| ~ 1e5,
    # tau = 1e-5 or gamma = 1e3 at tau = 1e-3, every float32 backend, torch and cpp included,
    # misses 1e-4 on the gradient here: the tied gaps γ/τ are only known to an ulp of 1e5.)
    img, txt = make_pair(33, 40, seed=1)
    txt[7] = txt[8]
    txt[9] = txt[8]
    check_against_truth("triton", 0, 0, torch.float32, 2.0, 0.07, 0.1, "mean", img=img, txt=txt)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "bf16x6"])
def test_precision_modes_float32_accuracy(launch, precision):
    img, txt = make_pair(40, 36, seed=11)
    t_img, t_txt = [x.double().requires_grad_(True) for x in (img, txt)]
    ref = hn_clip_loss_f64(t_img, t_txt, 0.07, 0.5, 0.1)
    ref.backward()
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    loss = hn_clip_loss(*leaves, 0.07, gamma=0.5, label_smoothing=0.1, backend="triton", precision=precision)
    loss.backward()
    assert_close_rel(loss, ref, TOL_F32_LOSS, "loss")
    assert_close_rel(leaves[0].grad, t_img.grad, TOL_F32_GRAD, "d img")
    assert_close_rel(leaves[1].grad, t_txt.grad, TOL_F32_GRAD, "d txt")


# ---------------------------------------------------------------- determinism, no mutation
def test_deterministic_and_inputs_untouched_gpu_launch(monkeypatch):
    monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    img, txt = make_pair(130, 24, seed=7)
    img0, txt0 = img.clone(), txt.clone()
    up = torch.linspace(-1.0, 1.0, 130)
    upstream0 = up.clone()
    results = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau = torch.tensor(0.05, requires_grad=True)
        rows = hn_clip_loss(*leaves, tau, label_smoothing=0.1, reduction="none", backend="triton")
        rows.backward(up)
        results.append((rows, leaves[0].grad, leaves[1].grad, tau.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.equal(img, img0) and torch.equal(txt, txt0) and torch.equal(up, upstream0)
