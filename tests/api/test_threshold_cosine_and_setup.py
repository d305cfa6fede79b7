"""False-negative masking compares the captions' cosine whatever ``normalize`` says, a cosine
equal to c is masked, TRITON_INTERPRET set too late raises our error, and integer NumPy γ works
under torch.compile.

Every backend, and each of its three ops (the symmetric loss, the directional op, a rank's op),
at interpreter shapes (N ≤ 16, D ≤ 32): a few seconds per backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cases import ALL_BACKENDS, TOL_F32_LOSS
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends import directional_fn, rank_losses, symmetric_losses
from hnclip_kernels.options import LossOptions

OPS = ("symmetric", "directional", "rank")


def _run(op, backend, img, txt, tau, threshold, normalize, gamma=0.5, eps=0.0, m=None, offset=0):
    """(loss, d img, d txt, d τ, kept per row (i2t rows, then t2i rows)) of ``op`` on ``backend``:
    the symmetric loss's mean, or Σ of a rank's ½(i2t + t2i) rows (local rows [offset, offset + m)
    of the global batch img, txt), with each feature's gradient summed over its local and global
    copies (the global batch's gradient)."""
    tau = torch.tensor(tau, requires_grad=True)
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    opts = LossOptions(
        gamma=gamma, label_smoothing=eps, normalize=normalize, backend=backend, false_negative_threshold=threshold
    ).resolved(img)
    if op == "symmetric":
        pairs, (i2t, t2i) = symmetric_losses(*leaves, tau, opts, return_stats=True)
        loss = pairs.mean()
        grads = torch.autograd.grad(loss, [*leaves, tau])
        return loss.detach(), *grads, torch.cat([i2t.kept, t2i.kept])
    local = [x.detach()[offset : offset + m].clone().requires_grad_(True) for x in (img, txt)]
    kw = dict(
        offset=offset,
        gamma=gamma,
        label_smoothing=eps,
        normalize=normalize,
        false_negative_threshold=threshold,
        return_stats=True,
    )
    if op == "directional":
        fn = directional_fn(backend)
        i2t, s_i2t = fn(local[0], leaves[1], query_txt=local[1].detach(), key_txt=leaves[1].detach(), tau=tau, **kw)
        t2i, s_t2i = fn(local[1], leaves[0], query_txt=local[1].detach(), key_txt=leaves[1].detach(), tau=tau, **kw)
        rows = 0.5 * (i2t + t2i)
    else:
        rows, (s_i2t, s_t2i) = rank_losses(*local, *leaves, tau, offset, opts, return_stats=True)
    loss = rows.sum()
    d_loc_img, d_loc_txt, d_img, d_txt, d_tau = torch.autograd.grad(loss, [*local, *leaves, tau])
    d_img, d_txt = d_img.clone(), d_txt.clone()
    d_img[offset : offset + m] += d_loc_img
    d_txt[offset : offset + m] += d_loc_txt
    return loss.detach(), d_img, d_txt, d_tau, torch.cat([s_i2t.kept, s_t2i.kept])


def _truth(op, img, txt, tau, threshold, normalize, gamma=0.5, eps=0.0, m=None, offset=0):
    """The float64 formula's (loss, d img, d txt, d τ) for ``_run``'s op (the mask at the float64
    captions' cosine: ``hn_clip_loss_f64``)."""
    leaves = [x.detach().double().requires_grad_(True) for x in (img, txt)]
    tau = torch.tensor(tau, dtype=torch.float64, requires_grad=True)
    rows = hn_clip_loss_f64(
        *leaves,
        tau,
        gamma=gamma,
        label_smoothing=eps,
        reduction="none",
        normalize=normalize,
        false_negative_threshold=threshold,
    )
    loss = rows.mean() if op == "symmetric" else rows[offset : offset + m].sum()
    return (loss.detach(), *torch.autograd.grad(loss, [*leaves, tau]))


def _check(got, want, dtype, what):
    """Loss to float32 rounding; each gradient to its dtype's rounding (16-bit gradients come back
    in the features' dtype) plus float32's."""
    assert_close_rel(got[0], want[0], 10 * TOL_F32_LOSS, f"{what}: loss")
    for name, g, w in zip(("d img", "d txt", "d tau"), got[1:4], want[1:4]):
        floor = 0.0 if g.dtype == torch.float32 else float((w.to(g.dtype).double() - w).norm() / w.norm())
        assert_close_rel(g, w, 2 * floor + 1e-4, f"{what}: {name}")


# ---- item 2: exact duplicates under open_clip's 16-bit precisions (normalize=False, c = 0.9999)
def _open_clip_duplicates(dtype, n=16, d=32):
    """(img, txt) as open_clip returns them under amp_bf16 / fp16 / pure_bf16: L2-normalised in
    the 16-bit dtype (‖t‖² off 1 by up to ~7e-3 in bf16); captions k and k + n/2 are exact
    duplicates (the same 16-bit row)."""
    g = torch.Generator().manual_seed(0)
    txt = torch.randn(n, d, generator=g)
    txt[n // 2 :] = txt[: n // 2]
    img = txt + 0.8 * torch.randn(n, d, generator=g)
    return F.normalize(img.to(dtype), dim=1), F.normalize(txt.to(dtype), dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_exact_duplicates_of_16bit_normalised_features_are_all_masked(backend, op, dtype):
    img, txt = _open_clip_duplicates(dtype)
    n = img.shape[0]
    sq = (txt.double() ** 2).sum(dim=1)
    assert (sq - 1).abs().max() > 1e-4  # the regime of the bug: norms off 1 by more than 1 − c
    m, offset = (n, 0) if op == "symmetric" else (6, 5)
    got = _run(op, backend, img, txt, 0.05, 0.9999, False, m=m, offset=offset)
    # every row has exactly one duplicate among its n − 1 negatives: n − 2 kept, in both directions
    assert got[4].tolist() == [float(n - 2)] * (2 * m), f"{backend}/{op}: kept {got[4].tolist()}"
    _check(got, _truth(op, img, txt, 0.05, 0.9999, False, m=m, offset=offset), dtype, f"{backend}/{op}")


# ---- item 6: the threshold's boundary (the README's "cosine ≥ c")
def _boundary_case(normalize):
    """Captions whose cosines are exactly representable: (1,0,0,0)·(½,½,½,½) = 0.5 exactly, the
    other pairs 0 or −0.5 (with ``normalize``, the raw rows are these unit vectors times powers of
    two: their norms, and so the normalised vectors, are exact too)."""
    txt = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5], [0, -1.0, 0, 0], [-0.5, 0.5, -0.5, 0.5]])
    img = torch.tensor([[0.8, 0.6, 0, 0], [0.6, 0, 0.8, 0], [0, 0.6, 0, 0.8], [0, 0, 0.6, 0.8]])
    if normalize:
        txt = txt * torch.tensor([[2.0], [0.25], [4.0], [1.0]])
    return img, txt


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_cosine_equal_to_the_threshold_is_masked(backend, op, normalize):
    img, txt = _boundary_case(normalize)
    m, offset = (4, 0) if op == "symmetric" else (2, 1)
    got = _run(op, backend, img, txt, 0.1, 0.5, normalize, eps=0.1, m=m, offset=offset)
    # caption 0 has cosine 0.5 = c with caption 1 (and 1 with 0), every other pair less: rows of
    # captions 0 and 1 keep 2 of their 3 negatives, the others all 3
    full = torch.tensor([2.0, 2.0, 3.0, 3.0])[offset : offset + m]
    assert got[4].tolist() == torch.cat([full, full]).tolist(), f"{backend}/{op}: kept {got[4].tolist()}"
    _check(
        got, _truth(op, img, txt, 0.1, 0.5, normalize, eps=0.1, m=m, offset=offset), torch.float32, f"{backend}/{op}"
    )
    # just above the cosine nothing is masked
    above = _run(op, backend, img, txt, 0.1, 0.5000001, normalize, eps=0.1, m=m, offset=offset)
    assert above[4].tolist() == [3.0] * (2 * m), f"{backend}/{op}: kept {above[4].tolist()} at c above 0.5"


# ---- item 4: TRITON_INTERPRET=1 after `import triton`; integer NumPy γ under torch.compile
@pytest.mark.parametrize("first", ["import triton", "import torch._dynamo"])
def test_triton_interpret_set_after_importing_triton_raises_value_error(first):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        f"{first}\nimport os\nos.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch, hnclip_kernels as h\n"
        "try:\n    h.hn_clip_loss(torch.randn(4, 8), torch.randn(4, 8), 0.1, backend='triton')\n"
        "except ValueError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("OK") and "set TRITON_INTERPRET=1 before importing triton" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


@pytest.mark.parametrize("gamma", [np.int64(1), np.int32(0), np.float32(0.25)], ids=["int64", "int32", "float32"])
@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
def test_numpy_gamma_under_compile_fullgraph(backend, gamma):
    torch._dynamo.reset()
    img, txt = torch.randn(4, 8), torch.randn(4, 8)
    compiled = torch.compile(
        lambda a, b, g: hn_clip_loss(a, b, 0.05, gamma=g, backend=backend), fullgraph=True, backend="eager"
    )
    got = compiled(img, txt, gamma)
    assert torch.equal(got, hn_clip_loss(img, txt, 0.05, gamma=float(gamma), backend=backend))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_saturation_report_masks_the_16bit_duplicates_too(dtype):
    from hnclip_kernels.diagnostics import saturation_report

    img, txt = _open_clip_duplicates(dtype)
    report = saturation_report(img, txt, 0.05, normalize=False, backend="torch", false_negative_threshold=0.9999)
    assert report.masked_pairs == img.shape[0]  # 8 duplicate pairs, each counts 2
