"""FlopCounterMode's formulas of the C++ operators (``hnclip_kernels/backends/cpp/flops.py``)
beside the products the kernels run.

The formulas state the loss's useful products of the real shapes (``glue.logit_flops``: for a
logit matrix S of R × C over D, S forward, dS·k and dSᵀ·q backward, 2·R·C·D FLOPs each), not what
the kernels execute; the kernels' own work is pinned here too, and is never below the useful
products (a formula stating more than the kernels run would overstate an MFU). The mode never
sees inside an operator (it runs one with itself popped), so the work is counted
apart: ``torch.profiler`` records every aten matmul the C++ kernels call (``at::mm_out``,
``addmm_``) with its shapes. One thread, so that every call runs where the profiler records it
(at::parallel_for's workers go unrecorded). Shapes of a few dozen rows: each case runs in
milliseconds.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

try:
    from hnclip_kernels.backends.cpp import directional as cpp_directional
    from hnclip_kernels.backends.cpp import ops as cpp_ops
    from hnclip_kernels.backends.cpp import symmetric as cpp_symmetric
except ImportError as exc:  # pragma: no cover - the extension was not built
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)

from hnclip_kernels import hn_clip_loss

N, M, D = 40, 16, 24
MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::addmm_": (1, 2)}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def counted(fn) -> int:
    """FLOPs (2·M·N·K) of the aten matmuls ``fn`` runs, C++ callers included."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    total = 0
    for event in prof.events():
        assert event.name not in ("aten::bmm", "aten::baddbmm", "aten::addbmm"), event.name  # not counted below
        if event.name in MATMULS:
            a, b = (event.input_shapes[i] for i in MATMULS[event.name])
            total += 2 * a[0] * a[1] * b[1]
    return total


def stated(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


def features(*rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(r, D, generator=gen, requires_grad=True) for r in rows]


@pytest.mark.parametrize("gamma, threshold, products", [(0.0, None, 4), (0.5, None, 4), (0.5, 0.3, 6)])
def test_symmetric_formula_states_the_useful_products(gamma, threshold, products):
    # forward 1 product (the margin folded into (v̂ + γt̂)/τ), backward 3 (recompute, ds·t̂, dsᵀ·v̂);
    # masking forms the captions' tile beside each logit tile: one more in each
    img, txt = features(N, N)
    tau = torch.tensor(0.07, requires_grad=True)

    def step():
        hn_clip_loss(img, txt, tau, gamma=gamma, backend="cpp", false_negative_threshold=threshold).backward()

    assert counted(step) == products * 2 * N * N * D
    assert stated(step) == 3 * 2 * N * N * D  # S, dS·t̂, dSᵀ·v̂


@pytest.mark.parametrize(
    "factors, weights, threshold, products",
    [
        ("keys", "uniform", None, 3),  # i2t of the distributed loss: shares kept, backward a rescale
        ("keys", "per row", None, 5),  # a per-row gradient: recompute and Pᵀ·q̂ in the backward
        ("queries", "per row", 0.3, 7),  # t2i, masked: the captions' tile in forward and recompute
        ("other", "uniform", None, 4),  # margin factors neither: Z of inner width 2D
        ("other", "per row", 0.3, 9),
    ],
)
def test_directional_formula_states_the_useful_products(factors, weights, threshold, products):
    q, k = features(M, N)
    offset = N - M
    a, b = {
        "keys": (k.detach()[offset:].clone(), k.detach().clone()),
        "queries": (q.detach().clone(), torch.randn(N, D)),
        "other": (torch.randn(M, D), torch.randn(N, D)),
    }[factors]
    w = torch.ones(M) if weights == "uniform" else torch.rand(M, generator=torch.Generator().manual_seed(1))
    tau = torch.tensor(0.07, requires_grad=True)

    def step():
        rows = cpp_ops.directional_nll_cpp(
            q,
            k,
            query_txt=a,
            key_txt=b,
            tau=tau,
            offset=offset,
            gamma=0.5,
            label_smoothing=0.0,
            normalize=True,
            false_negative_threshold=threshold,
        )
        (rows * w).sum().backward()

    assert counted(step) == products * 2 * M * N * D
    assert stated(step) == 3 * 2 * M * N * D  # whatever the factors, weights and masking


def test_raw_kernels_formulas_and_a_tau_only_backward():
    # the operators' bodies called directly: FlopCounterMode then sees the raw kernels
    # (hnclip::cpp_raw_*) and counts them by their own formulas
    img, txt = (x.detach() for x in features(N, N))
    tau, gamma, eps, thr = (torch.tensor(v, dtype=torch.float64) for v in (0.07, 0.5, 0.0, 0.3))

    no_negatives, no_ids = img.new_empty((0, D)), torch.empty((0,), dtype=torch.long)
    masks = (torch.empty(0), torch.empty(0), no_ids, no_ids)

    def symmetric():  # normalize, masked, margin code 0 (text), need_grad
        no_own, no_own_mask = img.new_empty((0, 0, D)), torch.empty((0, 0), dtype=torch.bool)
        inputs = (img, txt, no_negatives, no_own, no_own_mask, no_ids, tau, gamma, eps, thr)
        out = cpp_symmetric._forward(*inputs, True, True, 0, True)
        cpp_symmetric._backward(torch.rand(N), *inputs, *out[1:], True, True, 0, True, 0, True)  # group mode 0

    assert counted(symmetric) == 6 * 2 * N * N * D
    assert stated(symmetric) == 3 * 2 * N * N * D
    q, k, a, b = (x.detach() for x in features(M, N, M, N, seed=2))

    def directional():
        out = cpp_directional._forward(q, k, a, b, *masks, tau, gamma, eps, thr, N - M, True, False, True)
        rest = (*out[1:], N - M, True, False, True, 0, True)  # group mode 0 ("mask"), need_qk
        cpp_directional._backward(torch.rand(M), q, k, a, b, *masks, tau, gamma, eps, thr, *rest)

    assert counted(directional) == (4 + 3) * 2 * M * N * D
    assert stated(directional) == 3 * 2 * M * N * D
    # dτ alone: the backward runs no kernel, its formula states 0
    img, txt = (x.detach() for x in features(N, N))
    tau = torch.tensor(0.07, requires_grad=True)

    def tau_only():
        hn_clip_loss(img, txt, tau, gamma=0.5, backend="cpp").backward()

    assert stated(tau_only) == counted(tau_only) == 2 * N * N * D


def test_formulas_on_fake_tensors_state_the_shapes_products():
    # no values to read, none needed: the forward's S, whatever need_grad makes the kernels form
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), FlopCounterMode(display=False) as mode:
        q, k, a, b = torch.empty(M, D), torch.empty(N, D), torch.empty(M, D), torch.empty(N, D)
        scalars = [torch.zeros((), dtype=torch.float64) for _ in range(4)]
        no_masks = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
        torch.ops.hnclip.cpp_directional_nll(q, k, a, b, *no_masks, *scalars, N - M, True, False, True)
    assert mode.get_total_flops() == 2 * M * N * D
