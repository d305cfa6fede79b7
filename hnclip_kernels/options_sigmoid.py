"""The sigmoid (SigLIP) loss's options: validated once at the public boundary, then carried whole.

:class:`SigmoidOptions` is built once per entry (per call of :func:`hnclip_kernels.hn_siglip_loss`,
once per :class:`~hnclip_kernels.HNSigLipLoss`); its constructor raises the ``TypeError`` /
``ValueError`` of a bad option, and :meth:`SigmoidOptions.bind` checks one call's features and
scalars and resolves the backend.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

import torch

from . import validation
from .margin import Margin
from .validation_options import check_options, check_precision, resolve_precision
from .validation_scalars import hyperparameter, plain_number

GROUP_MODES = ("mask", "positive")


@dataclasses.dataclass(frozen=True)
class SigmoidOptions:
    """Options of the sigmoid loss with the adaptive margin (``docs/siglip.md``).

    Attributes:
        gamma: margin scale γ ≥ 0 (0 is SigLIP exactly).
        margin: the margin's detached score (:class:`~hnclip_kernels.margin.Margin`).
        group_mode: what equal ``group_ids`` mean: "mask" (default: the pairs are no negatives
            and leave the loss, as in ``hn_clip_loss``) or "positive" (label +1, SigLIP+-style
            multi-positive targets).
        reduction: "mean" (the sum over pairs / N, open_clip's normalisation), "sum" or "none"
            ((N,) row sums).
        normalize: L2-normalise the features inside the loss.
        backend: "auto", "torch", "cpp" or "triton"; after :meth:`bind`, the resolved one.
        precision: the Triton backend's tensor-core precision for float32 features (None: default).

    Raises:
        TypeError: non-real ``gamma``, non-bool ``normalize``, non-string ``group_mode`` /
            ``precision`` / ``margin``.
        ValueError: γ < 0 or non-finite, unknown ``reduction``, ``backend``, ``precision``,
            ``margin`` or ``group_mode``.
    """

    gamma: Union[float, torch.Tensor] = 0.5
    margin: Margin = Margin.TEXT
    group_mode: str = "mask"
    reduction: str = "mean"
    normalize: bool = True
    backend: str = "auto"
    precision: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "gamma", hyperparameter("gamma", self.gamma))
        check_options(self.gamma, 0.0, self.reduction, self.backend, self.normalize)
        check_precision(self.precision)
        object.__setattr__(self, "margin", Margin.parse(self.margin))
        if not isinstance(self.group_mode, str):
            raise TypeError(f"group_mode must be a string, one of {GROUP_MODES}, got {type(self.group_mode).__name__}")
        if self.group_mode not in GROUP_MODES:
            raise ValueError(
                f"group_mode must be one of {GROUP_MODES}, got {self.group_mode!r}: 'mask' drops same-group "
                "pairs from the loss, 'positive' labels them +1"
            )

    @property
    def groups_positive(self) -> bool:
        return self.group_mode == "positive"

    def bind(self, img: torch.Tensor, txt: torch.Tensor, names: tuple = ("img", "txt")) -> "SigmoidOptions":
        """These options for one call on ``img``/``txt`` (checked): the backend resolved for
        these tensors and the precision default applied."""
        validation.check_features(img, txt, *names)
        from .backends import resolve_backend

        backend = resolve_backend(self.backend, img)
        precision = resolve_precision(self.precision) if backend == "triton" else None
        return dataclasses.replace(self, backend=backend, precision=precision)


def scalar_tensor(name: str, x, like: torch.Tensor, *, positive: bool) -> torch.Tensor:
    """``logit_scale`` / ``logit_bias`` as a 0-dim tensor on ``like``'s device (a tensor keeps
    its autograd graph; a number becomes a constant), its value checked once on the host
    (finite; > 0 with ``positive``), not under ``torch.compile`` or on meta tensors.

    Raises:
        TypeError: not a real number or a one-element floating tensor.
        ValueError: non-finite, or ≤ 0 with ``positive``, or on another device than ``like``."""
    x = plain_number(x)
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or not x.is_floating_point():
            raise TypeError(
                f"{name} must be a real number or a one-element floating tensor, got a {x.dtype} tensor "
                f"of shape {tuple(x.shape)}"
            )
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but the features on {like.device}; move {name}")
        value = None if torch.compiler.is_compiling() or x.device.type == "meta" else float(x.detach())
        tensor = x.reshape(())
    elif isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number or a one-element floating tensor, got {type(x).__name__}")
    else:
        value = None if torch.compiler.is_compiling() else float(x)
        tensor = torch.tensor(float(x), dtype=torch.float64 if like.dtype == torch.float64 else torch.float32,
                              device=like.device)  # fmt: skip
    if value is not None and (not math.isfinite(value) or (positive and value <= 0)):
        need = "finite and > 0 (already exponentiated: logit_scale.exp())" if positive else "finite"
        raise ValueError(f"{name} must be {need}, got {value}")
    return tensor


def logit_bound(img, txt, negatives, s, b, options: SigmoidOptions) -> Optional[float]:
    """The largest |z| of the sigmoid loss's pairs: s·(1 + γ)·‖v‖‖k‖ + |b| (row norms 1 with
    ``normalize``, else read in one host sync); None where nothing is read (``torch.compile``,
    meta tensors, a tensor γ)."""
    if torch.compiler.is_compiling() or img.device.type == "meta" or isinstance(options.gamma, torch.Tensor):
        return None
    keys = (txt,) if negatives is None else (txt, negatives)
    if options.normalize:
        norm_v = norm_k = 1.0
    else:
        extremes = validation.row_norm_extremes(img, *keys)
        norm_v, norm_k = extremes[0][0], max(e[0] for e in extremes[1:])
    return float(s.detach()) * (1.0 + options.gamma) * norm_v * max(norm_k, norm_v) + (
        0.0 if b is None else abs(float(b.detach()))
    )
