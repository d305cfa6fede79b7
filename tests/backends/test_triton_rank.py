"""A distributed rank's op on Triton (``hnclip::triton_rank_nll``): both directions of the
rank's M local rows against the N gathered columns in one walk, the margin's t tᵀ_all formed
once per tile for both.

* Against the two directional ops it replaces (what the distributed loss ran before): every
  value and gradient identical to the bit under the interpreter's launch, over dtypes, γ, ε,
  strided inputs and a backward in several ragged chunks.
* Against a float64 evaluation of the formula under both launch configurations (the GPU's tiles:
  128 × 32 for 16-bit, 64 × 16 for float32).
* With false-negative masking: bit for bit the masked directional ops, and the float64 formula.
* As an operator: opcheck, torch.func.grad, torch.compile(fullgraph=True).

The distributed loss itself (gloo ranks, every mode) runs it in tests/distributed/test_distributed.py.
Bounded: interpreter shapes (M ≤ 130, N ≤ 300), about a minute on two cores.
"""

import pytest
import torch

from cases import TOL_F32_GRAD, TOL_F32_LOSS, TOL_LOWP_LOSS, make_pair
from helpers import assert_close_rel
from hnclip_kernels.backends.pytorch.reference import directional_nll_torch
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton import ops as ht

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter checks (CPU tensors)")

OPS = torch.ops.hnclip
NAMES = ("rows", "d img", "d txt", "d all_img", "d all_txt", "d tau")


def _global(n, d, dtype, seed, duplicates=False):
    all_img, all_txt = make_pair(n, d, dtype, seed=seed)
    if duplicates:  # every fifth caption a near-duplicate (cosine ~0.999) of the one before it
        g = torch.Generator().manual_seed(seed + 1)
        txt = all_txt.double()
        txt[1::5] = txt[0::5][: txt[1::5].shape[0]] + 0.03 * torch.randn(
            txt[1::5].shape, generator=g, dtype=torch.float64
        )
        all_txt = txt.to(dtype)
    return all_img, all_txt


def _leaves(all_img, all_txt, m, offset, strided=False):
    """Fresh leaves: the local rows (copies, as a rank holds them) and the gathered batch;
    ``strided``: column-major copies of everything (non-contiguous inputs)."""

    def leaf(x):
        x = x.detach().clone()
        if strided:
            x = x.t().contiguous().t()
        return x.requires_grad_(True)

    return (leaf(all_img[offset : offset + m]), leaf(all_txt[offset : offset + m]), leaf(all_img), leaf(all_txt))


def _run(kind, leaves, tau, offset, gamma, eps, weights, normalize=True, threshold=None):
    """rows (M,) and the gradients of Σ weights·rows w.r.t. the four features and τ."""
    img, txt, all_img, all_txt = leaves
    tau = torch.tensor(tau, dtype=torch.float64 if kind == "f64" else torch.float32, requires_grad=True)
    kw = dict(tau=tau, offset=offset, gamma=gamma, label_smoothing=eps, normalize=normalize)
    if threshold is not None:
        kw["false_negative_threshold"] = threshold
    if kind == "rank":
        rows = ht.rank_nll_triton(img, txt, all_img, all_txt, **kw)
    else:
        fn = directional_nll_torch if kind == "f64" else ht.directional_nll_triton
        i2t = fn(img, all_txt, query_txt=txt, key_txt=all_txt, **kw)
        t2i = fn(txt, all_img, query_txt=txt, key_txt=all_txt, **kw)
        rows = 0.5 * (i2t + t2i)
    grads = torch.autograd.grad((rows * weights.to(rows.dtype)).sum(), [*leaves, tau])
    return (rows.detach(), *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gamma,eps,strided", [(0.0, 0.0, False), (0.5, 0.0, True), (0.5, 0.1, False)])
def test_rank_op_equals_two_directional_ops_bitwise(launch, monkeypatch, dtype, gamma, eps, strided):
    # several ragged backward chunks (the interpreter's 32 × 32: 2 × 4 of them; the GPU's 128 × 128:
    # 1 × 2) and column splits; on the GPU's tiles too (the rank walk's 128 × 64 are _fwd_kernel's)
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    m, n, d, offset = 40, 160, 24, 97
    all_img, all_txt = _global(n, d, dtype, seed=3)
    weights = torch.linspace(-0.5, 1.5, m)
    fused = _run("rank", _leaves(all_img, all_txt, m, offset, strided), 0.05, offset, gamma, eps, weights)
    pair = _run("directional", _leaves(all_img, all_txt, m, offset, strided), 0.05, offset, gamma, eps, weights)
    for name, x, y in zip(NAMES, fused, pair):
        assert x.dtype == y.dtype
        if launch == "gpu" and dtype == torch.float32:
            # float32's rank walk takes 64 × 16 tiles (three float32 accumulators), _fwd_kernel 64 × 32:
            # the online LSEs merge their tiles in another order
            assert_close_rel(x, y, 2e-6, name)
        elif launch == "gpu" and dtype == torch.float16 and name not in ("rows", "d tau"):
            # fp16 on the GPU's tiles: the dS heads and the GEMM shapes are the directional ops', but
            # the low parts of the 16-bit dS split (its rounding compensation) are not, so the CPU
            # GEMMs' sums differ by up to one fp16 ulp of a gradient (seen on AVX2, not AVX-512):
            # bitwise only for the rows and dτ, the feature gradients within one ulp
            assert_close_rel(x, y, 2**-10, name)
        else:
            assert torch.equal(x, y), f"{name}: max |Δ| {(x.float() - y.float()).abs().max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gamma,eps", [(0.0, 0.0), (0.5, 0.1)])
def test_masked_rank_op_equals_two_directional_ops_bitwise(dtype, gamma, eps):
    # false-negative masking: one caption cosine masks a pair in both directions, as in each
    # directional op; near-duplicate captions (cosine ~0.999) above the threshold 0.9
    m, n, d, offset = 40, 100, 24, 37
    all_img, all_txt = _global(n, d, dtype, seed=7, duplicates=True)
    weights = torch.linspace(-0.5, 1.5, m)
    fused = _run("rank", _leaves(all_img, all_txt, m, offset), 0.05, offset, gamma, eps, weights, threshold=0.9)
    pair = _run("directional", _leaves(all_img, all_txt, m, offset), 0.05, offset, gamma, eps, weights, threshold=0.9)
    unmasked = _run("rank", _leaves(all_img, all_txt, m, offset), 0.05, offset, gamma, eps, weights)
    assert not torch.equal(fused[0], unmasked[0])  # pairs were masked
    for name, x, y in zip(NAMES, fused, pair):
        assert torch.equal(x, y), f"{name}: max |Δ| {(x.float() - y.float()).abs().max():.3g}"


def test_rank_op_statistics_are_the_directional_ops():
    m, n, d, offset = 20, 50, 16, 30
    all_img, all_txt = _global(n, d, torch.float32, seed=4)
    img, txt = all_img[offset : offset + m], all_txt[offset : offset + m]
    kw = dict(tau=torch.tensor(0.03), offset=offset, gamma=0.5, label_smoothing=0.1, normalize=True, return_stats=True)
    rows, (i2t, t2i) = ht.rank_nll_triton(img, txt, all_img, all_txt, **kw)
    _, want_i2t = ht.directional_nll_triton(img, all_txt, query_txt=txt, key_txt=all_txt, **kw)
    _, want_t2i = ht.directional_nll_triton(txt, all_img, query_txt=txt, key_txt=all_txt, **kw)
    for got, want in ((i2t, want_i2t), (t2i, want_t2i)):
        for name, x, y in zip(got._fields, got, want):
            assert (x is None and y is None) if name == "kept" else torch.equal(x, y), name


@pytest.mark.parametrize("dtype,threshold", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 0.9)])
def test_rank_op_against_float64(launch, dtype, threshold):
    # the GPU launch: 128-row blocks (16-bit) over M = 130 local rows, 64-wide column tiles, the
    # positives at 100 … 229 of N = 300; a weight per row; masked: near-duplicate captions
    m, n, d, offset = 130, 300, 32, 100
    all_img, all_txt = _global(n, d, dtype, seed=5, duplicates=threshold is not None)
    weights = torch.linspace(0.25, 2.0, m, dtype=torch.float64)
    got = _run("rank", _leaves(all_img, all_txt, m, offset), 0.05, offset, 0.5, 0.1, weights, threshold=threshold)
    want = _run(
        "f64",
        _leaves(all_img.double(), all_txt.double(), m, offset),
        0.05,
        offset,
        0.5,
        0.1,
        weights,
        threshold=threshold,
    )
    assert got[0].dtype == torch.float32 and all(g.dtype == dtype for g in got[1:5])
    for name, x, y in zip(NAMES, got, want):
        if dtype == torch.float32:
            tol = TOL_F32_LOSS if name == "rows" else TOL_F32_GRAD
        else:  # the gradients are rounded to bf16 (2^-9 relative)
            tol = TOL_LOWP_LOSS if name in ("rows", "d tau") else 1e-2
        assert_close_rel(x, y, tol, f"{dtype} {launch} {name}")


def _rank_args(gamma=0.5, eps=0.1, grad=True, m=4, offset=2, n=8, d=8, threshold=None):
    all_img, all_txt = _global(n, d, torch.float32, seed=6, duplicates=threshold is not None)
    img = all_img[offset : offset + m].clone().requires_grad_(grad)
    txt = all_txt[offset : offset + m].clone().requires_grad_(grad)
    tau = torch.tensor(0.05, requires_grad=grad)
    hyper = [torch.tensor(x, dtype=torch.float64) for x in (gamma, eps, threshold or 0.0)]
    return (
        img,
        txt,
        all_img.requires_grad_(grad),
        all_txt.requires_grad_(grad),
        tau,
        *hyper,
        offset,
        True,  # normalize
        threshold is not None,  # masked
        gamma != 0.0,  # has_margin
        eps != 0.0,  # smoothing
        "tf32x3",
    )


@pytest.mark.parametrize("gamma, eps, threshold", [(0.0, 0.1, None), (0.5, 0.0, None), (0.5, 0.1, 0.9)])
def test_opcheck_rank(gamma, eps, threshold):
    args = _rank_args(gamma, eps, threshold=threshold)
    torch.library.opcheck(OPS.triton_rank_nll, args)
    plain = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    out = OPS.triton_rank_nll(*plain)
    torch.library.opcheck(
        OPS.triton_rank_nll_backward, (torch.linspace(-1.0, 1.0, 4), *plain[:8], *out[1:], *plain[8:], True)
    )


def _weighted_rows(img, txt, all_img, all_txt, tau):
    rows = ht.rank_nll_triton(
        img, txt, all_img, all_txt, tau=tau, offset=2, gamma=0.5, label_smoothing=0.1, normalize=True
    )
    return (rows * torch.arange(1.0, rows.shape[0] + 1)).sum()


def test_func_grad_and_compile_rank():
    args = [x.detach() for x in _rank_args(grad=False)[:5]]
    leaves = [x.clone().requires_grad_() for x in args]
    want = torch.autograd.grad(_weighted_rows(*leaves), leaves)
    got = torch.func.grad(_weighted_rows, argnums=(0, 1, 2, 3, 4))(*args)
    for name, x, y in zip(NAMES[1:], got, want):
        assert torch.equal(x, y), f"torch.func.grad {name}"
    compiled = torch.compile(_weighted_rows, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in args]
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for name, x, y in zip(NAMES[1:], got, want):
        assert torch.equal(x, y), f"torch.compile {name}"


def test_rank_op_only_tau_wants_a_gradient():
    img, txt, all_img, all_txt, tau = (x.detach() for x in _rank_args(grad=False)[:5])
    tau.requires_grad_(True)
    (d_tau,) = torch.autograd.grad(_weighted_rows(img, txt, all_img, all_txt, tau), [tau])
    leaves = [x.clone().requires_grad_() for x in (img, txt, all_img, all_txt, tau)]
    want = torch.autograd.grad(_weighted_rows(*leaves), leaves)[-1]
    assert torch.equal(d_tau, want)


def test_rank_op_checks_shapes():
    img, txt, all_img, all_txt, tau = (x.detach() for x in _rank_args(grad=False)[:5])
    kw = dict(tau=tau, gamma=0.5, label_smoothing=0.0, normalize=True)
    with pytest.raises(ValueError, match="offset"):
        ht.rank_nll_triton(img, txt, all_img, all_txt, offset=6, **kw)
    with pytest.raises(ValueError, match="query_txt"):
        ht.rank_nll_triton(img, txt[:3], all_img, all_txt, offset=2, **kw)
    with pytest.raises(TypeError, match="offset"):
        ht.rank_nll_triton(img, txt, all_img, all_txt, offset=2.0, **kw)
