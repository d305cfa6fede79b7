"""``negatives_layout="own"`` in ``hnclip_kernels.integrations.transformers`` (tiny random
``CLIPConfig``, CPU, no download): each example's (B, K, L) negative slots are extra image→text
columns of its own row only.

Checked against ``hn_clip_loss(negatives=(B, K, D), negatives_mask=(B, K))`` on the model's own
embeddings (the real slots through ``get_text_features``, scattered into their slots here by a
loop) in the loss and every parameter's gradient, and against the float64 oracle
(``tests/own_oracle.py``) on a float64 copy of the model; ``"shared"`` (the default) unchanged to
the bit. Bound: about a second each (a 2-layer CLIP of width 32, B = 6)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_transformers import FUSED, assert_grads_close, batch, grads, tiny_model  # noqa: E402
from test_transformers_negatives import negatives  # noqa: E402

from hnclip_kernels import hn_clip_loss  # noqa: E402
from hnclip_kernels.integrations.transformers import (  # noqa: E402
    HNClipTrainer,
    clip_model_loss,
    collate_hard_negatives,
)
from hnclip_kernels.integrations.transformers_negatives import negative_slots  # noqa: E402
from own_oracle import own_rows_f64  # noqa: E402

B, K = 6, 3
COUNTS = [2, 0, 3, 1, 0, 1]  # example b's real negatives (0 to K): rows 1 and 4 have none


def _slots():
    """(B, K, L) ids and mask: example b's first COUNTS[b] slots real (varied lengths), the rest all-0
    rows; and the real ones flat (M, L) in example order."""
    flat_ids, flat_mask = negatives(sum(COUNTS), length=6)
    flat_mask[::2, -2:] = 0  # some negatives shorter: their padding is not a slot's emptiness
    ids = torch.zeros(B, K, 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    row = 0
    for b, c in enumerate(COUNTS):
        ids[b, :c], mask[b, :c] = flat_ids[row : row + c], flat_mask[row : row + c]
        row += c
    return ids, mask, flat_ids, flat_mask


def _pooled(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _reference_inputs(model, ids, pixels, mask, flat_ids, flat_mask):
    """The model's embeddings and its own negatives (B, K, D) filled slot by slot, the mask (B, K)."""
    img = _pooled(model.get_image_features(pixel_values=pixels))
    txt = _pooled(model.get_text_features(input_ids=ids, attention_mask=mask))
    neg = _pooled(model.get_text_features(input_ids=flat_ids, attention_mask=flat_mask))
    slots, real, row = [], torch.zeros(B, K, dtype=torch.bool), 0
    for b, c in enumerate(COUNTS):
        pad = neg.new_zeros(K - c, neg.shape[1])
        slots.append(torch.cat([neg[row : row + c], pad]))
        real[b, :c] = True
        row += c
    return img, txt, torch.stack(slots), real


@pytest.mark.parametrize("backend", ["torch", *FUSED[:1]])
def test_own_layout_is_the_core_own_loss_on_the_towers_embeddings(backend):
    """Loss and every parameter's gradient equal hn_clip_loss(negatives=(B, K, D),
    negatives_mask=) on the model's embeddings (rel 1e-6 loss, 1e-5 gradients; measured 0 on torch and cpp)."""
    model = tiny_model()
    ids, pixels, mask = batch(B)
    slot_ids, slot_mask, flat_ids, flat_mask = _slots()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    options = dict(gamma=0.5, label_smoothing=0.1, margin="image_text", backend=backend)
    loss = clip_model_loss(ours, ids, pixels, mask, negative_input_ids=slot_ids, negative_attention_mask=slot_mask,
                           negatives_layout="own", **options)  # fmt: skip
    loss.backward()
    img, txt, own, real = _reference_inputs(ref, ids, pixels, mask, flat_ids, flat_mask)
    want = hn_clip_loss(img, txt, 1.0 / ref.logit_scale.exp(), negatives=own, negatives_mask=real, **options)
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-6, atol=0), (loss.item(), want.item())
    assert_grads_close(grads(ours), grads(ref), 1e-5)


def test_own_layout_matches_the_float64_oracle_and_chunking():
    """The float64 formula (own_oracle) on a float64 copy of the model: loss rel ≤ 1e-5, every
    parameter's gradient rel ≤ 1e-4 (measured 5e-8 / 3.4e-6 on torch; cpp and triton 1.1e-7 / 3.1e-6
    and 2.6e-6); chunk_size=2 the same loss (rel 1e-6)."""
    model = tiny_model()
    ids, pixels, mask = batch(B)
    slot_ids, slot_mask, flat_ids, flat_mask = _slots()
    ref = copy.deepcopy(model).double()
    img, txt, own, real = _reference_inputs(ref, ids, pixels.double(), mask, flat_ids, flat_mask)
    unit = torch.nn.functional.normalize
    own_unit = unit(own, dim=-1).masked_fill(~real[..., None], 0.0)
    tau = ref.logit_scale.exp().reciprocal()
    expected = own_rows_f64(unit(img, dim=-1), unit(txt, dim=-1), own_unit, real, tau, gamma=0.5,
                            label_smoothing=0.1).mean()  # fmt: skip
    expected.backward()
    kwargs = dict(negative_input_ids=slot_ids, negative_attention_mask=slot_mask, negatives_layout="own",
                  gamma=0.5, label_smoothing=0.1, backend="torch")  # fmt: skip
    loss = clip_model_loss(model, ids, pixels, mask, **kwargs)
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
    assert_grads_close(grads(model), grads(ref), 1e-4)
    with torch.no_grad():
        chunked = clip_model_loss(model, ids, pixels, mask, chunk_size=2, **kwargs)
    assert torch.allclose(chunked, loss, rtol=1e-6, atol=0)


def test_shared_default_unchanged_and_own_differs():
    model = tiny_model()
    ids, pixels, mask = batch(B)
    slot_ids, slot_mask, _, _ = _slots()
    with torch.no_grad():
        default = clip_model_loss(model, ids, pixels, mask, negative_input_ids=slot_ids,
                                  negative_attention_mask=slot_mask)  # fmt: skip
        shared = clip_model_loss(model, ids, pixels, mask, negative_input_ids=slot_ids,
                                 negative_attention_mask=slot_mask, negatives_layout="shared")  # fmt: skip
        own = clip_model_loss(model, ids, pixels, mask, negative_input_ids=slot_ids,
                              negative_attention_mask=slot_mask, negatives_layout="own")  # fmt: skip
        empty = clip_model_loss(model, ids, pixels, mask, negative_input_ids=slot_ids[:, :0],
                                negative_attention_mask=None, negatives_layout="own")  # fmt: skip
        plain = clip_model_loss(model, ids, pixels, mask)
    assert torch.equal(default, shared) and torch.equal(empty, plain)
    assert shared > own > plain  # own: fewer extra columns per row than shared's M, more than none


def test_negative_slots_and_layout_errors(tmp_path):
    slot_ids, slot_mask, flat_ids, flat_mask = _slots()
    assert negative_slots(slot_ids, slot_mask).sum(dim=1).tolist() == COUNTS
    assert negative_slots(slot_ids, None).all()
    model = tiny_model()
    ids, pixels, mask = batch(B)
    with pytest.raises(ValueError, match=r"negatives_layout must be 'shared' .* got 'per_row'"):
        clip_model_loss(model, ids, pixels, mask, negatives_layout="per_row")
    with pytest.raises(TypeError, match="negatives_layout must be a string"):
        clip_model_loss(model, ids, pixels, mask, negatives_layout=True)
    with pytest.raises(ValueError, match=r"\(B, K, L\) slots per example.*'shared'"):
        clip_model_loss(model, ids, pixels, mask, negative_input_ids=flat_ids, negative_attention_mask=flat_mask,
                        negatives_layout="own")  # fmt: skip
    from test_transformers_siglip import tiny_siglip

    with pytest.raises(ValueError, match="negatives_layout='own' is the softmax loss's"):
        clip_model_loss(tiny_siglip(), ids, pixels, mask, negative_input_ids=slot_ids, negatives_layout="own")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="negatives_layout must be"):
        HNClipTrainer(model=model, args=args, negatives_layout="rows")
    with pytest.raises(ValueError, match="negatives_layout='own' is the softmax loss's"):
        HNClipTrainer(model=tiny_siglip(), args=args, negatives_layout="own")


def test_trainer_passes_the_layout_to_the_loss(tmp_path):
    from test_transformers_negatives import _examples

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    collated = collate_hard_negatives(_examples())
    model = tiny_model()
    trainer = HNClipTrainer(model=model, args=args, negatives_layout="own")
    assert trainer.hn_options["negatives_layout"] == "own"
    assert "negatives_layout" not in HNClipTrainer(model=model, args=args).hn_options  # today's call
    with torch.no_grad():
        got = trainer.compute_loss(model, collated)
        keys = ("negative_input_ids", "negative_attention_mask", "group_ids")
        want = clip_model_loss(model, collated["input_ids"], collated["pixel_values"], collated["attention_mask"],
                               negatives_layout="own", **{k: collated[k] for k in keys})  # fmt: skip
        shared = clip_model_loss(model, collated["input_ids"], collated["pixel_values"], collated["attention_mask"],
                                 **{k: collated[k] for k in keys})  # fmt: skip
    assert torch.equal(got, want) and not torch.equal(got, shared)
