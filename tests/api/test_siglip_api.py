"""``hn_siglip_loss``: its checks, its reductions, and the torch reference against the float64
oracle (tests/sigmoid_oracle.py) and open_clip's ``SigLipLoss``."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sigmoid_oracle import sigmoid_rows_f64

from hnclip_kernels import HNSigLipLoss, hn_siglip_loss

open_clip_loss = pytest.importorskip("open_clip.loss")


def _features(n, d, seed, dtype=torch.float32, clusters=None):
    g = torch.Generator().manual_seed(seed)
    if clusters is None:
        return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    centres = torch.randn(clusters, d, generator=g, dtype=torch.float64)
    x = centres[torch.arange(n) % clusters] + 0.02 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return x.to(dtype)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _rows_agree(got, want, tol, floor=None):
    """Each row within ``tol`` of ``want``'s row, relative to it, or within ``floor[i]`` absolute:
    the float32 rounding of a gradient that the normalisation's projection cancels (a row
    orthogonal to nothing, D = 1: the truth is 0, float32 leaves eps·s·(columns)/‖x_i‖)."""
    for i in range(got.shape[0]):
        diff = (got[i].double() - want[i]).norm()
        err = diff / want[i].norm().clamp_min(1e-300)
        assert err <= tol or diff <= (1e-30 if floor is None else floor[i]), f"row {i}: {err:.3e}"


def test_gamma_zero_equals_open_clip_siglip_value_and_gradients():
    img, txt = _features(9, 16, 1).requires_grad_(), _features(9, 16, 2).requires_grad_()
    s, b = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    ours = hn_siglip_loss(img, txt, s, b, gamma=0.0, backend="torch")
    theirs = open_clip_loss.SigLipLoss()(F.normalize(img, dim=1), F.normalize(txt, dim=1), s, b)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * abs(theirs.item())
    for a, c in zip(_grads(ours, (img, txt, s, b)), _grads(theirs, (img, txt, s, b))):
        assert (a - c).abs().max() <= 1e-6 * c.abs().max().clamp_min(1.0)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 13),
    d=st.integers(1, 9),
    m=st.sampled_from([0, 1, 5]),
    scale=st.sampled_from([1.0, 10.0, 100.0]),
    bias=st.floats(-15.0, 5.0),
    gamma=st.sampled_from([0.0, 0.5, 2.0]),
    margin=st.sampled_from(["text", "image_text"]),
    groups=st.sampled_from([None, 2, 4]),
    group_mode=st.sampled_from(["mask", "positive"]),
    profile=st.sampled_from(["uniform", "clustered"]),
    seed=st.integers(0, 10_000),
)
# CI's draw: one saturated pair at s = 100, loss 5.6e-25, float32 off by 1.1e-5 relative
@example(n=1, d=2, m=0, scale=100.0, bias=-1.2957370153322287, gamma=0.0, margin="text", groups=None,
         group_mode="mask", profile="clustered", seed=4291)  # fmt: skip
def test_torch_backend_rows_and_gradients_match_float64(
    n, d, m, scale, bias, gamma, margin, groups, group_mode, profile, seed
):
    clusters = None if profile == "uniform" else max(1, n // 3)
    img, txt = _features(n, d, seed, clusters=clusters), _features(n, d, seed + 1, clusters=clusters)
    neg = _features(m, d, seed + 2) if m else None
    ids = None if groups is None else torch.arange(n) % groups
    kw = dict(gamma=gamma, margin=margin, group_ids=ids, group_mode=group_mode)
    leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_()]
    leaves += [neg.clone().requires_grad_()] if m else []
    s, b = torch.tensor(scale, requires_grad=True), torch.tensor(bias, requires_grad=True)
    got = hn_siglip_loss(*leaves[:2], s, b, negatives=leaves[2] if m else None, reduction="none", backend="torch", **kw)
    want_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ws = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    wb = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    want = sigmoid_rows_f64(
        *want_leaves[:2], ws, wb, negatives=want_leaves[2] if m else None, margin=margin, gamma=gamma,
        query_groups=ids, key_groups=ids, groups_positive=group_mode == "positive",
    )  # fmt: skip
    # a row's float32 logit z is off by a few ulps of |s·score| + |b| (|score| ≤ 1 + γ), which a
    # saturated row's loss softplus(−z) ≈ e^−z carries as that much relative error
    _rows_agree(got, want, 1e-5 + 4 * 2.0**-24 * (scale * (1 + gamma) + abs(bias)))
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g_got = _grads((got.double() * upstream).sum(), [*leaves, s, b])
    g_want = _grads((want * upstream).sum(), [*want_leaves, ws, wb])
    names = ["img", "txt", "negatives"][: len(leaves)] + ["s", "b"]
    for name, x, a, c in zip(names, [*leaves, s, b], g_got, g_want):
        if c.dim() == 0:
            assert abs(a.item() - c.item()) <= 1e-5 * abs(c.item()) + 1e-6 * scale * (n + m) * n * 1e-2, name
        else:
            floor = 1e-6 * scale * (n + m) / x.detach().double().norm(dim=1).clamp_min(1e-30)
            _rows_agree(a, c, 1e-4, floor)


def test_saturated_positive_keeps_its_gradient():
    """z = 20 on the positive: the true dL/dz = −σ(−20) ≈ −2e-9, which a float32 σ(z) − 1 makes 0."""
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    txt = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor(0.0, requires_grad=True)
    loss = hn_siglip_loss(img, txt, 20.0, b, gamma=0.0, backend="torch", reduction="sum")
    (db,) = torch.autograd.grad(loss, b)
    want = 2 * (-1 / (1 + math.exp(20.0)) + 1 / (1 + math.exp(0.0)))  # two positives, two negatives at z = 0
    assert abs(db.item() - want) <= 1e-6 * abs(want)
    img2 = img.detach().clone().requires_grad_()
    loss = hn_siglip_loss(img2, txt, 20.0, -30.0, gamma=0.0, backend="torch", reduction="sum")
    (d_img,) = torch.autograd.grad(loss, img2)
    assert (d_img != 0).any() and torch.isfinite(d_img).all()


def test_reductions_and_bias_none():
    img, txt = _features(6, 5, 3), _features(6, 5, 4)
    rows = hn_siglip_loss(img, txt, 5.0, -2.0, reduction="none", backend="torch")
    assert rows.shape == (6,)
    assert torch.equal(hn_siglip_loss(img, txt, 5.0, -2.0, reduction="sum", backend="torch"), rows.sum())
    assert torch.equal(hn_siglip_loss(img, txt, 5.0, -2.0, backend="torch"), rows.mean())
    no_bias = hn_siglip_loss(img, txt, 5.0, None, backend="torch")
    assert torch.equal(no_bias, hn_siglip_loss(img, txt, 5.0, 0.0, backend="torch"))


def test_inputs_are_not_mutated():
    img, txt, neg = _features(5, 4, 5), _features(5, 4, 6), _features(3, 4, 7)
    ids = torch.tensor([0, 1, 0, 2, 1])
    copies = [x.clone() for x in (img, txt, neg, ids)]
    hn_siglip_loss(img, txt, 10.0, -5.0, negatives=neg, group_ids=ids, normalize=True, backend="torch")
    for a, c in zip((img, txt, neg, ids), copies):
        assert torch.equal(a, c)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(logit_scale=0.0), ValueError, "logit_scale must be finite and > 0"),
        (dict(logit_scale=-1.0), ValueError, "logit_scale"),
        (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
        (dict(logit_scale="10"), TypeError, "logit_scale"),
        (dict(logit_scale=torch.tensor([1.0, 2.0])), TypeError, "one-element"),
        (dict(logit_bias=float("inf")), ValueError, "logit_bias must be finite"),
        (dict(logit_bias=torch.tensor(1)), TypeError, "logit_bias"),
        (dict(group_mode="positives"), ValueError, "group_mode must be one of"),
        (dict(group_mode=1), TypeError, "group_mode"),
        (dict(margin="image"), ValueError, "margin must be one of"),
        (dict(gamma=-0.1), ValueError, "gamma"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(negatives=torch.zeros(3, 7)), ValueError, "negatives has D = 7"),
        (dict(group_ids=torch.zeros(4, dtype=torch.long)), ValueError, "group_ids must be 1-D of length N = 5"),
        (dict(group_ids=torch.zeros(5)), TypeError, "group_ids must be an integer tensor"),
        (dict(logit_scale=1e38, normalize=True), ValueError, "overflows"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, words):
    args = dict(img=_features(5, 4, 1), txt=_features(5, 4, 2), logit_scale=10.0, logit_bias=-10.0, backend="torch")
    args.update(kwargs)
    with pytest.raises(error, match=words):
        hn_siglip_loss(**args)


def test_features_checked_by_name():
    with pytest.raises(TypeError, match="img must be a torch.Tensor"):
        hn_siglip_loss([[1.0]], torch.ones(1, 1), 1.0)
    with pytest.raises(ValueError, match="same shape"):
        hn_siglip_loss(torch.ones(2, 3), torch.ones(3, 3), 1.0)


# ---- HNSigLipLoss holding a process group, copied (EMA/SWA) and pickled (checkpoints), as HNClipLoss
def _group():
    return torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)


def test_siglip_module_deepcopy_shares_the_process_group():
    group = _group()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), HNSigLipLoss(group=group, gamma=0.3))
    for copied in (copy.deepcopy(model), torch.optim.swa_utils.AveragedModel(model).module):
        assert copied[1].group is group and copied[1].options.gamma == 0.3
        assert copied[0].weight is not model[0].weight


def test_siglip_module_pickle_drops_a_process_group_and_asks_for_it():
    loss = HNSigLipLoss(group=_group(), rank=0, world_size=2)
    restored = pickle.loads(pickle.dumps(loss))
    assert restored.group is None and restored.world_size == 2
    img, txt = _features(3, 4, 0), _features(3, 4, 1)
    with pytest.raises(ValueError, match="unpickled without its process group"):
        restored(img, txt, 10.0, -5.0)
    plain = pickle.loads(pickle.dumps(HNSigLipLoss(gamma=0.2)))  # no group: nothing to ask for
    want = sigmoid_rows_f64(img, txt, 10.0, -5.0, gamma=0.2, normalize=False).mean()
    torch.testing.assert_close(plain(img, txt, 10.0, -5.0).double(), want, rtol=1e-5, atol=0)
