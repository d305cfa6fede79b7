"""``chunked_features`` on a tiny open_clip SigLIP model (``init_logit_bias``, random init, no
download): it returns the model's forward outputs, ``logit_bias`` fourth, and
``HNSigLipLoss(gamma=0)`` on the chunked features equals open_clip's ``SigLipLoss`` on the
unchunked forward in value and every parameter's gradient (float32, 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from hnclip_kernels import HNSigLipLoss, chunked_features

open_clip = pytest.importorskip("open_clip")

N, C, CTX = 7, 3, 16


def siglip_model(seed=0):
    torch.manual_seed(seed)
    return open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=32,
        init_logit_bias=-2.0,
        vision_cfg=dict(image_size=32, patch_size=8, width=32, head_width=16, layers=2, mlp_ratio=2.0),
        text_cfg=dict(context_length=CTX, vocab_size=49408, width=32, heads=2, layers=2, mlp_ratio=2.0),
    ).train()


def test_chunked_siglip_equals_open_clip_siglip_loss():
    from open_clip.loss import SigLipLoss

    g = torch.Generator().manual_seed(1)
    images, texts = torch.randn(N, 3, 32, 32, generator=g), torch.randint(1, 49000, (N, CTX), generator=g)
    texts[:, -1] = 49407
    model = siglip_model()
    out = model(images, texts)
    assert len(out) == 4  # open_clip's SigLIP forward: features, logit_scale.exp(), logit_bias
    theirs = SigLipLoss()(*out)
    their_grads = torch.autograd.grad(theirs, list(model.parameters()), allow_unused=True)
    feats = chunked_features(model, images, texts, C)
    assert len(feats) == 4 and feats[3] is model.logit_bias
    ours = HNSigLipLoss(gamma=0.0, backend="torch")(*feats)
    our_grads = torch.autograd.grad(ours, list(model.parameters()), allow_unused=True)
    assert abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item())
    for (name, _), a, b in zip(model.named_parameters(), our_grads, their_grads):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        assert rel_err(a, b) <= 1e-5 or (a - b).abs().max() <= 1e-7, name
