"""``hnclip::triton_symmetric_nll`` with the hard-negative family's inputs (the single-process loss
on the Triton kernels): absent inputs as None or empty are the same call bit for bit (every dtype,
both launch modes); opcheck of the operator and its backward; torch's ``triton_op`` finds exactly
its kernels; its workspace is ``workspace_bytes(negatives=, group_ids=)`` (counted as
test_workspace.py counts, with several ragged backward chunks); the merged i2t statistics are the
ones of one directional walk over all N + M columns.

Values and gradients against the float64 oracle: tests/api/test_hard_negatives_triton.py.
"""

from __future__ import annotations

import pytest
import torch
from test_workspace import _LAYERS, _Counter

import hnclip_kernels
from cases import ALL_BACKENDS, make_pair
from hnclip_kernels.backends.triton import config as cfg
from hnclip_kernels.backends.triton import workspace
from hnclip_kernels.margin import Margin

pytestmark = pytest.mark.skipif("triton" not in ALL_BACKENDS, reason="triton cannot run here")

D = 16


def _features(n, m, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    img, txt, neg = (torch.randn(r, D, generator=gen).to(dtype) for r in (n, n, m))
    txt[1] = txt[0] + 0.05 * txt[1]  # a near-duplicate caption pair
    return img, txt, neg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_without_family_inputs_it_is_the_symmetric_operator(dtype, threshold, launch):
    # M = 0 (None and a (0, D) tensor), no ids, margin "text": the same kernels, outputs and gradients to the bit
    from hnclip_kernels.backends.triton.ops import hn_clip_pairs_triton

    img, txt, _ = _features(9, 0, dtype, seed=1)
    out = []
    for fn in ("plain", "text", "empty"):
        leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
        tau = torch.tensor(0.05, requires_grad=True)
        kw = dict(tau=tau, gamma=0.5, label_smoothing=0.1, normalize=True, false_negative_threshold=threshold,
                  return_stats=True)  # fmt: skip
        if fn == "empty":
            rows, stats = hn_clip_pairs_triton(*leaves, negatives=leaves[0].new_empty((0, D)), **kw)
        elif fn == "text":
            rows, stats = hn_clip_pairs_triton(*leaves, negatives=None, group_ids=None, margin=Margin.TEXT, **kw)
        else:
            rows, stats = hn_clip_pairs_triton(*leaves, **kw)
        grads = torch.autograd.grad((rows * torch.linspace(0.5, 1.5, 9)).sum(), [*leaves, tau])
        out.append([rows.detach(), *[x for s in stats for x in s if x is not None], *grads])
    for got in out[1:]:
        for x, y in zip(out[0], got):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_merged_statistics_are_one_walk_over_all_columns(ids, margin, launch):
    # the symmetric walk's i2t summaries merged with the block's partials: the i2t statistics of one
    # directional walk of the directional operator over the N + M columns (float64 oracle's row losses aside)
    from hnclip_kernels.backends.triton.ops import directional_nll_triton, hn_clip_pairs_triton

    n, m = 9, 13
    img, txt, neg = _features(n, m, torch.float32, seed=2)
    group_ids = torch.tensor([0, 0, 1, 2, 3, 1, 4, 5, 6]) if ids else None
    kw = dict(tau=torch.tensor(0.05), gamma=0.5, label_smoothing=0.1, normalize=True, false_negative_threshold=0.8)
    _, (i2t, _) = hn_clip_pairs_triton(img, txt, negatives=neg, group_ids=group_ids, margin=margin, return_stats=True,
                                       **kw)  # fmt: skip
    keys = torch.cat([txt, neg])
    margin_kw = dict(query_txt=txt, key_txt=keys) if margin == "text" else dict(
        query_txt=img, key_txt=keys, mask_query=txt, mask_key=keys)  # fmt: skip
    groups = dict(query_groups=group_ids, key_groups=group_ids) if ids else {}
    _, want = directional_nll_triton(img, keys, offset=0, return_stats=True, **margin_kw, **groups, **kw)
    for name in ("delta", "mean_neg", "dsum", "kept"):
        got, ref = getattr(i2t, name), getattr(want, name)
        assert torch.allclose(got, ref, rtol=2e-6, atol=2e-6), name


def _op_args(case: str):
    img, txt, neg = (x.detach() for x in _features(7, 3, torch.float32, seed=3))
    img.requires_grad_(True)
    groups = torch.tensor([0, 1, 1, 2, 0, 3, 4]) if "ids" in case else torch.empty(0, dtype=torch.long)
    masked = "threshold" in case
    f64 = [torch.tensor(x, dtype=torch.float64) for x in (0.5, 0.1, 0.3 if masked else 0.0)]
    tau = torch.tensor(0.1, requires_grad=True)
    # normalize, masked, has_margin, smoothing, precision, the margin's code
    flags = (True, masked, True, True, "ieee", (Margin.IMAGE_TEXT if "image_text" in case else Margin.TEXT).code)
    flags += ({"supcon": 1, "mil_nce": 2}.get(case.split("-")[-1], 0),)  # group_mode's code (GroupMode.code)
    no_own = (img.new_empty((0, 0, img.shape[1])), torch.empty((0, 0), dtype=torch.bool))
    return (img, txt, neg, *no_own, groups, tau, *f64), flags


OPCHECK_CASES = ["threshold-ids", "ids-alone", "none", "none-image_text", "threshold-image_text"]


@pytest.mark.parametrize("case", OPCHECK_CASES + ["threshold-ids-supcon", "ids-mil_nce"])  # + the positive modes
def test_opcheck(case):
    import hnclip_kernels.backends.triton.ops  # noqa: F401  (registers the operator)

    inputs, flags = _op_args(case)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    op = torch.ops.hnclip.triton_symmetric_nll
    torch.library.opcheck(op.default, (*inputs, *flags), test_utils=checks)
    saved = [x.detach() for x in op(*inputs, *flags)[1:]]
    grad = torch.linspace(0.5, 1.0, 7)
    bargs = (grad, *(x.detach() for x in inputs), *saved, *flags, True)  # need_features
    torch.library.opcheck(torch.ops.hnclip.triton_symmetric_nll_backward.default, bargs, test_utils=checks)


KERNELS = {  # the bodies taking the family's inputs and the kernels torch's triton_op must find in them
    "directional": {
        "_directional_nll": ["_fwd_kernel", "_merge_kernel"],
        "_directional_nll_backward": ["_dscore_kernel", "_round16_kernel"],
    },
    "symmetric": {
        "_symmetric_nll": ["_fold_kernel", "_fwd_kernel", "_fwd_pair_kernel", "_merge_kernel"],
        "_symmetric_nll_backward": ["_dscore_kernel", "_dscore_pair_kernel", "_round16_kernel"],
    },
}


def test_operators_find_exactly_their_kernels():
    # as tests/backends/test_triton_ops_kernels.py: torch's triton_op follows the bodies' calls by name
    # (compiled kernels: a subprocess without TRITON_INTERPRET)
    import json
    import os
    import subprocess
    import sys

    probe = (
        "import importlib, json\n"
        "from torch._library.triton import get_inner_triton_kernels\n"
        "def name(k):\n"
        "    while type(k).__name__ != 'JITFunction' and hasattr(k, 'fn'):\n"
        "        k = k.fn\n"
        "    return getattr(k, '__name__', repr(k))\n"
        "out = {}\n"
        f"for mod, bodies in {json.dumps({m: sorted(b) for m, b in KERNELS.items()})}.items():\n"
        "    module = importlib.import_module('hnclip_kernels.backends.triton.' + mod)\n"
        "    out[mod] = {b: sorted({name(k) for k in get_inner_triton_kernels(getattr(module, b))}) for b in bodies}\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == KERNELS


@pytest.fixture
def counter(monkeypatch):
    """test_workspace.py's allocation log of the kernel layers (and this operator's body), with
    the phase set around the forward and the backward calls by the test itself."""
    c = _Counter()
    real_empty = torch.empty
    layers = (*_LAYERS, "hnclip_kernels.backends.triton.symmetric")

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if sys._getframe(1).f_globals.get("__name__") in layers:
            c.allocated(t)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return c


import sys  # noqa: E402  (the counter's frame lookup)


@pytest.mark.parametrize(
    "dtype,n,m,ids,threshold,eps",
    [
        (torch.bfloat16, 200, 170, False, None, 0.0),
        (torch.float32, 200, 40, True, None, 0.1),
        (torch.float16, 200, 300, True, 0.5, 0.0),
        (torch.float32, 200, 0, True, 0.5, 0.1),
        (torch.bfloat16, 100, 600, False, None, 0.0),  # the block's partials are the forward's peak
    ],
)
def test_family_workspace_counted(monkeypatch, counter, dtype, n, m, ids, threshold, eps):
    # GPU tiles, 4 "SMs", a 1-byte dS budget (several ragged chunks in both walks)
    monkeypatch.setenv("HNCLIP_TRITON_LAUNCH", "gpu")
    monkeypatch.setattr(cfg, "sm_count", lambda device: 4)
    monkeypatch.setattr(cfg, "BWD_WORKSPACE_BYTES", 1)
    d = 32
    if n == 100:  # this case holds the block's term: it must be larger than the symmetric walk's
        assert workspace.family_forward_bytes(n, m, 2, False) > workspace.forward_bytes(n, n, 2, True, False)
    img, txt = (x.requires_grad_(True) for x in make_pair(n, d, dtype, seed=4))
    neg = torch.randn(m, d).to(dtype).requires_grad_(True)
    group_ids = torch.arange(n) % 50 if ids else None
    counter.phase = "fwd"
    loss = hnclip_kernels.hn_clip_loss(img, txt, 0.07, negatives=neg, group_ids=group_ids, label_smoothing=eps,
                                       false_negative_threshold=threshold, backend="triton")  # fmt: skip
    counter.phase = "bwd"
    loss.backward()
    counter.phase = None
    fwd, bwd = counter.peak("fwd"), counter.peak("bwd")
    masked = ids or threshold is not None
    assert fwd == workspace.family_forward_bytes(n, m, dtype.itemsize, bool(eps), masked=masked) > 0
    assert fwd + bwd == hnclip_kernels.workspace_bytes(
        n, d, dtype, label_smoothing=eps, false_negative_threshold=threshold, negatives=m, group_ids=ids
    )


def test_family_workspace_at_scale():
    # the bound: N = M = 262144, D = 768, bf16 within 1 GiB beyond the inputs; the block adds nothing
    # to today's peak there (the N×N chunk pair is the larger backward chunk)
    n, d = 262144, 768
    today = hnclip_kernels.workspace_bytes(n, d, torch.bfloat16)
    family = hnclip_kernels.workspace_bytes(n, d, torch.bfloat16, negatives=n)
    assert family == today < 2**30
    worst = hnclip_kernels.workspace_bytes(
        n, d, torch.bfloat16, negatives=4 * n, group_ids=True, label_smoothing=0.1, false_negative_threshold=0.9
    )
    assert worst < 2**30
    with pytest.raises(ValueError, match="negatives"):
        hnclip_kernels.workspace_bytes(n, d, torch.bfloat16, negatives=-1)
    with pytest.raises(ValueError, match="local_rows"):
        hnclip_kernels.workspace_bytes(n, d, torch.bfloat16, negatives=3, local_rows=5)
