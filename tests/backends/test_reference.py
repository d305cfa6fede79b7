"""The float64 truth itself, the pure-PyTorch backend in float64, gradcheck.

The torch backend's float32/fp16/bf16 checks against the truth (shared with every backend) are in
test_backends.py.
"""

import pytest
import torch
import torch.nn.functional as F

from cases import ALL_BACKENDS, GAMMAS, SMOOTHINGS, make_pair
from helpers import hn_clip_loss_f64
from hnclip_kernels import hn_clip_loss


@pytest.mark.parametrize("eps", SMOOTHINGS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_truth_matches_cross_entropy_in_float64(gamma, eps):
    # Away from saturation float64 F.cross_entropy is exact enough to validate the truth.
    img, txt = make_pair(9, 5, torch.float64)
    v, t = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    g = (t @ t.T) * (1 - torch.eye(9, dtype=torch.float64))
    z = (v @ t.T + gamma * g) / 0.3
    labels = torch.arange(9)
    expected = 0.5 * (
        F.cross_entropy(z, labels, label_smoothing=eps) + F.cross_entropy(z.T, labels, label_smoothing=eps)
    )
    got = hn_clip_loss_f64(img, txt, 0.3, gamma, eps)
    assert abs(got.item() - expected.item()) <= 1e-13 * abs(expected.item())


def test_torch_backend_float64_returns_float64():
    img, txt = make_pair(6, 4, torch.float64)
    loss = hn_clip_loss(img, txt, 0.1, backend="torch")
    assert loss.dtype == torch.float64
    assert abs(loss.item() - hn_clip_loss_f64(img, txt, 0.1).item()) <= 1e-12 * loss.item()


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("eps", SMOOTHINGS)
def test_gradcheck_float64(eps, normalize):
    # Finite differences see the margin's dependence on txt, which the loss stops by
    # definition; so check img, txt and τ with γ = 0, and img and τ with γ > 0.
    img, txt = make_pair(5, 4, torch.float64, seed=3)
    if not normalize:
        img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    img.requires_grad_(True)
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)

    def fn(gamma, t):
        return lambda a, *rest: hn_clip_loss(
            a,
            rest[0] if t is None else t,
            rest[-1],
            gamma=gamma,
            label_smoothing=eps,
            normalize=normalize,
            reduction="none",
            backend="torch",
        )

    assert torch.autograd.gradcheck(fn(0.0, None), (img, txt.clone().requires_grad_(True), tau))
    assert torch.autograd.gradcheck(fn(0.7, txt), (img, tau))


def test_gradcheck_directional_with_margin():
    # With the margin factors passed as constants, every input of a direction is checkable.
    from hnclip_kernels.backends.pytorch.reference import directional_nll_torch

    gen = torch.Generator().manual_seed(8)
    q, k = (torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    k2 = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    a, b = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen, dtype=torch.float64)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    fn = lambda q_, k_, t_: directional_nll_torch(
        q_,
        k_,
        query_txt=a,
        key_txt=b,
        tau=t_,
        offset=2,  # noqa: E731
        gamma=1.5,
        label_smoothing=0.1,
        normalize=True,
    )
    assert torch.autograd.gradcheck(fn, (q, k2, tau))


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
@pytest.mark.parametrize("gap", [21.0, 30.0, 36.0])
def test_float64_rows_between_20_and_40_keep_their_last_bits(backend, gap):
    # row 0's image is its caption negated, caption 1 orthogonal: δ = (cos + 1)/τ = gap exactly in
    # both directions' row 0, where softplus(δ) = δ + e^-δ (e^-21 = 7.6e-10, e^-36 = 2.3e-16) and
    # σ(δ) = 1 − e^-δ. F.softplus's default threshold (20: x itself above it) drops e^-δ, exact in
    # float32 but 2e-9 off in float64. Loss and gradients against the float64 truth: 1e-14.
    txt = torch.eye(2, 3, dtype=torch.float64)
    img = torch.stack([-txt[0], txt[1] + torch.tensor([0.0, 0.0, 0.5], dtype=torch.float64)])
    tau = 1.0 / gap
    leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    got = hn_clip_loss(*leaves, tau, gamma=0.0, reduction="none", backend=backend)
    ref_leaves = [x.clone().requires_grad_(True) for x in (img, txt)]
    want = hn_clip_loss_f64(*ref_leaves, tau, gamma=0.0, reduction="none")
    assert got.dtype == torch.float64
    assert (got - want).abs().max() <= 1e-14 * want.abs().max(), f"{got.tolist()} vs {want.tolist()}"
    upstream = torch.tensor([1.0, 0.5], dtype=torch.float64)
    for name, g, w in zip(("d img", "d txt"), torch.autograd.grad(got, leaves, upstream),
                          torch.autograd.grad(want, ref_leaves, upstream)):  # fmt: skip
        assert (g - w).abs().max() <= 1e-14 * w.abs().max(), f"{name}: {(g - w).abs().max().item():.3e}"
