"""GPU correctness: the core test matrix with compiled Triton kernels against the float64 formula.

float32 must match the float64 truth (tests/helpers.py) to 1e-5 (loss) and 1e-4 (gradients)
in relative norm. float16 and bfloat16 are judged the way Apple's cut-cross-entropy judges its
kernels: elementwise, our error against the truth may exceed the error of plain PyTorch in
the same dtype (logits computed in that dtype, then F.cross_entropy) by at most a small
tolerance, here relative to the truth's largest magnitude because gradients scale with 1/N.

Two levels, chosen by the environment variable GPU_TEST_LEVEL (every distinct set of kernel
constexprs and argument specialisations compiles separately, and compiling dominates the run):

* ``full`` (the default): every (N, D, dtype) of the matrix, all 54 option combinations per
  dtype, every test below (about 12 minutes on an H200, serially).
* ``quick`` (what ``tools/gpu_check.sh`` runs): N in {1, 17, 130, 4097}, D in {3, 64, 768},
  every dtype; γ = 0 and γ > 0, with and without label smoothing, for every dtype; every τ and
  reduction per dtype; non-contiguous inputs, large N against the float64 torch backend,
  bitwise determinism and the N = 65536 memory bound unchanged. Tolerances are the same.
"""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from cases import DTYPES, GAMMAS, REDUCTIONS, SIZES_D, SIZES_N, SMOOTHINGS, TAUS, TOL_F32_GRAD, TOL_F32_LOSS, make_pair
from helpers import assert_close_rel, hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends.triton import config as cfg

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: these tests are for compiled kernels",
    ),
]

DEV = "cuda"
LEVELS = ("quick", "full")
LEVEL = os.environ.get("GPU_TEST_LEVEL", "") or "full"
if LEVEL not in LEVELS:
    raise ValueError(f"GPU_TEST_LEVEL={LEVEL!r}: choose from {', '.join(LEVELS)}")
GPU_N = {"full": SIZES_N + (4097,), "quick": (1, 17, 130, 4097)}
GPU_D = {"full": SIZES_D + (768,), "quick": (3, 64, 768)}
LOWP_TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}  # cut-cross-entropy's tolerances
OPTIONS = list(itertools.product(GAMMAS, TAUS, SMOOTHINGS, REDUCTIONS))


@pytest.fixture(scope="module", autouse=True)
def all_cpu_threads():
    # the float64 truth runs on the CPU; conftest's 2 threads would make N = 4097 crawl.
    # Under pytest-xdist the workers share the cores.
    before = torch.get_num_threads()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    yield
    torch.set_num_threads(before)


def matrix_cases(level=LEVEL):
    """full: every (N, D, dtype) once, the loss options walking through their product (step
    coprime with 54). quick: every (N, D) once, the dtype a Latin square over them (each dtype
    meets every N and every D), and each dtype's four cases (one per N) take the four
    (γ = 0 / γ > 0) × (ε = 0 / ε > 0) combinations, every τ and every reduction."""
    cases = []
    if level == "full":
        for idx, (n, d, dtype) in enumerate(itertools.product(GPU_N[level], GPU_D[level], DTYPES)):
            gamma, tau, eps, red = OPTIONS[(idx * 23) % len(OPTIONS)]
            cases.append((n, d, dtype, gamma, tau, eps, red))
        return cases
    for i, n in enumerate(GPU_N[level]):
        for j, d in enumerate(GPU_D[level]):
            k = (i + j) % len(DTYPES)
            margin, smooth = divmod((i + k) % 4, 2)
            gamma = GAMMAS[1 + (i + j) % 2] if margin else 0.0
            eps = SMOOTHINGS[1] if smooth else 0.0
            tau = TAUS[(2 * i + j) % len(TAUS)]
            cases.append((n, d, DTYPES[k], gamma, tau, eps, REDUCTIONS[(i + k) % len(REDUCTIONS)]))
    return cases


def option_cases(level=LEVEL):
    """(dtype, γ, τ, ε, reduction) at N = 130, D = 100. full: every combination for every dtype.
    quick: for every dtype each (γ, ε) pair once, τ and the reduction rotating so that every
    value of each appears (the kernels specialise on γ ≠ 0 and ε ≠ 0, not on the values)."""
    if level == "full":
        return [(dtype, *opt) for dtype in DTYPES for opt in OPTIONS]
    cases = []
    for i, dtype in enumerate(DTYPES):
        for j, (gamma, eps) in enumerate(itertools.product(GAMMAS, SMOOTHINGS)):
            cases.append((dtype, gamma, TAUS[(i + j) % len(TAUS)], eps, REDUCTIONS[(i + 2 * j) % len(REDUCTIONS)]))
    return cases


def option_id(case):
    dtype, gamma, tau, eps, red = case
    return f"{str(dtype).split('.')[-1]}-g{gamma}-tau{tau}-ls{eps}-{red}"


def case_id(case):
    n, d, dtype, gamma, tau, eps, red = case
    return f"N{n}-D{d}-{str(dtype).split('.')[-1]}-g{gamma}-tau{tau}-ls{eps}-{red}"


def plain_lowp_loss(img, txt, tau, gamma, label_smoothing, reduction):
    """Plain PyTorch in the inputs' dtype: logits in that dtype, F.cross_entropy on their float32 copy."""
    v, t = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    n = v.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=v.device)
    z = ((v @ t.T + gamma * (t @ t.T).detach().masked_fill(eye, 0.0)) / tau).float()
    labels = torch.arange(n, device=v.device)
    rows = 0.5 * (
        F.cross_entropy(z, labels, reduction="none", label_smoothing=label_smoothing)
        + F.cross_entropy(z.T, labels, reduction="none", label_smoothing=label_smoothing)
    )
    return {"mean": rows.mean(), "sum": rows.sum(), "none": rows}[reduction]


def loss_and_grads(fn, img, txt, tau, tau_dtype, upstream):
    """(loss, d img, d txt[, d tau]) as float64 CPU tensors; ``tau_dtype`` None passes a float."""
    leaves = [x.detach().requires_grad_(True) for x in (img, txt)]  # detach keeps the strides
    tau_arg = tau if tau_dtype is None else torch.tensor(tau, dtype=tau_dtype, device=img.device, requires_grad=True)
    loss = fn(leaves[0], leaves[1], tau_arg)
    loss.backward(upstream.to(loss.device, loss.dtype) if upstream is not None else torch.ones_like(loss))
    out = [loss, leaves[0].grad, leaves[1].grad] + ([tau_arg.grad] if tau_dtype is not None else [])
    return [x.detach().double().cpu() for x in out]


def assert_no_worse_than_plain(ours, plain, truth, tol, what):
    err, plain_err = (ours - truth).abs(), (plain - truth).abs()
    excess = err - plain_err - tol * truth.abs().max().clamp_min(1e-12)
    if (excess > 0).any():
        i = int(excess.reshape(-1).argmax())
        raise AssertionError(
            f"{what}: error {err.reshape(-1)[i]:.3e} > plain-PyTorch error {plain_err.reshape(-1)[i]:.3e} + tolerance "
            f"at flat index {i}: ours {ours.reshape(-1)[i]:.8e}, plain {plain.reshape(-1)[i]:.8e}, "
            f"truth {truth.reshape(-1)[i]:.8e}"
        )


def check_case(n, d, dtype, gamma, tau, eps, reduction, *, tau_grad=True, upstream=None, img=None, txt=None, seed=0):
    """Triton on the GPU against the float64 truth on the CPU, on the same (upcast) inputs."""
    if img is None:
        img, txt = (x.to(DEV) for x in make_pair(n, d, dtype, seed=seed))
    n = img.shape[0]
    if upstream is None and reduction == "none":
        upstream = torch.linspace(-1.0, 2.0, n, dtype=torch.float64)  # an upstream gradient that is not 1

    def ours_fn(a, b, t):
        return hn_clip_loss(a, b, t, gamma=gamma, label_smoothing=eps, reduction=reduction, backend="triton")

    def truth_fn(a, b, t):
        return hn_clip_loss_f64(a, b, t, gamma, eps, reduction)

    ours = loss_and_grads(ours_fn, img, txt, tau, torch.float32 if tau_grad else None, upstream)
    truth = loss_and_grads(
        truth_fn, img.cpu().double(), txt.cpu().double(), tau, torch.float64 if tau_grad else None, upstream
    )
    names = ("loss", "d img", "d txt", "d tau")
    if dtype == torch.float32:
        for name, a, b in zip(names, ours, truth):
            assert_close_rel(a, b, TOL_F32_LOSS if name == "loss" else TOL_F32_GRAD, name)
        return

    def plain_fn(a, b, t):
        return plain_lowp_loss(a, b, t, gamma, eps, reduction)

    plain = loss_and_grads(plain_fn, img, txt, tau, torch.float32 if tau_grad else None, upstream)
    for name, a, p, b in zip(names, ours, plain, truth):
        assert_no_worse_than_plain(a, p, b, LOWP_TOL[dtype], name)


@pytest.mark.parametrize("case", matrix_cases(), ids=case_id)
def test_matrix_against_float64(case):
    n, d, dtype, gamma, tau, eps, reduction = case
    check_case(n, d, dtype, gamma, tau, eps, reduction, tau_grad=(n + d) % 2 == 1)


@pytest.mark.parametrize("case", option_cases(), ids=option_id)
def test_every_option_combination(case):
    dtype, gamma, tau, eps, reduction = case
    check_case(130, 100, dtype, gamma, tau, eps, reduction, tau_grad=True, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs_and_upstream_grad(dtype):
    n, d = 257, 96
    gen = torch.Generator(device=DEV).manual_seed(5)
    img = torch.randn(d, n, device=DEV, generator=gen).to(dtype).T  # column-major
    txt = torch.randn(n, 2 * d, device=DEV, generator=gen).to(dtype)[:, ::2]  # strided
    assert not img.is_contiguous() and not txt.is_contiguous()
    upstream = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    check_case(n, d, dtype, 0.5, 0.07, 0.1, "none", upstream=upstream, img=img, txt=txt)
    check_case(n, d, dtype, 2.0, 0.05, 0.0, "sum", upstream=torch.tensor(-3.5, dtype=torch.float64), img=img, txt=txt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_n_against_float64_torch_backend(dtype):
    # beyond the CPU truth's reach: the torch backend in float64 on the GPU is the reference
    img, txt = (x.to(DEV) for x in make_pair(16384, 512, dtype, seed=11))

    def run(a, b, backend):
        tau_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        return loss_and_grads(
            lambda x, y, t: hn_clip_loss(x, y, t, gamma=0.5, label_smoothing=0.1, backend=backend),
            a,
            b,
            0.05,
            tau_dtype,
            None,
        )

    truth = run(img.double(), txt.double(), "torch")
    ours = run(img, txt, "triton")
    names = ("loss", "d img", "d txt", "d tau")
    if dtype == torch.float32:
        for name, a, b in zip(names, ours, truth):
            assert_close_rel(a, b, TOL_F32_LOSS if name == "loss" else TOL_F32_GRAD, name)
    else:
        plain = loss_and_grads(
            lambda x, y, t: plain_lowp_loss(x, y, t, 0.5, 0.1, "mean"), img, txt, 0.05, torch.float32, None
        )
        for name, a, p, b in zip(names, ours, plain, truth):
            assert_no_worse_than_plain(a, p, b, LOWP_TOL[dtype], name)


@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hard_negative_family_against_float64_torch_backend(dtype, margin):
    # hnclip::triton_symmetric_nll with the family compiled: N = 1030 (ragged tiles, tile pairs), M = 700 negatives, group ids
    # across tiles and a threshold, against the torch backend in float64 on the GPU; every gradient per
    # row (each row's norm floored at 1e-3 of the largest: a masked negative's gradient is 0)
    n, m, d = 1030, 700, 256
    img, txt = (x.to(DEV) for x in make_pair(n, d, dtype, seed=12))
    neg = (txt[torch.arange(m) % n].float() + 0.3 * torch.randn(m, d, device=DEV)).to(dtype)
    ids = torch.arange(n, device=DEV) % 515  # rows k and k + 515 share an id
    kw = dict(group_ids=ids, margin=margin, gamma=0.5, label_smoothing=0.1, false_negative_threshold=0.9)
    runs = []
    for backend, cast in (("torch", torch.float64), ("triton", dtype)):
        leaves = [x.to(cast).requires_grad_(True) for x in (img, txt, neg)]
        tau = torch.tensor(0.05, device=DEV, dtype=torch.float64 if cast == torch.float64 else torch.float32,
                           requires_grad=True)  # fmt: skip
        loss = hn_clip_loss(leaves[0], leaves[1], tau, negatives=leaves[2], backend=backend, **kw)
        runs.append((loss, *torch.autograd.grad(loss, [*leaves, tau])))
    tol = {torch.float32: TOL_F32_GRAD, torch.bfloat16: 2.0**-7}[dtype]
    for name, got, want in zip(("loss", "d img", "d txt", "d negatives", "d tau"), runs[1], runs[0]):
        got, want = got.double(), want.double()
        if want.dim() == 0:
            assert_close_rel(got, want, TOL_F32_LOSS if name == "loss" else tol, name)
            continue
        norms = want.norm(dim=1)
        rows = (got - want).norm(dim=1) / torch.maximum(norms, 1e-3 * norms.max())
        assert rows.max() <= tol, f"{name}: row {int(rows.argmax())} rel err {rows.max():.3e} > {tol:.1e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deterministic_bitwise(dtype):
    img, txt = (x.to(DEV) for x in make_pair(4097, 768, dtype, seed=7))
    runs = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau = torch.tensor(0.05, device=DEV, requires_grad=True)
        loss = hn_clip_loss(*leaves, tau, gamma=0.5, label_smoothing=0.1, backend="triton")
        loss.backward()
        runs.append((loss, leaves[0].grad, leaves[1].grad, tau.grad))
    for name, a, b in zip(("loss", "d img", "d txt", "d tau"), *runs):
        assert torch.equal(a, b), f"{name} differs between identical runs"


def test_large_n_memory_is_linear():
    n, d = 65536, 256
    img, txt = (torch.randn(n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = hn_clip_loss(img, txt, 0.07, backend="triton")
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(loss) and torch.isfinite(img.grad.float()).all()
    # O(N·D) working set (float32 copies and gradients), against 16 GiB for one float32 N×N matrix
    assert extra <= 24 * n * d * 4, f"peak {extra / 2**20:.0f} MiB above the inputs"
    assert extra <= n * n * 4 // 10


# ------------------------------------------------------------------ torch.library operators
# What the interpreter cannot check (tests/backends/test_triton_library.py does the rest on CPU): Inductor
# compiling the kernels of hnclip::triton_* into its graph (γ reaches them from device memory:
# as a float argument Inductor types it fp64 and the forward fails to compile), the traced
# kernels running ("aot_eager"), the
# operators' fake implementations and dynamic shapes on CUDA (opcheck), export on CUDA.
# The tests are named test_library_*: tools/gpu_check.sh runs them as their own step.
LIBRARY_DTYPES = {"quick": (torch.bfloat16,), "full": DTYPES}
# τ annealed and γ ramped every step, γ = 0 at the first (γ = 0 and γ ≠ 0 are two graphs)
LIBRARY_SCHEDULE = [(0.07 - 0.002 * i, 0.05 * i) for i in range(12)]
LIBRARY_GRAD_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}  # 16-bit: an ulp here and there


def _library_pair(dtype, n=300, d=96, seed=21):
    return (x.to(DEV) for x in make_pair(n, d, dtype, seed=seed))


def _library_step(img, txt, tau, gamma):
    return hn_clip_loss(img, txt, tau, gamma=gamma, label_smoothing=0.1, backend="triton")


def _loss_and_grads(fn, img, txt, *args):
    leaves = [img.detach().clone().requires_grad_(), txt.detach().clone().requires_grad_()]
    loss = fn(*leaves, *args)
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


def _compare(fn, img, txt, *args, dtype, what):
    """``fn`` (compiled) against ``_library_step`` eagerly: loss and gradients."""
    _assert_same(_loss_and_grads(fn, img, txt, *args), _loss_and_grads(_library_step, img, txt, *args), dtype, what)


def _assert_same(got, want, dtype, what):
    for name, g, w in zip(("loss", "d img", "d txt"), got, want):
        assert_close_rel(g, w, 1e-5 if name == "loss" else LIBRARY_GRAD_TOL[dtype], f"{what}: {name}")


@pytest.mark.parametrize("dtype", LIBRARY_DTYPES[LEVEL], ids=str)
def test_library_inductor_fullgraph_schedule(dtype):
    """torch.compile with Inductor (fullgraph), τ and γ Python floats changing every step:
    at most two compiles over 12 steps, loss and gradients as eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_library_step, fullgraph=True, backend=counter)
    img, txt = _library_pair(dtype)
    for tau, gamma in LIBRARY_SCHEDULE:
        _compare(compiled, img, txt, tau, gamma, dtype=dtype, what=f"inductor at tau={tau:.3f}, gamma={gamma:.2f}")
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles over a 12-step schedule"


def test_library_aot_eager_chunked_backward_autotuned(monkeypatch):
    """The traced kernels run as traced (backend "aot_eager", no Inductor), with autotuning on and
    a backward in 3 × 3 chunks, so the accumulating GEMMs run inside the traced graph."""
    monkeypatch.setenv("HNCLIP_AUTOTUNE", "1")
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 8192)  # 128 × 128 chunks
    assert cfg.chunk_shape(300, 300) == (128, 128)
    torch._dynamo.reset()
    compiled = torch.compile(_library_step, fullgraph=True, backend="aot_eager")
    img, txt = _library_pair(torch.float32, seed=22)
    for tau, gamma in LIBRARY_SCHEDULE[:3]:
        _compare(compiled, img, txt, tau, gamma, dtype=torch.float32, what=f"aot_eager at gamma={gamma:.2f}")


def test_library_opcheck_cuda():
    """Schema, fake implementations (the triton_op functions traced on fake CUDA tensors) and
    AOT dispatch with dynamic shapes, for the four operators on CUDA tensors."""
    from hnclip_kernels.backends.triton import ops as _registers  # noqa: F401  (alone in a worker)

    ops = torch.ops.hnclip
    n, d, m, offset = 70, 40, 30, 20
    img, txt = (x.requires_grad_() for x in _library_pair(torch.float32, n, d, seed=23))
    tau = torch.tensor(0.07, device=DEV, requires_grad=True)
    gamma, eps, thr = (torch.tensor(x, device=DEV, dtype=torch.float64) for x in (0.5, 0.1, 0.3))
    no_neg, no_id = img.new_empty((0, d)).detach(), torch.empty(0, device=DEV, dtype=torch.long)
    no_own = (img.new_empty((0, 0, d)).detach(), torch.empty((0, 0), device=DEV, dtype=torch.bool))
    for masked in (False, True):  # false-negative masking at caption cosine 0.3
        # normalize, masked, has_margin, smoothing, precision, the margin's code ("text"), group_mode ("mask")
        statics = (True, masked, True, True, "tf32x3", 0, 0)
        sym = (img, txt, no_neg, *no_own, no_id, tau, gamma, eps, thr, *statics)
        torch.library.opcheck(ops.triton_symmetric_nll, sym)
        detached = [x.detach() for x in (img, txt, no_neg, *no_own, no_id, tau)]
        out = ops.triton_symmetric_nll(*detached, gamma, eps, thr, *statics)
        grad = torch.linspace(0.5, 1.5, n, device=DEV)
        torch.library.opcheck(
            ops.triton_symmetric_nll_backward, (grad, *detached, gamma, eps, thr, *out[1:], *statics, True)
        )
        q = img[:m].detach().requires_grad_()
        a, b = txt.detach()[offset : offset + m], txt.detach()
        zero = torch.zeros((), device=DEV, dtype=torch.float64)
        family = (img.new_empty((0,)).detach(), img.new_empty((0,)).detach(), no_id, no_id)  # none of it
        # offset, normalize, masked, has_margin, smoothing, precision, group_mode ("mask")
        dir_statics = (offset, True, masked, True, False, "ieee", 0)
        direc = (q, txt, a, b, *family, tau, gamma, zero, thr, *dir_statics)
        torch.library.opcheck(ops.triton_directional_nll, direc)
        ins = (q.detach(), detached[1], a, b, *family, detached[-1], gamma, zero, thr)
        out = ops.triton_directional_nll(*ins, *dir_statics)
        torch.library.opcheck(ops.triton_directional_nll_backward, (grad[:m], *ins, *out[1:], *dir_statics, True))


def test_library_func_grad_and_vmap_cuda():
    pairs = [tuple(_library_pair(torch.bfloat16, 65, 32, seed=s)) for s in range(3)]
    imgs, txts = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    tau = torch.tensor(0.07, device=DEV)

    def loss(a, b, t):
        return hn_clip_loss(a, b, t, gamma=0.5, label_smoothing=0.1, backend="triton")

    got = torch.func.vmap(torch.func.grad_and_value(loss, argnums=(0, 1)), in_dims=(0, 0, None))(imgs, txts, tau)
    for i in range(3):
        want = _loss_and_grads(loss, imgs[i], txts[i], tau)
        _assert_same((got[1][i], got[0][0][i], got[0][1][i]), want, torch.bfloat16, f"vmap(grad), batch {i}")


def test_library_export_cuda():
    class Loss(torch.nn.Module):
        def forward(self, img, txt):
            return hn_clip_loss(img, txt, 0.05, gamma=0.5, label_smoothing=0.1, backend="triton")

    img, txt = _library_pair(torch.bfloat16, seed=24)
    ep = torch.export.export(Loss(), (img, txt))
    assert_close_rel(ep.module()(img, txt), Loss()(img, txt), 1e-6, "exported loss")


@pytest.mark.skipif(LEVEL != "full", reason="full level only")
@pytest.mark.parametrize("autotune", ["0", "1"])
def test_library_inductor_dynamic_shapes_and_directional(monkeypatch, autotune):
    """Inductor with dynamic=True (symbolic sizes reach the kernels' integer arguments, and the
    launchers' grid and chunk arithmetic) over three batch sizes, and the distributed path's
    directional operator compiled, autotuned or not."""
    from hnclip_kernels.backends import triton_directional

    monkeypatch.setenv("HNCLIP_AUTOTUNE", autotune)
    torch._dynamo.reset()
    compiled = torch.compile(_library_step, fullgraph=True, dynamic=True)
    for n in (130, 257, 500):
        img, txt = _library_pair(torch.float32, n, 64, seed=n)
        _compare(compiled, img, txt, 0.05, 0.5, dtype=torch.float32, what=f"dynamic N={n}")
    fn = triton_directional()

    def rows(q, k, tau, gamma):
        return fn(
            q,
            k,
            query_txt=k[100:200].detach(),
            key_txt=k.detach(),
            tau=tau,
            offset=100,
            gamma=gamma,
            label_smoothing=0.1,
            normalize=True,
        ).sum()

    torch._dynamo.reset()
    compiled = torch.compile(rows, fullgraph=True)
    img, txt = _library_pair(torch.bfloat16, 400, 64, seed=25)
    for tau, gamma in LIBRARY_SCHEDULE[:4]:
        _assert_same(
            _loss_and_grads(compiled, img[100:200], txt, torch.tensor(tau, device=DEV), gamma),
            _loss_and_grads(rows, img[100:200], txt, torch.tensor(tau, device=DEV), gamma),
            torch.bfloat16,
            f"directional at gamma={gamma:.2f}",
        )
