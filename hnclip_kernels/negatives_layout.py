"""Which rows a batch's hard-negative captions are columns of, as one typed option of the trainer's
CSV column and the Hugging Face collation (``--hn-negatives-layout``, ``negatives_layout=``).

* ``"shared"`` (default, NegCLIP's): the batch's M negatives are ``negatives`` (M, D), extra
  image→text columns of every row;
* ``"own"`` (FSC-CLIP, the Qwen3-Embedding loss, sentence-transformers' per-query negatives): row
  i's negatives only are its extra columns, ``negatives`` (B, K, D) with ``negatives_mask`` (B, K)
  (``docs/hard_negatives.md``, "Each row's own negatives").

Both embed only the real negatives (M text-tower rows); ``own`` then scatters them into their slots
(:func:`own_slots`). Imports no module of the package.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["NegativesLayout", "own_slots"]


class NegativesLayout(str, enum.Enum):
    """Shared columns of every row (``SHARED``, "shared") or each row's own (``OWN``, "own"); a
    ``str`` so that ``layout == "shared"`` keeps holding."""

    SHARED = "shared"
    OWN = "own"

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, negatives_layout, name: str = "negatives_layout") -> "NegativesLayout":
        """``negatives_layout`` ("shared", "own" or a :class:`NegativesLayout`) as a member;
        ``name``: how the caller spells the option in the errors.

        Raises:
            TypeError: not a string. ValueError: another string."""
        if isinstance(negatives_layout, cls):
            return negatives_layout
        if not isinstance(negatives_layout, str):
            raise TypeError(f"{name} must be a string, 'shared' or 'own', got {type(negatives_layout).__name__}")
        try:
            return cls(negatives_layout)
        except ValueError:
            raise ValueError(
                f"{name} must be 'shared' (every image→text row gets all the batch's negatives, NegCLIP's) or "
                f"'own' (row i gets only its own negatives), got {negatives_layout!r}"
            ) from None


def own_slots(features: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The real negatives' embeddings ``features`` (M, D) scattered into their slots: (B, K, D)
    zeros but ``out[keep] = features`` (``keep`` (B, K) bool with M True entries, in row-major order:
    example by example, slot by slot). Differentiable in ``features``; the padding slots are zeros
    (the loss never reads them: ``negatives_mask`` = ``keep``).

    Raises:
        ValueError: ``keep`` not (B, K) bool, or M not its count of True entries."""
    if keep.dim() != 2 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a (B, K) bool mask of the negative slots, got {keep.dtype} {tuple(keep.shape)}")
    count = int(keep.sum())
    if features.dim() != 2 or features.shape[0] != count:
        raise ValueError(
            f"own_slots needs one embedding per real slot: keep has {count}, features shape {tuple(features.shape)}"
        )
    out = features.new_zeros(*keep.shape, features.shape[-1])
    return out.index_put((keep.to(features.device),), features)
