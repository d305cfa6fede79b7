"""``HNSigLipLoss``: a drop-in replacement for ``open_clip.loss.SigLipLoss`` with the adaptive margin."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from .distributed import sigmoid_rank_loss
from .module_checks import check_layout, check_positional_flags
from .module_group import HoldsProcessGroup
from .options_sigmoid import SigmoidOptions
from .siglip import sigmoid_rows

# open_clip 3.3.0's SigLipLoss.dist_impl values (None is its default, "bidir")
DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
NAMES = ("image_features", "text_features")


class HNSigLipLoss(HoldsProcessGroup, nn.Module):
    """The sigmoid loss of SigLIP with HN-CLIP's adaptive margin (:func:`hnclip_kernels.hn_siglip_loss`),
    with open_clip's ``SigLipLoss`` interface (``docs/siglip.md``). Swap it in where open_clip
    builds ``SigLipLoss`` (``open_clip.create_loss``)::

        loss = HNSigLipLoss(rank=args.rank, world_size=args.world_size, gamma=0.5)
        total = loss(image_features, text_features, logit_scale, logit_bias)  # the model's exp'd scale, bias

    With ``gamma=0`` it equals ``SigLipLoss`` in value and in the gradients of the features,
    ``logit_scale`` and ``logit_bias`` on every rank, for every ``dist_impl``.

    Across ranks (``world_size > 1``), rank r holds n_r pairs; its n_r image rows meet the N = Σ n_r
    captions of all ranks, gathered once with autograd (each rank's captions receive every rank's
    gradient, as through open_clip's exchanges), positives at the rank's global offset. Rank r
    returns ``(W / N)·Σ_{i on r} r_i`` (r_i: the row's sum over its columns): with equal local
    batches ``(1/n_r)·Σ_i r_i``, open_clip's value; the mean over ranks is the global batch's loss
    for any n_r (open_clip needs equal local batches). See
    :func:`hnclip_kernels.distributed.distributed_siglip_loss`.

    Args:
        cache_labels: accepted for compatibility; no effect (no label matrix is built).
        rank, world_size: this process's rank and the size of ``group``, as ``SigLipLoss``.
        dist_impl: None, "bidir", "shift", "reduce" or "gather": how open_clip moves the captions
            between ranks (neighbour exchanges, all-reduces, an all-gather). Here every value is
            one all-gather of the captions (with gradient) and gives the same loss and gradients:
            it is validated and kept (``self.dist_impl``, None read as open_clip's default
            "bidir") so that open_clip's arguments carry over, and changes nothing.
        gamma: margin scale γ ≥ 0 (default 0.5; 0 is SigLIP exactly).
        margin: "text" (default) or "image_text" (see :func:`hnclip_kernels.hn_siglip_loss`).
        group_mode: what equal ``group_ids`` mean: "mask" (default) or "positive".
        backend, precision: as :func:`hnclip_kernels.hn_siglip_loss`.
        normalize: L2-normalise inside; default False, as open_clip's models return normalised
            features (``SigLipLoss`` assumes them).
        group: the process group (default: the global group).

    Raises:
        TypeError: ``cache_labels`` not a bool, ``rank``/``world_size`` not ints, an option of
            the wrong type (:class:`~hnclip_kernels.options_sigmoid.SigmoidOptions`).
        ValueError: a bad rank/world_size layout, an unknown ``dist_impl`` or a bad option value.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Optional[str] = None,
        *,
        gamma: float = 0.5,
        margin: str = "text",
        group_mode: str = "mask",
        backend: str = "auto",
        normalize: bool = False,
        precision: Optional[str] = None,
        group=None,
    ):
        super().__init__()
        check_positional_flags(cache_labels=cache_labels, rank=rank, world_size=world_size)
        check_layout(rank, world_size)
        if dist_impl is not None and dist_impl not in DIST_IMPLS:
            raise ValueError(
                f"dist_impl must be None or one of {DIST_IMPLS} (open_clip's SigLipLoss), got {dist_impl!r}; "
                "HNSigLipLoss gathers the captions once for every value"
            )
        self.options = SigmoidOptions(
            gamma=gamma,
            margin=margin,
            group_mode=group_mode,
            normalize=normalize,
            backend=backend,
            precision=precision,
        )
        self.cache_labels = cache_labels
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.dist_impl = dist_impl or "bidir"
        self.group = group

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"rank={self.rank}, world_size={self.world_size}, dist_impl={self.dist_impl!r}, gamma={o.gamma}, "
            f"margin={o.margin!r}, group_mode={o.group_mode!r}, backend={o.backend!r}, normalize={o.normalize}, "
            f"precision={o.precision!r}"
        )

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: Union[float, torch.Tensor],
        logit_bias: Optional[Union[float, torch.Tensor]] = None,
        output_dict: bool = False,
        *,
        negatives: Optional[torch.Tensor] = None,
        group_ids: Optional[torch.Tensor] = None,
    ):
        """This rank's loss (see the class docstring).

        Args:
            image_features, text_features: this rank's (n, D) features, row i paired (float16,
                bfloat16, float32 or float64; same dtype and device).
            logit_scale: s > 0, already exponentiated (the model's ``logit_scale.exp()``, the
                third output of open_clip's model), a float or one-element tensor (receives dL/ds).
            logit_bias: b (the model's ``logit_bias``), a float or one-element tensor (receives
                dL/db), or None for b = 0.
            output_dict: return ``{"contrastive_loss": loss}``, as ``SigLipLoss``.
            negatives: None or this rank's (M, D) hard-negative captions (label −1 in every row;
                gathered across ranks, M may differ and be 0).
            group_ids: None or this rank's (n,) integer ids (on every rank or none); equal ids
                are masked or made positives by ``group_mode``.

        Returns:
            A float32 scalar (float64 for float64 features), or the dict.

        Raises:
            TypeError, ValueError: as :func:`hnclip_kernels.hn_siglip_loss`; across ranks on
                every rank (:func:`hnclip_kernels.distributed.distributed_siglip_loss`).
        """
        self.check_group_kept()
        if self.world_size == 1:
            rows = sigmoid_rows(
                image_features, text_features, logit_scale, logit_bias, self.options, negatives, group_ids, NAMES
            )
            loss = rows.mean()
        else:
            loss = sigmoid_rank_loss(
                image_features,
                text_features,
                logit_scale,
                logit_bias,
                self.options,
                rank=self.rank,
                world_size=self.world_size,
                group=self.group,
                negatives=negatives,
                group_ids=group_ids,
            )
        return {"contrastive_loss": loss} if output_dict else loss
