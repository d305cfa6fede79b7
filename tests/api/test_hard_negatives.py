"""The hard-negative family (``negatives``, ``group_ids``, ``margin``) on backend="torch" against
an independent float64 oracle of the formula (docs/hard_negatives.md; ``family_oracle.py``, which
states the tolerances).

Loss and every gradient (img, txt, negatives, τ) are compared, per pair row where the batch is
saturated.

Bound: about 10 s on 2 shared cores (hypothesis ``derandomize=True``, max_examples 100).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

import family_oracle as oracle
from cases import ALL_BACKENDS
from family_oracle import GROUPS, D, N, check, features
from helpers import assert_close_rel
from hnclip_kernels import HNClipLoss, hn_clip_loss
from hnclip_kernels.backends import resolve_backend


@pytest.mark.parametrize("m", oracle.M_SIZES)
@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_negatives_match_the_oracle(m, margin):
    oracle.check_negatives("torch", m, margin)


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("m", [0, 7])
def test_group_ids_match_the_oracle(groups, margin, m):
    oracle.check_group_ids("torch", groups, margin, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "options", [name for name in oracle.OPTIONS if name != "threshold-distinct"]
)  # that one: fused only
@pytest.mark.parametrize("margin", oracle.MARGINS)
def test_combinations_and_dtypes(dtype, options, margin):
    oracle.check_combination("torch", dtype, options, margin)


@pytest.mark.parametrize("margin", oracle.MARGINS)
@pytest.mark.parametrize("with_ids", [False, True])
def test_saturated_near_duplicates_per_row(margin, with_ids):
    oracle.check_saturated_rows("torch", margin, with_ids)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_threshold_one_masks_identical_captions_with_ids(backend):
    # captions 1 and 4 the same one-hot row: their cosine is exactly 1.0 in every dtype, so the
    # threshold 1.0 masks the pair ("at or above"); with group ids (distinct for 1 and 4) the mask is
    # the family's union of both rules, where a `>` would keep the pair (cpp vs torch 1.87 apart).
    img, txt, neg = features(N, D, 24), features(N, D, 25), features(3, D, 26)
    txt[1] = txt[4] = F.one_hot(torch.tensor(2), D).float()
    ids = torch.tensor([0, 1, 0, 2, 3, 5])
    check(img, txt, neg, 0.1, backend=backend, group_ids=ids, threshold=1.0)
    check(img, txt, None, 0.1, backend=backend, group_ids=ids, threshold=1.0)


def test_return_stats_cover_the_negative_columns():
    img, txt, neg = features(N, D, 12), features(N, D, 13), features(4, D, 14)
    loss, report = hn_clip_loss(img, txt, 0.1, negatives=neg, backend="torch", return_stats=True, label_smoothing=0.1)
    assert report.rows == 2 * N and report.masked_pairs is None
    assert abs(report.loss - loss.item()) <= 1e-5 * loss.item()
    loss, report = hn_clip_loss(
        img, txt, 0.1, negatives=neg, group_ids=GROUPS["random"], backend="torch", return_stats=True
    )
    assert abs(report.loss - loss.item()) <= 1e-5 * loss.item()
    # ids (0, 2, 0, 1, 2, 5): two pairs of equal ids, each pair masked in both entries of both directions
    assert report.masked_pairs == 4


def test_module_matches_the_function():
    img, txt, neg = features(N, D, 15), features(N, D, 16), features(3, D, 17)
    module = HNClipLoss(backend="torch", normalize=True, margin="image_text")
    got = module(img, txt, 10.0, negatives=neg, group_ids=GROUPS["random"])
    want = hn_clip_loss(img, txt, 0.1, negatives=neg, group_ids=GROUPS["random"], margin="image_text", backend="torch")
    assert torch.equal(got, want)
    assert "margin='image_text'" in repr(module)


def test_auto_runs_todays_auto_backend_and_inputs_are_not_mutated():
    # "auto" picks as today's loss does (cpp on CPU where the extension is built, else torch)
    img, txt, neg = features(N, D, 18), features(N, D, 19), features(3, D, 20)
    ids = GROUPS["random"].clone()
    copies = [x.clone() for x in (img, txt, neg, ids)]
    auto = hn_clip_loss(img, txt, 0.1, negatives=neg, group_ids=ids, margin="image_text")
    picked = resolve_backend("auto", img)
    assert picked == ("cpp" if "cpp" in ALL_BACKENDS else "torch")
    want = hn_clip_loss(img, txt, 0.1, negatives=neg, group_ids=ids, margin="image_text", backend=picked)
    assert torch.equal(auto, want)
    for x, c in zip((img, txt, neg, ids), copies):
        assert torch.equal(x, c)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**oracle.FAMILY_DRAWS)
def test_hypothesis_draws_match_the_oracle(**draw):
    oracle.check_draw("torch", **draw)


def test_compile_fullgraph():
    torch._dynamo.reset()
    img, txt, neg = features(N, D, 21), features(N, D, 22), features(4, D, 23)
    ids = GROUPS["random"]

    def fn(a, b, c, tau):
        return hn_clip_loss(
            a, b, tau, negatives=c, group_ids=ids, margin="image_text", false_negative_threshold=0.5, backend="torch"
        )

    tau = torch.tensor(0.1)
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(img, txt, neg, tau), fn(img, txt, neg, tau), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("margin", ["text", "image_text"])
def test_gradcheck_float64(margin, backend):
    # γ = 0: the margin is off, so finite differences see every input (img, txt, negatives, τ)
    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} cannot run here")
    img, txt, neg = (features(n, 4, s, torch.float64).requires_grad_(True) for n, s in ((3, 24), (3, 25), (2, 26)))
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 1, 0])

    def fn(a, b, c, s):
        return hn_clip_loss(
            a, b, s, negatives=c, group_ids=ids, gamma=0.0, label_smoothing=0.1, margin=margin,
            reduction="none", backend=backend,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (img, txt, neg, tau))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_gradcheck_directional_with_mask_captions_and_groups(backend):
    # the directional protocol's family keywords (the reference's, and the C++ family operator's):
    # with the margin factors and mask captions constants, every input of a direction is
    # checkable with γ > 0
    if backend not in ALL_BACKENDS:
        pytest.skip(f"{backend} cannot run here")
    if backend == "cpp":
        from hnclip_kernels.backends.cpp.ops import directional_nll_cpp as directional
    else:
        from hnclip_kernels.backends.pytorch.reference import directional_nll_torch as directional

    q, k = features(3, 4, 27, torch.float64).requires_grad_(True), features(5, 4, 28, torch.float64)
    k.requires_grad_(True)
    a, b = features(3, 4, 29, torch.float64), features(5, 4, 30, torch.float64)
    a2, b2 = features(3, 4, 31, torch.float64), features(5, 4, 32, torch.float64)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)

    def fn(q_, k_, s):
        return directional(
            q_, k_, query_txt=a2, key_txt=b2, mask_query=a, mask_key=b, tau=s, offset=1,
            gamma=0.7, label_smoothing=0.1, normalize=True, false_negative_threshold=0.2,
            query_groups=torch.tensor([0, 1, 1]), key_groups=torch.tensor([0, 1, 2, 1]),
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (q, k, tau))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_label_smoothing_spreads_over_the_negative_columns_as_cross_entropy(backend):
    """docs/hard_negatives.md's statement, against torch's own ``F.cross_entropy(label_smoothing=ε)``
    on the dense logits (a second oracle beside family_oracle's): an image→text row spreads ε over
    its N + M classes (each negative caption gets ε/(N + M)), a text→image row over its N images.
    Spreading ε over the N captions only is another loss (checked to differ)."""
    dtype, eps, tau, gamma, m = (torch.float32 if backend == "triton" else torch.float64), 0.2, 0.1, 0.5, 5
    value_tol, grad_tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-12, 1e-11)
    raw = [features(n, D, s, dtype).requires_grad_(True) for n, s in ((N, 30), (N, 31), (m, 32))]
    got = hn_clip_loss(*raw[:2], tau, gamma=gamma, label_smoothing=eps, negatives=raw[2], backend=backend)
    got_grads = torch.autograd.grad(got, raw)
    v, t, neg = (F.normalize(x.double(), dim=1) for x in raw)
    x = torch.cat([t, neg])
    off = torch.ones(N, N + m, dtype=torch.float64)
    off[:, :N] -= torch.eye(N, dtype=torch.float64)  # no margin on the positive
    z_i2t = (v @ x.T + gamma * (t @ x.T).detach() * off) / tau
    z_t2i = (t @ v.T + gamma * (t @ t.T).detach() * off[:, :N]) / tau
    target = torch.arange(N)
    i2t, t2i = (F.cross_entropy(z, target, label_smoothing=eps) for z in (z_i2t, z_t2i))
    want = 0.5 * (i2t + t2i)
    assert_close_rel(got, want, value_tol, "loss")
    for name, a, b in zip(("img", "txt", "negatives"), got_grads, torch.autograd.grad(want, raw)):
        assert_close_rel(a, b, grad_tol, f"dL/d{name}")
    # ε over the N captions only: (1 − ε)·CE + ε·mean over the caption columns of −log p
    log_p = z_i2t.log_softmax(dim=1)
    captions_only = -(1 - eps) * log_p[target, target].mean() - eps * log_p[:, :N].mean(dim=1).mean()
    assert abs(0.5 * (captions_only + t2i) - want) > 1e-2 * want
