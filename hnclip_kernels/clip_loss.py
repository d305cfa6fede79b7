"""``HNClipLoss``: a drop-in replacement for ``open_clip.loss.ClipLoss`` computing HN-CLIP."""

from __future__ import annotations

import dataclasses
from typing import Union

import torch
from torch import nn

from . import validation
from .backends import direction_losses, symmetric_losses
from .distributed import rank_loss
from .loss import module_family_loss
from .module_checks import check_horovod, check_layout, check_positional_flags, checked_attribute
from .module_group import HoldsProcessGroup
from .numerics import autocast_disabled
from .options import LossOptions, as_tau_tensor, option_attribute, tau_from_scale
from .plausibility import warn_if_implausible_logit_scale
from .reports import report_of_call
from .validation_options import check_module_reduction


class HNClipLoss(HoldsProcessGroup, nn.Module):
    """HN-CLIP contrastive loss (arXiv 2608.18521) with open_clip's ``ClipLoss`` interface.

    ``python -m hnclip_kernels.train`` runs open_clip's trainer with it (see
    :mod:`hnclip_kernels.train`). In your own loop, swap it in where ``ClipLoss`` is built
    (in open_clip 3.x that is ``open_clip.create_loss``, defined in ``open_clip/factory.py``)::

        loss = HNClipLoss(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad,
                          cache_labels=True, rank=args.rank, world_size=args.world_size,
                          gamma=0.5)
        total = loss(image_features, text_features, logit_scale)   # logit_scale = model's exp'd scale

    With ``gamma=0`` (and ``label_smoothing=0``) it equals ``ClipLoss`` in value and in the
    gradients of the image features, text features and ``logit_scale``, in every mode below.

    Modes (``W`` ranks, rank r holds n_r pairs, global batch of N = Σ n_r pairs in rank
    order; ``L`` is the single-process HN-CLIP mean loss on the global batch, ``ℓ_i`` its
    per-pair rows ½(i2t_i + t2i_i); "DDP-averaged" means each rank's gradients summed over
    ranks and divided by W, as DistributedDataParallel does):

    * ``local_loss=True, gather_with_grad=True`` (recommended, open_clip's
      ``--local-loss --gather-with-grad``): rank r computes only its own rows: its n_r
      images against all N texts and its n_r texts against all N images, positives at global
      column ``offset_r + i``, margins from its texts against all gathered texts (global
      margins). It returns ``(W/N)·Σ_{i on r} ℓ_i`` (equal sizes: the mean of its rows); the
      mean over ranks is ``L``. Gradients through the gather are summed into the owning rank,
      so the DDP-averaged gradient of every parameter, ``logit_scale`` included, equals the
      gradient of ``L`` on one process. Exact also with unequal local batch sizes. The fused
      backends never hold an n×N matrix.
    * ``local_loss=True, gather_with_grad=False``: same rows and value, but the gathered
      features are constants: a rank's features receive only their *query-side* gradient
      (its images as i2t queries, its texts as t2i queries); the key-side part (as negatives
      and positives in every rank's rows) is dropped. DDP-averaged: ``logit_scale``'s
      gradient equals dL/ds exactly; the model's gradient is the query-side part of dL/dθ.
      Cheapest, not the global-batch gradient.
    * ``local_loss=False, gather_with_grad=False`` (open_clip's default): every rank
      computes the full global loss ``L`` (all N rows, offset 0); only the rank's own slot of
      the gathered features carries gradients. Each rank's feature gradients are exactly
      dL/d(own features), so DDP-averaged model gradients are dL/dθ **divided by W**, while
      ``logit_scale``'s DDP-averaged gradient is dL/ds (not divided). Every rank does the
      whole N×N work.
    * ``local_loss=False, gather_with_grad=True``: every rank computes ``L`` on the full batch
      and gradients through the gather are summed (W·dL/d(own features) per rank), so the
      DDP-averaged gradients equal dL/dθ and dL/ds exactly, at W times the compute.
    * ``world_size=1``: the single-process loss ``L`` on the local batch; all modes coincide.

    Args:
        local_loss, gather_with_grad, rank, world_size: as ``ClipLoss`` (``rank`` and
            ``world_size`` must be this process's rank and the size of ``group``).
        cache_labels: accepted for compatibility; has no effect (no label tensor is built:
            the kernels index the positives by offset).
        use_horovod: not supported; ``True`` raises ``ValueError``.
        gamma: margin scale γ ≥ 0 (0.5 is the paper's value; 0 is CLIP's InfoNCE).
        label_smoothing: ε in [0, 1), ``cross_entropy`` semantics.
        backend: "auto", "torch", "triton" or "cpp" (see :func:`hnclip_kernels.hn_clip_loss`).
        normalize: L2-normalise the features inside. Default False because open_clip's
            ``CLIP.forward`` already returns normalised features (as ``ClipLoss`` assumes);
            pass True for raw embeddings.
        precision: the Triton backend's tensor-core input precision for float32 features
            (see :func:`hnclip_kernels.hn_clip_loss`); None is its default, "tf32x3".
        group: process group to gather over (default: the global group). ``copy.deepcopy``
            (and ``torch.optim.swa_utils.AveragedModel``) share it with the copy; pickling
            leaves it out: an unpickled loss uses the default group if it had none, else raises
            at its first ``forward`` with ``world_size > 1`` until ``loss.group`` is set again.
        false_negative_threshold: None, or a caption cosine in (−1, 1] at and above which a pair
            i ≠ j is masked as a false negative in both directions (not in the paper; see
            :func:`hnclip_kernels.hn_clip_loss`). Distributed, the mask compares this rank's
            captions against all gathered captions, so a duplicate on another rank is masked too.
        return_stats: after every ``forward``, put a
            :class:`hnclip_kernels.diagnostics.SaturationReport` of this rank's rows in
            ``self.last_stats``, computed from the row statistics the loss kernels already
            save (no second forward): ``loss``, ``saturated_rows`` and
            ``effective_negatives`` are filled, the fields that need the logits again
            (naive float32/bf16 losses, lost positives, hardest margins) are None; use
            :func:`hnclip_kernels.diagnostics.saturation_report` for those. It costs a few
            O(N) reductions and one host sync per step (None for meta tensors and under
            ``torch.compile``, where no value can be read). The report is kept on the module,
            not put in ``output_dict``, because open_clip's training loop sums every value
            of that dict into the total loss.
        margin: "text" (default, the paper's sg(t_i·x)) or "image_text" (sg(v_i·x), LLaVE-style
            hardness); see :func:`hnclip_kernels.hn_clip_loss` and ``docs/hard_negatives.md``.
            With ``forward``'s ``negatives``/``group_ids``: the hard-negative family on every
            backend ("auto" as for today's loss), also with ``world_size > 1`` (each rank's
            negatives and ids gathered like its captions, M_r may differ and be 0; 16-bit
            features upcast to float32 before the gather).
        group_mode: what equal ``group_ids`` mean: "mask" (default: no negatives of each other) or
            "supcon" / "mil_nce" (positives, multi-positive targets; see
            :func:`hnclip_kernels.hn_clip_loss` and ``docs/hard_negatives.md#multi-positive-targets``),
            across ranks too (a group may span ranks); then every ``forward`` needs ``group_ids``
            (every backend) and ``return_stats`` is False. Each row's own (N, K, D) negatives
            compose with them as extra negatives of the image→text rows (where own negatives run).
        reduction: "mean" (default: the loss of each mode above) or "directions": ``forward``
            returns a :class:`~hnclip_kernels.DirectionRows` ``(i2t, t2i, lse_i2t, lse_t2i)``
            instead, each direction's rows and log-partition, unscaled: with ``local_loss=True``
            (and ``world_size > 1``) this rank's own n_r rows, else all N rows of the (gathered)
            batch; for FastCLIP-style estimators of the global normaliser (``docs/api.md``,
            "Per-direction rows"; with a positive ``group_mode`` the mode's rows and the LSE over
            every class, positives included). ``output_dict=True`` then raises (open_clip's loop sums the
            dict's values). "sum" and "none" raise ``ValueError`` (``hn_clip_loss`` has them).

    ``gamma``, ``label_smoothing``, ``backend``, ``normalize``, ``precision`` and
    ``false_negative_threshold`` (and ``margin``, ``group_mode``) are checked at
    construction: a bad value raises ``TypeError``/``ValueError`` there, not at the first forward.
    As attributes they live in ``self.options`` only: ``loss.gamma = 0.3`` (a γ warm-up) is
    validated with the constructor's errors and used from the next ``forward`` on (under
    ``torch.compile`` a new value may recompile), and ``repr`` shows the values in use. The
    constructor's other arguments (``local_loss``, ``gather_with_grad``, ``cache_labels``,
    ``use_horovod``, ``rank``, ``world_size``, ``return_stats``) are checked on assignment too.

    Warns (``RuntimeWarning``, once per process each; never under ``torch.compile``, where
    nothing is read): a ``logit_scale`` below 1 (τ, e.g. 0.07, passed in its place) or between 1
    and log 100 = 4.61 (open_clip's un-exponentiated log-scale, 2.66 at init; τ = 1/s would be
    0.22 or warmer), see :func:`hnclip_kernels.plausibility.scale_mistake`: the plausible range
    is s > 4.61, and open_clip's s is 14.3 at init and clamped to 100. With ``normalize=False``,
    features (and, once on their own, ``negatives``) whose row norms are off 1 by more than 5%
    (open_clip's ``encode_text`` without ``normalize=True``; the loss is then one of dot products,
    not cosines), from the norms its overflow check reads anyway (no extra host sync).

    Unequal local batch sizes (e.g. the last batch of an epoch) are exact: sizes are
    all-gathered, features padded to the largest, gathered and stripped. Invalid or
    inconsistent inputs raise on every rank, never hang (see ``hnclip_kernels.distributed``).
    Each ``forward`` with ``world_size > 1`` costs one extra tiny all_gather (sizes and
    checks) and one host sync. Autocast is disabled inside the loss (float32 accumulation).
    """

    # the warning about an implausible s (a subclass that forms s itself words its own, see
    # integrations.transformers)
    _scale_warning = staticmethod(warn_if_implausible_logit_scale)

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        gamma: float = 0.5,
        label_smoothing: float = 0.0,
        backend: str = "auto",
        normalize: bool = False,
        group=None,
        precision=None,
        return_stats: bool = False,
        false_negative_threshold=None,
        margin: str = "text",
        group_mode: str = "mask",
        reduction: str = "mean",
    ):
        super().__init__()
        check_module_reduction(reduction, "HNClipLoss")
        check_positional_flags(
            local_loss=local_loss,
            gather_with_grad=gather_with_grad,
            cache_labels=cache_labels,
            use_horovod=use_horovod,
            rank=rank,
            world_size=world_size,
        )
        check_horovod(use_horovod)
        check_layout(rank, world_size)
        # bad options fail here, where they are written, not at the first forward; the option
        # attributes (gamma, ...) read and write this one object (options.option_attribute)
        self.options = LossOptions(
            gamma=gamma,
            label_smoothing=label_smoothing,
            normalize=normalize,
            backend=backend,
            precision=precision,
            false_negative_threshold=false_negative_threshold,
            margin=margin,
            group_mode=group_mode,
            reduction=reduction,
        )
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.world_size = world_size
        self.rank = rank
        self.use_horovod = use_horovod
        self.group = group
        self.return_stats = return_stats
        self.last_stats = None

    gamma = option_attribute("gamma")
    label_smoothing = option_attribute("label_smoothing")
    backend = option_attribute("backend")
    normalize = option_attribute("normalize")
    precision = option_attribute("precision")
    false_negative_threshold = option_attribute("false_negative_threshold")
    margin = option_attribute("margin")
    group_mode = option_attribute("group_mode")

    @property
    def reduction(self) -> str:
        """ "mean" or "directions" (see the class docstring), read from and written to ``self.options``."""
        return self.options.reduction

    @reduction.setter
    def reduction(self, value: str) -> None:
        check_module_reduction(value, "HNClipLoss")
        self.options = dataclasses.replace(self.options, reduction=value)

    def extra_repr(self) -> str:
        return (
            f"local_loss={self.local_loss}, gather_with_grad={self.gather_with_grad}, "
            f"rank={self.rank}, world_size={self.world_size}, gamma={self.gamma}, "
            f"label_smoothing={self.label_smoothing}, backend={self.backend!r}, "
            f"normalize={self.normalize}, precision={self.precision!r}, return_stats={self.return_stats}, "
            f"false_negative_threshold={self.false_negative_threshold}, margin={self.margin!r}, "
            f"group_mode={self.group_mode!r}" + (f", reduction={self.reduction!r}" if self.reduction != "mean" else "")
        )

    def _single_process(self, image_features, text_features, tau, tau_value):
        """The loss on one process: the fused symmetric op of :func:`hnclip_kernels.hn_clip_loss`,
        its mean over the batch (and the row statistics with ``return_stats``)."""
        options = self.options.bind(
            image_features, text_features, tau, tau_value=tau_value, names=("image_features", "text_features")
        )
        tau_t = as_tau_tensor(tau, image_features)
        with autocast_disabled(image_features.device):
            if options.reduction == "directions":  # the rows themselves, not their mean
                out = direction_losses(
                    image_features, text_features, image_features, text_features, tau_t, 0, options, self.return_stats
                )
                return out if not self.return_stats else (out[0], (*out[1], image_features.shape[0]))
            out = symmetric_losses(image_features, text_features, tau_t, options, self.return_stats)
        if not self.return_stats:
            return out.mean()
        rows, stats = out
        return rows.mean(), (*stats, image_features.shape[0])

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: Union[float, torch.Tensor],
        logit_bias=None,
        output_dict: bool = False,
        *,
        negatives=None,
        group_ids=None,
        negatives_mask=None,
    ):
        """Loss of this rank (see the class docstring for what it equals in each mode).

        Args:
            image_features, text_features: (n, D) local features of this rank, row i paired.
            logit_scale: open_clip's already-exponentiated scale s = 1/τ (``model(...)``'s
                third output, i.e. ``model.logit_scale.exp()``); a tensor requiring grad
                receives ds in its own dtype. τ = 1/s is formed in float32 (float64 for
                float64 s or features), also for a 16-bit s (``--precision pure_bf16``).
                A Python float or NumPy scalar is accepted too. A value of log 100 = 4.61 or
                less (τ, or the un-exponentiated log-scale) warns once (see the class docstring).
            logit_bias: must be None (SigLIP-style biases are not part of HN-CLIP).
            output_dict: return ``{"contrastive_loss": loss}`` instead of the scalar.
            negatives, group_ids: None, or (M, D) hard-negative caption embeddings (extra i2t
                columns) and (n,) integer pair ids, as in :func:`hnclip_kernels.hn_clip_loss`.
                With ``world_size > 1`` this rank's (M may differ across ranks and be 0; ids on
                every rank or none): gathered like the captions, so the loss is the family loss
                of the concatenated global batch in each mode above
                (:func:`hnclip_kernels.distributed_hn_clip_loss`). With ``world_size`` 1 also
                (N, K, D), each row's own negatives, with ``negatives_mask`` (N, K) bool (True:
                real), as in :func:`hnclip_kernels.hn_clip_loss`; across ranks this rank's rows'
                own (not gathered with ``local_loss=True``, backend "torch" only there, every backend
                with ``reduction="directions"``; gathered
                on every backend with ``local_loss=False``; :func:`hnclip_kernels.distributed_hn_clip_loss`).

        Returns:
            A float32 scalar (float64 for float64 features), or the dict; as ``ClipLoss``. With
            ``reduction="directions"`` a :class:`~hnclip_kernels.DirectionRows` (see the class docstring).
        """
        if output_dict and self.reduction == "directions":
            raise ValueError(
                "HNClipLoss(reduction='directions') returns DirectionRows, not a loss: output_dict=True would "
                "put the rows in open_clip's summed loss dict; weight the rows and pass the scalar yourself"
            )
        if logit_bias is not None:
            raise ValueError(
                "HNClipLoss does not take a logit_bias (HN-CLIP has no bias term); "
                "use a model without init_logit_bias or open_clip's SigLipLoss"
            )
        logit_scale = validation.plain_number(logit_scale)
        scale_value, problem = validation.read_logit_scale(logit_scale)
        tau_value = None if scale_value is None else 1.0 / scale_value  # τ's one host read is s's
        self._scale_warning(scale_value)
        if problem is not None:
            if self.world_size == 1:
                raise problem
            # raising here would leave the other ranks waiting in a collective: a NaN τ fails the
            # all-ranks check inside, which raises on every rank; this rank then names logit_scale
            tau, tau_value = float("nan"), None
        else:
            tau = tau_from_scale(logit_scale, image_features)
        if self.world_size == 1:  # the family's one predicate: validation_family.family_of, inside
            family = module_family_loss(
                image_features, text_features, tau, self.options, negatives, group_ids,
                return_stats=self.return_stats, tau_value=tau_value, problem=problem, negatives_mask=negatives_mask,
            )  # fmt: skip
            if family is not None:  # None: M = 0 and no other family option, today's loss below
                loss, self.last_stats = family
                return {"contrastive_loss": loss} if output_dict else loss
        self.check_group_kept()
        if self.world_size == 1:
            loss = self._single_process(image_features, text_features, tau, tau_value)
        else:
            try:
                loss = rank_loss(
                    image_features,
                    text_features,
                    tau,
                    self.options,
                    local_loss=self.local_loss,
                    gather_with_grad=self.gather_with_grad,
                    rank=self.rank,
                    world_size=self.world_size,
                    group=self.group,
                    return_stats=self.return_stats,
                    tau_value=tau_value,
                    negatives=negatives,  # gathered like the captions (distributed.family); None: today's path
                    group_ids=group_ids,
                    negatives_mask=negatives_mask,  # each row's own (N, K, D): distributed.family
                )
            except (TypeError, ValueError) as exc:
                if problem is not None:
                    raise problem from exc
                raise
        if self.return_stats:
            loss, (i2t, t2i, n_keys) = loss
            self.last_stats = report_of_call(
                i2t, t2i, image_features, label_smoothing=self.options.label_smoothing, n_keys=n_keys
            )
        return {"contrastive_loss": loss} if output_dict else loss


for _name in ("local_loss", "gather_with_grad", "cache_labels", "use_horovod", "return_stats", "rank", "world_size"):
    setattr(HNClipLoss, _name, checked_attribute(_name))
