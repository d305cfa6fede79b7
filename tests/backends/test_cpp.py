"""The fused C++ CPU kernel (csrc/: the hnclip::cpp_* operators over the raw hnclip::cpp_raw_* kernels) against the float64 formula.

The checks every backend shares (float64 covering matrix, saturated regime, offset/rectangular and
low-precision directional op, determinism) are in test_backends.py. Skipped as a whole when the
extension ``hnclip_kernels._C`` was not built.
"""

import itertools
import warnings

import pytest
import torch

from cases import (
    GAMMAS,
    REDUCTIONS,
    SIZES_D,
    SIZES_N,
    SMOOTHINGS,
    TOL_F32_GRAD,
    TOL_F32_LOSS,
    check_against_truth,
    make_pair,
)
from cases import directional_case as _directional_case
from helpers import assert_close_rel, hn_clip_loss_f64

try:
    from hnclip_kernels.backends.cpp.ops import directional_nll_cpp
except ImportError as exc:  # pragma: no cover - depends on the install
    pytest.skip(
        f"C++ extension hnclip_kernels._C not built ({exc}); reinstall with `pip install --no-build-isolation -e .`",
        allow_module_level=True,
    )

import hnclip_kernels.backends as dispatch
from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends.pytorch.reference import directional_nll_torch


def _f64(x):
    """γ or ε as the registered operators take them: a 0-dim float64 tensor."""
    return torch.tensor(x, dtype=torch.float64)


_NO_IDS = torch.empty((0,), dtype=torch.long)
# the directional op's family inputs, absent: mask captions and group ids, empty
NO_MASKS = (torch.empty((0,)), torch.empty((0,)), _NO_IDS, _NO_IDS)


def _no_negatives(img):
    """The symmetric op's family tensors, absent: negatives (0, D), own negatives (0, 0, D) and
    their mask (0, 0), group ids (0,)."""
    d = img.shape[1]
    return img.new_empty((0, d)), img.new_empty((0, 0, d)), torch.empty((0, 0), dtype=torch.bool), _NO_IDS


# ------------------------------------------------------------------ values and gradients


@pytest.mark.parametrize("n,d", list(itertools.product(SIZES_N, SIZES_D)))
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("eps", SMOOTHINGS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float32_full_product(n, d, gamma, eps, reduction):
    # every N × D × γ × ε × reduction (cheap on CPU), τ a tensor that receives its gradient
    check_against_truth("cpp", n, d, torch.float32, gamma, 0.07, eps, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("normalize", [True, False])
def test_every_reduction(reduction, normalize):
    check_against_truth("cpp", 33, 24, torch.float32, 0.5, 0.07, 0.1, reduction, normalize=normalize, seed=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_low_precision_inputs(dtype, gamma):
    # accumulated in float32: the loss is float32 and within 1e-3 of the float64 truth
    check_against_truth("cpp", 65, 64, dtype, gamma, 0.05, 0.1, "mean", seed=5)


def test_non_contiguous_bfloat16_inputs():
    # float32 strided inputs are covered for every backend in test_api.py
    n, d = 17, 8
    bf_img, bf_txt = torch.randn(d, n).T.bfloat16(), torch.randn(n, 3 * d).bfloat16()[:, 1::3]
    assert not bf_img.is_contiguous() and not bf_txt.is_contiguous()
    check_against_truth("cpp", n, d, torch.bfloat16, 2.0, 0.07, 0.0, "sum", img=bf_img, txt=bf_txt)


@pytest.mark.parametrize(
    "reduction,upstream",
    [
        ("sum", torch.tensor(-3.5)),  # uniform row gradient ≠ 1: the forward's shares are rescaled
        ("none", None),  # a different gradient per row: the backward recomputes the key gradient
    ],
)
def test_upstream_gradient(reduction, upstream):
    n = 130
    if upstream is None:
        upstream = torch.randn(n, generator=torch.Generator().manual_seed(2))
    check_against_truth("cpp", n, 64, torch.float32, 0.5, 0.05, 0.1, reduction, upstream=upstream, seed=9)


def test_only_tau_requires_grad_and_no_grad_forward():
    img, txt = make_pair(65, 16, seed=4)
    tau = torch.tensor(0.07, requires_grad=True)
    loss = hn_clip_loss(img, txt, tau, gamma=0.5, label_smoothing=0.1, backend="cpp")
    loss.backward()
    ref_tau = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    hn_clip_loss_f64(img.double(), txt.double(), ref_tau, 0.5, 0.1).backward()
    assert_close_rel(tau.grad, ref_tau.grad, TOL_F32_GRAD, "d tau")
    with torch.no_grad():  # stats-only sweep, nothing saved for a backward
        nograd = hn_clip_loss(img, txt, 0.07, gamma=0.5, label_smoothing=0.1, reduction="none", backend="cpp")
    withgrad = hn_clip_loss(
        img.clone().requires_grad_(True), txt, 0.07, gamma=0.5, label_smoothing=0.1, reduction="none", backend="cpp"
    )
    assert_close_rel(nograd, withgrad, 1e-6, "no-grad forward")


def test_large_several_blocks_and_threads():
    # N = 600: several row blocks, column tiles and thread groups; non-uniform upstream gradient
    upstream = torch.rand(600, generator=torch.Generator().manual_seed(0)) + 0.5
    check_against_truth("cpp", 600, 48, torch.float32, 0.5, 0.05, 0.1, "none", upstream=upstream, seed=12)
    check_against_truth("cpp", 600, 48, torch.float32, 2.0, 0.02, 0.0, "mean", seed=13)


def test_nan_propagates():
    img, txt = make_pair(16, 8, seed=0)
    img[3, 2] = float("nan")
    rows = hn_clip_loss(img, txt, 0.07, reduction="none", backend="cpp")
    assert torch.isnan(rows[3])
    assert torch.isnan(hn_clip_loss(img, txt, 0.07, backend="cpp"))


# ------------------------------------------------------------------ operator properties


@pytest.mark.parametrize("kind", ["i2t", "t2i", "general"])
def test_gradcheck_float64_registered_op(kind):
    q, k, a, b = (x.double() for x in _directional_case(kind, m=4, n=9, d=5, offset=3, seed=1))
    q.requires_grad_(True)
    k.requires_grad_(True)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    for eps, normalize in ((0.0, True), (0.1, False)):
        fn = lambda q_, k_, t_, eps=eps, normalize=normalize: directional_nll_cpp(
            q_,
            k_,
            query_txt=a,
            key_txt=b,
            tau=t_,
            offset=3,
            gamma=0.7,  # noqa: E731
            label_smoothing=eps,
            normalize=normalize,
        )
        assert torch.autograd.gradcheck(fn, (q, k, tau))


def test_gradcheck_float64_public_api():
    # γ = 0: with γ > 0 the margin t tᵀ is stop-gradient by definition, which finite
    # differences of the public function cannot see (the registered-op test covers γ > 0)
    img, txt = (x.double().requires_grad_(True) for x in make_pair(6, 4, seed=8))
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    for reduction in ("mean", "none"):
        fn = lambda i, t, s, reduction=reduction: hn_clip_loss(
            i,
            t,
            s,
            gamma=0.0,
            label_smoothing=0.1,
            reduction=reduction,  # noqa: E731
            backend="cpp",
        )
        assert torch.autograd.gradcheck(fn, (img, txt, tau))


def test_float64_values_match_reference_tightly():
    img, txt = (x.requires_grad_(True) for x in make_pair(65, 32, torch.float64, seed=6))
    loss = hn_clip_loss(img, txt, 0.05, gamma=0.5, label_smoothing=0.1, backend="cpp")
    assert loss.dtype == torch.float64
    ref = hn_clip_loss_f64(img, txt, 0.05, 0.5, 0.1)
    assert_close_rel(loss, ref, 1e-12, "float64 loss")
    g = torch.autograd.grad(loss, (img, txt))
    r = torch.autograd.grad(ref, (img, txt))
    for x, y, name in zip(g, r, ("d img", "d txt")):
        assert_close_rel(x, y, 1e-10, name)


def test_inputs_not_mutated():
    for dtype in (torch.float32, torch.bfloat16):
        img, txt = make_pair(17, 8, dtype, seed=3)
        img = img.requires_grad_(True)
        txt = txt.requires_grad_(True)
        tau = torch.tensor(0.07, requires_grad=True)
        before = [x.detach().clone() for x in (img, txt, tau)]
        hn_clip_loss(img, txt, tau, gamma=0.5, label_smoothing=0.1, reduction="none", backend="cpp").backward(
            torch.linspace(0.1, 1.0, 17)
        )
        for x, x0 in zip((img, txt, tau), before):
            assert torch.equal(x.detach(), x0)


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def f(img, txt, tau):
        return hn_clip_loss(img, txt, tau, gamma=0.5, label_smoothing=0.1, backend="cpp")

    compiled = torch.compile(f, fullgraph=True)  # fullgraph: a graph break would raise
    img, txt = make_pair(33, 16, seed=10)
    img = img.T.contiguous().T  # column-major: gradients must still come back right
    out = []
    for fn in (f, compiled):
        leaves = [x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True) for x in (img, txt)]
        tau = torch.tensor(0.07, requires_grad=True)
        loss = fn(*leaves, tau)
        loss.backward()
        out.append((loss.detach(), leaves[0].grad, leaves[1].grad, tau.grad))
    for name, a, b in zip(("loss", "d img", "d txt", "d tau"), *out):
        assert_close_rel(a, b, 1e-6, f"compiled {name}")


@pytest.mark.parametrize("masked", [False, True])
def test_opcheck_registered_operators(masked):
    # masked: false-negative masking at caption cosine 0.5 (the kept counts are an output)
    q, k, a, b = _directional_case("i2t", m=4, n=9, d=5, offset=3, seed=2)
    q.requires_grad_(True)
    tau = torch.tensor(0.1, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    # offset 3, normalize, masked, need_grad
    args = (q, k, a, b, *NO_MASKS, tau, _f64(0.5), _f64(0.1), _f64(0.5), 3, True, masked, True)
    torch.library.opcheck(torch.ops.hnclip.cpp_directional_nll.default, args, test_utils=checks)
    saved = [x.detach() for x in torch.ops.hnclip.cpp_directional_nll(*args)[1:]]
    grad = torch.linspace(0.5, 1.0, 4)
    torch.library.opcheck(
        torch.ops.hnclip.cpp_directional_nll_backward.default,
        # the flags, the group mode's code 0 ("mask"; the forward's default), need_features
        (grad, q.detach(), k, a, b, *NO_MASKS, tau.detach(), *args[9:12], *saved, 3, True, masked, True, 0, True),
        test_utils=checks,
    )


def test_thread_counts_agree():
    # 1 thread (one group) and 3 threads (three groups of row blocks, summed in order)
    img, txt = make_pair(300, 40, seed=14)
    upstream = torch.rand(300, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
            rows = hn_clip_loss(*leaves, 0.05, gamma=0.5, label_smoothing=0.1, reduction="none", backend="cpp")
            rows.backward(upstream)
            results.append((rows, *(x.grad for x in leaves)))
            check_against_truth("cpp", 300, 40, torch.float32, 2.0, 0.05, 0.1, "mean", seed=15)
    finally:
        torch.set_num_threads(before)
    for name, x, y in zip(("rows", "d img", "d txt"), *results):
        assert_close_rel(x, y, 1e-6, name)


# ------------------------------------------------------------------ dispatch


def test_auto_picks_cpp_on_cpu():
    img, txt = make_pair(20, 8, seed=1)
    assert dispatch.resolve_backend("auto", img) == "cpp"
    assert torch.equal(hn_clip_loss(img, txt, 0.07, backend="auto"), hn_clip_loss(img, txt, 0.07, backend="cpp"))


def test_missing_extension_messages(monkeypatch):
    monkeypatch.setattr(dispatch, "cpp_directional", lambda: None)
    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())
    img, txt = make_pair(4, 3)
    with pytest.raises(ValueError, match="C\\+\\+ extension"):
        hn_clip_loss(img, txt, 0.07, backend="cpp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hn_clip_loss(img, txt, 0.07, backend="auto")
        hn_clip_loss(img, txt, 0.07, backend="auto")
    assert sum("not built" in str(w.message) for w in caught) == 1


# ------------------------------------------------------------------ symmetric single-process op


def _pairs_both_ways(img, txt, tau, gamma, eps, normalize, upstream, symmetric):
    """Per-pair losses and (d img, d txt, d tau): the symmetric op, or two directional calls."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    t = torch.tensor(tau, dtype=img.dtype, requires_grad=True)
    if symmetric:
        scalars = (_f64(gamma), _f64(eps), _f64(0.0))
        rows = torch.ops.hnclip.cpp_symmetric_nll(*leaves, *_no_negatives(img), t, *scalars, normalize, False, 0, True)[
            0
        ]
    else:
        v, w = leaves
        opts = dict(query_txt=w, key_txt=w, tau=t, offset=0, gamma=gamma, label_smoothing=eps, normalize=normalize)
        rows = 0.5 * (directional_nll_cpp(v, w, **opts) + directional_nll_cpp(w, v, **opts))
    rows.backward(upstream.to(rows.dtype))
    return rows.detach(), leaves[0].grad, leaves[1].grad, t.grad


@pytest.mark.parametrize(
    "n,gamma,eps,normalize",
    [
        (1, 0.5, 0.1, True),
        (2, 2.0, 0.0, True),
        (129, 0.5, 0.1, True),
        (300, 0.0, 0.1, False),
        (515, 2.0, 0.1, True),
    ],
)
def test_symmetric_matches_directional(n, gamma, eps, normalize):
    # N not a multiple of any block (row tiles 128, strips 256, column tiles 512), non-uniform upstream
    img, txt = make_pair(n, 24, seed=n)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(n))
    sym = _pairs_both_ways(img, txt, 0.05, gamma, eps, normalize, upstream, True)
    two = _pairs_both_ways(img, txt, 0.05, gamma, eps, normalize, upstream, False)
    for name, x, y in zip(("rows", "d img", "d txt", "d tau"), sym, two):
        assert_close_rel(x, y, 1e-5, name)
    # and the public API goes through the symmetric op
    rows = hn_clip_loss(
        img, txt, 0.05, gamma=gamma, label_smoothing=eps, reduction="none", normalize=normalize, backend="cpp"
    )
    assert torch.equal(rows, sym[0])


def test_symmetric_float64_matches_directional_tightly():
    img, txt = make_pair(70, 16, torch.float64, seed=21)
    upstream = torch.rand(70, generator=torch.Generator().manual_seed(4), dtype=torch.float64) - 0.3
    sym = _pairs_both_ways(img, txt, 0.03, 0.5, 0.1, True, upstream, True)
    two = _pairs_both_ways(img, txt, 0.03, 0.5, 0.1, True, upstream, False)
    assert sym[0].dtype == torch.float64
    for name, x, y in zip(("rows", "d img", "d txt", "d tau"), sym, two):
        assert_close_rel(x, y, 1e-12, name)


def test_symmetric_gradcheck_with_margin():
    # γ > 0: the margin t tᵀ is stop-gradient, so finite differences run over img and τ only
    img, txt = (x.double() for x in make_pair(7, 5, seed=3))
    img.requires_grad_(True)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    for eps, normalize in ((0.0, True), (0.1, False)):
        fn = lambda i, s, eps=eps, normalize=normalize: torch.ops.hnclip.cpp_symmetric_nll(
            i, txt, *_no_negatives(txt), s, _f64(0.7), _f64(eps), _f64(0.0), normalize, False, 0, True
        )[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (img, tau))


def test_symmetric_threads_deterministic_and_agree():
    # several row groups: bit-identical reruns for a thread count, agreement across counts
    img, txt = make_pair(333, 40, seed=16)
    upstream = torch.rand(333, generator=torch.Generator().manual_seed(5)) + 0.5
    before = torch.get_num_threads()
    runs = {}
    try:
        for threads in (1, 2, 3, 3):
            torch.set_num_threads(threads)
            out = _pairs_both_ways(img, txt, 0.05, 0.5, 0.1, True, upstream, True)
            if threads in runs:
                for x, y in zip(out, runs[threads]):
                    assert torch.equal(x, y)
            runs[threads] = out
    finally:
        torch.set_num_threads(before)
    for threads in (2, 3):
        for name, x, y in zip(("rows", "d img", "d txt", "d tau"), runs[threads], runs[1]):
            assert_close_rel(x, y, 1e-6, f"{threads} threads {name}")


def test_symmetric_nan_in_txt_reaches_every_t2i_row():
    img, txt = make_pair(20, 8, seed=2)
    txt[5, 1] = float("nan")  # column 5 of Z (every i2t row) and t2i row 5, through the column statistics
    rows = hn_clip_loss(img, txt, 0.07, gamma=0.0, reduction="none", backend="cpp")
    assert torch.isnan(rows).all()
    assert torch.isnan(hn_clip_loss(img, txt, 0.07, backend="cpp"))


@pytest.mark.parametrize("masked", [False, True])
def test_opcheck_symmetric_operators(masked):
    img, txt = make_pair(9, 5, seed=2)
    img.requires_grad_(True)
    tau = torch.tensor(0.1, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    # normalize, masked, margin code 0 (text), need_grad
    args = (img, txt, *_no_negatives(img), tau, _f64(0.5), _f64(0.1), _f64(0.3), True, masked, 0, True)
    torch.library.opcheck(torch.ops.hnclip.cpp_symmetric_nll.default, args, test_utils=checks)
    saved = [x.detach() for x in torch.ops.hnclip.cpp_symmetric_nll(*args)[1:]]
    grad = torch.linspace(0.5, 1.0, 9)
    torch.library.opcheck(
        torch.ops.hnclip.cpp_symmetric_nll_backward.default,
        (grad, img.detach(), txt, *args[2:6], tau.detach(), *args[7:10], *saved, True, masked, 0, True, 0, True),
        test_utils=checks,
    )


# ------------------------------------------------------------------ huge logits: recomputed tiles
# γ/τ = 1e8 puts |Z| near 1e8, where an ulp of a float32 logit is 8: a backward whose logit rounds
# even one ulp away from the one the forward's LSE came from turns P = exp(Z − LSE) into e^8·P.
# These run past the N = 16 / 64 of test_api.py's test_huge_logits: several tile-rows (the last one
# short), a column tile of 1 key (N = 513: a matrix-vector product inside BLAS, rounded otherwise
# than a wide tile), several threads, and the directional backward's recompute.
HUGE_GAMMA, HUGE_TAU = 1e4, 1e-4


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n,d", [(513, 16), (600, 64)])
@pytest.mark.parametrize("threads", [1, 3])
def test_backward_probabilities_use_the_forward_logits(n, d, threads):
    # The root cause, checked directly: with a one-hot upstream g = e_i the symmetric backward's shares
    # separate, dt̂_j = P_ij v̂_i and dv̂_j = P'_ji t̂_i for j ≠ i, so its probabilities of row i must sum
    # to sigmoid(delta_r_i) (i2t) and sigmoid(delta_c_i) (t2i), the forward's statistics.
    from hnclip_kernels.backends import epilogue

    img, txt = make_pair(n, d, seed=n)
    rv, rt = epilogue.inv_norms(img, True, torch.float32), epilogue.inv_norms(txt, True, torch.float32)
    v_hat, t_hat = epilogue.scaled(img, rv, torch.float32), epilogue.scaled(txt, rt, torch.float32)
    inv_tau = 1.0 / torch.tensor(HUGE_TAU)
    pos = epilogue.positive_logits(v_hat, t_hat, 0, inv_tau)

    probed = sorted({*range(0, n, 7), *range(n - 9, n)})  # every tile-row, and all of the short last one

    def run():
        delta_r, _, _, _, delta_c, _, _, _ = torch.ops.hnclip.cpp_raw_symmetric_fwd(
            v_hat, t_hat, pos, inv_tau, HUGE_GAMMA, None
        )
        sums = torch.empty(len(probed), 2, dtype=torch.float64)
        for row, i in enumerate(probed):
            g = torch.zeros(n)
            g[i] = 1.0
            d_v, d_t = torch.ops.hnclip.cpp_raw_symmetric_bwd(
                v_hat, t_hat, pos, inv_tau, delta_r, delta_c, g, HUGE_GAMMA, None, g[:0], g[:0]
            )
            p_row = d_t.double() @ v_hat[i].double() / v_hat[i].double().square().sum()
            p_col = d_v.double() @ t_hat[i].double() / t_hat[i].double().square().sum()
            p_row[i] = p_col[i] = 0.0
            sums[row] = torch.stack((p_row.sum(), p_col.sum()))
        return sums, torch.stack((delta_r, delta_c), dim=1)[probed].double().sigmoid()

    sums, expected = _with_threads(threads, run)
    worst = int((sums - expected).abs().amax(dim=1).argmax())
    assert torch.allclose(sums, expected, rtol=1e-4, atol=0), (
        f"row {probed[worst]}: the backward's probabilities (i2t, t2i) sum to {sums[worst].tolist()}, the "
        f"forward's statistics say {expected[worst].tolist()}"
    )


@pytest.mark.parametrize("n,d", [(513, 16), (600, 64)])
@pytest.mark.parametrize("threads", [1, 3])
def test_huge_logits_several_tiles_and_threads(n, d, threads):
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5
    _with_threads(
        threads,
        lambda: check_against_truth(
            "cpp", n, d, torch.float32, HUGE_GAMMA, HUGE_TAU, 0.0, "none", upstream=upstream, seed=n
        ),
    )


@pytest.mark.parametrize("kind", ["i2t", "t2i", "general"])
def test_huge_logits_directional_recompute(kind):
    # a different upstream gradient per row: the key gradient comes from a backward recompute of the tiles
    m, n, offset = 300, 1025, 700  # several tile-rows, key tiles of 512, 512 and 1
    q, k, a, b = _directional_case(kind, m=m, n=n, d=16, offset=offset, seed=6)
    weights = torch.rand(m, generator=torch.Generator().manual_seed(6)) + 0.5
    outs = []
    for fn, dt in ((directional_nll_cpp, torch.float32), (directional_nll_torch, torch.float64)):
        qq, kk = (x.detach().to(dt).clone().requires_grad_(True) for x in (q, k))
        tau = torch.tensor(HUGE_TAU, dtype=dt, requires_grad=True)
        rows = fn(
            qq,
            kk,
            query_txt=a.to(dt),
            key_txt=b.to(dt),
            tau=tau,
            offset=offset,
            gamma=HUGE_GAMMA,
            label_smoothing=0.0,
            normalize=True,
        )
        (rows * weights.to(dt)).sum().backward()
        outs.append((rows, qq.grad, kk.grad, tau.grad))
    for name, x, y in zip(("rows", "d q", "d k", "d tau"), *outs):
        assert_close_rel(x, y, TOL_F32_LOSS if name == "rows" else TOL_F32_GRAD, name)
