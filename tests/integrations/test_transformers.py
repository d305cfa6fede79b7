"""``hnclip_kernels.integrations.transformers`` on a tiny ``CLIPConfig`` (CPU, no download).

Bounds: each test builds a 2-layer CLIP of width 32 in well under a second; the Trainer runs 6
steps of batch 8 (a few seconds); the 2-process gloo run spawns two interpreters that import
torch and transformers (about 15–30 s on 2 loaded cores, killed after 120 s).
"""

from __future__ import annotations

import copy
import math
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from helpers import hn_clip_loss_f64, rel_err, spawn_gloo_ranks  # noqa: E402
from hnclip_kernels import HNClipLoss  # noqa: E402
from hnclip_kernels.backends import cpp_directional  # noqa: E402
from hnclip_kernels.integrations.transformers import HNClipTrainer, clip_model_loss  # noqa: E402

N, L, VOCAB = 11, 7, 99  # N differs from every model dimension, so an (N, N) shape is the logits
BOS, EOS, PAD = 97, 98, 0
HAS_CPP = cpp_directional() is not None
FUSED = ["cpp", "triton"] if HAS_CPP else ["triton"]
# k_proj biases: softmax is invariant to a constant per query, so their exact gradient is 0 and
# both sides hold float32 rounding noise (~1e-8); they are checked against the whole gradient's norm
ZERO_GRAD = "self_attn.k_proj.bias"


def tiny_config():
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
        ),
        vision_config=dict(
            image_size=30,
            patch_size=6,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
        ),
        projection_dim=24,
    )


def tiny_model(seed=0):
    from transformers import CLIPModel

    torch.manual_seed(seed)
    return CLIPModel(tiny_config()).eval()


def batch(n=N, seed=1):
    """Token ids with BOS … EOS and padding of varied lengths (the pooled EOS moves), and images."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, BOS, (n, L), generator=g)
    lengths = torch.randint(3, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids[:, 0] = BOS
    ids[torch.arange(n), lengths - 1] = EOS
    ids[mask == 0] = PAD
    return ids, torch.randn(n, 3, 30, 30, generator=g), mask


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_grads_close(got, want, tol):
    total = torch.cat([g.reshape(-1) for g in want.values()]).norm().item()
    for name, expected in want.items():
        if ZERO_GRAD in name:
            assert (got[name] - expected).norm().item() <= 1e-6 * total, name
        else:
            err = rel_err(got[name], expected)
            assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("backend", ["torch", *FUSED])
def test_gamma0_equals_clip_model_loss_and_every_gradient(backend):
    """γ = 0, one process: the loss and every parameter's gradient are CLIPModel(return_loss=True)'s."""
    model = tiny_model()
    ids, pixels, mask = batch()
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    expected = ref(input_ids=ids, pixel_values=pixels, attention_mask=mask, return_loss=True).loss
    expected.backward()
    loss = clip_model_loss(ours, ids, pixels, mask, gamma=0.0, backend=backend)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
    assert ours.logit_scale.grad.item() != 0
    assert_grads_close(grads(ours), grads(ref), 1e-5)


@pytest.mark.parametrize("backend", FUSED)
def test_margin_and_smoothing_match_float64_formula(backend):
    """γ = 0.5, ε = 0.1: the loss and every gradient of a float64 evaluation of Eq. 2 on the model."""
    model = tiny_model()
    ids, pixels, mask = batch()
    ref = copy.deepcopy(model).double()
    img = ref.get_image_features(pixel_values=pixels.double()).pooler_output
    txt = ref.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    expected = hn_clip_loss_f64(img, txt, ref.logit_scale.exp().reciprocal(), gamma=0.5, label_smoothing=0.1)
    expected.backward()
    loss = clip_model_loss(model, ids, pixels, mask, gamma=0.5, label_smoothing=0.1, backend=backend)
    loss.backward()
    assert rel_err(loss, expected) <= 1e-5
    assert_grads_close(grads(model), grads(ref), 1e-4)


class ShapeRecorder(TorchDispatchMode):
    """Every tensor shape an aten op returns while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self.shapes.add(tuple(x.shape))
        return out


def _square(shapes):
    return sorted(s for s in shapes if list(s).count(N) >= 2)


@pytest.mark.parametrize("backend", FUSED)
def test_no_n_by_n_tensor_is_allocated(backend):
    model = tiny_model()
    ids, pixels, mask = batch()
    with ShapeRecorder() as stock:  # the recorder sees CLIPModel's logits: the check can fail
        model(input_ids=ids, pixel_values=pixels, attention_mask=mask, return_loss=True).loss.backward()
    assert (N, N) in stock.shapes
    model.zero_grad()
    with ShapeRecorder() as ours:
        clip_model_loss(model, ids, pixels, mask, backend=backend).backward()
    assert (N, 24) in ours.shapes  # the projected embeddings went through the recorder
    assert _square(ours.shapes) == []


def test_return_outputs_holds_normalised_embeddings():
    model = tiny_model()
    ids, pixels, mask = batch()
    loss, out = clip_model_loss(model, ids, pixels, mask, return_outputs=True)
    stock = model(input_ids=ids, pixel_values=pixels, attention_mask=mask)
    assert out.loss is loss and out.logits_per_image is None
    torch.testing.assert_close(out.image_embeds, stock.image_embeds)
    torch.testing.assert_close(out.text_embeds, stock.text_embeds)


def test_bf16_model_temperature_is_the_float32_exp_of_logit_scale(monkeypatch):
    """A bf16 CLIPModel: the loss gets s = exp(logit_scale) taken in float32 (the bf16 parameter
    upcast first), never exp in bf16. At logit_scale = ln 100 (4.59375 in bf16) that is
    98.86 against bf16's 99.0, a 1.4e-3 other temperature; the loss's value and its gradient
    towards logit_scale follow it."""
    seen = []
    original = HNClipLoss.forward

    def forward(self, image_features, text_features, logit_scale, *args, **kwargs):
        seen.append(logit_scale.detach().clone())
        return original(self, image_features, text_features, logit_scale, *args, **kwargs)

    monkeypatch.setattr(HNClipLoss, "forward", forward)
    model = tiny_model().to(torch.bfloat16)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    want = model.logit_scale.detach().float().exp()
    assert want != model.logit_scale.detach().exp().float()  # the two temperatures differ here
    ids, pixels, mask = batch()
    loss = clip_model_loss(model, ids, pixels.bfloat16(), mask, backend="torch")
    assert torch.isfinite(loss) and len(seen) == 1
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0].reshape(()), want.reshape(()))


def test_logit_scale_warning_speaks_of_the_models_parameter(monkeypatch):
    """clip_model_loss exponentiates model.logit_scale itself: no "pass model.logit_scale.exp()"
    advice (HNClipLoss's, about an argument this caller never passed) for a small parameter, a warm
    τ the model holds (logit_scale = 1.0: τ = 0.37); a negative one (τ > 1, log τ stored in its
    place) warns once, naming the model's parameter, at the caller's line."""
    monkeypatch.setattr("hnclip_kernels.plausibility._warned", set())
    model = tiny_model()
    ids, pixels, mask = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value in (1.0, 0.0, 1.5, math.log(1 / 0.07)):
            with torch.no_grad():
                model.logit_scale.fill_(value)
            clip_model_loss(model, ids, pixels, mask, backend="torch")
    with torch.no_grad():
        model.logit_scale.fill_(math.log(0.07))
    words = r"^clip_model_loss got a model whose logit_scale parameter is -2\.65926 < 0: .* tau = 1 / exp\(model"
    with pytest.warns(RuntimeWarning, match=words) as caught:
        clip_model_loss(model, ids, pixels, mask, backend="torch")  # line below: the warning points here
        line = sys._getframe().f_lineno - 1
        clip_model_loss(model, ids, pixels, mask, backend="torch")
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "set the parameter to 2.65926" in message and ".exp()" not in message
    assert caught[0].filename == __file__ and caught[0].lineno == line


def test_bad_models_and_options_raise():
    ids, pixels, mask = batch()
    with pytest.raises(TypeError, match="get_image_features"):
        clip_model_loss(torch.nn.Linear(2, 2), ids, pixels)
    with pytest.raises(ValueError, match="DataParallel"):
        clip_model_loss(torch.nn.DataParallel(tiny_model()), ids, pixels)
    with pytest.raises(ValueError, match="gamma"):
        clip_model_loss(tiny_model(), ids, pixels, gamma=-1.0)
    with pytest.raises(ValueError, match="backend"):
        HNClipTrainer(model=tiny_model(), backend="cuda")


def test_false_negative_threshold_reaches_the_core_loss_only_when_set(monkeypatch):
    seen = []
    original = HNClipLoss.__init__

    def init(self, *args, **kwargs):
        seen.append(kwargs)
        original(self, *args, **{k: v for k, v in kwargs.items() if k != "false_negative_threshold"})

    monkeypatch.setattr(HNClipLoss, "__init__", init)
    ids, pixels, mask = batch()
    clip_model_loss(tiny_model(), ids, pixels, mask)
    clip_model_loss(tiny_model(), ids, pixels, mask, false_negative_threshold=0.95)
    assert "false_negative_threshold" not in seen[0] and seen[1]["false_negative_threshold"] == 0.95


class PairData(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids, self.pixels, self.mask = batch(n, seed=3)

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "pixel_values": self.pixels[i], "attention_mask": self.mask[i]}


def test_trainer_trains_with_finite_decreasing_loss(tmp_path):
    """6 steps on one repeated batch of 8 pairs (the loss must fall), CPU, nothing written but tmp_path."""
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
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
    trainer = HNClipTrainer(
        model=tiny_model().train(),
        args=args,
        train_dataset=PairData(8),
        eval_dataset=PairData(8),
        gamma=0.5,
        backend="cpp" if HAS_CPP else "torch",
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] and sum(b < a for a, b in zip(losses, losses[1:])) >= 4, losses
    metrics = trainer.evaluate()
    model = trainer.model.eval()
    ids, pixels, mask = PairData(8).ids, PairData(8).pixels, PairData(8).mask
    with torch.no_grad():
        expected = clip_model_loss(model, ids, pixels, mask, gamma=0.5).item()
    assert abs(metrics["eval_loss"] - expected) <= 1e-5 * expected


def _args(tmp_path, **kwargs):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kwargs,
    )


def test_trainer_takes_label_smoothing_factor_as_epsilon(tmp_path):
    # before, TrainingArguments(label_smoothing_factor=0.1) built a label smoother that compute_loss never called
    ids, pixels, mask = PairData(8).ids, PairData(8).pixels, PairData(8).mask
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": mask}
    model = tiny_model()
    trainer = HNClipTrainer(model=model, args=_args(tmp_path, label_smoothing_factor=0.1), backend="torch")
    with torch.no_grad():
        got = trainer.compute_loss(model, inputs).item()
        want = clip_model_loss(model, ids, pixels, mask, label_smoothing=0.1, backend="torch").item()
        plain = clip_model_loss(model, ids, pixels, mask, label_smoothing=0.0, backend="torch").item()
    assert got == want and abs(got - plain) > 1e-3
    assert trainer.hn_options["label_smoothing"] == 0.1 and trainer.label_smoother is None
    same = HNClipTrainer(model=model, args=_args(tmp_path, label_smoothing_factor=0.1), label_smoothing=0.1)
    assert same.hn_options["label_smoothing"] == 0.1
    only_ours = HNClipTrainer(model=model, args=_args(tmp_path), label_smoothing=0.2)
    assert only_ours.hn_options["label_smoothing"] == 0.2
    with pytest.raises(ValueError, match=r"label_smoothing=0\.0 and TrainingArguments\(label_smoothing_factor=0\.1\)"):
        HNClipTrainer(model=model, args=_args(tmp_path, label_smoothing_factor=0.1), label_smoothing=0.0)


def test_evaluate_calls_compute_metrics_with_pair_labels(tmp_path):
    # before, prediction_step returned no labels and the Trainer never called compute_metrics
    calls = []

    def recall_at_1(prediction):
        image, text = (torch.as_tensor(p) for p in prediction.predictions)
        labels = torch.as_tensor(prediction.label_ids)
        calls.append((image, text, labels))
        return {"r1_i2t": (torch.argmax(image @ text.T, dim=1) == labels).double().mean().item()}

    data = PairData(8)
    model = tiny_model()
    trainer = HNClipTrainer(
        model=model,
        args=_args(tmp_path, per_device_eval_batch_size=3),
        eval_dataset=data,
        compute_metrics=recall_at_1,
        backend="torch",
    )
    for _ in range(2):  # labels restart at every evaluation
        metrics = trainer.evaluate()
    assert len(calls) == 2
    image, text, labels = calls[-1]
    assert torch.equal(labels, torch.arange(8))  # three batches (3, 3, 2): positions across batches
    with torch.no_grad():
        _, out = clip_model_loss(model, data.ids, data.pixels, data.mask, return_outputs=True, backend="torch")
    torch.testing.assert_close(image, out.image_embeds)
    torch.testing.assert_close(text, out.text_embeds)
    want = (torch.argmax(out.image_embeds @ out.text_embeds.T, dim=1) == torch.arange(8)).double().mean().item()
    assert metrics["eval_r1_i2t"] == pytest.approx(want) and "eval_loss" in metrics


def test_evaluation_labels_count_every_ranks_pairs(tmp_path, monkeypatch):
    # rank 1 of 2 with local batches of 3 (rank 0: 4, then 2): positions in the gathered, rank-ordered predictions
    import hnclip_kernels.integrations.transformers as hf

    trainer = HNClipTrainer(model=tiny_model(), args=_args(tmp_path))
    sizes = iter([[4, 3], [2, 3]])
    monkeypatch.setattr(hf, "_distributed_layout", lambda: (1, 2))
    monkeypatch.setattr(hf, "gather_sizes", lambda n, device: next(sizes))

    class Out:
        image_embeds = torch.zeros(3, 24)

    assert trainer._pair_positions(Out).tolist() == [4, 5, 6]
    assert trainer._pair_positions(Out).tolist() == [9, 10, 11]


# ----------------------------------------------------------------------------- two gloo processes

SIZES = (5, 6)  # unequal local batches: the global batch is the N = 11 of the tests above


def _rank(rank, world):
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_model())  # the wrapper path of clip_model_loss
    ids, pixels, mask = batch()
    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    loss = clip_model_loss(ddp, ids[rows], pixels[rows], mask[rows], gamma=0.5, label_smoothing=0.1)
    loss.backward()  # DDP averages the gradients over the two ranks
    return loss.item(), {k: g.numpy() for k, g in grads(ddp.module).items()}


def test_two_gloo_processes_equal_the_global_batch(tmp_path):
    """2 ranks of 5 and 6 pairs under DDP: mean loss and averaged gradients = one process on all 11."""
    results = {
        rank: (loss, {k: torch.from_numpy(g) for k, g in grad.items()})
        for rank, (loss, grad) in spawn_gloo_ranks(_rank, tmp_path, timeout=120).items()
    }
    model = tiny_model()
    expected = clip_model_loss(model, *batch(), gamma=0.5, label_smoothing=0.1)
    expected.backward()
    mean_loss = sum(results[r][0] for r in (0, 1)) / 2
    assert abs(mean_loss - expected.item()) <= 1e-5 * expected.item()
    assert_grads_close(results[0][1], grads(model), 1e-5)
    assert_grads_close(results[1][1], grads(model), 1e-5)
    assert results[0][0] != results[1][0]  # each rank has its own share, not the global loss
