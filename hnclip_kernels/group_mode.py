"""What equal ``group_ids`` mean in the softmax (InfoNCE / HN-CLIP) loss, as one typed option.

Every layer takes a :class:`GroupMode` (validated once, in :class:`hnclip_kernels.LossOptions`).
``"mask"`` is today's meaning (same-group pairs are no negatives); ``"supcon"`` and ``"mil_nce"``
make them positives, with the two formulations users cite (``docs/hard_negatives.md``,
"Multi-positive targets"), on every backend. Imports no module of the package.
"""

from __future__ import annotations

import enum


class GroupMode(str, enum.Enum):
    """What pairs with equal ``group_ids`` are to each other; a ``str`` so that
    ``group_mode == "mask"`` keeps holding for callers that compare strings.

    * ``MASK`` ("mask", default): no negatives of each other; they leave the row (today's).
    * ``SUPCON`` ("supcon", SupCon's L_out, Khosla et al. 2020): positives, the target spread
      uniformly over the row's group P(i): loss_i = LSE_i − (1/|P(i)|)·Σ_{p∈P(i)} Z_ip.
    * ``MIL_NCE`` ("mil_nce", Miech et al. 2020): positives, the probability of any of them:
      loss_i = −log Σ_{p∈P(i)} softmax(Z_i)_p = LSE_i − LSE_{p∈P(i)} Z_ip.
    """

    MASK = "mask"
    SUPCON = "supcon"
    MIL_NCE = "mil_nce"

    def __repr__(self) -> str:  # as the string a caller passes: a loss module's repr stays valid Python
        return repr(self.value)

    def __str__(self) -> str:
        return self.value

    @property
    def positives(self) -> bool:
        """Are same-group pairs positives (``supcon``, ``mil_nce``) rather than masked?"""
        return self is not GroupMode.MASK

    @property
    def code(self) -> int:
        """The mode as a small integer (the distributed consensus row: 0 mask, 1 supcon, 2 mil_nce)."""
        return list(GroupMode).index(self)

    @classmethod
    def from_code(cls, code: int) -> "GroupMode":
        return list(cls)[code]

    @classmethod
    def parse(cls, group_mode) -> "GroupMode":
        """``group_mode`` ("mask", "supcon", "mil_nce" or a :class:`GroupMode`) as a :class:`GroupMode`.

        Raises:
            TypeError: not a string. ValueError: no member's value (``"positive"``, the sigmoid
            loss's word, names the two formulations to pick from)."""
        if isinstance(group_mode, cls):
            return group_mode
        names = tuple(m.value for m in cls)
        if not isinstance(group_mode, str):
            raise TypeError(f"group_mode must be a string, one of {names}, got {type(group_mode).__name__}")
        try:
            return cls(group_mode)
        except ValueError:
            hint = (
                "'positive' is hn_siglip_loss's; the softmax loss has two multi-positive formulations, "
                if group_mode == "positive"
                else ""
            )
            raise ValueError(
                f"group_mode must be one of {names}, got {group_mode!r}: {hint}'mask' drops same-group pairs from "
                "the softmax, 'supcon' spreads the target uniformly over the group (SupCon's L_out), 'mil_nce' "
                "takes the probability of any positive (log Σ_p softmax)"
            ) from None
