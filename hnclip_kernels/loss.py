"""``hn_clip_loss``: the public entry point, argument checks and backend dispatch."""
from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, Optional, Union

import torch

from . import validation as _validation
from .backends.pytorch import directional_nll_torch
from .numerics import autocast_disabled, compute_dtype

_warned = set()


def _warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def triton_directional() -> Callable:
    """The Triton directional op, imported lazily: triton is optional on CPU-only installs."""
    try:
        from .backends.triton.ops import directional_nll_triton
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError(
            f"backend='triton' needs the triton package ({exc}); install triton or use backend='torch'"
        ) from exc
    return directional_nll_triton


def _triton_interpreting() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    from .backends.triton import launch

    return launch._is_interpreting()


def cpp_directional():
    """The C++ directional op, or None when the extension was not built."""
    try:
        from .backends.cpp.ops import directional_nll_cpp
    except ImportError:
        return None
    return directional_nll_cpp


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """Map ``backend`` to "torch", "triton" or "cpp" for tensors like ``x``, or raise."""
    if backend == "auto":
        if x.device.type == "cuda" and x.dtype != torch.float64:
            return "triton"
        if x.device.type == "cpu" and x.dtype != torch.float64 and cpp_directional() is not None:
            return "cpp"
        if x.device.type == "cpu" and cpp_directional() is None:
            _warn_once("auto-cpu", "hnclip_kernels: the C++ extension is not built; backend='auto' uses "
                                   "the pure-PyTorch backend (materialises N×N logits) on CPU")
        return "torch"
    if backend in ("cpp", "triton") and x.device.type == "meta":
        raise ValueError(f"backend={backend!r} cannot run on meta tensors; backend='torch' (or 'auto') "
                         "gives a meta result of the right shape")
    if backend == "triton":
        if x.dtype == torch.float64:
            raise TypeError("backend='triton' supports float16, bfloat16 and float32 inputs; "
                            "use backend='torch' for float64")
        if x.device.type == "cpu" and not _triton_interpreting():
            raise ValueError("backend='triton' got CPU tensors but Triton is not interpreting; move the "
                             "tensors to CUDA, set TRITON_INTERPRET=1 before importing triton, or use "
                             "backend='cpp' / 'torch'")
        if x.device.type not in ("cuda", "cpu"):
            raise ValueError(f"backend='triton' needs CUDA tensors, got device {x.device}")
    if backend == "cpp":
        if x.device.type != "cpu":
            raise ValueError(f"backend='cpp' needs CPU tensors, got device {x.device}; use backend='triton'")
        if cpp_directional() is None:
            raise ValueError("backend='cpp' needs the C++ extension, which is not built; reinstall with the "
                             "README's install command (it compiles csrc/), or use backend='torch'")
    return backend


def directional_fn(backend: str, precision: Optional[str] = None) -> Callable:
    """The directional op of a resolved backend. Every one follows the keyword-only protocol of
    :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`::

        fn(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize,
           return_stats=False)

    ``precision`` reaches the Triton op only (the other backends compute float32 products in
    IEEE float32)."""
    if backend == "triton":
        fn = triton_directional()  # raises the install hint now rather than at the first call
        return functools.partial(fn, precision=precision) if precision is not None else fn
    if backend == "cpp":
        return cpp_directional()
    return directional_nll_torch


def as_tau_tensor(tau: Union[float, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if isinstance(tau, torch.Tensor):
        return tau.to(device=like.device).reshape(())
    # arithmetic, not torch.tensor(float(tau)): under torch.compile a changing τ stays a symbolic
    # float instead of being specialised into a new graph at every value of a schedule
    return torch.zeros((), device=like.device, dtype=compute_dtype(like.dtype)) + tau


def _warn_if_tau_looks_like_logit_scale(tau_value: Optional[float]) -> None:
    if tau_value is None or tau_value <= 1.0:
        return
    # stacklevel 4: _warn_once, this function, hn_clip_loss, then the line that called it
    _warn_once("tau>1", f"hn_clip_loss got tau = {tau_value:g} > 1: tau is the temperature, and a value above 1 "
                        f"is almost always open_clip's logit_scale passed by mistake (1/tau = {1.0 / tau_value:g} "
                        "would then be the temperature). Pass tau = 1 / logit_scale.exp() (or 1 / logit_scale "
                        "if it is already exponentiated). This warning is shown once.", stacklevel=4)


def reduce_rows(rows: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return rows.mean()
    if reduction == "sum":
        return rows.sum()
    return rows


def hn_clip_loss(
    img: torch.Tensor,
    txt: torch.Tensor,
    tau: Union[float, torch.Tensor],
    *,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    normalize: bool = True,
    backend: str = "auto",
    precision: Optional[str] = None,
) -> torch.Tensor:
    """HN-CLIP contrastive loss with adaptive similarity margins (arXiv 2608.18521, Eq. 2).

    With v = img, t = txt (L2-normalised row-wise when ``normalize``)::

        Z = (v tᵀ + γ · stopgrad(t tᵀ) · (1 − I)) / τ
        loss = ½ [CE(Z, arange(N)) + CE(Zᵀ, arange(N))]

    γ = 0 is CLIP's symmetric InfoNCE. Each row's NLL is computed as
    ``softplus(LSE_{j≠i} Z_ij − Z_ii)`` with float32 accumulation, so losses far below
    float32's epsilon (saturated fine-tuning, τ ≈ 0.01) keep their value and gradient.

    Args:
        img: (N, D) image embeddings; float16, bfloat16, float32 (float64: torch and cpp backends).
        txt: (N, D) text embeddings, same dtype and device as ``img``; row i pairs with image i.
        tau: temperature τ > 0 (dimensionless), a Python float or a 0-dim tensor. open_clip's
            ``logit_scale`` s is 1/τ: pass ``1 / logit_scale.exp()`` (or ``1 / logit_scale``
            if it is already exponentiated). A tensor that requires grad receives dL/dτ.
            A tensor τ is read once on the host to validate it (one device sync).
        gamma: margin scale γ ≥ 0 (default 0.5, the paper's value).
        label_smoothing: ε in [0, 1), ``torch.nn.functional.cross_entropy`` semantics.
        reduction: "mean" (scalar), "sum" (scalar) or "none" ((N,), entry k = ½(i2t_k + t2i_k)).
        normalize: L2-normalise inside (autograd through it); False trusts the caller.
        backend: "auto" (Triton on CUDA, the C++ kernel on CPU when built, else torch),
            "torch" (pure PyTorch reference, materialises N×N), "triton" (fused kernels; CPU
            tensors only under TRITON_INTERPRET=1) or "cpp" (fused CPU kernel).
        precision: tensor-core input precision of the Triton backend for float32 features:
            "tf32x3" (default, None), "bf16x6", "ieee" (no tensor cores) or "bf16x3" (faster,
            below float32 accuracy in the saturated regime); see the README's "Precision"
            table. 16-bit features and the other backends ignore it (they are exact in
            float32 accumulation already).

    Returns:
        float32 loss (float64 for float64 inputs): a scalar, or shape (N,) for "none".
        Gradients reach ``img``/``txt`` in their own dtype and ``tau`` in its dtype.
        Second derivatives (a backward through a gradient taken with ``create_graph=True``)
        are exact on backend="torch"; the fused backends ("cpp", "triton") raise a
        ``RuntimeError`` naming backend="torch" instead. Meta-device features give a
        meta-device result of the right shape (backend "torch"/"auto"), with no value checks.

    Warns:
        RuntimeWarning (once per process): τ > 1, almost always open_clip's ``logit_scale``
        passed in place of τ = 1 / logit_scale. Not under ``torch.compile``.

    Raises:
        TypeError: non-tensor or integer features, dtype mismatch, non-real ``tau``/``gamma``/
            ``label_smoothing``, non-bool ``normalize``, non-string ``precision``, float64
            with backend="triton".
        ValueError: non-2-D features, shape or device mismatch, N = 0 or D = 0, τ ≤ 0,
            non-finite or so small that the logit gaps (2 + γ)/τ (or, with ``normalize=False``,
            the features' norms) overflow float32, γ < 0 or non-finite, ε
            outside [0, 1), unknown ``reduction``/``backend``/``precision``, a backend that cannot run on
            these tensors. Under ``torch.compile`` value checks are skipped (no graph breaks).
    """
    _validation.check_features(img, txt)
    _validation.check_options(gamma, label_smoothing, reduction, backend, normalize)
    _validation.check_precision(precision)
    n_rows = img.shape[0] if reduction != "none" else 1  # how many rows' losses the reduction sums
    tau_value = _validation.check_tau(tau, img.device, img.dtype, gamma, label_smoothing=label_smoothing,
                                      n_keys=img.shape[0], n_rows=n_rows)
    if not normalize:
        _validation.check_feature_range(img, txt, tau_value, gamma, label_smoothing, n_rows=n_rows)
    _warn_if_tau_looks_like_logit_scale(tau_value)
    # autocast would run the reference's matmuls in bf16: accumulation here is float32 by design
    with autocast_disabled(img.device):
        rows = pair_losses(resolve_backend(backend, img), img, txt, as_tau_tensor(tau, img), gamma,
                           label_smoothing, normalize, precision)
    return reduce_rows(rows, reduction)


def pair_losses(backend: str, img, txt, tau: torch.Tensor, gamma: float, label_smoothing: float,
                normalize: bool, precision: Optional[str] = None, return_stats: bool = False):
    """½(i2t_k + t2i_k) for every pair k, shape (N,), on a resolved backend; with
    ``return_stats`` also ``(i2t, t2i)``, both directions' detached ``RowStats``."""
    options = dict(tau=tau, gamma=gamma, label_smoothing=label_smoothing, normalize=normalize,
                   return_stats=return_stats)
    if backend == "triton":
        from .backends.triton.ops import hn_clip_pairs_triton  # one fused op for both directions

        return hn_clip_pairs_triton(img, txt, **options, precision=precision)
    if img.dtype in (torch.float16, torch.bfloat16):
        # each tensor feeds both directions: upcast once, so its two gradient halves are summed
        # in float32 and rounded to the input dtype once (two bf16 halves summed lose ~1e-3)
        img, txt = img.float(), txt.float()
    if backend == "cpp":
        from .backends.cpp.ops import hn_clip_pairs_cpp  # one operator: each logit tile serves i2t and t2i

        return hn_clip_pairs_cpp(img, txt, **options)
    i2t = directional_nll_torch(img, txt, query_txt=txt, key_txt=txt, offset=0, **options)
    t2i = directional_nll_torch(txt, img, query_txt=txt, key_txt=txt, offset=0, **options)
    if not return_stats:
        return 0.5 * (i2t + t2i)
    return 0.5 * (i2t[0] + t2i[0]), (i2t[1], t2i[1])
