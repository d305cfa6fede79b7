"""Hard negatives and group ids in ``hnclip_kernels.integrations.transformers`` (tiny random
``CLIPConfig``, CPU, no download): ``clip_model_loss(negative_input_ids=, negative_attention_mask=,
group_ids=, margin=)``, ``collate_hard_negatives`` and ``HNClipTrainer`` with those columns."""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_transformers import BOS, EOS, batch, grads, tiny_model  # noqa: E402

from hnclip_kernels import hn_clip_loss  # noqa: E402
from hnclip_kernels.integrations.transformers import (  # noqa: E402
    HNClipTrainer,
    clip_model_loss,
    collate_hard_negatives,
)
from hnclip_kernels.integrations.transformers_negatives import flat_negatives  # noqa: E402

N = 6


def negatives(m, length=5, seed=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, BOS, (m, length), generator=g)
    ids[:, 0], ids[:, -1] = BOS, EOS
    return ids, torch.ones_like(ids)


def _pooled(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def test_negatives_and_ids_are_the_core_losss_on_the_towers_embeddings():
    """The loss and every parameter's gradient equal hn_clip_loss on the model's own embeddings,
    the negatives through get_text_features (so the text tower gets their gradient)."""
    model = tiny_model()
    ids, pixels, mask = batch(N)
    neg_ids, neg_mask = negatives(4)
    groups = torch.tensor([0, 0, 1, 2, 3, 3])
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    loss = clip_model_loss(
        ours,
        ids,
        pixels,
        mask,
        negative_input_ids=neg_ids,
        negative_attention_mask=neg_mask,
        group_ids=groups,
        margin="image_text",
        backend="torch",
    )
    loss.backward()
    img = _pooled(ref.get_image_features(pixel_values=pixels))
    txt = _pooled(ref.get_text_features(input_ids=ids, attention_mask=mask))
    neg = _pooled(ref.get_text_features(input_ids=neg_ids, attention_mask=neg_mask))
    want = hn_clip_loss(
        img, txt, 1.0 / ref.logit_scale.exp(), negatives=neg, group_ids=groups, margin="image_text", backend="torch"
    )
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-6, atol=0)
    got, expected = grads(ours), grads(ref)
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-5, atol=1e-7), name
    plain = copy.deepcopy(model)
    clip_model_loss(plain, ids, pixels, mask, backend="torch").backward()
    emb = "text_model.embeddings.token_embedding.weight"
    touched = neg_ids.unique()  # tokens only the negatives use get gradient only through them
    only_neg = touched[~torch.isin(touched, ids.unique())]
    assert only_neg.numel() > 0
    assert grads(plain)[emb][only_neg].abs().max() == 0 and got[emb][only_neg].abs().max() > 0


def test_slots_per_example_equal_the_flat_negatives_and_chunking():
    model = tiny_model()
    ids, pixels, mask = batch(N)
    neg_ids, neg_mask = negatives(3)
    slots = torch.zeros(N, 2, neg_ids.shape[1], dtype=torch.long)
    slot_mask = torch.zeros_like(slots)
    for (b, j), row in zip([(0, 0), (0, 1), (4, 0)], range(3)):  # example 0 has two negatives, 4 one
        slots[b, j], slot_mask[b, j] = neg_ids[row], neg_mask[row]
    flat, flat_mask = flat_negatives(slots, slot_mask)
    assert torch.equal(flat, neg_ids) and torch.equal(flat_mask, neg_mask)
    with torch.no_grad():
        want = clip_model_loss(model, ids, pixels, mask, negative_input_ids=neg_ids, negative_attention_mask=neg_mask)
        got = clip_model_loss(model, ids, pixels, mask, negative_input_ids=slots, negative_attention_mask=slot_mask)
        chunked = clip_model_loss(
            model, ids, pixels, mask, negative_input_ids=slots, negative_attention_mask=slot_mask, chunk_size=2
        )
        none = clip_model_loss(model, ids, pixels, mask, negative_input_ids=slots[:, :0], negative_attention_mask=None)
        plain = clip_model_loss(model, ids, pixels, mask)
    assert torch.equal(got, want) and torch.allclose(chunked, want, rtol=1e-6)
    assert torch.equal(none, plain) and want > plain  # M = 0 is no negatives


def test_flat_negatives_errors():
    with pytest.raises(ValueError, match="without negative_input_ids"):
        flat_negatives(None, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(M, L\) negatives or \(B, K, L\)"):
        flat_negatives(torch.ones(3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="must match"):
        flat_negatives(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4))


def _examples():
    ids, pixels, mask = batch(4, seed=3)
    neg_ids, _ = negatives(3, length=6)
    counts = [2, 0, 1, 0]
    rows = iter(neg_ids.tolist())
    out = []
    for i, k in enumerate(counts):
        ex = {"input_ids": ids[i], "pixel_values": pixels[i], "attention_mask": mask[i], "group_ids": "ab"[i % 2]}
        negs = [next(rows)[: 4 + j] for j in range(k)]  # varied lengths: 4, 5 tokens
        ex["negative_input_ids"] = negs if k else ([] if i == 1 else None)
        out.append(ex)
    return out


def test_collate_hard_negatives_pads_slots_and_maps_ids():
    batch_ = collate_hard_negatives(_examples())
    assert batch_["input_ids"].shape == (4, 7) and batch_["pixel_values"].shape == (4, 3, 30, 30)
    assert batch_["negative_input_ids"].shape == (4, 2, 5)
    assert batch_["negative_attention_mask"].sum(dim=-1).tolist() == [[4, 5], [0, 0], [4, 0], [0, 0]]
    assert batch_["group_ids"].tolist() == [0, 1, 0, 1]
    flat, _ = flat_negatives(batch_["negative_input_ids"], batch_["negative_attention_mask"])
    assert flat.shape == (3, 5)
    no_neg = collate_hard_negatives([{k: v for k, v in ex.items() if k != "negative_input_ids"} for ex in _examples()])
    assert "negative_input_ids" not in no_neg and "negative_attention_mask" not in no_neg
    with pytest.raises(ValueError, match="wrap"):
        collate_hard_negatives([{**_examples()[0], "negative_input_ids": [BOS, 5, EOS]}])
    with pytest.raises(ValueError, match="group_ids is missing"):
        collate_hard_negatives([_examples()[0], {k: v for k, v in _examples()[1].items() if k != "group_ids"}])


class NegativeData(torch.utils.data.Dataset):
    def __init__(self):
        self.examples = _examples() * 2

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def test_trainer_trains_on_negative_and_group_columns(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
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
        train_dataset=NegativeData(),
        data_collator=collate_hard_negatives,
        margin="image_text",
    )
    trainer._set_signature_columns_if_needed()
    assert {"negative_input_ids", "negative_attention_mask", "group_ids"} <= set(trainer._signature_columns)
    collated = collate_hard_negatives(_examples())
    model = trainer.model.eval()
    with torch.no_grad():
        got = trainer.compute_loss(model, collated)
        want = clip_model_loss(
            model,
            collated["input_ids"],
            collated["pixel_values"],
            collated["attention_mask"],
            negative_input_ids=collated["negative_input_ids"],
            negative_attention_mask=collated["negative_attention_mask"],
            group_ids=collated["group_ids"],
            margin="image_text",
        )
        plain = trainer.compute_loss(model, {k: collated[k] for k in ("input_ids", "pixel_values", "attention_mask")})
    assert torch.equal(got, want) and not torch.equal(got, plain)
    model.train()
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def test_unknown_columns_still_raise(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = HNClipTrainer(model=tiny_model(), args=args)
    ids, pixels, _ = batch(4)
    with pytest.raises(ValueError, match="negative_ids"):
        trainer.compute_loss(trainer.model, {"input_ids": ids, "pixel_values": pixels, "negative_ids": ids})
