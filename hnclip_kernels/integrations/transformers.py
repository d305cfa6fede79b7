"""HN-CLIP for Hugging Face ``transformers`` CLIP models, without an N×N logit matrix.

``CLIPModel.forward`` normalises the projected embeddings and builds ``logits_per_text``
(N×N) in every call, with or without ``return_loss``, and its loss is plain InfoNCE on that
matrix, each rank seeing only its own batch. :func:`clip_model_loss` instead takes the
embeddings from ``get_image_features`` / ``get_text_features`` and τ = 1 / exp(logit_scale)
and runs :class:`hnclip_kernels.HNClipLoss` on them (fused kernels: no N×N tensor; under
``torch.distributed`` local rows against the gathered batch). A ``SiglipModel`` (a model with a
``logit_bias``) gets the sigmoid loss, :class:`hnclip_kernels.HNSigLipLoss`, the same way.
:class:`HNClipTrainer` is a ``transformers.Trainer`` whose ``compute_loss`` is :func:`clip_model_loss`.

Needs the ``[hf]`` extra (``pip install "hnclip-kernels[hf]"``: ``transformers[torch]`` 5.x).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
    from transformers.models.clip.modeling_clip import CLIPOutput
except ImportError as exc:  # pragma: no cover - the [hf] extra is part of [test]
    raise ImportError(
        "hnclip_kernels.integrations.transformers needs transformers 5.x: "
        'pip install "hnclip-kernels[hf]" (or "transformers[torch]>=5,<6")'
    ) from exc

from ..chunked import check_chunk_size
from ..clip_loss import HNClipLoss
from ..distributed.gather import HAS_DISTRIBUTED, dist, gather_sizes
from ..negatives_layout import NegativesLayout, own_slots
from ..plausibility import warn_if_implausible_model_logit_scale
from ..sharding import squeeze_scalar_parameters, unsqueeze_scalar_parameters
from ..siglip_loss import HNSigLipLoss
from .transformers_embeddings import embeddings, is_sigmoid_model
from .transformers_negatives import NEGATIVE_KEYS, collate_hard_negatives, flat_negatives, negative_slots

__all__ = ["clip_model_loss", "HNClipTrainer", "collate_hard_negatives"]


def _distributed_layout():
    """(rank, world size) of the default process group; (0, 1) without one."""
    if HAS_DISTRIBUTED and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _ModelLoss(HNClipLoss):
    """``HNClipLoss`` as :func:`clip_model_loss` runs it: s = exp(``model.logit_scale``) is formed
    here, not passed by the caller, so an implausible s is worded as the model's parameter (and
    the missing-``.exp()`` warning, about an argument the caller never passed, does not apply)."""

    _scale_warning = staticmethod(warn_if_implausible_model_logit_scale)


def _loss_module(gamma, label_smoothing, false_negative_threshold, backend, margin="text") -> HNClipLoss:
    rank, world_size = _distributed_layout()
    options = dict(gamma=gamma, label_smoothing=label_smoothing, backend=backend, normalize=True)
    if false_negative_threshold is not None:  # passed on only when set: the core validates it
        options["false_negative_threshold"] = false_negative_threshold
    options["margin"] = margin  # validated once, by the loss's options
    # local rows against the gathered batch, gradients through the gather: with DDP's averaging
    # every parameter's gradient is the single-process gradient on the global batch
    return _ModelLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size, **options)


def _sigmoid_module(gamma, label_smoothing, false_negative_threshold, backend, margin, group_mode) -> HNSigLipLoss:
    """The sigmoid loss of a model with a ``logit_bias`` (``SiglipModel``): local image rows
    against the gathered captions under ``torch.distributed``."""
    if label_smoothing or false_negative_threshold is not None:
        raise ValueError(
            "label_smoothing and false_negative_threshold have no meaning in the sigmoid loss of this SigLIP "
            "model (a model with a logit_bias); leave them unset (group_ids with group_mode='mask' drop "
            "known duplicates)"
        )
    rank, world_size = _distributed_layout()
    return HNSigLipLoss(rank=rank, world_size=world_size, gamma=gamma, margin=margin, group_mode=group_mode,
                        backend=backend, normalize=True)  # fmt: skip


def _layout(negatives_layout, model) -> NegativesLayout:
    """``negatives_layout`` checked once; "own" refused for a SigLIP model (its loss takes shared ones)."""
    layout = NegativesLayout.parse(negatives_layout)
    if layout is NegativesLayout.OWN and is_sigmoid_model(model):
        raise ValueError(
            "negatives_layout='own' is the softmax loss's (a CLIP model); this SigLIP model (a model with a "
            "logit_bias) takes negatives_layout='shared'"
        )
    return layout


def clip_model_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    false_negative_threshold: Optional[float] = None,
    backend: str = "auto",
    return_outputs: bool = False,
    chunk_size: Optional[int] = None,
    negative_input_ids: Optional[torch.Tensor] = None,
    negative_attention_mask: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    margin: str = "text",
    group_mode: str = "mask",
    negatives_layout: str = "shared",
):
    """HN-CLIP loss (arXiv 2608.18521, Eq. 2) of a ``transformers`` CLIP batch, never forming N×N logits.

    Runs ``model.get_image_features(pixel_values)`` and ``model.get_text_features(input_ids,
    attention_mask)`` (the projected embeddings ``CLIPModel.forward`` normalises), L2-normalises
    them inside the loss and takes τ = 1 / exp(``model.logit_scale``), as ``CLIPModel`` scales its
    logits. At γ = 0 (and ε = 0) on one process it equals ``model(..., return_loss=True).loss`` in
    value and in every parameter's gradient, up to float32 rounding.

    Under ``torch.distributed`` (default process group initialised) it is a collective: every
    rank calls it with its own batch (sizes may differ) and gets its share of the global loss,
    local rows against the gathered columns with gradients through the gather
    (``HNClipLoss(local_loss=True, gather_with_grad=True)``), so the DDP-averaged gradient of
    every parameter equals the single-process gradient on the concatenated global batch, and
    the mean of the ranks' losses is the global loss. The ranks first agree on each tower's calls
    (one all_reduce of two integers) and a rank with fewer chunks or no negatives pads with
    one-row calls that enter nothing (:mod:`hnclip_kernels.chunked`), so models sharded per layer
    (FSDP2, ZeRO-3) see the same collectives on every rank.

    Args:
        model: a ``transformers.CLIPModel`` (or a model with ``get_image_features``,
            ``get_text_features`` and a ``logit_scale`` parameter, the log of 1/τ), bare or
            wrapped in DDP / FSDP / accelerate (the wrapper's forward runs, so its gradient
            synchronisation does); ``torch.nn.DataParallel`` is refused.
        input_ids: (N, L) token ids; ``attention_mask`` (N, L) or None.
        pixel_values: (N, 3, H, W) images, as the CLIP processor returns them.
        gamma: margin scale γ ≥ 0 (0.5, the paper's value; 0 is InfoNCE).
        label_smoothing: ε in [0, 1), ``cross_entropy`` semantics.
        false_negative_threshold: None (default) or a caption-cosine threshold; passed to the
            core loss only when set (see :class:`hnclip_kernels.HNClipLoss`).
        backend: "auto", "torch", "cpp" or "triton" (``hn_clip_loss``'s ``backend``).
        return_outputs: also return a ``CLIPOutput`` with the L2-normalised ``image_embeds`` and
            ``text_embeds`` (N, D) and ``loss`` (its ``logits_*`` fields are None).
        chunk_size: None (default: each tower runs on the whole batch) or an integer ≥ 1: each
            tower runs ``chunk_size`` pairs at a time, each chunk's activations recomputed in the
            backward (:func:`hnclip_kernels.chunked_encode`, dropout masks replayed), then one loss
            over the whole batch: the same loss and gradients, with the encoders' activation
            memory of one chunk.
        negative_input_ids, negative_attention_mask: None, or (M, L) token ids (and mask) of hard-
            negative captions (NegCLIP's), run through ``get_text_features`` (chunked too) and
            passed as the loss's ``negatives``: extra columns of every image→text row
            (``docs/hard_negatives.md``); M = 0 is none. (B, K, L) slots per example are
            flattened first (:func:`~hnclip_kernels.integrations.transformers_negatives.flat_negatives`).
        negatives_layout: "shared" (default, as above; NegCLIP's) or "own": (B, K, L) slots only,
            example b's real slots (mask rows not all 0) are extra columns of its image→text row
            only: their embeddings, scattered back into (B, K, D), are the loss's ``negatives``
            with ``negatives_mask`` (B, K) (``docs/hard_negatives.md``, "Each row's own
            negatives"). Either way only the real slots run through the text tower.
        group_ids: None or (N,) integer pair ids: equal ids are no negatives of each other.
        margin: "text" (default) or "image_text" (LLaVE-style hardness), as ``hn_clip_loss``'s.
        group_mode: what equal ``group_ids`` mean for a SigLIP model: "mask" (default) or
            "positive" (label +1); a CLIP model takes "mask" only.

    SigLIP: a model with a ``logit_bias`` (``transformers.SiglipModel``) trains with the sigmoid
    loss (:class:`hnclip_kernels.HNSigLipLoss`, ``docs/siglip.md``): s = exp(``logit_scale``),
    b = ``logit_bias``, the embeddings L2-normalised inside. At γ = 0 on one process it equals
    ``model(..., return_loss=True).loss``; across ranks each rank's image rows meet every rank's
    captions (its share ``(W/N)·Σ`` of the global loss). ``label_smoothing`` and
    ``false_negative_threshold`` raise ``ValueError`` there.

    FSDP2 and DeepSpeed ZeRO: ``fully_shard`` and ``deepspeed.initialize`` take no 0-dim parameter,
    and CLIPModel's ``logit_scale`` is one; make it (1,) before wrapping and 0-dim again in the
    state dict you save (:mod:`hnclip_kernels.sharding`).

    Returns:
        The float32 scalar loss (this rank's share under ``torch.distributed``), or
        ``(loss, CLIPOutput)`` with ``return_outputs``.

    Warns:
        RuntimeWarning (once per process): a negative ``model.logit_scale`` (τ > 1, almost surely
        log τ stored in its place). A small non-negative one is a warm τ the model holds and is
        taken as ``CLIPModel`` takes it, quietly.

    Raises:
        TypeError: a model without the CLIP embedding methods; a ``chunk_size`` that is not an integer (a bool, a float).
        ValueError: ``torch.nn.DataParallel``; ``chunk_size`` < 1; ``negatives_layout`` neither "shared"
            nor "own", or "own" with flat (M, L) negatives or a SigLIP model; and every error of :class:`hnclip_kernels.HNClipLoss`
            (bad options at once, bad features or τ at the loss), or of :class:`hnclip_kernels.HNSigLipLoss`
            for a SigLIP model.
    """
    if is_sigmoid_model(model):  # SiglipModel: the sigmoid loss with its logit_bias
        loss_fn = _sigmoid_module(gamma, label_smoothing, false_negative_threshold, backend, margin, group_mode)
    else:
        loss_fn = _loss_module(gamma, label_smoothing, false_negative_threshold, backend, margin)  # bad options first
        if group_mode != "mask":
            raise ValueError(f"group_mode={group_mode!r} is the sigmoid loss's (a SigLIP model); CLIP takes 'mask'")
    chunk_size = check_chunk_size(chunk_size)
    own = _layout(negatives_layout, model) is NegativesLayout.OWN
    neg_ids, neg_mask = flat_negatives(negative_input_ids, negative_attention_mask)
    keep = negative_slots(negative_input_ids, negative_attention_mask) if own and neg_ids is not None else None
    negatives = None if neg_ids is None else (neg_ids, neg_mask)
    image, text, scale, negative, bias = embeddings(
        model, input_ids, pixel_values, attention_mask, chunk_size, negatives
    )
    family = {} if group_ids is None else {"group_ids": group_ids}  # only what is given: else today's call
    if negative is not None and keep is not None:  # own: the real slots' embeddings back in (B, K, D)
        family["negatives"], family["negatives_mask"] = own_slots(negative, keep), keep.to(negative.device)
    elif negative is not None:
        family["negatives"] = negative
    loss = loss_fn(image, text, scale, bias, **family) if bias is not None else loss_fn(image, text, scale, **family)
    if not return_outputs:
        return loss
    return loss, CLIPOutput(loss=loss, image_embeds=F.normalize(image, dim=-1), text_embeds=F.normalize(text, dim=-1))


_BATCH_KEYS = ("input_ids", "pixel_values", "attention_mask", *NEGATIVE_KEYS)
_IGNORED_KEYS = ("return_loss",)  # what a CLIP data collator may add for CLIPModel.forward


class HNClipTrainer(transformers.Trainer):
    """``transformers.Trainer`` training a CLIP model with the HN-CLIP loss (:func:`clip_model_loss`).

    Takes every ``Trainer`` argument plus the loss's keyword options::

        trainer = HNClipTrainer(model=model, args=args, train_dataset=ds, data_collator=collate,
                                gamma=0.5, label_smoothing=0.0, false_negative_threshold=None,
                                backend="auto", chunk_size=None, margin="text", group_mode="mask",
                                negatives_layout="shared")

    A ``SiglipModel`` trains with the sigmoid loss (:func:`clip_model_loss`; ``group_mode`` is its).

    Batches are dicts with ``input_ids``, ``pixel_values`` and optionally ``attention_mask``,
    ``negative_input_ids``, ``negative_attention_mask`` and ``group_ids`` (hard negatives: the
    layout of :mod:`~hnclip_kernels.integrations.transformers_negatives`, which
    ``data_collator=collate_hard_negatives`` builds from per-example lists; those columns survive
    ``remove_unused_columns``; ``negatives_layout="own"`` makes each example's negatives its own
    row's, :func:`clip_model_loss`). ``return_loss`` is ignored; any other key raises ``ValueError``
    (it would be silently unused). Under ``torchrun`` each rank's loss is its share of the global batch's
    (:func:`clip_model_loss`), so DDP's averaged gradients are the global batch's. Evaluation
    reports the same loss; its predictions are the normalised ``(image_embeds, text_embeds)``
    and its labels the pairs' positions in the evaluation (int64: row i's caption is text row
    ``labels[i]`` of the concatenated predictions, across batches and ranks), so a
    ``compute_metrics`` can score retrieval (R@1: ``argmax(image_embeds @ text_embeds.T, 1) ==
    labels``). With ``batch_eval_metrics`` they stay positions in the whole evaluation.
    Mixed precision (``bf16=True``/``fp16=True``) runs the embedding pass under accelerate's
    autocast; the loss itself accumulates in float32.

    ``label_smoothing`` None (the default) takes ε from ``TrainingArguments.label_smoothing_factor``
    (0 by default; the same ε as ``cross_entropy``'s), applied inside the loss (the Trainer's own
    label smoother is not used). Raises ``ValueError`` if both are set and differ.

    Under FSDP or DeepSpeed it makes the model's 0-dim parameters (``logit_scale``) shape (1,)
    before the Trainer wraps the model (:mod:`hnclip_kernels.sharding`; an optimizer passed in
    ``optimizers`` then raises ``ValueError``) and saves them 0-dim, so ``CLIPModel.from_pretrained``
    loads its checkpoints; so too a ``CLIPModel`` whose ``logit_scale`` was made (1,) beforehand.

    ``chunk_size=C`` (:func:`clip_model_loss`): ``per_device_train_batch_size`` is then the
    contrastive batch (× world size under torchrun) and the encoders hold the activations of C
    pairs; evaluation runs in chunks of C too. ``gradient_accumulation_steps`` K, with or without
    it, averages K separate contrastive batches (each micro-batch is its own loss, its negatives
    only its own pairs): it does not enlarge the contrastive batch. To contrast more pairs,
    raise ``per_device_train_batch_size`` with a ``chunk_size``; keep K for what still does not fit.
    """

    # compute_loss returns a per-batch mean: the Trainer divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args,
        gamma: float = 0.5,
        label_smoothing: Optional[float] = None,
        false_negative_threshold: Optional[float] = None,
        backend: str = "auto",
        chunk_size: Optional[int] = None,
        margin: str = "text",
        group_mode: str = "mask",
        negatives_layout: str = "shared",
        **kwargs,
    ):
        # bad options fail here, where they are written, not at the first step
        eps = 0.0 if label_smoothing is None else label_smoothing
        _loss_module(gamma, eps, false_negative_threshold, backend, margin)
        chunk_size = check_chunk_size(chunk_size)
        negatives_layout = NegativesLayout.parse(negatives_layout)
        super().__init__(*args, **kwargs)
        factor = self.args.label_smoothing_factor
        if label_smoothing is None:
            label_smoothing = factor
            try:
                _loss_module(gamma, label_smoothing, false_negative_threshold, backend)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"TrainingArguments(label_smoothing_factor={factor}) is the loss's ε: {exc}") from exc
        elif factor != 0 and factor != label_smoothing:
            raise ValueError(
                f"HNClipTrainer got label_smoothing={label_smoothing} and TrainingArguments("
                f"label_smoothing_factor={factor}); set one of them (or both to the same value)"
            )
        self.label_smoother = None  # ε is applied inside the loss, with cross_entropy's semantics
        self.hn_options = dict(
            gamma=gamma,
            label_smoothing=label_smoothing,
            false_negative_threshold=false_negative_threshold,
            backend=backend,
        )
        self._eval_rows = 0
        if chunk_size is not None:  # passed on only when set: without it the call is today's
            self.hn_options["chunk_size"] = chunk_size
        self.hn_options["margin"] = margin
        if group_mode != "mask":  # the sigmoid loss's (SigLIP models); passed on only when set
            self.hn_options["group_mode"] = group_mode
        if _layout(negatives_layout, self.model) is not NegativesLayout.SHARED:  # passed on only when set
            self.hn_options["negatives_layout"] = negatives_layout.value
        # FSDP and DeepSpeed take no 0-dim parameter: train them (1,), save them 0-dim (_save)
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        self.scalar_names = unsqueeze_scalar_parameters(self.model) if sharded else ()
        if self.scalar_names and self.optimizer is not None:
            raise ValueError(
                "HNClipTrainer under FSDP/DeepSpeed makes the model's 0-dim parameters (1,) "
                f"({', '.join(self.scalar_names)}): build the optimizer you pass after "
                "hnclip_kernels.sharding.unsqueeze_scalar_parameters(model), or let the Trainer build it"
            )
        if not self.scalar_names and isinstance(self.model, transformers.CLIPModel) and self.model.logit_scale.dim():
            self.scalar_names = ("logit_scale",)  # made (1,) beforehand (docs/distributed.md's recipe)

    def _save(self, output_dir=None, state_dict=None):
        # the checkpoint is the unmodified model's: CLIPModel.from_pretrained refuses a (1,) logit_scale
        if self.scalar_names and (state_dict is None or len(state_dict)):  # {}: DeepSpeed's own checkpoint
            state = self.accelerator.unwrap_model(self.model).state_dict() if state_dict is None else state_dict
            state_dict = squeeze_scalar_parameters(state, self.scalar_names)
        return super()._save(output_dir, state_dict=state_dict)

    def _set_signature_columns_if_needed(self):
        # remove_unused_columns keeps the columns of model.forward: the hard-negative ones too
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns, *NEGATIVE_KEYS]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        unknown = sorted(set(inputs) - set(_BATCH_KEYS) - set(_IGNORED_KEYS))
        if unknown:
            raise ValueError(
                f"HNClipTrainer batches hold {', '.join(_BATCH_KEYS)}; got also {', '.join(unknown)} "
                "(drop them in the data collator)"
            )
        for key in ("input_ids", "pixel_values"):
            if inputs.get(key) is None:
                raise ValueError(f"HNClipTrainer batches need {key!r}; got keys {sorted(inputs)}")
        with self.accelerator.autocast():
            return clip_model_loss(
                model,
                inputs["input_ids"],
                inputs["pixel_values"],
                inputs.get("attention_mask"),
                return_outputs=return_outputs,
                **{key: inputs[key] for key in NEGATIVE_KEYS if inputs.get(key) is not None},
                **self.hn_options,
            )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Trainer.prediction_step calls model(**inputs) for a CLIPModel without labels: N×N
        # logits and no loss. Evaluate with the training loss instead.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        return loss, (outputs.image_embeds.detach(), outputs.text_embeds.detach()), self._pair_positions(outputs)

    def evaluation_loop(self, *args, **kwargs):
        self._eval_rows = 0  # labels count the pairs of one evaluation
        return super().evaluation_loop(*args, **kwargs)

    def _pair_positions(self, outputs) -> torch.Tensor:
        """This batch's pairs' positions in the evaluation's gathered predictions (the Trainer
        concatenates batches in order, ranks in rank order within a step): under
        ``torch.distributed`` one all_gather of the ranks' batch sizes per step."""
        n = outputs.image_embeds.shape[0]
        device = outputs.image_embeds.device
        rank, world_size = _distributed_layout()
        sizes = gather_sizes(n, device) if world_size > 1 else [n]
        start = self._eval_rows + sum(sizes[:rank])
        self._eval_rows += sum(sizes)
        return torch.arange(start, start + n, device=device)
