"""LoRA and DoRA adapters (``peft``) trained through the chunked encoder passes.

A frozen base with adapters is the case where checkpointing can silently train nothing: with
reentrant ``torch.utils.checkpoint`` a chunk whose inputs do not require grad (pixels, token
ids) returns an output without a graph, so the adapters inside it get no gradient
(locuslab/open-unlearning #178). ``hnclip_kernels.chunked`` checkpoints non-reentrantly; these
tests hold it to that:

* a tiny open_clip ViT (``chunked_features``) and a tiny ``CLIPModel`` (``clip_model_loss(
  chunk_size=...)``), in float64, LoRA (``init_lora_weights=False``: B ≠ 0, so A's gradient is
  not 0 either) and DoRA: every adapter parameter's gradient from 11 pairs in chunks of 4 + 4 + 3
  equals the unchunked one within ``assert_close(rtol=1e-10, atol=1e-12)`` (measured: ≤ 4e-15
  absolute, float64 summation order), and every one is nonzero;
* the base stays frozen: ``requires_grad`` False, ``.grad`` None, values bit-identical after an
  AdamW step with weight decay over all the model's parameters;
* LoRA dropout (``lora_dropout``) replays its masks: the chunked gradients equal the same chunks
  run once with grad, same seed;
* the teeth: ``chunked.checkpoint`` patched to ``use_reentrant=True`` gives every adapter a None
  gradient (so a regression to reentrant checkpointing fails the tests above);
* the trainer (``python -m hnclip_kernels.train`` takes no adapters; docs/large_batches.md):
  two plain-SGD steps of ``HNClipTrainer`` on the float64 LoRA ``CLIPModel``, unchunked and
  ``chunk_size=3``: each step's adapter gradients equal and nonzero (same tolerances; measured
  ≤ 4.0e-15), the base bit-identical, every chunk non-reentrant;
* (slow) ``HNClipTrainer(chunk_size=3)`` on a ``PeftModel``: three steps, the unchunked losses and
  adapters, the base unchanged.

Bounds: each default-tier test builds one tiny model (width 32, 2 layers) and runs two or three
forward/backward passes of 11 pairs: about a second each on 2 loaded cores; the trainer test two
models and four steps of 8 pairs, about 3 s (more when the cores are contended).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hnclip_kernels import HNClipLoss, chunked, chunked_features

peft = pytest.importorskip("peft")
open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

from hnclip_kernels.integrations.transformers import HNClipTrainer, clip_model_loss  # noqa: E402

N, C, CTX, VOCAB, L = 11, 4, 16, 99, 7
RTOL, ATOL = 1e-10, 1e-12  # float64: chunked and unchunked differ only in the order of sums
# open_clip's blocks: nn.MultiheadAttention ("attn", peft's LoRA for it; no DoRA) and the MLP's Linears
OC_TARGETS = {False: ["attn", "c_fc", "c_proj"], True: ["c_fc", "c_proj"]}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "visual_projection", "text_projection"]


def lora(model, targets, *, dora=False, dropout=0.0):
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, use_dora=dora, init_lora_weights=False
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def oc_model(dora=False):
    torch.manual_seed(0)
    model = open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=32,
        vision_cfg=dict(image_size=32, patch_size=8, width=32, head_width=16, layers=2, mlp_ratio=2.0),
        text_cfg=dict(context_length=CTX, vocab_size=49408, width=32, heads=2, layers=2, mlp_ratio=2.0),
    )
    return lora(model.double().train(), OC_TARGETS[dora], dora=dora)


def oc_batch():
    g = torch.Generator().manual_seed(1)
    texts = torch.randint(1, 49000, (N, CTX), generator=g)
    texts[torch.arange(N), torch.randint(3, CTX, (N,), generator=g)] = 49407  # EOT: the pooled (argmax) token
    return torch.randn(N, 3, 32, 32, generator=g, dtype=torch.float64), texts


def hf_clip(dtype=torch.float64):
    """A bare tiny CLIPModel (width 32, 2 layers), train mode."""
    tower = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=97, eos_token_id=98, pad_token_id=0, **tower
        ),
        vision_config=dict(image_size=30, patch_size=6, **tower),
        projection_dim=24,
    )
    torch.manual_seed(0)
    return transformers.CLIPModel(config).to(dtype).train()


def hf_model(dora=False, dropout=0.0, dtype=torch.float64):
    return lora(hf_clip(dtype), HF_TARGETS, dora=dora, dropout=dropout)


def hf_batch(n=N, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (n, L), generator=g)
    lengths = torch.randint(3, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids[:, 0] = 97
    ids[torch.arange(n), lengths - 1] = 98
    ids[mask == 0] = 0
    return ids, torch.randn(n, 3, 30, 30, generator=g, dtype=dtype), mask


def oc_step(model, batch, chunk):
    images, texts = batch
    if chunk:
        img, txt, scale = chunked_features(model, images, texts, chunk)
    else:
        img, txt, scale = model.encode_image(images, True), model.encode_text(texts, True), model.logit_scale.exp()
    return HNClipLoss(gamma=0.5)(img, txt, scale)


def hf_step(model, batch, chunk, by_hand=False):
    ids, pixels, mask = batch
    if not by_hand:
        return clip_model_loss(model, ids, pixels, mask, gamma=0.5, chunk_size=chunk)
    # the same chunks run once with grad, nothing recomputed
    img = torch.cat(
        [model.get_image_features(pixel_values=pixels[i : i + chunk]).pooler_output for i in range(0, N, chunk)]
    )
    txt = torch.cat(
        [
            model.get_text_features(input_ids=ids[i : i + chunk], attention_mask=mask[i : i + chunk]).pooler_output
            for i in range(0, N, chunk)
        ]
    )
    return HNClipLoss(gamma=0.5, normalize=True)(img, txt, model.logit_scale.exp())


def grads(model, step, batch, chunk, seed=0, **kw):
    """{name: grad} of every parameter after one step's backward (None where none came)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    step(model, batch, chunk, **kw).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def adapters(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


def assert_adapter_grads_equal(got, want, names):
    for name in names:
        assert want[name] is not None and want[name].abs().max() > 0, f"{name}: no gradient unchunked"
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def assert_base_frozen_through_a_step(model, step, batch):
    """requires_grad False and .grad None on the base; an AdamW step with weight decay over all
    parameters moves every adapter and no base weight."""
    base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert base and trained and not any("lora" in name for name in base)
    assert all("lora" in name for name in trained), sorted(trained)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.zero_grad(set_to_none=True)
    step(model, batch, C).backward()
    assert all(p.grad is None for name, p in model.named_parameters() if name in base)
    optimizer.step()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[name], value) for name, value in base.items())
    assert all(not torch.equal(params[name], value) for name, value in trained.items())


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_open_clip_adapters_get_the_unchunked_gradients(dora):
    model, batch = oc_model(dora), oc_batch()
    names = adapters(model)
    # 4 blocks × (A, B, DoRA's magnitude) of c_fc, c_proj; LoRA: A, B of c_fc, c_proj, attn's in_proj and out_proj
    assert len(names) == 4 * (3 * 2 if dora else 2 * 4)
    want = grads(model, oc_step, batch, None)
    got = grads(model, oc_step, batch, C)
    assert_adapter_grads_equal(got, want, names)
    assert_base_frozen_through_a_step(model, oc_step, batch)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_clip_model_adapters_get_the_unchunked_gradients(dora):
    model, batch = hf_model(dora), hf_batch()
    names = adapters(model)
    assert len(names) == (3 if dora else 2) * (
        6 * 2 * 2 + 2
    )  # (A, B[, magnitude]) × (6 Linears × 4 layers + 2 projections)
    want = grads(model, hf_step, batch, None)
    got = grads(model, hf_step, batch, C)
    assert_adapter_grads_equal(got, want, names)
    assert_base_frozen_through_a_step(model, hf_step, batch)


def test_lora_dropout_masks_are_replayed(monkeypatch):
    """lora_dropout 0.3: the chunked gradients are those of the same chunks run once (same seed);
    without the RNG replay the recompute draws other masks and they are not."""
    model, batch = hf_model(dropout=0.3), hf_batch()
    names = adapters(model)
    want = grads(model, hf_step, batch, C, by_hand=True)
    assert_adapter_grads_equal(grads(model, hf_step, batch, C), want, names)
    other_seed = grads(model, hf_step, batch, C, seed=1, by_hand=True)
    assert max((other_seed[n] - want[n]).abs().max() for n in names) > 1e-3
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(chunked, "checkpoint", lambda fn, *a, **k: real(fn, *a, **{**k, "preserve_rng_state": False}))
    unreplayed = grads(model, hf_step, batch, C)
    assert max((unreplayed[n] - want[n]).abs().max() for n in names) > 1e-3


@pytest.mark.parametrize("kind", ["open_clip", "CLIPModel"])
def test_reentrant_checkpointing_would_train_no_adapter(kind, monkeypatch):
    """The regression these tests catch: reentrant checkpointing of a chunk whose inputs need no
    grad returns a graph-less output, so every adapter's gradient is None. (logit_scale is
    trained here so that the loss still has a graph: with everything outside the chunks frozen,
    backward raises instead.)"""
    model, batch, step = (oc_model(), oc_batch(), oc_step) if kind == "open_clip" else (hf_model(), hf_batch(), hf_step)
    model.logit_scale.requires_grad_(True)
    names = adapters(model)
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(chunked, "checkpoint", lambda fn, *a, **k: real(fn, *a, **{**k, "use_reentrant": True}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "None of the inputs have requires_grad=True"
        got = grads(model, step, batch, C)
    assert got["base_model.model.logit_scale"] is not None
    assert all(got[n] is None for n in names if n != "base_model.model.logit_scale")


class HFPairs(torch.utils.data.Dataset):
    def __init__(self, n=8, dtype=torch.float32):
        self.ids, self.pixels, self.mask = hf_batch(n, dtype=dtype, seed=3)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return dict(input_ids=self.ids[i], pixel_values=self.pixels[i], attention_mask=self.mask[i])


class AdapterGrads(transformers.TrainerCallback):
    """Each optimizer step's gradients of the trained parameters, as the optimizer sees them."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        params = self.model.named_parameters()
        self.steps.append({name: None if p.grad is None else p.grad.clone() for name, p in params if p.requires_grad})


def test_hn_clip_trainer_chunked_steps_give_a_peft_model_the_unchunked_adapters(tmp_path, monkeypatch):
    """The trainer path (python -m hnclip_kernels.train takes no adapters: docs/large_batches.md):
    two plain-SGD steps of HNClipTrainer on a float64 LoRA CLIPModel (logit_scale trained too, as
    docs/large_batches.md shows), 8 pairs a step, unchunked and chunk_size=3 (3 + 3 + 2) from the same
    initialisation and data. Each step's gradient of every adapter (the optimizer's view, no
    clipping) is nonzero and equals the unchunked one within rtol 1e-10, atol 1e-12 (measured
    ≤ 4e-15), the adapters after the steps too; the base is bit-identical; the chunks ran under
    non-reentrant checkpointing (reentrant: every adapter's gradient None, which fails here)."""
    from transformers import TrainingArguments

    real, modes = torch.utils.checkpoint.checkpoint, []
    monkeypatch.setattr(
        chunked, "checkpoint", lambda fn, *a, **k: modes.append(k["use_reentrant"]) or real(fn, *a, **k)
    )

    def run(**kw):
        model = hf_model()
        model.logit_scale.requires_grad_(True)
        base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, optim="sgd", learning_rate=1e-2,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, warmup_steps=0, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        grads = AdapterGrads(model)
        dataset = HFPairs(dtype=torch.float64)
        HNClipTrainer(model=model, args=args, train_dataset=dataset, gamma=0.5, callbacks=[grads], **kw).train()
        params = dict(model.named_parameters())
        assert all(torch.equal(params[name], value) for name, value in base.items()), "a base weight moved"
        return grads.steps, {name: p.detach().clone() for name, p in params.items() if p.requires_grad}

    plain_grads, plain = run()
    assert modes == []  # unchunked: nothing checkpointed
    got_grads, got = run(chunk_size=3)
    names = list(plain)  # the adapters (A, B of 6 Linears × 4 layers + 2 projections) and logit_scale
    assert len(names) == 2 * (6 * 2 * 2 + 2) + 1 and sum("lora_" in name for name in names) == len(names) - 1
    assert len(plain_grads) == len(got_grads) == 2
    for want, have in zip(plain_grads, got_grads):
        assert_adapter_grads_equal(have, want, names)
    assert_adapter_grads_equal(got, plain, names)
    assert modes == [False] * 2 * 2 * 3  # 2 steps × 2 towers × 3 chunks, none reentrant


@pytest.mark.slow
def test_hn_clip_trainer_trains_a_peft_model_chunked(tmp_path):
    """3 steps of HNClipTrainer on a PeftModel, batch 8 in chunks of 3: the unchunked losses and
    adapters (float32: losses to 1e-5 relative, adapters to 1e-5 absolute), the base unchanged."""
    from transformers import TrainingArguments

    def run(**kw):
        model = hf_model(dtype=torch.float32)
        base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=3e-3,
            warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = HNClipTrainer(model=model, args=args, train_dataset=HFPairs(), gamma=0.5, **kw)
        trainer.train()
        params = dict(model.named_parameters())
        assert all(torch.equal(params[name], value) for name, value in base.items())
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        return losses, {name: p.detach().clone() for name, p in params.items() if p.requires_grad}

    plain, plain_adapters = run()
    losses, got = run(chunk_size=3)
    assert len(plain) == 3 and plain[0] != plain[-1]
    assert losses == pytest.approx(plain, rel=1e-5)
    # AdamW's step is about lr·sign(g) where |g| is small: float32 rounding of the chunked sums
    # moves such elements by a few 1e-6 after 3 steps (lr 3e-3): atol 1e-5, 0.3% of one step
    worst = max((got[name] - value).abs().max().item() for name, value in plain_adapters.items())
    assert worst <= 1e-5, worst


def test_open_clip_out_proj_alone_trains_nothing():
    """docs/large_batches.md's target advice: nn.MultiheadAttention's forward reads
    ``out_proj.weight`` itself, so a LoRA on open_clip's ``out_proj`` alone is never called
    (target "attn", peft's LoRA for the whole attention)."""
    torch.manual_seed(0)
    model = open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=32,
        vision_cfg=dict(image_size=32, patch_size=8, width=32, head_width=16, layers=2, mlp_ratio=2.0),
        text_cfg=dict(context_length=CTX, vocab_size=49408, width=32, heads=2, layers=2, mlp_ratio=2.0),
    )
    model = lora(model, ["out_proj"])
    images, _ = oc_batch()
    assert adapters(model)
    assert not model.encode_image(images.float(), normalize=True).requires_grad


def test_modules_to_save_leaves_logit_scale_frozen():
    """docs/large_batches.md: logit_scale is a bare parameter; peft's modules_to_save names modules,
    so ``modules_to_save=["logit_scale"]`` trains nothing more (requires_grad_ does)."""
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["logit_scale"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(hf_clip(), config)
    assert not model.logit_scale.requires_grad
    model.logit_scale.requires_grad_(True)
    assert any(name.endswith("logit_scale") for name in adapters(model))
