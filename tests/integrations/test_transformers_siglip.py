"""A tiny ``transformers.SiglipModel`` (local ``SiglipConfig``, no download) through
``clip_model_loss`` and ``HNClipTrainer``: the sigmoid loss with the model's logit_scale and
logit_bias; at γ = 0 its own ``return_loss=True`` loss and every parameter's gradient."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from hnclip_kernels.integrations.transformers import HNClipTrainer, clip_model_loss  # noqa: E402

N, L, VOCAB = 6, 8, 50


def tiny_siglip(seed=0):
    from transformers import SiglipConfig, SiglipModel

    config = SiglipConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=L, projection_size=32),
        vision_config=dict(image_size=24, patch_size=6, hidden_size=32, intermediate_size=37,
                           num_hidden_layers=2, num_attention_heads=2),
    )  # fmt: skip
    torch.manual_seed(seed)
    return SiglipModel(config).eval()


def batch(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, L), generator=g), torch.randn(n, 3, 24, 24, generator=g)


def test_gamma_zero_equals_the_models_own_loss_and_gradients():
    model = tiny_siglip().double()
    with torch.no_grad():
        model.logit_bias.fill_(-2.0)  # a bias that matters (the initial -10 drowns the positives)
    ids, pixels = batch()
    theirs = model(input_ids=ids, pixel_values=pixels.double(), return_loss=True).loss
    their_grads = torch.autograd.grad(theirs, list(model.parameters()))
    ours = clip_model_loss(model, ids, pixels.double(), gamma=0.0, backend="torch")
    our_grads = torch.autograd.grad(ours, list(model.parameters()))
    assert abs(ours.item() - theirs.item()) < 1e-12
    named = [name for name, _ in model.named_parameters()]
    for name, a, b in zip(named, our_grads, their_grads):
        assert (a - b).abs().max().item() <= 1e-10 * (1 + b.abs().max().item()), name
    assert our_grads[named.index("logit_bias")].abs().item() > 1e-3


def test_margin_group_ids_and_refused_options():
    model = tiny_siglip()
    ids, pixels = batch()
    plain = clip_model_loss(model, ids, pixels, gamma=0.0, backend="torch")
    assert clip_model_loss(model, ids, pixels, gamma=0.5, backend="torch").item() != plain.item()
    groups = torch.tensor([0, 0, 1, 2, 3, 4])
    masked = clip_model_loss(model, ids, pixels, gamma=0.0, backend="torch", group_ids=groups)
    positive = clip_model_loss(model, ids, pixels, gamma=0.0, backend="torch", group_ids=groups,
                               group_mode="positive")  # fmt: skip
    assert len({plain.item(), masked.item(), positive.item()}) == 3
    with pytest.raises(ValueError, match="label_smoothing"):
        clip_model_loss(model, ids, pixels, label_smoothing=0.1)
    with pytest.raises(ValueError, match="group_mode"):
        clip_model_loss(model, ids, pixels, group_mode="merge", backend="torch")


class PairData(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids, self.pixels = batch(n, seed=2)

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "pixel_values": self.pixels[i]}


def test_trainer_trains_a_siglip_model(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=8,
                             learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to="none",
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    trainer = HNClipTrainer(model=tiny_siglip().train(), args=args, train_dataset=PairData(8), gamma=0.5,
                            backend="torch")  # fmt: skip
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
