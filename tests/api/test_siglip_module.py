"""``HNSigLipLoss`` on one process: open_clip's ``SigLipLoss`` at γ = 0 (value and every gradient),
its constructor's checks, ``dist_impl`` (validated, changes nothing), the export and the output dict.
The ranks: tests/distributed/test_siglip_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hnclip_kernels
from hnclip_kernels import HNSigLipLoss, hn_siglip_loss
from hnclip_kernels.distributed import distributed_siglip_loss


def _inputs(n=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    t = F.normalize(0.7 * v + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    s = torch.tensor(10.0, dtype=torch.float64)
    b = torch.tensor(-10.0, dtype=torch.float64)
    return [x.clone().requires_grad_() for x in (v, t, s, b)]


def _loss_and_grads(loss_fn, inputs, **kwargs):
    loss = loss_fn(*inputs, **kwargs)
    grads = torch.autograd.grad(loss, inputs)
    return loss, grads


@pytest.mark.parametrize("dist_impl", [None, "bidir", "shift", "reduce", "gather"])
def test_gamma_zero_equals_open_clip_siglip(dist_impl):
    from open_clip.loss import SigLipLoss

    inputs = _inputs()
    theirs, their_grads = _loss_and_grads(SigLipLoss(dist_impl=dist_impl), inputs)
    ours, our_grads = _loss_and_grads(HNSigLipLoss(dist_impl=dist_impl, gamma=0.0, backend="torch"), inputs)
    assert abs(ours.item() - theirs.item()) < 1e-13
    for a, b in zip(our_grads, their_grads):
        assert (a - b).abs().max().item() < 1e-13


def test_margin_changes_the_loss_and_the_module_is_the_functional_entry():
    inputs = _inputs()
    module = HNSigLipLoss(gamma=0.5, margin="image_text", backend="torch")(*inputs)
    functional = hn_siglip_loss(*inputs, gamma=0.5, margin="image_text", normalize=False, backend="torch")
    assert module.item() == functional.item()
    assert module.item() != HNSigLipLoss(gamma=0.0, backend="torch")(*inputs).item()


def test_one_rank_distributed_entry_is_the_single_process_loss():
    v, t, s, b = _inputs()
    ids = torch.tensor([0, 1, 1, 2, 3, 3])
    neg = torch.randn(3, 8, dtype=torch.float64)
    kw = dict(gamma=0.5, group_ids=ids, negatives=neg, group_mode="positive", backend="torch")
    assert distributed_siglip_loss(v, t, s, b, **kw).item() == hn_siglip_loss(v, t, s, b, **kw).item()


def test_constructor_checks_and_dist_impl():
    with pytest.raises(ValueError, match="dist_impl"):
        HNSigLipLoss(dist_impl="ring")
    with pytest.raises(TypeError, match="cache_labels"):
        HNSigLipLoss(0.0)  # positional: cache_labels, not gamma
    with pytest.raises(ValueError, match="gamma"):
        HNSigLipLoss(gamma=-1.0)
    with pytest.raises(ValueError, match="group_mode"):
        HNSigLipLoss(group_mode="merge")
    with pytest.raises(ValueError, match="rank"):
        HNSigLipLoss(rank=2, world_size=2)
    assert HNSigLipLoss().dist_impl == "bidir" and HNSigLipLoss(dist_impl="shift").dist_impl == "shift"
    assert "dist_impl='gather'" in repr(HNSigLipLoss(dist_impl="gather"))


def test_output_dict_export_and_no_bias():
    v, t, s, _ = _inputs()
    out = HNSigLipLoss(backend="torch")(v, t, s, None, output_dict=True)
    assert set(out) == {"contrastive_loss"} and out["contrastive_loss"].dim() == 0
    assert "HNSigLipLoss" in hnclip_kernels.__all__
    with pytest.raises(ValueError, match="logit_scale"):
        HNSigLipLoss(backend="torch")(v, t, -1.0, None)
