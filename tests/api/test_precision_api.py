"""The ``precision`` argument: validated, reaches the Triton kernels for float32, ignored elsewhere."""

import pytest
import torch

from cases import make_pair
from hnclip_kernels import HNClipLoss, hn_clip_loss


@pytest.mark.parametrize(
    "bad,exc,match", [("tf32", ValueError, "tf32x3"), ("fp8", ValueError, "precision"), (3, TypeError, "precision")]
)
def test_bad_precision_names_the_argument(bad, exc, match):
    img, txt = make_pair(4, 8)
    with pytest.raises(exc, match=match):
        hn_clip_loss(img, txt, 0.1, precision=bad)
    with pytest.raises(exc, match=match):
        HNClipLoss(precision=bad)  # at construction, not at the first forward


def _loss_and_grad(img, txt, precision):
    leaf = img.clone().requires_grad_(True)
    loss = hn_clip_loss(leaf, txt, 0.05, backend="triton", precision=precision)
    loss.backward()
    return loss.detach(), leaf.grad


def test_precision_reaches_float32_kernels():
    img, txt = make_pair(40, 64, seed=5)
    ieee = _loss_and_grad(img, txt, "ieee")
    for mode in ("tf32x3", "bf16x3"):
        other = _loss_and_grad(img, txt, mode)
        # different operand splits give (slightly) different float32 results
        assert not (torch.equal(ieee[0], other[0]) and torch.equal(ieee[1], other[1])), mode
    assert all(torch.equal(a, b) for a, b in zip(_loss_and_grad(img, txt, None), _loss_and_grad(img, txt, "tf32x3")))


def test_precision_ignored_for_bf16_and_other_backends():
    img, txt = make_pair(40, 64, torch.bfloat16, seed=6)
    assert torch.equal(_loss_and_grad(img, txt, "ieee")[1], _loss_and_grad(img, txt, "bf16x3")[1])
    img, txt = make_pair(20, 16, seed=7)
    for backend in ("torch", "cpp"):
        try:
            a = hn_clip_loss(img, txt, 0.05, backend=backend, precision="bf16x3")
        except ValueError as exc:  # cpp not built
            assert "cpp" in str(exc)
            continue
        assert torch.equal(a, hn_clip_loss(img, txt, 0.05, backend=backend))


def test_clip_loss_module_passes_precision():
    img, txt = make_pair(24, 32, seed=8)
    scale = torch.tensor(20.0)
    out = {p: HNClipLoss(backend="triton", normalize=True, precision=p)(img, txt, scale) for p in ("ieee", "bf16x3")}
    assert not torch.equal(out["ieee"], out["bf16x3"])
    assert torch.allclose(out["ieee"], out["bf16x3"], rtol=1e-4)
