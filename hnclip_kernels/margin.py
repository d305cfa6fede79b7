"""The margin's kind: which detached score γ·sg(a_i·b_k) the logits add, and the one function
that picks its operands.

Every layer takes a :class:`Margin` (validated once, in :class:`hnclip_kernels.LossOptions`);
the operator schemas and ``csrc/`` take its :attr:`Margin.code` and switch on it once. A new
member fails ``tests/api/test_margin_kinds.py`` on every backend until each implements it.
Imports no module of the package.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch


class Margin(str, enum.Enum):
    """The margin's detached score (``docs/hard_negatives.md``); a ``str`` so that
    ``margin == "text"`` keeps holding for callers that compare strings.

    * ``TEXT`` ("text", the paper's): sg(t_i·x), the query's caption against each key's caption;
    * ``IMAGE_TEXT`` ("image_text", LLaVE-style hardness): sg(v_i·t_k), the detached logit.
    """

    TEXT = "text"
    IMAGE_TEXT = "image_text"

    def __repr__(self) -> str:  # as the string a caller passes: a loss module's repr stays valid Python
        return repr(self.value)

    def __str__(self) -> str:
        return self.value

    @property
    def code(self) -> int:
        """The kind as the operator schemas and ``csrc/`` take it (0: TEXT, 1: IMAGE_TEXT)."""
        return _CODES[self]

    @classmethod
    def from_code(cls, code: int) -> "Margin":
        return list(cls)[code]

    @classmethod
    def parse(cls, margin) -> "Margin":
        """``margin`` ("text", "image_text" or a :class:`Margin`) as a :class:`Margin`.

        Raises:
            TypeError: not a string. ValueError: no member's value."""
        if isinstance(margin, cls):
            return margin
        names = tuple(m.value for m in cls)
        if not isinstance(margin, str):
            raise TypeError(f"margin must be a string, one of {names}, got {type(margin).__name__}")
        try:
            return cls(margin)
        except ValueError:
            raise ValueError(
                f"margin must be one of {names}, got {margin!r}: 'text' is HN-CLIP's sg(t_i·x), "
                "'image_text' the detached image-text score sg(v_i·x) (LLaVE-style hardness)"
            ) from None


_CODES = {m: i for i, m in enumerate(Margin)}


def margin_operands(
    margin: Margin,
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_txt: torch.Tensor,
    key_txt: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The one place that decides which features form the margin's product: for one direction
    with ``queries`` (M, D) against ``keys`` (K, D), whose captions are ``query_txt`` (M, D) and
    ``key_txt`` (K, D), returns ``(a, b, mask_a, mask_b)``: the margin is γ·sg(a_i·b_k) and the
    false-negative mask compares ``mask_a``·``mask_b`` (None: the margin's own product, a and b
    are the captions). The mask always compares captions."""
    if margin is Margin.TEXT:
        return query_txt, key_txt, None, None
    if margin is Margin.IMAGE_TEXT:
        return queries, keys, query_txt, key_txt
    raise NotImplementedError(f"margin {margin!r} has no operands yet")  # a new member, see the module doc
