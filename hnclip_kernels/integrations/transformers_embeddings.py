"""The embedding pass of :func:`hnclip_kernels.integrations.transformers.clip_model_loss`: a
``transformers`` CLIP model's projected image, caption and hard-negative embeddings and its scale,
through the model's wrapper (DDP, FSDP, accelerate, DeepSpeed) when it has one, each tower's calls
agreed across ranks (:mod:`hnclip_kernels.chunked`). Split from that module by role.
"""

from __future__ import annotations

import torch
from torch import nn

from ..chunked import agree_tower_calls, padded_encode, tower_calls

__all__ = ["embeddings", "is_sigmoid_model"]

_MISSING = object()


def _pooled(output) -> torch.Tensor:
    """The projected embedding: transformers 5 returns a ModelOutput whose ``pooler_output`` it
    is, 4.x returned the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    return output.pooler_output


def _unwrap(model: nn.Module) -> nn.Module:
    """The CLIP model inside DDP / FSDP / accelerate wrappers (their ``.module``) or ``torch.compile``."""
    inner = model
    while True:
        if isinstance(inner, nn.DataParallel):
            raise ValueError(
                "clip_model_loss does not support torch.nn.DataParallel (its replicas cannot run the "
                "embedding pass): launch one process per GPU with torchrun (DistributedDataParallel)"
            )
        nxt = getattr(inner, "module", None)
        if not isinstance(nxt, nn.Module):
            nxt = getattr(inner, "_orig_mod", None)
        if not isinstance(nxt, nn.Module):
            return inner
        inner = nxt


def _check_clip(clip) -> None:
    missing = [name for name in ("get_image_features", "get_text_features", "logit_scale") if not hasattr(clip, name)]
    if missing:
        raise TypeError(
            f"model must be a transformers CLIPModel (or a model with get_image_features, "
            f"get_text_features and logit_scale), got {type(clip).__name__} without {', '.join(missing)}"
        )


def is_sigmoid_model(model) -> bool:
    """Does the (possibly wrapped) model train with the sigmoid loss, i.e. has it a ``logit_bias``
    (``transformers.SiglipModel``)?"""
    return getattr(_unwrap(model), "logit_bias", None) is not None


def _features(clip, input_ids, pixel_values, attention_mask, chunk_size=None, negatives=None, calls=(1, 0)):
    """(image embeddings, text embeddings, s = exp(logit_scale), negative embeddings or None, b =
    the model's ``logit_bias`` (float32 or better) or None), as
    ``CLIPModel.forward`` forms them before its normalisation and N×N product; s in float32 or
    better (a bf16 model's exp(logit_scale) in bf16 would be another temperature: s = 100 rounds
    to 100.5). ``negatives``: None or (ids, mask) of the hard-negative captions, run through the
    text tower after the captions. With a ``chunk_size`` each tower runs in recomputed chunks
    (:func:`hnclip_kernels.chunked_encode`). ``calls``: the agreed (pair, negative) encoder calls
    per tower (:func:`~hnclip_kernels.chunked.agree_tower_calls`); a rank without negatives joins
    its padding calls to the captions' embeddings."""

    def image_encoder(pixel_values):
        return _pooled(clip.get_image_features(pixel_values=pixel_values))

    def text_encoder(**kw):
        return _pooled(clip.get_text_features(**kw))

    pair_calls, negative_calls = calls
    captions = dict(input_ids=input_ids, attention_mask=attention_mask)
    image = padded_encode(image_encoder, pixel_values, chunk_size, pair_calls)
    text = padded_encode(text_encoder, captions, chunk_size, pair_calls)
    inputs = None if negatives is None else dict(input_ids=negatives[0], attention_mask=negatives[1])
    negative = padded_encode(text_encoder, inputs, chunk_size, negative_calls, filler=captions)
    if negatives is None and negative is not None:  # padding only: (0, D), it rides on the captions
        text, negative = torch.cat([text, negative]), None
    scale, bias = clip.logit_scale, getattr(clip, "logit_bias", None)
    if bias is not None:  # SiglipModel: z = s·(v·t) + b, b read as s is (float32 or better)
        bias = bias.to(torch.promote_types(bias.dtype, torch.float32))
    return image, text, scale.to(torch.promote_types(scale.dtype, torch.float32)).exp(), negative, bias


def _is_fsdp2(module) -> bool:
    """``fully_shard`` (FSDP2) turns the module itself into the wrapper: its unshard runs in
    forward hooks of the module, which calling get_*_features directly bypasses."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def embeddings(model, input_ids, pixel_values, attention_mask, chunk_size=None, negatives=None):
    """``_features`` of the CLIP model in ``model``, run inside the wrapper's forward when there is one
    (DDP, FSDP, accelerate, DeepSpeed); the ranks' tower calls agreed first (one all_reduce)."""
    clip = _unwrap(model)
    _check_clip(clip)
    # every rank makes as many calls of each tower (sharded layers gather in each): one all_reduce
    own = (
        tower_calls(input_ids.shape[0], chunk_size),
        0 if negatives is None else tower_calls(len(negatives[0]), chunk_size),
    )
    calls = agree_tower_calls(*own, like=pixel_values)
    if clip is model and not _is_fsdp2(clip):
        return _features(clip, input_ids, pixel_values, attention_mask, chunk_size, negatives, calls)
    # A wrapper's own forward must run: DDP arms its gradient all-reduce there, FSDP gathers the
    # parameters there (FSDP2: in the root module's forward hooks). So the wrapped model's
    # forward is the embedding pass for this one call.
    saved = clip.__dict__.get("forward", _MISSING)  # accelerate may have set an instance forward

    def embedding_forward(input_ids, pixel_values, attention_mask=None):
        return _features(clip, input_ids, pixel_values, attention_mask, chunk_size, negatives, calls)

    clip.forward = embedding_forward
    try:
        return model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask)
    finally:
        if saved is _MISSING:
            del clip.forward
        else:
            clip.forward = saved
