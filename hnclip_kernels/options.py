"""The loss's options: validated once at the public boundary, then carried unchanged.

:class:`LossOptions` is built once per entry point — per call of ``hn_clip_loss`` and
``distributed_hn_clip_loss``, once per :class:`~hnclip_kernels.HNClipLoss` at construction —
and its constructor raises the ``TypeError``/``ValueError`` of a bad option. ``bind`` then
checks one call's features and τ (τ read on the host at most once), resolves ``"auto"`` to the
backend that runs these tensors and applies the Triton precision default, and returns the
bound options that every backend and the distributed path receive.

γ and ε stay the numbers the caller gave (a Python float, or a symbolic float under
``torch.compile``): the fused backends turn them into 0-dim float64 tensors at the operator
boundary (:func:`hnclip_kernels.backends.glue.hyperparameter`), so a new value of either
reuses a compiled graph on both fused backends.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from . import validation
from .group_mode import GroupMode
from .margin import Margin
from .numerics import compute_dtype
from .validation_options import (
    ROW_REDUCTIONS,
    check_false_negative_threshold,
    check_options,
    check_precision,
    resolve_precision,
)
from .validation_rows import check_small_rows
from .validation_scalars import hyperparameter, plain_number


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """Options of the HN-CLIP loss (arXiv 2608.18521, Eq. 2); the constructor validates them.

    Attributes:
        gamma: margin scale γ ≥ 0 (0.5 is the paper's value; 0 is CLIP's InfoNCE).
        label_smoothing: ε in [0, 1), ``torch.nn.functional.cross_entropy`` semantics.
        reduction: "mean", "sum", "none" or "directions" (each direction's rows and LSE,
            :class:`~hnclip_kernels.DirectionRows`; ``docs/api.md``, "Per-direction rows").
        normalize: L2-normalise the features inside the loss.
        backend: "auto", "torch", "cpp" or "triton"; after :meth:`bind`, the resolved one.
        precision: the Triton backend's tensor-core input precision for float32 features
            (``validation_options.FP32_PRECISIONS``); None before :meth:`bind` means the default,
            after it the resolved mode (None on the other backends, which ignore it).
        tau_value: τ as read on the host by :meth:`bind` (None before, under
            ``torch.compile`` and for meta tensors, where nothing is read).
        false_negative_threshold: None (no masking) or a caption cosine in (−1, 1]: a pair
            i ≠ j with t̂_i·t̂_j ≥ it (the captions' cosine, also with ``normalize=False``) is not
            a negative in either direction (not in the paper;
            see :func:`hnclip_kernels.hn_clip_loss`).
        margin: the margin's detached score, a :class:`~hnclip_kernels.margin.Margin` (given as
            "text", sg(t_i·x), the paper's, default, or "image_text", sg(v_i·x)); see
            ``docs/hard_negatives.md``.
        group_mode: what equal ``group_ids`` mean, a :class:`~hnclip_kernels.group_mode.GroupMode`
            (given as "mask", the default: no negatives of each other; "supcon" or "mil_nce":
            positives, ``docs/hard_negatives.md#multi-positive-targets``). The positive modes run
            on every backend, with shared (M, D) or each row's own (N, K, D) negatives, and with
            every reduction ("directions": each direction's mode row and its LSE over every class,
            ``docs/api.md``, "Per-direction rows"; not with own negatives too).

    Raises:
        TypeError: non-real ``gamma``/``label_smoothing``, non-bool ``normalize``,
            non-string ``precision``, non-real ``false_negative_threshold``.
        ValueError: γ < 0 or non-finite, ε outside [0, 1), unknown ``reduction``,
            ``backend`` or ``precision``, ``false_negative_threshold`` outside (−1, 1],
            ``margin`` not "text" or "image_text" (a non-string: ``TypeError``), ``group_mode``
            not "mask", "supcon" or "mil_nce" (a non-string: ``TypeError``).
    """

    gamma: Union[float, torch.Tensor] = 0.5
    label_smoothing: float = 0.0
    reduction: str = "mean"
    normalize: bool = True
    backend: str = "auto"
    precision: Optional[str] = None
    tau_value: Optional[float] = None
    false_negative_threshold: Optional[float] = None
    margin: Margin = Margin.TEXT
    group_mode: GroupMode = GroupMode.MASK

    def __post_init__(self):
        for name in ("gamma", "label_smoothing"):  # NumPy scalars, one-element tensors: hyperparameter
            object.__setattr__(self, name, hyperparameter(name, getattr(self, name)))
        check_options(self.gamma, self.label_smoothing, self.reduction, self.backend, self.normalize)
        check_precision(self.precision)
        if self.false_negative_threshold is not None:  # NumPy scalars and arrays, Fractions: a Python float
            object.__setattr__(self, "false_negative_threshold", plain_number(self.false_negative_threshold))
        check_false_negative_threshold(self.false_negative_threshold)
        object.__setattr__(self, "margin", Margin.parse(self.margin))
        object.__setattr__(self, "group_mode", GroupMode.parse(self.group_mode))

    def bind(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        tau: Union[float, torch.Tensor],
        *,
        tau_value: Optional[float] = None,
        n_rows: Optional[int] = None,
        names: tuple = ("img", "txt"),
        n_keys: Optional[int] = None,
    ) -> "LossOptions":
        """These options for one single-process call on ``img``/``txt`` (N, D) with temperature
        ``tau``: the features and τ checked (τ read once, or ``tau_value`` used where the caller
        already read it), the backend resolved for these tensors, the precision default applied.

        ``n_rows``: how many pairs' losses the reduction adds up (default: N for "mean"/"sum",
        1 for "none" and "directions"), for the overflow bound of :func:`validation.check_tau`. ``n_keys``: the
        number of key columns of the widest row (default N; N + M with M negative captions).

        Raises: the ``TypeError``/``ValueError`` of :func:`validation.check_features`,
        :func:`validation.check_tau`, :func:`validation.check_feature_range` and
        :func:`hnclip_kernels.backends.resolve_backend`.
        """
        validation.check_features(img, txt, *names)
        if n_rows is None:
            n_rows = img.shape[0] if self.reduction not in ROW_REDUCTIONS else 1
        value = self.checked_tau(img, txt, tau, n_rows=n_rows, tau_value=tau_value, names=names, n_keys=n_keys)
        return self.resolved(img, value)

    def checked_tau(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        tau: Union[float, torch.Tensor],
        *,
        n_rows: int,
        tau_value: Optional[float] = None,
        feature_range: bool = True,
        names: tuple = ("img", "txt"),
        n_keys: Optional[int] = None,
    ) -> Optional[float]:
        """τ checked for these options on features ``img``/``txt`` (N, D):
        :func:`validation.check_tau` with N key columns, ``n_rows`` summed rows and dL/dτ's bound
        when ``tau`` requires grad (``tau_value``: τ already read, checked instead of reading
        ``tau`` again); with ``normalize=True``, τ against the smallest row norms
        (:func:`validation_rows.check_small_rows`: dL/dx's bound); then, with ``normalize=False``
        and ``feature_range``, the features' range (:func:`validation.check_feature_range`).
        Returns τ's value (None where it is not read).

        Raises: the ``TypeError``/``ValueError`` of those checks."""
        tau_grad = validation.tau_requires_grad(tau)  # dτ's bound too (a τ read earlier is a float)
        value = validation.check_tau(
            tau if tau_value is None else tau_value,
            img.device,
            img.dtype,
            self.gamma,
            label_smoothing=self.label_smoothing,
            n_keys=img.shape[0] if n_keys is None else n_keys,
            n_rows=n_rows,
            tau_grad=tau_grad,
        )
        if self.normalize:  # a row of norm near 0 under a tiny τ: dL/dx overflows while the loss does not
            keys = img.shape[0] if n_keys is None else n_keys
            check_small_rows((img, txt), names, value, self.gamma, self.label_smoothing, keys, n_rows)
        if feature_range and not self.normalize:
            validation.check_feature_range(
                img, txt, value, self.gamma, self.label_smoothing, *names, n_rows=n_rows, tau_grad=tau_grad
            )
        return value

    def resolved(self, like: torch.Tensor, tau_value: Optional[float] = None) -> "LossOptions":
        """The backend that runs tensors like ``like`` and its precision, with ``tau_value``.

        Raises: :func:`~hnclip_kernels.backends.resolve_backend`'s errors."""
        from .backends import resolve_backend

        backend = resolve_backend(self.backend, like)
        precision = None
        if backend == "triton":
            precision = resolve_precision(self.precision)
        return dataclasses.replace(self, backend=backend, precision=precision, tau_value=tau_value)


def option_attribute(name: str) -> property:
    """An attribute of a module that holds its :class:`LossOptions` in ``self.options``: reading
    it gives the option the loss uses; assigning builds new options with it (``dataclasses.replace``
    runs the constructor's validation: the same ``TypeError``/``ValueError``, nothing changed on
    error), which the next call uses. So ``loss_fn.gamma = 0.3`` is a γ schedule step."""

    def get(self):
        return getattr(self.options, name)

    def set_(self, value):
        self.options = dataclasses.replace(self.options, **{name: value})

    return property(
        get,
        set_,
        doc=f"The loss's ``{name}`` (see :class:`LossOptions`), read from and "
        "written to ``self.options``; assignment validates and takes effect at once.",
    )


def as_tau_tensor(tau: Union[float, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """τ as a 0-dim tensor on ``like``'s device (a tensor τ keeps its dtype and autograd; a
    number becomes the compute dtype of ``like``)."""
    if isinstance(tau, torch.Tensor):
        # a 16-bit τ computes in float32 (its gradient still comes back in its own dtype), so
        # no product or quotient with it is rounded to 16 bits on the way
        dtype = tau.dtype if tau.dtype in (torch.float32, torch.float64) else compute_dtype(like.dtype)
        return tau.to(device=like.device, dtype=dtype).reshape(())
    tau = plain_number(tau)
    # arithmetic, not torch.tensor(float(tau)): under torch.compile a changing τ stays a symbolic
    # float instead of being specialised into a new graph at every value of a schedule
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.zeros((), device=like.device, dtype=dtype) + tau


def tau_from_scale(logit_scale, like):
    """τ = 1/s, formed in float32 or better: float64 for a float64 s or float64 features.

    Under ``--precision pure_bf16``/``pure_fp16`` the model's ``logit_scale`` is 16-bit, and a
    16-bit 1/s is a different temperature (s = 100 in bf16 gives τ = 0.01000977, the loss of a
    saturated batch 3% off). Upcasting s first keeps τ = 1/s of the scale as given; ds still
    comes back in s's own dtype (autograd through the cast)."""
    if not isinstance(logit_scale, torch.Tensor):
        return 1.0 / float(logit_scale)
    wide = logit_scale.dtype == torch.float64 or (isinstance(like, torch.Tensor) and like.dtype == torch.float64)
    return logit_scale.to(torch.float64 if wide else torch.float32).reciprocal()
