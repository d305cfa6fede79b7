"""One rank's HN-CLIP loss from its local rows and the gathered global batch."""

from __future__ import annotations

from typing import Union

import torch

from ..backends import direction_losses, rank_losses, symmetric_losses
from ..options import LossOptions, as_tau_tensor


def rank_hn_clip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    all_image_features: torch.Tensor,
    all_text_features: torch.Tensor,
    tau: Union[float, torch.Tensor],
    offset: int,
    options: LossOptions,
    *,
    local_loss: bool = True,
    world_size: int = 1,
    return_stats: bool = False,
):
    """This rank's HN-CLIP loss from its local features and the gathered global ones.

    ``local_loss=True`` (and ``world_size > 1``): rank rows only. i2t rows are the local
    images against all N texts, t2i rows the local texts against all N images, positive of
    local row i at global column ``offset + i`` (``offset`` = this rank's first global row),
    margins from the local texts against all texts (global margins); one fused op for both
    directions on Triton (the margin's product shared), two directional calls on the others
    (``backends.rank_losses``). Returns ``(W / N) · Σ_i ½(i2t_i + t2i_i)``: the mean over ranks
    of this value is the global mean loss (equal sizes: the mean of local rows).

    ``local_loss=False`` or ``world_size == 1``: the full global batch on this rank, all N
    images against all N texts, offset 0: exactly the single-process loss, computed by the
    same fused symmetric op as :func:`hnclip_kernels.hn_clip_loss` (one logit tile serves
    both directions; 16-bit features upcast once). ``offset`` and the local tensors are not
    used. Returns the global mean loss.

    ``return_stats``: also ``(i2t, t2i, n_keys)``: the detached ``backends.softmax.RowStats`` of
    this rank's rows in both directions and the number of key columns N (what
    :func:`hnclip_kernels.diagnostics.report_from_row_stats` reads).
    ``options.reduction == "directions"``: instead of the loss, the rows of
    :func:`rank_direction_rows` (unscaled), with ``return_stats`` as above.
    ``options``: the loss options bound to these tensors (:meth:`LossOptions.resolved`: the
    backend resolved). No input checks (``distributed_hn_clip_loss`` does them collectively).
    """
    tau_t = as_tau_tensor(tau, all_image_features)
    if options.reduction == "directions":
        out = rank_direction_rows(
            (image_features, text_features), (all_image_features, all_text_features), tau_t, offset, options,
            local_loss=local_loss, world_size=world_size, return_stats=return_stats,
        )  # fmt: skip
        return (out[0], (*out[1], all_image_features.shape[0])) if return_stats else out
    if not local_loss or world_size == 1:
        out = symmetric_losses(all_image_features, all_text_features, tau_t, options, return_stats)
        rows, stats = out if return_stats else (out, None)
        loss = rows.mean()
        return (loss, (*stats, all_image_features.shape[0])) if return_stats else loss
    out = rank_losses(
        image_features, text_features, all_image_features, all_text_features, tau_t, offset, options, return_stats
    )
    rows, (i2t_stats, t2i_stats) = out if return_stats else (out, (None, None))
    n_total = all_image_features.shape[0]
    if n_total == world_size * image_features.shape[0]:
        loss = rows.mean()  # equal sizes: exactly ClipLoss's mean of the local rows
    else:
        loss = rows.sum() / (n_total / world_size)
    return (loss, (i2t_stats, t2i_stats, n_total)) if return_stats else loss


def rank_direction_rows(local, gathered, tau, offset, options, *, local_loss, world_size, return_stats, family=None):
    """``reduction="directions"`` across ranks: the
    :class:`~hnclip_kernels.DirectionRows` of this rank's rows (``local_loss=True``, ``world_size >
    1``: its n_r images and captions against the gathered columns, positive at ``offset + i``),
    or of all N rows of the gathered batch (``local_loss=False``: the single-process rows of the
    concatenated batch, the same on every rank). Unscaled: the caller weights them. ``local`` /
    ``gathered``: (images, captions); ``tau`` a tensor; ``family`` the gathered family or None."""
    if local_loss and world_size > 1:
        return direction_losses(*local, *gathered, tau, offset, options, return_stats, family)
    return direction_losses(*gathered, *gathered, tau, 0, options, return_stats, family)
