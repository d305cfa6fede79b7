"""``hnclip::cpp_symmetric_nll`` with the hard-negative family's inputs (the family's
single-process loss on the C++ kernels): its formulas in ``FlopCounterMode`` (the useful products) beside the products the kernels run
(``torch.profiler``, as test_cpp_flops.py), opcheck of the operator and its backward, gradcheck in float64 with γ > 0
(a margin the inputs do not see is still exercised through the other inputs), that no negatives
and an empty (0, D) block are one call, bit for bit, and that an unknown margin code raises.

Shapes of a few dozen rows: the file runs in a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

from hnclip_kernels.margin import Margin

try:
    from hnclip_kernels.backends.cpp.ops import hn_clip_pairs_cpp
except ImportError as exc:  # pragma: no cover - the extension was not built
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)

from test_cpp_flops import counted, one_thread, stated  # noqa: F401  (one_thread: an autouse fixture)

N, M, D = 40, 16, 24
IDS = torch.arange(N) % 13


def features(*rows, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(r, D, generator=gen, dtype=dtype, requires_grad=True) for r in rows]


@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("weights", ["uniform", "per row"])
@pytest.mark.parametrize(
    "m, ids, threshold, f",
    [(M, False, None, 0), (M, True, None, 0), (M, True, 0.3, 1), (M, False, 0.3, 1), (0, True, None, 0)],
)
def test_formula_states_the_useful_products_beside_the_kernels(margin, weights, m, ids, threshold, f):
    # the symmetric op's (1 + f) forward and (3 + f) backward products over N×N; the N×M block:
    # forward (1 + f + 2) (logits, the shares P·n̂ and Pᵀ·v̂), backward 0 for a uniform upstream
    # gradient (the shares rescaled), else (2 + f) (recompute, Pᵀ·v̂; P·n̂ rescaled per row).
    # f = 1 where the threshold's caption tile is formed; the margin folds in for either margin.
    # FlopCounterMode states the useful products whatever the kernels run: S = v [t; n]ᵀ of N × (N + M)
    # forward, dS·[t; n] and dSᵀ·v backward
    img, txt, neg = features(N, N, m)
    w = torch.ones(N) if weights == "uniform" else torch.linspace(0.5, 1.5, N)

    def step():
        tau = torch.tensor(0.07, requires_grad=True)
        loss = hn_clip_pairs_cpp(
            img, txt, negatives=neg, group_ids=IDS if ids else None, tau=tau, gamma=0.5, label_smoothing=0.1, normalize=True,
            margin=margin, false_negative_threshold=threshold,
        )  # fmt: skip
        (loss * w).sum().backward()

    block = (3 + f) + (0 if weights == "uniform" else 2 + f)
    assert counted(step) == 2 * D * ((4 + 2 * f) * N * N + block * N * m)
    assert stated(step) == 3 * 2 * D * N * (N + m)


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_no_negatives_and_an_empty_block_are_one_call(threshold):
    # M = 0 either way, no ids, margin "text": every output and gradient bit-identical
    img, txt = features(N, N, seed=1)
    out = []
    for negatives in (None, img.new_empty((0, D))):
        tau = torch.tensor(0.07, requires_grad=True)
        kw = dict(tau=tau, gamma=0.5, label_smoothing=0.1, normalize=True, false_negative_threshold=threshold)
        loss = hn_clip_pairs_cpp(img, txt, negatives=negatives, margin=Margin.TEXT, **kw)
        weights = torch.linspace(0.5, 1.5, N)
        out.append((loss.detach(), *torch.autograd.grad((loss * weights).sum(), [img, txt, tau])))
    for x, y in zip(*out):
        assert torch.equal(x, y)


@pytest.mark.parametrize("code", [-1, len(Margin), 99])
def test_unknown_margin_code_raises(code):
    # the operator's margin code is range-checked once, by the raw kernels' registration
    inputs, masked = _args("none")
    with pytest.raises(RuntimeError, match=f"hnclip: unknown margin code {code} "):
        torch.ops.hnclip.cpp_symmetric_nll(*inputs, True, masked, code, True)
    with pytest.raises(RuntimeError, match=f"hnclip: unknown margin code {code} "):
        torch.ops.hnclip.cpp_raw_symmetric_fwd(*inputs[:2], torch.zeros(7), torch.ones(()), 0.0, None, margin=code)


def _args(case: str):
    img, txt, neg = (x.detach() for x in features(7, 7, 3, seed=2))
    img.requires_grad_(True)
    groups = torch.tensor([0, 1, 1, 2, 0, 3, 4]) if "ids" in case else torch.empty(0, dtype=torch.long)
    thr = 0.3 if "threshold" in case else (math.inf if "ids" in case else 0.0)
    f64 = [torch.tensor(x, dtype=torch.float64) for x in (0.5, 0.1, thr)]
    masked = "threshold" in case or "ids" in case
    tau = torch.tensor(0.1, requires_grad=True)
    no_own = (img.new_empty((0, 0, img.shape[1])), torch.empty((0, 0), dtype=torch.bool))
    return (img, txt, neg, *no_own, groups, tau, *f64), masked


@pytest.mark.parametrize("case", ["threshold-ids", "ids-alone", "none", "none-image_text", "threshold-image_text"])
def test_opcheck(case):
    inputs, masked = _args(case)
    code = (Margin.IMAGE_TEXT if "image_text" in case else Margin.TEXT).code
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    op = torch.ops.hnclip.cpp_symmetric_nll
    torch.library.opcheck(op.default, (*inputs, True, masked, code, True), test_utils=checks)
    saved = [x.detach() for x in op(*inputs, True, masked, code, True)[1:]]
    grad = torch.linspace(0.5, 1.0, 7)
    detached = [x.detach() for x in inputs]
    bargs = (grad, *detached, *saved, True, masked, code, True, 0, True)  # need_grad, group mode 0, need_features
    torch.library.opcheck(torch.ops.hnclip.cpp_symmetric_nll_backward.default, bargs, test_utils=checks)


@pytest.mark.parametrize("margin", ["text", "image_text"])
@pytest.mark.parametrize("normalize", [True, False])
def test_gradcheck_float64(margin, normalize):
    # γ = 0: finite differences see every input (the margin is stop-gradient); ids, threshold, ε
    img, txt, neg = features(4, 4, 3, seed=3, dtype=torch.float64)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 1, 0, 2])

    def fn(a, b, c, s):
        return hn_clip_pairs_cpp(
            a, b, negatives=c, group_ids=ids, tau=s, gamma=0.0, label_smoothing=0.1, normalize=normalize, margin=margin,
            false_negative_threshold=0.9,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (img, txt, neg, tau))
