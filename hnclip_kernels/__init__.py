"""hnclip-kernels: the HN-CLIP contrastive loss (arXiv 2608.18521), exact, fast and memory-lean.

Public API: :func:`hn_clip_loss`, :class:`HNClipLoss` (drop-in for open_clip's ClipLoss),
:func:`gather_features`. Backends: ``hnclip_kernels.backends.pytorch.reference`` (pure PyTorch),
``hnclip_kernels.backends.triton.ops`` (fused Triton kernels), ``hnclip_kernels.backends.cpp.ops``
(fused C++ CPU kernel).
"""
from .clip_loss import HNClipLoss
from .distributed import gather_features
from .loss import hn_clip_loss
from .options import LossOptions

__all__ = ["hn_clip_loss", "HNClipLoss", "gather_features", "LossOptions"]
__version__ = "0.1.0"
