"""What ``torch.utils.flop_counter.FlopCounterMode`` (and the MFU tools built on it) counts for the
fused operators: a counter made before the first loss call sees their formulas, and every formula
states the loss's useful products of the real shapes, the same on cpp and Triton
(``docs/benchmarks.md``, "FLOPs under FlopCounterMode").

Useful products of one logit matrix S = q kᵀ of R rows × C columns over D: the forward's S, the
backward's dS·k and dSᵀ·q, 2·R·C·D FLOPs each (torch's count of a matmul). Bounds: batches of a
few dozen rows (Triton in its interpreter), one subprocess of ~10 s.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hnclip_kernels import hn_clip_loss
from hnclip_kernels.backends import cpp_directional

N, M, D = 24, 8, 16
BACKENDS = [
    pytest.param("cpp", marks=pytest.mark.skipif(cpp_directional() is None, reason="the C++ extension is not built")),
    "triton",
]

# a fresh interpreter: counters made before any loss call (after `import hnclip_kernels` only); each
# backend's operators are defined at its first call, inside `early`'s first block or outside any counter
_FRESH = """
import json, sys, torch
from torch.utils.flop_counter import FlopCounterMode
import hnclip_kernels
early = FlopCounterMode(display=False)  # an MFU logger built at start-up
early_idle = FlopCounterMode(display=False)  # one that is not active at the first call
gen = torch.Generator().manual_seed(0)
img, txt, neg = (torch.randn(n, 16, generator=gen, requires_grad=True) for n in (24, 24, 8))
results = {}
for case in sys.argv[1:]:
    backend, family = case.split(":")
    def step():
        negatives = neg if family == "family" else None
        hnclip_kernels.hn_clip_loss(img, txt, 0.07, backend=backend, negatives=negatives).backward()
    with early:
        step()
    step()  # outside any counter
    with early_idle:
        step()
    with FlopCounterMode(display=False) as late:  # made after the first call
        step()
    results[case] = [early.get_total_flops(), early_idle.get_total_flops(), late.get_total_flops()]
print(json.dumps(results))
"""


def test_a_counter_made_before_the_first_call_counts_the_operators():
    # each backend's first call runs inside `early` (its operators are defined then, after every
    # counter here was made); `early_idle` is not active at that moment
    cases = ["triton:loss", "triton:family"]
    if cpp_directional() is not None:
        cases = ["cpp:family", "cpp:loss", *cases]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _FRESH, *cases], env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for case, (early, early_idle, late) in results.items():
        cols = N + (M if case.endswith("family") else 0)
        assert early == early_idle == late == 3 * 2 * N * cols * D, (case, early, early_idle, late)


def _counted(fn):
    """(forward FLOPs, backward FLOPs) that FlopCounterMode states for ``fn()``'s loss."""
    with FlopCounterMode(display=False) as fwd:
        loss = fn()
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _summed(fn, *args):
    return fn(*args).sum()


def _leaves(*rows, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(r, D, generator=gen).to(dtype).requires_grad_() for r in rows]


SINGLE = {  # hn_clip_loss's keywords; "negatives": M negative captions; "ids": group ids
    "γ=0": dict(gamma=0.0),
    "γ=0.5": dict(gamma=0.5),
    "γ=0.5 threshold": dict(gamma=0.5, false_negative_threshold=0.5),
    "bf16 γ=0.5": dict(gamma=0.5, dtype=torch.bfloat16),
    "family γ=0.5": dict(gamma=0.5, negatives=True),
    "family γ=0 threshold ids": dict(gamma=0.0, negatives=True, ids=True, false_negative_threshold=0.5),
    "family image_text threshold": dict(gamma=0.5, negatives=True, margin="image_text", false_negative_threshold=0.5),
    "family M=0 ids": dict(gamma=0.5, ids=True),
}


@pytest.mark.parametrize("case", list(SINGLE), ids=list(SINGLE))
def test_single_process_calls_state_the_useful_products_on_both_backends(case):
    kwargs = dict(SINGLE[case])
    dtype = kwargs.pop("dtype", torch.float32)
    img, txt, neg = _leaves(N, N, M, dtype=dtype)
    if not kwargs.pop("negatives", False):
        neg = None
    if kwargs.pop("ids", False):
        kwargs["group_ids"] = torch.arange(N) // 3
    cols = N + (0 if neg is None else M)
    useful = (2 * N * cols * D, 4 * N * cols * D)  # S forward; dS·k and dSᵀ·q backward
    backends = ["triton"] + (["cpp"] if cpp_directional() is not None else [])
    for backend in backends:
        got = _counted(functools.partial(hn_clip_loss, img, txt, 0.07, backend=backend, negatives=neg, **kwargs))
        assert got == useful, (backend, got, useful)
    # dτ alone: the backward forms no feature gradient and states 0
    tau = torch.tensor(0.07, requires_grad=True)
    x, y = (t.detach() for t in (img, txt))
    for backend in backends:
        assert _counted(functools.partial(hn_clip_loss, x, y, tau, backend=backend, **kwargs)) == (2 * N * N * D, 0)


@pytest.mark.parametrize("family", [False, True], ids=["rank", "family rank"])
def test_a_ranks_ops_state_the_useful_products_on_both_backends(family):
    # a rank's M local rows against N gathered columns: Triton's one op for both directions
    # (hnclip::triton_rank_nll, or two family directional ops), cpp's two directional ops
    from hnclip_kernels import LossOptions
    from hnclip_kernels.backends import rank_losses
    from hnclip_kernels.validation_family import Family

    rows = 8
    all_img, all_txt, neg = _leaves(N, N, M, seed=1)
    img, txt = (x[N - rows :] for x in (all_img, all_txt))
    tau = torch.tensor(0.07)
    keys = N + (M if family else 0)
    useful = (2 * rows * (keys + N) * D, 4 * rows * (keys + N) * D)  # i2t over N (+ K) keys, t2i over N
    backends = ["triton"] + (["cpp"] if cpp_directional() is not None else [])
    for backend in backends:
        options = LossOptions(gamma=0.5, backend=backend, false_negative_threshold=0.5).resolved(img, 0.07)
        gathered = Family(neg, torch.arange(N) // 2) if family else None
        args = (img, txt, all_img, all_txt, tau, N - rows, options, False, gathered)
        call = functools.partial(_summed, rank_losses, *args)
        assert _counted(call) == useful, backend


@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_own_negatives_state_their_products_on_both_backends(margin):
    # each row's K own negatives add N·K logits: 2·N·K·D forward (v̂_i·n̂_ik), and dS·n̂ and dSᵀ·v̂
    # backward (4·N·K·D); the margin's t̂_i·n̂_ik is detached work, not stated
    k = 3
    img, txt = _leaves(N, N, seed=2)
    own = torch.randn(N, k, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    mask = torch.rand(N, k, generator=torch.Generator().manual_seed(4)) < 0.7
    useful = (2 * N * (N + k) * D, 4 * N * (N + k) * D)
    for backend in ["triton"] + (["cpp"] if cpp_directional() is not None else []):
        call = functools.partial(hn_clip_loss, img, txt, 0.07, negatives=own, negatives_mask=mask, margin=margin)
        assert _counted(functools.partial(call, backend=backend)) == useful, backend


def _directions_loss(*args, **kwargs):
    rows = hn_clip_loss(*args, reduction="directions", **kwargs)
    return sum(x.sum() for x in rows)


@pytest.mark.parametrize("m, eps", [(0, 0.0), (M, 0.0), (M, 0.1)])
def test_directions_state_two_directional_walks_on_both_backends(m, eps):
    # one directional op a direction, i2t over N + M columns, t2i over N (the symmetric op's
    # shared tiles are not shared here); ε > 0: each direction's unsmoothed rows in a second call
    img, txt, neg = _leaves(N, N, M, seed=5)
    calls = 2 if eps else 1
    logits = N * (N + m) + N * N
    useful = (calls * 2 * logits * D, calls * 4 * logits * D)
    for backend in ["triton"] + (["cpp"] if cpp_directional() is not None else []):
        call = functools.partial(_directions_loss, img, txt, 0.07, negatives=neg if m else None, label_smoothing=eps)
        assert _counted(functools.partial(call, backend=backend)) == useful, backend


@pytest.mark.parametrize(
    "margin, threshold, forward_blocks",
    [("image_text", None, 1), ("text", None, 2), ("text", 0.5, 3)],
    ids=["image_text", "text", "text threshold"],
)
def test_directions_with_own_negatives_count_the_host_block_on_both_backends(margin, threshold, forward_blocks):
    # reduction="directions" with each row's K own negatives: the directional ops' formulas (i2t over
    # the N captions, t2i over N) plus the own block's autograd einsums, which FlopCounterMode counts
    # as executed (no operator hides them): v̂·n̂ (2·N·K·D), the margin's detached t̂·n̂ ("text") and a
    # threshold's caption cosines forward; dL/dn̂ and dL/dv̂ backward (4·N·K·D)
    k = 3
    img, txt = _leaves(N, N, seed=6)
    own = torch.randn(N, k, D, generator=torch.Generator().manual_seed(7), requires_grad=True)
    mask = torch.rand(N, k, generator=torch.Generator().manual_seed(8)) < 0.7
    walks = 2 * N * N  # i2t's N × N and t2i's N × N logits
    block = N * k * D
    expected = (2 * walks * D + forward_blocks * 2 * block, 4 * walks * D + 4 * block)
    for backend in ["triton"] + (["cpp"] if cpp_directional() is not None else []):
        call = functools.partial(
            _directions_loss, img, txt, 0.07, negatives=own, negatives_mask=mask, margin=margin,
            false_negative_threshold=threshold, backend=backend,
        )  # fmt: skip
        assert _counted(call) == expected, backend
