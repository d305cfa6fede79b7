"""``hn_siglip_loss``: the public entry of the sigmoid (SigLIP) loss with the adaptive margin."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .backends import sigmoid_fn
from .loss import reduce_rows
from .numerics import autocast_disabled, compute_dtype
from .options_sigmoid import SigmoidOptions, logit_bound, scalar_tensor
from .validation_family import family_arguments

Scalar = Union[float, torch.Tensor]


def hn_siglip_loss(
    img: torch.Tensor,
    txt: torch.Tensor,
    logit_scale: Scalar,
    logit_bias: Optional[Scalar] = None,
    *,
    gamma: float = 0.5,
    margin: str = "text",
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    group_mode: str = "mask",
    reduction: str = "mean",
    normalize: bool = True,
    backend: str = "auto",
    precision: Optional[str] = None,
) -> torch.Tensor:
    """The sigmoid loss of SigLIP (Zhai et al. 2023, open_clip's normalisation) with HN-CLIP's
    adaptive margin on its negatives (this project's extension: the paper's margin is for the
    softmax loss; ``docs/siglip.md``).

    With v = img, t = txt (L2-normalised when ``normalize``), the columns k = [t; negatives],
    s = ``logit_scale``, b = ``logit_bias``::

        z_ij = s·(v_i·k_j + γ·sg(h_ij)·[y_ij = −1]) + b
        loss = (1/N)·Σ_ij log(1 + exp(−y_ij·z_ij))

    y_ij = +1 on the positive (j = i), −1 elsewhere (the negatives' columns always). h is the
    margin's score: "text" sg(t_i·k_j) (the paper's caption geometry), "image_text" sg(v_i·k_j).
    γ = 0 is SigLIP exactly (open_clip's ``SigLipLoss`` on the same features). Each pair's loss and
    gradient σ(z) − [y = 1] are formed without cancellation, in float32 (float64 for float64
    features), so saturated pairs keep their gradient (a float32 σ(z) − 1 rounds to 0 from z ≈ 17).

    Args:
        img, txt: (N, D) embeddings, float16/bfloat16/float32 (float64: torch and cpp), same
            dtype and device; row i of ``txt`` is image i's caption.
        logit_scale: s > 0, already exponentiated (open_clip's ``logit_scale.exp()``): a float or a
            one-element tensor; a tensor that requires grad receives dL/ds.
        logit_bias: b (a float or a one-element tensor, receives dL/db), or None for b = 0.
        gamma: margin scale γ ≥ 0 (default 0.5).
        margin: "text" (default) or "image_text".
        negatives: None or (M, D) hard-negative captions (``txt``'s dtype and device): M more
            columns of every image row, label −1; gradients reach them.
        group_ids: None or (N,) integer ids; what equal ids mean is ``group_mode``'s.
        group_mode: "mask" (default: pairs i ≠ j of one group are not negatives and leave the
            loss; for duplicate captions) or "positive" (they are positives, label +1:
            SigLIP+-style multi-positive targets, for several captions of one image).
        reduction: "mean" (the pair sum / N), "sum" or "none" ((N,): row i's sum over its columns).
        normalize: L2-normalise inside (autograd through it); False trusts the caller.
        backend: "auto" (Triton on CUDA, the C++ kernel on CPU when built, else torch), "torch"
            (materialises N×(N + M)), "cpp" or "triton" (fused, O(N·D) extra memory).
        precision: the Triton backend's tensor-core precision for float32 features.

    Returns:
        float32 loss (float64 for float64 features): a scalar, or (N,) for "none".

    Raises:
        TypeError: non-tensor or non-floating features, dtype mismatch, non-real ``logit_scale``
            / ``logit_bias`` / ``gamma``, float64 with backend="triton"; ``negatives`` or
            ``group_ids`` of the wrong kind.
        ValueError: shape or device mismatch, N = 0 or D = 0, s ≤ 0 or non-finite, b non-finite,
            logits beyond the compute dtype's range, γ < 0, unknown ``margin``, ``group_mode``,
            ``reduction``, ``backend`` or ``precision``; ``negatives`` or ``group_ids`` of the
            wrong shape or device.
    """
    options = SigmoidOptions(
        gamma=gamma,
        margin=margin,
        group_mode=group_mode,
        reduction=reduction,
        normalize=normalize,
        backend=backend,
        precision=precision,
    )
    rows = sigmoid_rows(img, txt, logit_scale, logit_bias, options, negatives, group_ids)
    return reduce_rows(rows, options.reduction)


def sigmoid_rows(img, txt, logit_scale, logit_bias, options: SigmoidOptions, negatives=None, group_ids=None,
                 names=("img", "txt")) -> torch.Tensor:  # fmt: skip
    """The (N,) row losses of one process for checked ``options`` (unbound); the arguments are
    checked here, once."""
    bound = options.bind(img, txt, names)
    negatives, group_ids = family_arguments(img, txt, negatives, group_ids, names)
    s = scalar_tensor("logit_scale", logit_scale, img, positive=True)
    b = None if logit_bias is None else scalar_tensor("logit_bias", logit_bias, img, positive=False)
    check_logit_range(img, txt, negatives, s, b, bound)
    fn = sigmoid_fn(bound.backend, bound.precision)
    with autocast_disabled(img.device):
        return fn(
            img,
            txt,
            s,
            b,
            offset=0,
            gamma=bound.gamma,
            margin=bound.margin,
            normalize=bound.normalize,
            negatives=negatives,
            query_groups=group_ids,
            key_groups=group_ids,
            groups_positive=bound.groups_positive,
        )


def check_logit_range(img, txt, negatives, s, b, options: SigmoidOptions) -> None:
    """ValueError where the logits (and so a row's sum) could overflow the compute dtype:
    |z| ≤ s·(1 + γ)·‖v‖‖k‖ + |b| (norms 1 with ``normalize``). One host sync with
    ``normalize=False``; nothing is read under ``torch.compile`` or on meta tensors."""
    bound = logit_bound(img, txt, negatives, s, b, options)
    if bound is None:
        return
    columns = txt.shape[0] + (0 if negatives is None else negatives.shape[0])
    limit = torch.finfo(compute_dtype(img.dtype)).max
    if not math.isfinite(bound) or bound * columns * img.shape[0] >= limit:
        raise ValueError(
            f"the sigmoid loss's logits reach {bound:.3g} (logit_scale·(1 + gamma)·‖v‖‖k‖ + |logit_bias|), so its "
            f"sum over {img.shape[0]}×{columns} pairs overflows {compute_dtype(img.dtype)}; "
            "check logit_scale (already exponentiated?) or normalise the features"
        )
