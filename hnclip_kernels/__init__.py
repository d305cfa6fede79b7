"""hnclip-kernels: the HN-CLIP contrastive loss (arXiv 2608.18521), exact, fast and memory-lean.

Public API: :func:`hn_clip_loss`, :func:`hn_siglip_loss` (the sigmoid loss), :class:`HNClipLoss` (drop-in for open_clip's ClipLoss),
:class:`HNSigLipLoss` (drop-in for open_clip's SigLipLoss), :func:`sigmoid_saturation_report`
(the pairs a naive float32 sigmoid-loss gradient loses),
:func:`gather_features`, :func:`workspace_bytes`, :class:`DirectionRows` (``reduction="directions"``), :func:`chunked_encode` / :func:`chunked_features`
(encoders run in recomputed chunks: contrastive batches beyond the encoders' activation memory).
Backends: ``hnclip_kernels.backends.pytorch.reference`` (pure PyTorch),
``hnclip_kernels.backends.triton.ops`` (fused Triton kernels), ``hnclip_kernels.backends.cpp.ops``
(fused C++ CPU kernel).
"""

from .backends.directions import DirectionRows
from .chunked import chunked_encode, chunked_features
from .clip_loss import HNClipLoss
from .diagnostics_sigmoid import SigmoidSaturationReport, sigmoid_saturation_report
from .distributed import gather_features
from .loss import hn_clip_loss
from .options import LossOptions
from .siglip import hn_siglip_loss
from .siglip_loss import HNSigLipLoss


def workspace_bytes(
    n,
    d,
    dtype,
    *,
    gamma=0.5,
    label_smoothing=0.0,
    local_rows=None,
    device=None,
    false_negative_threshold=None,
    negatives=0,
    group_ids=False,
    own_negatives=0,
    normalize=True,
    reduction="none",
    group_mode="mask",
    positive_pairs=0,
) -> int:
    """Bytes the fused Triton path allocates beyond inputs and outputs (forward statistics plus
    the backward's dS chunk), GPU launch configuration; ``local_rows``: a rank's M for the
    distributed loss's per-rank op (both directions of its M local rows against n gathered columns);
    ``negatives`` (M hard-negative captions) and ``group_ids`` (bool): the hard-negative family's
    loss; ``own_negatives`` (K, each row's own negatives (N, K, D)), ``normalize`` and
    ``reduction`` ("directions": two directional walks; with ``own_negatives`` also their autograd
    block, and ``local_rows`` a rank's rows); ``group_mode`` ("supcon"/"mil_nce" with ``group_ids``:
    the host pass over ``positive_pairs`` = Σ over groups of |G|² same-group pairs). See :func:`hnclip_kernels.backends.triton.workspace.workspace_bytes`
    (imported on call: Triton is an optional dependency)."""
    from .backends.triton.workspace import workspace_bytes as _workspace_bytes

    return _workspace_bytes(
        n,
        d,
        dtype,
        gamma=gamma,
        label_smoothing=label_smoothing,
        local_rows=local_rows,
        device=device,
        false_negative_threshold=false_negative_threshold,
        negatives=negatives,
        group_ids=group_ids,
        own_negatives=own_negatives,
        normalize=normalize,
        reduction=reduction,
        group_mode=group_mode,
        positive_pairs=positive_pairs,
    )


__all__ = [
    "hn_clip_loss",
    "hn_siglip_loss",
    "sigmoid_saturation_report",
    "SigmoidSaturationReport",
    "HNClipLoss",
    "HNSigLipLoss",
    "gather_features",
    "LossOptions",
    "DirectionRows",
    "workspace_bytes",
    "chunked_encode",
    "chunked_features",
]
__version__ = "0.1.0"
