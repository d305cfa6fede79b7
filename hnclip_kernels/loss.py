"""``hn_clip_loss``: the public entry point of the single-process loss."""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import validation, validation_family
from .backends import direction_losses, symmetric_losses
from .numerics import autocast_disabled
from .options import LossOptions, as_tau_tensor
from .plausibility import warn_if_tau_looks_like_logit_scale
from .reports import report_of_call
from .validation_family import check_positive_stats
from .validation_options import ROW_REDUCTIONS
from .validation_rows import check_small_rows


def reduce_rows(rows, reduction: str):
    """The rows reduced: a scalar for "mean"/"sum"; as they are for "none" (N,) and
    "directions" (:class:`~hnclip_kernels.DirectionRows`)."""
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
    return_stats: bool = False,
    false_negative_threshold: Optional[float] = None,
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    margin: str = "text",
    group_mode: str = "mask",
    negatives_mask: Optional[torch.Tensor] = None,
):
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
            τ, γ and ε may also be NumPy scalars or one-element floating tensors (γ and ε get
            no gradient); under ``torch.compile`` these are graph inputs like Python floats.
            A 16-bit τ tensor computes in float32; dτ comes back in its dtype.
        reduction: "mean" (scalar), "sum" (scalar), "none" ((N,), entry k = ½(i2t_k + t2i_k)) or
            "directions": a :class:`~hnclip_kernels.DirectionRows` ``(i2t, t2i, lse_i2t, lse_t2i)``,
            each direction's per-row loss and log-partition (N,), all differentiable
            (``docs/api.md``, "Per-direction rows": their exact definition with every option,
            and their cost, two directional passes, four with label smoothing).
        normalize: L2-normalise inside (autograd through it); False trusts the caller.
        backend: "auto" (Triton on CUDA, the C++ kernel on CPU when built, else torch),
            "torch" (pure PyTorch reference, materialises N×N), "triton" (fused kernels; CPU
            tensors only under TRITON_INTERPRET=1) or "cpp" (fused CPU kernel).
        precision: tensor-core input precision of the Triton backend for float32 features:
            "tf32x3" (default, None), "bf16x6", "ieee" (no tensor cores) or "bf16x3" (faster,
            below float32 accuracy in the saturated regime); see the README's "Precision"
            table. 16-bit features and the other backends ignore it (they are exact in
            float32 accumulation already).
        return_stats: also return a :class:`hnclip_kernels.diagnostics.SaturationReport` of the
            batch (``loss``, ``saturated_rows``, ``effective_negatives``), made from the row
            statistics the forward saved (a few O(N) reductions and one host sync; None for meta
            tensors and under ``torch.compile``). :func:`~hnclip_kernels.diagnostics.saturation_report`
            fills the fields that need the logits again.
        false_negative_threshold: None (default: every i ≠ j is a negative, as in the paper) or
            a caption cosine c in (−1, 1]: a pair i ≠ j with t̂_i·t̂_j ≥ c is no negative in either
            direction (no logit, margin or gradient; ε spreads over the classes a row keeps). The
            cosine is the margin's own caption product in float32 (float64 for float64 inputs),
            also with ``normalize=False``; to mask exact duplicates use c ≤ 0.9999. Ties within a
            few ulps of c and the details: ``docs/masking.md``.
        negatives: None or (M, D) hard-negative caption embeddings (``txt``'s dtype and device;
            M = 0 is None): extra columns of every image→text row; gradients reach them. Or
            (N, K, D): row i's own K negatives, extra columns of image→text row i only (K = 0
            is None; ``docs/hard_negatives.md``, "Each row's own negatives").
        negatives_mask: None (every own negative real) or (N, K) bool with (N, K, D)
            ``negatives``: True where row i's k-th negative is real; False entries are no
            columns (no logit, no ε share, zero gradient).
        group_ids: None or (N,) integer ids (``txt``'s device): pairs i ≠ k with equal ids are no
            negatives of each other in either direction.
        margin: "text" (default: sg(t_i·x), the paper's) or "image_text" (sg(v_i·x) in i2t,
            sg(v_i·t_k) in t2i), a :class:`~hnclip_kernels.margin.Margin`. ``negatives``,
            ``group_ids`` and ``margin="image_text"`` are the hard-negative family
            (``docs/hard_negatives.md``), on every backend; without them nothing changes, bit for bit.
        group_mode: what equal ``group_ids`` mean: "mask" (default, above) or, as positives
            (multi-positive targets, ``docs/hard_negatives.md#multi-positive-targets``), "supcon"
            (row i's target spread uniformly over its group P(i): LSE_i − mean_{p∈P(i)} Z_ip) or
            "mil_nce" (−log Σ_{p∈P(i)} softmax(Z_i)_p), in both directions; positives get no margin
            and are never masked; ε and the threshold as documented there. (N, K, D) ``negatives``
            are extra negative columns of the image→text rows then, never positives. Needs
            ``group_ids``; every backend; no ``return_stats``. With "directions" each direction's
            row is the mode's and its LSE runs over every class, positives included
            (``docs/api.md``, "Per-direction rows"; with (N, K, D) ``negatives`` too: ``ValueError``).

    Returns:
        float32 loss (float64 for float64 inputs): a scalar, shape (N,) for "none", four (N,)
        rows for "directions";
        ``(loss, report)`` with ``return_stats``.
        Gradients reach ``img``/``txt`` in their own dtype and ``tau`` in its dtype.
        Second derivatives (a backward through a gradient taken with ``create_graph=True``)
        are exact on backend="torch"; the fused backends ("cpp", "triton") raise a
        ``RuntimeError`` naming backend="torch" instead. Meta-device features give a
        meta-device result of the right shape (backend "torch"/"auto"), with no value checks.

    Warns:
        RuntimeWarning (once per process, not under ``torch.compile``): τ > 1, almost always
        open_clip's ``logit_scale`` passed in place of τ = 1 / logit_scale
        (:func:`hnclip_kernels.plausibility.scale_mistake`); with ``normalize=False``, row norms
        of the features or ``negatives`` off 1 by more than 5% (dot products, not cosines).

    Raises:
        TypeError: non-tensor, DTensor (pass ``.full_tensor()``) or integer features, dtype
            mismatch, non-real ``tau``/``gamma``/``label_smoothing``, non-bool
            ``normalize``/``return_stats``, non-string ``precision``, float64 with backend="triton".
        ValueError: non-2-D features, shape or device mismatch, N = 0 or D = 0, τ ≤ 0,
            non-finite or so small that the logit gaps (2 + γ)/τ (or, with ``normalize=False``,
            the features' norms) overflow float32, γ < 0 or non-finite, ε
            outside [0, 1), unknown ``reduction``/``backend``/``precision``,
            ``false_negative_threshold`` outside (−1, 1], a backend that cannot run on these
            tensors; ``negatives`` not 2-D, of another D or device than ``txt`` (another dtype
            or non-floating: ``TypeError``), (N, K, D) with another N; ``negatives_mask`` without
            (N, K, D) negatives or of another shape or device (not bool: ``TypeError``);
            ``group_ids`` not of shape (N,) or on another device (non-integer: ``TypeError``);
            ``margin`` not "text"/"image_text"; ``group_mode`` not "mask"/"supcon"/"mil_nce", a
            positive one without ``group_ids``, with ``return_stats`` or with
            ``reduction="directions"``. Under
            ``torch.compile`` value checks are skipped (no graph breaks).
    """
    tau = validation.plain_number(tau)
    options = LossOptions(
        gamma=gamma,
        label_smoothing=label_smoothing,
        reduction=reduction,
        normalize=normalize,
        backend=backend,
        precision=precision,
        false_negative_threshold=false_negative_threshold,
        margin=margin,
        group_mode=group_mode,
    )
    family = validation_family.family_of(
        img, txt, negatives, group_ids, options.margin, negatives_mask=negatives_mask, group_mode=options.group_mode
    )
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be True or False, got {return_stats!r}")
    rows, report = pair_losses(img, txt, tau, options, family, return_stats, warn_tau=True)
    return (reduce_rows(rows, reduction), report) if return_stats else reduce_rows(rows, reduction)


def pair_losses(img, txt, tau, options, family, return_stats, *, tau_value=None, names=("img", "txt"), warn_tau=False):
    """The per-pair rows (N,) of one process and, with ``return_stats``, their report (else
    None): ``options`` unbound, ``family`` a checked
    :class:`~hnclip_kernels.validation_family.Family` or None (today's loss)."""
    # family_of checked the features when it returned a family; bind checks them otherwise
    check_positive_stats(options.group_mode, return_stats)
    n_negatives = 0 if family is None or family.negatives is None else family.negatives.shape[0]
    if family is not None and family.own_negatives is not None:  # the widest row's columns
        n_negatives = family.own_negatives.shape[1]
    n_keys = img.shape[0] + n_negatives if family is not None else None
    bound = options.bind(img, txt, tau, tau_value=tau_value, names=names, n_keys=n_keys)
    if family is not None:
        _check_family(img, txt, tau, bound, family, n_keys, names)
    if warn_tau:  # hn_clip_loss's warning (HNClipLoss warns about its logit_scale instead)
        warn_if_tau_looks_like_logit_scale(bound.tau_value, depth=1)
    # autocast would run the reference's matmuls in bf16: accumulation here is float32 by design
    with autocast_disabled(img.device):
        tau_t = as_tau_tensor(tau, img)
        if bound.reduction == "directions":
            out = direction_losses(img, txt, img, txt, tau_t, 0, bound, return_stats, family)
        else:
            out = symmetric_losses(img, txt, tau_t, bound, return_stats, family)
    if not return_stats:
        return out, None
    rows, (i2t, t2i) = out
    keys = img.shape[0] if family is None else (_i2t_columns(img, family, n_keys), img.shape[0])
    return rows, report_of_call(i2t, t2i, img, label_smoothing=bound.label_smoothing, n_keys=keys)


def _i2t_columns(img, family, n_keys):
    """The i2t rows' key columns for the report: ``n_keys``, or with own negatives per row
    N + the row's real ones (a (N,) tensor)."""
    if family.own_negatives is None:
        return n_keys
    if family.own_mask is None:
        return n_keys
    return img.shape[0] + family.own_mask.sum(dim=1)


def _real_negatives(family):
    """The negatives the range checks read: shared (M, D), or the real own ones flattened (padding
    rows, often zeros, are no columns; under ``torch.compile`` every row, no data-dependent shape)."""
    if family.own_negatives is None:
        return family.negatives
    own = family.own_negatives
    if family.own_mask is None or torch.compiler.is_compiling():
        return own.reshape(-1, own.shape[-1])
    return own[family.own_mask]


def _check_family(img, txt, tau, bound, family, n_keys, names) -> None:
    """The family's range checks on bound options: the negatives' small rows (``normalize``), or
    the logit gaps their norms (and an image-text margin's) give (``normalize=False``)."""
    n_rows = img.shape[0] if bound.reduction not in ROW_REDUCTIONS else 1
    negatives = _real_negatives(family)
    negatives = None if negatives is not None and negatives.shape[0] == 0 else negatives
    if bound.normalize and negatives is not None and negatives.shape[0] > 0:  # bind checked img and txt
        kw = dict(gamma=bound.gamma, label_smoothing=bound.label_smoothing, n_keys=n_keys, n_rows=n_rows)
        check_small_rows((negatives,), ("negatives",), bound.tau_value, **kw)
    if not bound.normalize:
        tau_grad = validation.tau_requires_grad(tau)
        validation_family.check_family_range(
            img, txt, negatives, family.margin, bound.tau_value, bound.gamma, bound.label_smoothing, n_rows,
            tau_grad, names,
        )  # fmt: skip


def module_family_loss(
    img, txt, tau, options, negatives, group_ids, *, return_stats, tau_value, problem, negatives_mask=None
):  # fmt: skip
    """``HNClipLoss.forward`` with a family option on one process (``world_size > 1`` goes to
    :func:`hnclip_kernels.distributed.rank_loss`): (mean loss, or the ``DirectionRows`` of
    ``reduction="directions"``; report or None), or None where
    the checked options turn out to be today's (M = 0, no ids, margin "text"). ``problem``: the
    error of an invalid logit_scale, raised once the family arguments are checked."""
    names = ("image_features", "text_features")
    family = validation_family.family_of(
        img, txt, negatives, group_ids, options.margin, names, negatives_mask, group_mode=options.group_mode
    )
    if family is None:
        return None
    if problem is not None:
        raise problem
    rows, report = pair_losses(img, txt, tau, options, family, return_stats, tau_value=tau_value, names=names)
    return (rows if options.reduction == "directions" else rows.mean()), report
