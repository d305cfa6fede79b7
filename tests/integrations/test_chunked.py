"""``hnclip_kernels.chunked_encode`` / ``chunked_features`` and ``clip_model_loss(chunk_size=...)``.

Tiny random-init towers (open_clip ViT of width 32 with patch and attention dropout, a 2-layer
``CLIPConfig`` with attention dropout), 11 pairs, chunks of 4 (4 + 4 + 3: a chunk that does not
divide the batch). Every parameter's gradient, ``logit_scale`` included, is compared at 1e-5
relative in float32 against (a) the unchunked step without dropout and (b) with dropout, the
same chunks run once with grad and nothing recomputed (same seed, same order). One spawn of 2
gloo ranks checks DDP (one all-reduce per bucket per step) and FSDP2 (``fully_shard``, with the
save/load round trip of ``hnclip_kernels.sharding``).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from helpers import rel_err, spawn_gloo_ranks
from hnclip_kernels import HNClipLoss, chunked, chunked_encode, chunked_features
from hnclip_kernels.sharding import unsqueeze_scalar_parameters

open_clip = pytest.importorskip("open_clip")

N, C, CTX = 11, 4, 16
TOL = 1e-5


def oc_model(dropout: bool, seed=0):
    torch.manual_seed(seed)
    model = open_clip.create_model(
        "ViT-B-32",
        pretrained=None,
        embed_dim=32,
        vision_cfg=dict(
            image_size=32,
            patch_size=8,
            width=32,
            head_width=16,
            layers=2,
            mlp_ratio=2.0,
            patch_dropout=0.5 if dropout else 0.0,
        ),
        text_cfg=dict(context_length=CTX, vocab_size=49408, width=32, heads=2, layers=2, mlp_ratio=2.0),
    )
    if dropout:  # open_clip's blocks are nn.MultiheadAttention, dropout 0 by default
        for m in model.modules():
            if isinstance(m, torch.nn.MultiheadAttention):
                m.dropout = 0.25
    return model.train()


def oc_batch(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    texts = torch.randint(1, 49000, (n, CTX), generator=g)
    texts[torch.arange(n), torch.randint(3, CTX, (n,), generator=g)] = 49407  # EOT: the pooled (argmax) token
    return torch.randn(n, 3, 32, 32, generator=g), texts


def groups(model, grads=None):
    """{group: {name: grad}}: the image tower, the text side (all the rest), logit_scale; the
    gradients from ``grads`` ({name: grad}) where given, else from ``.grad``."""
    out = {"image tower": {}, "text tower": {}, "logit_scale": {}}
    for name, p in model.named_parameters():
        grad = p.grad if grads is None else grads.get(name)
        if grad is None:
            continue
        key = (
            "logit_scale"
            if name == "logit_scale"
            else "image tower"
            if name.startswith(("visual", "vision"))
            else "text tower"
        )
        out[key][name] = grad.detach().clone()
    return out


# CLIPModel's k_proj biases: softmax is invariant to a constant per query, so their exact gradient is 0
# and both sides hold float32 rounding noise (~1e-9); they are measured against their group's norm
ZERO_GRAD = "self_attn.k_proj.bias"


def worst(got, want):
    """{group: worst relative error over its parameters}; every parameter of want must be in got."""
    res = {}
    for key, params in want.items():
        assert set(got[key]) == set(params), key
        total = torch.cat([g.reshape(-1) for g in params.values()]).norm() if params else None
        res[key] = max(
            (
                rel_err(got[key][n], g) if ZERO_GRAD not in n else (got[key][n] - g).norm().item() / total.item()
                for n, g in params.items()
            ),
            default=0.0,
        )
    return res


def assert_worst(got, want, tol=TOL):
    errs = worst(got, want)
    assert want["logit_scale"], "logit_scale got no gradient"
    assert all(e <= tol for e in errs.values()), errs
    return errs


def oc_step(model, images, texts, chunk, *, seed=0, by_hand=False, lit=False):
    """One HN-CLIP (γ = 0.5) forward and backward; ``by_hand``: the chunks run once with grad, unrecomputed."""
    torch.manual_seed(seed)
    loss_fn = HNClipLoss(gamma=0.5)
    if lit:  # frozen image tower, LiT-style
        with torch.no_grad():
            img = (
                chunked_encode(lambda x: model.encode_image(x, normalize=True), images, chunk)
                if chunk
                else model.encode_image(images, normalize=True)
            )
        txt = (
            chunked_encode(lambda x: model.encode_text(x, normalize=True), texts, chunk)
            if chunk
            else model.encode_text(texts, normalize=True)
        )
        scale = model.logit_scale.exp()
    elif by_hand:
        img = torch.cat(
            [model.encode_image(images[i : i + chunk], normalize=True) for i in range(0, len(images), chunk)]
        )
        txt = torch.cat([model.encode_text(texts[i : i + chunk], normalize=True) for i in range(0, len(texts), chunk)])
        scale = model.logit_scale.exp()
    elif chunk:
        img, txt, scale = chunked_features(model, images, texts, chunk)
    else:
        img, txt, scale = model(images, texts)
    loss = loss_fn(img, txt, scale)
    loss.backward()
    return loss.detach(), groups(model)


def _no_rng_replay(monkeypatch):
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(chunked, "checkpoint", lambda fn, *a, **k: real(fn, *a, **{**k, "preserve_rng_state": False}))


# ----------------------------------------------------------------------------- open_clip


def test_open_clip_no_dropout_equals_unchunked():
    images, texts = oc_batch()
    model = oc_model(dropout=False)
    ref_loss, ref = oc_step(copy.deepcopy(model), images, texts, None)
    loss, got = oc_step(model, images, texts, C)
    assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
    assert_worst(got, ref)


def test_open_clip_dropout_replays_the_masks(monkeypatch):
    images, texts = oc_batch()
    model = oc_model(dropout=True)
    ref_loss, ref = oc_step(copy.deepcopy(model), images, texts, C, by_hand=True)
    loss, got = oc_step(copy.deepcopy(model), images, texts, C)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=TOL)
    assert_worst(got, ref)
    # the comparison sees the masks: another seed's masks, or a recompute that draws new ones, differ
    _, other_seed = oc_step(copy.deepcopy(model), images, texts, C, by_hand=True, seed=1)
    assert min(worst(other_seed, ref).values()) > 1e-3
    _no_rng_replay(monkeypatch)
    _, unreplayed = oc_step(copy.deepcopy(model), images, texts, C)
    assert max(worst(unreplayed, ref).values()) > 1e-2


def test_open_clip_frozen_image_tower():
    images, texts = oc_batch()
    model = oc_model(dropout=False)
    _, ref = oc_step(copy.deepcopy(model), images, texts, None, lit=True)
    _, got = oc_step(model, images, texts, C, lit=True)
    assert not ref["image tower"] and not got["image tower"]
    assert_worst(got, ref)
    # locked parameters (requires_grad=False) under grad mode: checkpointed chunks with nothing to recompute
    locked = oc_model(dropout=False)
    locked.lock_image_tower()
    _, got_locked = oc_step(locked, images, texts, C)
    assert not got_locked["image tower"]
    assert_worst(got_locked, ref)


def test_inference_mode_tower_gives_the_unchunked_features():
    images, _ = oc_batch()
    model = oc_model(dropout=False).eval()
    with torch.inference_mode():
        got = chunked_encode(model.encode_image, images, C)
        want = model.encode_image(images)
    assert rel_err(got, want) <= TOL


def test_open_clip_autocast_bf16_within_bf16_bounds():
    images, texts = oc_batch()
    model = oc_model(dropout=False)
    _, truth = oc_step(copy.deepcopy(model), images, texts, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, plain = oc_step(copy.deepcopy(model), images, texts, None)
        _, got = oc_step(copy.deepcopy(model), images, texts, C)
    plain_err, got_err = worst(plain, truth), worst(got, truth)
    for key in truth:  # the chunked bf16 step is as close to float32 as the unchunked bf16 step
        assert got_err[key] <= 2 * plain_err[key] + 2e-3, (key, got_err, plain_err)
    assert max(got_err.values()) > 0  # autocast ran


@pytest.mark.parametrize("chunk", [1, N - 1, N, 100])
def test_every_chunk_size_gives_the_same_features(chunk):
    images, texts = oc_batch()
    model = oc_model(dropout=False)
    want = model.encode_text(texts)
    got = chunked_encode(model.encode_text, texts, chunk)
    assert got.shape == want.shape and rel_err(got, want) <= TOL


def test_tuple_and_dict_inputs_and_none_values():
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    lin = torch.nn.Linear(5, 4)

    def enc(a, b, mask=None):
        assert mask is None
        return lin(torch.cat([a, b], 1))

    want = enc(x, y)
    assert rel_err(chunked_encode(enc, (x, y), 3), want) <= TOL
    assert rel_err(chunked_encode(enc, dict(a=x, b=y, mask=None), 3), want) <= TOL


@pytest.mark.parametrize(
    "bad, exc",
    [
        (0, ValueError),
        (-2, ValueError),
        (True, TypeError),
        (2.0, TypeError),
        (1.5, TypeError),
        ("4", TypeError),
        (None, TypeError),
    ],
)
def test_bad_chunk_sizes_raise_naming_chunk_size(bad, exc):
    with pytest.raises(exc, match="chunk_size"):
        chunked_encode(torch.nn.Identity(), torch.randn(4, 2), bad)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="same batch size"):
        chunked_encode(lambda a, b: a, (torch.randn(4, 2), torch.randn(5, 2)), 2)
    with pytest.raises(TypeError, match="inputs must be"):
        chunked_encode(lambda a: a, "text", 2)
    with pytest.raises(TypeError, match="must return a tensor"):
        chunked_encode(lambda a: (a,), torch.randn(4, 2), 2)


def test_encoder_output_without_one_row_per_input_row_raises():
    # a batch-pooled output (one row per call) would be cat'ed chunk by chunk into 3 rows for 7
    # inputs, silently; a 0-dim one would fail in torch.cat without naming the encoder
    x = torch.randn(7, 2)
    for encoder in (lambda a: a.mean(0, keepdim=True), lambda a: a.sum(), lambda a: a[:-1]):
        for chunk in (3, 7):  # several chunks, and one chunk (the encoder called once, plainly)
            with pytest.raises(ValueError, match=r"encoder must return one row per input row, got shape"):
                chunked_encode(encoder, x, chunk)


def _step_grads(step, encoder, x, seed=0):
    encoder.zero_grad()
    torch.manual_seed(seed)
    loss = step(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in encoder.parameters()]


def test_compiles_as_one_graph_without_breaks():
    # Dynamo traces grad mode (no graph break, no is_inference_mode_enabled() call), and the compiled
    # step (fullgraph, aot_eager: AOT replays the checkpointed chunks' dropout masks) gives the eager
    # chunked step's loss and gradients; under no_grad / inference_mode the plain chunks run
    torch._dynamo.reset()
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    x = torch.randn(10, 8)

    def step(x):
        return chunked_encode(encoder, x, 3).square().sum()

    explained = torch._dynamo.explain(step)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    (got, got_grads), (want, want_grads) = _step_grads(compiled, encoder, x), _step_grads(step, encoder, x)
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= TOL
    encoder.eval()
    with torch.no_grad():
        assert rel_err(compiled(x), step(x)) <= TOL
    with torch.inference_mode():
        assert rel_err(compiled(x), step(x)) <= TOL


# ----------------------------------------------------------------------------- Hugging Face CLIPModel

VOCAB, L = 99, 7


def hf_model(dropout: bool, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=97,
            eos_token_id=98,
            pad_token_id=0,
            attention_dropout=0.25 if dropout else 0.0,
        ),
        vision_config=dict(
            image_size=30,
            patch_size=6,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            attention_dropout=0.25 if dropout else 0.0,
        ),
        projection_dim=24,
    )
    torch.manual_seed(seed)
    return transformers.CLIPModel(cfg).train()


def hf_batch(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (n, L), generator=g)
    lengths = torch.randint(3, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids[:, 0] = 97
    ids[torch.arange(n), lengths - 1] = 98
    ids[mask == 0] = 0
    return ids, torch.randn(n, 3, 30, 30, generator=g), mask


def hf_step(model, batch, chunk, *, seed=0, by_hand=False):
    from hnclip_kernels.integrations.transformers import clip_model_loss

    ids, pixels, mask = batch
    torch.manual_seed(seed)
    if by_hand:
        img = torch.cat(
            [model.get_image_features(pixel_values=pixels[i : i + chunk]).pooler_output for i in range(0, N, chunk)]
        )
        txt = torch.cat(
            [
                model.get_text_features(input_ids=ids[i : i + chunk], attention_mask=mask[i : i + chunk]).pooler_output
                for i in range(0, N, chunk)
            ]
        )
        loss = HNClipLoss(gamma=0.5, normalize=True)(img, txt, model.logit_scale.exp())
    else:
        loss = clip_model_loss(model, ids, pixels, mask, gamma=0.5, chunk_size=chunk)
    loss.backward()
    return loss.detach(), groups(model)


def test_clip_model_no_dropout_equals_unchunked():
    model, batch = hf_model(dropout=False), hf_batch()
    ref_loss, ref = hf_step(copy.deepcopy(model), batch, None)
    loss, got = hf_step(model, batch, C)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=TOL)
    assert_worst(got, ref)


def test_clip_model_attention_dropout_replays_the_masks(monkeypatch):
    model, batch = hf_model(dropout=True), hf_batch()
    _, ref = hf_step(copy.deepcopy(model), batch, C, by_hand=True)
    _, got = hf_step(copy.deepcopy(model), batch, C)
    assert_worst(got, ref)
    _, other_seed = hf_step(copy.deepcopy(model), batch, C, by_hand=True, seed=1)
    assert max(worst(other_seed, ref).values()) > 1e-3
    _no_rng_replay(monkeypatch)
    _, unreplayed = hf_step(copy.deepcopy(model), batch, C)
    assert max(worst(unreplayed, ref).values()) > 1e-3


def test_clip_model_frozen_vision_tower():
    model, batch = hf_model(dropout=False), hf_batch()
    for part in (model.vision_model, model.visual_projection):
        part.requires_grad_(False)
    _, ref = hf_step(copy.deepcopy(model), batch, None)
    _, got = hf_step(model, batch, C)
    assert not got["image tower"] and got["text tower"]
    assert_worst(got, ref)


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (False, TypeError)])
def test_clip_model_loss_and_trainer_refuse_bad_chunk_sizes(bad, exc, tmp_path):
    from transformers import TrainingArguments

    from hnclip_kernels.integrations.transformers import HNClipTrainer, clip_model_loss

    with pytest.raises(exc, match="chunk_size"):
        clip_model_loss(hf_model(dropout=False), *hf_batch(), chunk_size=bad)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(exc, match="chunk_size"):
        HNClipTrainer(model=hf_model(dropout=False), args=args, chunk_size=bad)


class HFPairs(torch.utils.data.Dataset):
    """n (input_ids, pixel_values, attention_mask) pairs of hf_batch, a Trainer's train_dataset."""

    def __init__(self, n=8):
        self.ids, self.pixels, self.mask = hf_batch(n, seed=3)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return dict(input_ids=self.ids[i], pixel_values=self.pixels[i], attention_mask=self.mask[i])


def test_hn_clip_trainer_chunked_steps_equal_unchunked(tmp_path):
    """3 optimizer steps of one contrastive batch of 8 in chunks of 3: the unchunked run's losses."""
    from transformers import TrainingArguments

    from hnclip_kernels.integrations.transformers import HNClipTrainer

    def run(**kw):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            warmup_steps=0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = HNClipTrainer(model=hf_model(dropout=False), args=args, train_dataset=HFPairs(), gamma=0.5, **kw)
        trainer.train()
        return [row["loss"] for row in trainer.state.log_history if "loss" in row], trainer

    plain, _ = run()
    chunked_losses, trainer = run(chunk_size=3)
    assert trainer.hn_options["chunk_size"] == 3
    assert len(plain) == 3 and plain[0] != plain[-1]
    assert chunked_losses == pytest.approx(plain, rel=1e-5)


# ----------------------------------------------------------------------------- 2 gloo ranks: DDP and FSDP2

SIZES = (6, 5)


def _counting_allreduce(counter):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        counter.append(bucket.index())
        return allreduce_hook(None, bucket)

    return hook


def _ddp_open_clip(rank, world, report):
    """train.py's chunked forward inside DDP: averaged gradients = one process on the 11 pairs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hnclip_kernels.train import _chunked_forward

    images, texts = oc_batch()
    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    loss_fn = HNClipLoss(gamma=0.5, local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    for name, chunk in (("unchunked", None), ("chunked", C)):
        model = oc_model(dropout=False)
        ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets: each must be all-reduced once
        calls = []
        ddp.register_comm_hook(None, _counting_allreduce(calls))
        if chunk:
            model.forward = functools.partial(_chunked_forward, model, chunk)
        img, txt, scale = ddp(images[rows], texts[rows])
        loss_fn(img, txt, scale).backward()
        report[f"oc_{name}"] = {k: {n: g.numpy() for n, g in v.items()} for k, v in groups(model).items()}
        report[f"oc_{name}_allreduces"] = calls


def _hf_wrapped(rank, world, report, out_dir):
    """clip_model_loss through DDP and through FSDP2 (fully_shard, logit_scale made (1,) by
    unsqueeze_scalar_parameters), chunked or not; the chunked FSDP2 model, after an SGD step,
    saved by rank 0 with its scalars squeezed back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hnclip_kernels.integrations.transformers import clip_model_loss
    from hnclip_kernels.sharding import squeeze_scalar_parameters, unsqueeze_scalar_parameters

    ids, pixels, mask = hf_batch()
    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    for name, chunk in (("unchunked", None), ("chunked", C)):
        for kind in ("ddp", "fsdp2"):
            model = hf_model(dropout=False)
            names = unsqueeze_scalar_parameters(model)  # fully_shard refuses 0-dim parameters
            wrapped = DDP(model) if kind == "ddp" else fully_shard(model)
            clip_model_loss(wrapped, ids[rows], pixels[rows], mask[rows], gamma=0.5, chunk_size=chunk).backward()
            out = {}
            for key, params in groups(model).items():
                out[key] = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).numpy() for n, g in params.items()}
            report[f"hf_{kind}_{name}"] = out
            if kind == "fsdp2" and chunk:
                try:  # the sharded state dict holds DTensors: refused, naming the fix
                    squeeze_scalar_parameters(model.state_dict(), names)
                except TypeError as exc:
                    report["sharded_state_error"] = str(exc)
                torch.optim.SGD(model.parameters(), lr=0.5).step()
                report["fsdp2_trained_scale"] = model.logit_scale.full_tensor().detach().numpy()
                options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, the rest {}
                state = get_model_state_dict(model, options=options)
                if rank == 0:
                    model.save_pretrained(out_dir, state_dict=squeeze_scalar_parameters(state, names))


def _rank(rank, world, out_dir):
    report = {}
    _ddp_open_clip(rank, world, report)
    _hf_wrapped(rank, world, report, out_dir)
    return report


def _as_torch(report):
    return {k: {n: torch.from_numpy(g) for n, g in v.items()} for k, v in report.items()}


def test_two_gloo_ranks_ddp_and_fsdp2(tmp_path):
    """2 ranks of 6 and 5 pairs, local_loss + gather_with_grad: chunked = unchunked = one process on all 11,
    for open_clip under DDP (each bucket all-reduced once a step, as unchunked) and CLIPModel under DDP
    and FSDP2; the FSDP2 model's trained logit_scale round-trips save_pretrained / from_pretrained."""
    saved = tmp_path / "fsdp2_clip"
    reports = spawn_gloo_ranks(_rank, tmp_path, str(saved), timeout=240)
    images, texts = oc_batch()
    _, oc_single = oc_step(oc_model(dropout=False), images, texts, None)
    hf_single_model = hf_model(dropout=False)
    unsqueeze_scalar_parameters(hf_single_model)
    _, hf_single = hf_step(hf_single_model, hf_batch(), None)
    for rank in (0, 1):
        report = reports[rank]
        assert report["oc_chunked_allreduces"] == report["oc_unchunked_allreduces"]
        assert len(set(report["oc_chunked_allreduces"])) == len(report["oc_chunked_allreduces"]) >= 1
        for name in ("unchunked", "chunked"):
            assert_worst(_as_torch(report[f"oc_{name}"]), oc_single)
            for kind in ("ddp", "fsdp2"):
                assert_worst(_as_torch(report[f"hf_{kind}_{name}"]), hf_single)
    # the trained (1,) logit_scale, saved 0-dim, loads into the unmodified CLIPModel bit for bit
    from transformers import CLIPModel

    assert "full_state_dict=True" in reports[0]["sharded_state_error"]
    trained = reports[0]["fsdp2_trained_scale"]
    assert trained.tobytes() == reports[1]["fsdp2_trained_scale"].tobytes()
    assert trained.item() != hf_model(dropout=False).logit_scale.item()
    back = CLIPModel.from_pretrained(str(saved)).logit_scale.detach()
    assert back.shape == () and back.numpy().tobytes() == trained.tobytes()
