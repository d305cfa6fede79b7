"""Inputs that are valid but almost surely a mistake, and the once-per-process warning about them.

One home for each rule, so that every entry point (``hn_clip_loss``, ``HNClipLoss``,
``distributed_hn_clip_loss``, ``saturation_report``, ``clip_model_loss``) applies the same one,
each warning in the words of what its caller passed (τ, ``logit_scale``, the model):

* :func:`scale_mistake`: where the temperature sits, as s = 1/τ. open_clip keeps a
  learnable *log*-scale, initialised at log(1/0.07) = 2.66 and clamped to [0, log 100], and
  its model returns s = exp of it, between 1/0.07 = 14.3 and 100 in practice. So s < 1
  (τ > 1) is a temperature where a scale belongs or a scale where τ belongs, and
  1 ≤ s ≤ log 100 = 4.61 is the log-scale's own range: the ``.exp()`` was left out. An entry
  point that exponentiates the log-scale itself (``clip_model_loss`` takes the model) cannot
  miss the ``.exp()``: it warns of s < 1 alone, naming the model's parameter
  (:func:`warn_if_implausible_model_logit_scale`).
* :func:`unit_norm_mistake`: with ``normalize=False`` the loss takes the features as given;
  rows far from unit norm (raw encoder outputs) give another loss than the cosine one the
  formula means (41.0 against 4.81 for raw open_clip features). The hard-negative captions
  (``negatives=``) are held to the same rule: open_clip's ``encode_text`` does not normalise
  unless asked, and raw negatives gave 16.67 against 7.12 in a real step.

No module of the package is imported here (the bottom layer: every module may warn).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Optional

import torch

_warned = set()
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODULE_CALL = os.path.abspath(sys.modules[torch.nn.Module.__module__].__file__)  # Module.__call__'s frames

LOG_SCALE_MAX = math.log(100.0)  # open_clip clamps its log-scale parameter to [0, log 100]
UNIT_NORM_TOLERANCE = 0.05  # |‖x‖ − 1| above this: not L2-normalised (bf16 rounding stays below 0.004)


def warn_once(key: str, message: str, stacklevel: Optional[int] = 3) -> None:
    """A ``RuntimeWarning`` shown once per process for each ``key``, attributed to the frame
    ``stacklevel`` levels up (as ``warnings.warn``'s, counted from here), or with None to the
    first caller outside this package and ``nn.Module``'s call machinery (the user's line,
    however deep the check that warns sits)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=_outside_level() if stacklevel is None else stacklevel)


def _outside_level() -> int:
    frame, level = sys._getframe(2), 2  # level 2: warn_once's caller
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE) or os.path.abspath(frame.f_code.co_filename) == _MODULE_CALL
    ):
        frame, level = frame.f_back, level + 1
    return level


def scale_mistake(scale: Optional[float]) -> Optional[str]:
    """What s = 1/τ (a host float; None: not read) looks like: ``"tau"`` for s < 1 (τ > 1),
    ``"log-scale"`` for 1 ≤ s ≤ log 100 (open_clip's un-exponentiated ``logit_scale``), None
    for anything above (plausible: open_clip's s is 14.3 at init and at most 100)."""
    if scale is None:
        return None
    if scale < 1.0:
        return "tau"
    if scale <= LOG_SCALE_MAX:
        return "log-scale"
    return None


def unit_norm_mistake(deviation: Optional[float]) -> bool:
    """Whether rows whose norms are off 1 by up to ``deviation`` (max |‖x_i‖ − 1|; None: not
    measured) are not L2-normalised features. Normalised features in 16 bits are within 0.4%."""
    return deviation is not None and math.isfinite(deviation) and deviation > UNIT_NORM_TOLERANCE


def warn_if_not_unit_norm(deviation: Optional[float], names: tuple) -> None:
    """Warn once per process when ``normalize=False`` got rows off unit norm by ``deviation``
    (at the user's line that called the loss). ``names``: the features' two names (img/txt,
    image_features/text_features), or ``("negatives",)`` for the hard-negative captions, which
    warn once on their own (fixing the features' rows must not silence the negatives')."""
    if unit_norm_mistake(deviation):
        rows = "/".join(names)
        warn_once(
            "normalize=False" if len(names) == 2 else f"normalize=False:{rows}",
            f"normalize=False but the rows of {rows} have norms off 1 by up "
            f"to {deviation:.3g}: the loss then takes dot products, not cosines, and differs "
            "from the normalised loss. Pass normalize=True, or L2-normalise the features "
            "(torch.nn.functional.normalize(x, dim=-1); open_clip's encode_text(tokens, normalize=True)) "
            "before the loss. This warning is shown once.",
            stacklevel=None,
        )


def warn_if_tau_looks_like_logit_scale(
    tau_value: Optional[float], caller: str = "hn_clip_loss", depth: int = 0
) -> None:
    """Warn once when τ > 1 (:func:`scale_mistake` of s = 1/τ is "tau"), naming ``caller``, at
    the line that called ``caller``, which calls this function directly (``depth`` 0:
    ``saturation_report``) or through ``depth`` helpers (``hn_clip_loss`` through ``pair_losses``: 1). τ ≤ 1 is a temperature some use (SimCLR's 0.5): only the swap is
    flagged here."""
    if tau_value is None or scale_mistake(1.0 / tau_value) != "tau":
        return
    # stacklevel: warn_once, this function, the helpers, the caller, then the line that called it
    warn_once(
        "tau>1",
        f"{caller} got tau = {tau_value:g} > 1: tau is the temperature, and a value above 1 "
        f"is almost always open_clip's logit_scale passed by mistake (1/tau = {1.0 / tau_value:g} "
        "would then be the temperature). Pass tau = 1 / logit_scale.exp() (or 1 / logit_scale "
        "if it is already exponentiated). This warning is shown once.",
        stacklevel=4 + depth,
    )


def warn_if_implausible_logit_scale(scale: Optional[float]) -> None:
    """``HNClipLoss``'s warning (once per process for each mistake, at the user's line) when
    s = ``logit_scale`` (a host float; None: not read) is τ or open_clip's raw log-scale."""
    mistake = scale_mistake(scale)
    if mistake == "tau":
        warn_once(
            "logit_scale<1",
            f"HNClipLoss got logit_scale = {scale:g} < 1: logit_scale is 1/tau (open_clip's "
            f"model(...) returns it exponentiated, 14.3 at init), so this trains at tau = "
            f"{1.0 / scale:g}. If {scale:g} is the temperature, pass logit_scale = 1 / tau = "
            f"{1.0 / scale:g}. This warning is shown once.",
            stacklevel=None,
        )
    elif mistake == "log-scale":
        warn_once(
            "logit_scale=log",
            f"HNClipLoss got logit_scale = {scale:g}, in the range of open_clip's "
            f"un-exponentiated log-scale [0, log 100 = 4.61]: this trains at tau = "
            f"{1.0 / scale:g}. Pass model.logit_scale.exp() (model(...)'s third output), "
            "not model.logit_scale; if a temperature this warm is meant, filter this "
            "RuntimeWarning. This warning is shown once.",
            stacklevel=None,
        )


def warn_if_implausible_model_logit_scale(scale: Optional[float], caller: str = "clip_model_loss") -> None:
    """``clip_model_loss``'s warning (once per process, at the user's line) about the model's own
    ``logit_scale`` parameter, given s = exp(``model.logit_scale``) (a host float; None: not read).

    The function exponentiates the parameter itself, as ``CLIPModel`` does, so the "log-scale"
    mistake of :func:`scale_mistake` (a missing ``.exp()``) cannot happen here: a parameter from
    0 to 1.53 (s from 1 to log 100) is a warm temperature the model holds (τ from 0.22 to 1)
    and stays quiet.
    s < 1 is a negative parameter, τ > 1: almost surely log τ stored where log(1/τ) belongs."""
    if scale_mistake(scale) != "tau":
        return
    log_scale = math.log(scale) if scale > 0 else float("-inf")
    warn_once(
        "model.logit_scale<0",
        f"{caller} got a model whose logit_scale parameter is {log_scale:g} < 0: {caller} takes "
        f"tau = 1 / exp(model.logit_scale) = {1.0 / scale:g} > 1, as CLIPModel scales its logits by "
        f"exp(logit_scale). logit_scale is log(1 / tau) (CLIPConfig.logit_scale_init_value, "
        f"2.6592 = log(1 / 0.07) by default); if {log_scale:g} is log(tau), set the parameter to "
        f"{-log_scale:g}. This warning is shown once.",
        stacklevel=None,
    )
