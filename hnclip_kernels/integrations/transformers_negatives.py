"""Hard-negative batches for :mod:`hnclip_kernels.integrations.transformers`: collation and checks.

Split from the loss and the Trainer by role: how a dataset's per-example hard-negative captions
and group ids become the tensors :func:`~hnclip_kernels.integrations.transformers.clip_model_loss`
takes (``docs/hard_negatives.md``, "With Hugging Face").

The batch layout (what :func:`collate_hard_negatives` builds and ``HNClipTrainer`` reads):

* ``negative_input_ids``: (B, K, L) token ids, K slots per example (K the batch's largest count
  of negatives per example, L its longest negative), or (M, L) negatives already flat;
* ``negative_attention_mask``: the same shape; a slot whose mask row is all 0 holds no negative
  (an example with fewer than K negatives is padded with such slots). Without it every slot is
  a negative;
* ``group_ids``: (B,) int64 ids, equal ids for pairs that are no negatives of each other.

With ``negatives_layout="shared"`` (default) the real slots, flattened (:func:`flat_negatives`),
are extra image→text columns of every row; with ``"own"`` example b's real slots are columns of
row b only, ``negatives_mask`` (B, K) = :func:`negative_slots`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["collate_hard_negatives", "flat_negatives", "negative_slots", "NEGATIVE_KEYS"]

NEGATIVE_KEYS = ("negative_input_ids", "negative_attention_mask", "group_ids")


def _rows(value, key: str, i: int) -> list:
    """An example's negatives as a list of 1-D int64 tensors (None or an empty list: none)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        if value.dim() == 1:
            raise ValueError(
                f"example {i}: {key} must hold a list of negatives (k, L), got one sequence of shape "
                f"{tuple(value.shape)}; wrap a single negative in a list"
            )
        return [torch.as_tensor(r, dtype=torch.long) for r in value]
    rows = list(value)
    if rows and not isinstance(rows[0], (Sequence, torch.Tensor)):
        raise ValueError(
            f"example {i}: {key} must hold a list of negatives (k, L), got one sequence; wrap it in a list"
        )
    return [torch.as_tensor(r, dtype=torch.long) for r in rows]


def _padded(per_example: list, k: int, length: int) -> torch.Tensor:
    out = torch.zeros(len(per_example), k, length, dtype=torch.long)
    for b, rows in enumerate(per_example):
        for j, row in enumerate(rows):
            out[b, j, : row.shape[0]] = row
    return out


def batch_group_ids(values: Sequence[Any]) -> torch.Tensor:
    """(B,) int64 ids from any hashable values (ints, strings, tuples): equal values, equal ids
    (numbered in order of first appearance in the batch)."""
    index = {}
    try:
        return torch.tensor([index.setdefault(v, len(index)) for v in values], dtype=torch.long)
    except TypeError as exc:
        raise TypeError(f"group_ids values must be hashable (ints, strings), got {exc}") from exc


def collate_hard_negatives(examples: Sequence[Mapping[str, Any]]) -> dict:
    """Collate examples with 0..k hard-negative captions each into an ``HNClipTrainer`` batch.

    Each example is a dict with ``input_ids``, ``pixel_values`` and optionally
    ``attention_mask`` (stacked by ``transformers.default_data_collator``, as without
    negatives), and optionally:

    * ``negative_input_ids``: a list of k ≥ 0 token sequences (k and the lengths may vary
      between examples; None or [] is none), and ``negative_attention_mask`` in the same shape
      (without it, 1 for every given token);
    * ``group_ids``: any hashable (an image id, a string), mapped to int64 ids per batch.

    Returns the stacked batch plus ``negative_input_ids`` and ``negative_attention_mask`` of
    shape (B, K, L), zero-padded (K the largest k, L the longest negative; an all-0 mask row is
    an empty slot), and ``group_ids`` (B,). Keys absent from every example stay absent; with no
    negative in the batch (every k = 0) the two negative keys are absent too.

    Raises:
        ValueError: a negative given as one sequence instead of a list of them; a mask of
            another shape than its ids; ``group_ids`` on some examples only.
        TypeError: unhashable ``group_ids`` values.
    """
    from transformers import default_data_collator

    examples = list(examples)
    batch = default_data_collator([{k: v for k, v in ex.items() if k not in NEGATIVE_KEYS} for ex in examples])
    ids = [_rows(ex.get("negative_input_ids"), "negative_input_ids", i) for i, ex in enumerate(examples)]
    has_mask = any(ex.get("negative_attention_mask") is not None for ex in examples)
    masks = []
    for i, (ex, rows) in enumerate(zip(examples, ids)):
        given = _rows(ex.get("negative_attention_mask"), "negative_attention_mask", i) if has_mask else []
        if has_mask and [m.shape for m in given] != [r.shape for r in rows]:
            raise ValueError(
                f"example {i}: negative_attention_mask has shapes {[tuple(m.shape) for m in given]}, "
                f"negative_input_ids {[tuple(r.shape) for r in rows]}; they must match"
            )
        masks.append(given if has_mask else [torch.ones_like(r) for r in rows])
    k = max((len(rows) for rows in ids), default=0)
    if k > 0:
        length = max(r.shape[0] for rows in ids for r in rows)
        batch["negative_input_ids"] = _padded(ids, k, length)
        batch["negative_attention_mask"] = _padded(masks, k, length)
    has_groups = ["group_ids" in ex for ex in examples]
    if any(has_groups):
        if not all(has_groups):
            missing = [i for i, h in enumerate(has_groups) if not h]
            raise ValueError(f"group_ids is missing from examples {missing[:5]}; give every example an id or none")
        batch["group_ids"] = batch_group_ids([ex["group_ids"] for ex in examples])
    return batch


def flat_negatives(
    negative_input_ids: Optional[torch.Tensor], negative_attention_mask: Optional[torch.Tensor]
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The batch's negatives as (M, L) ids and mask (None: no negatives, M = 0 included).

    (B, K, L) slots keep those whose mask row is not all 0 (every slot without a mask), in
    example order; (M, L) passes through.

    Raises:
        ValueError: ids not 2-D or 3-D, a mask of another shape, a mask without ids.
    """
    if negative_input_ids is None:
        if negative_attention_mask is not None:
            raise ValueError("negative_attention_mask without negative_input_ids; pass both or neither")
        return None, None
    ids, mask = negative_input_ids, negative_attention_mask
    if ids.dim() not in (2, 3):
        raise ValueError(
            f"negative_input_ids must be (M, L) negatives or (B, K, L) slots per example, got shape {tuple(ids.shape)}"
        )
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(
            f"negative_attention_mask has shape {tuple(mask.shape)}, negative_input_ids {tuple(ids.shape)}; "
            "they must match"
        )
    if ids.dim() == 3:
        if mask is None:
            ids = ids.reshape(-1, ids.shape[-1])
        else:
            keep = mask.bool().any(dim=-1)
            ids, mask = ids[keep], mask[keep]
    if ids.shape[0] == 0:
        return None, None
    return ids, mask


def negative_slots(negative_input_ids: torch.Tensor, negative_attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, K) bool, True where example b's slot k holds a negative (its mask row is not all 0;
    every slot without a mask): the ``negatives_mask`` of each row's own negatives, and the order
    :func:`flat_negatives` keeps them in.

    Raises:
        ValueError: ids not (B, K, L) (flat (M, L) negatives belong to no example: pass slots per
            example, as :func:`collate_hard_negatives` builds them), a mask of another shape."""
    ids, mask = negative_input_ids, negative_attention_mask
    if ids.dim() != 3:
        raise ValueError(
            f"negatives_layout='own' needs negative_input_ids as (B, K, L) slots per example (collate_hard_negatives "
            f"builds them), got shape {tuple(ids.shape)}; flat (M, L) negatives belong to no example: use "
            "negatives_layout='shared' for them"
        )
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(
            f"negative_attention_mask has shape {tuple(mask.shape)}, negative_input_ids {tuple(ids.shape)}; "
            "they must match"
        )
    if mask is None:
        return torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
    return mask.bool().any(dim=-1)
