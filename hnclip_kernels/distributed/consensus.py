"""The cross-rank consensus check: every rank's inputs checked in one small collective, so that
bad input on any rank raises on every rank instead of hanging the job.

Each rank runs its local checks without raising, packs the outcome with its sizes, feature
dim, dtype and options into one int64 row (γ, ε and τ as float64 bit patterns), and all ranks
all_gather the rows before any feature is gathered. Every rank then inspects every rank's
row and raises the same error: the offending rank its own ``TypeError``/``ValueError``, the
others a ``ValueError`` naming the offending rank.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Tuple

import torch

from .. import validation
from ..group_mode import GroupMode
from ..margin import Margin
from ..options import LossOptions
from ..plausibility import warn_if_not_unit_norm
from ..validation_family import Family, check_family_range, family_of
from .gather import dist, group_rank_world, meta_device

# metadata vector layout, one int64 row per rank
_STATUS, _N_IMG, _N_TXT, _DIM, _DTYPE, _FLAGS, _GAMMA, _EPS, _WORLD, _PREC, _TAU, _IMG_NORM, _TXT_NORM = range(13)
_THRESHOLD = 13  # the false-negative threshold's float64 bits, NO_THRESHOLD for None
# the hard-negative family: M_r (0 for None); bit 0 group_ids given, bits 1-2 the margin's code,
# bits 3- the group mode's code
_N_NEG, _FAMILY = 14, 15
_OWN_K = 16  # K_r of each row's own negatives (N, K, D) on this rank, 0 for none (never gathered with local_loss)
_META_LEN = 17
NO_THRESHOLD = -(1 << 63)  # -0.0's bits: a threshold is sent as float(c) + 0.0, which is +0.0 for -0.0
_STATUS_TEXT = {
    0: "ok",
    1: "invalid features",
    2: "invalid logit scale / temperature",
    3: "invalid options or backend",
    4: "rank / world_size do not match the process group",
    5: "invalid negatives or group_ids",
}


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def local_checks(image_features, text_features, tau, options, rank, world_size, group, tau_value=None):
    """Run every local check without raising: (status, exception or None, the options as
    requested or None, the options bound to these tensors or None).

    ``options``: a :class:`LossOptions`, or a function that builds one (its error is this rank's
    status 3). ``tau_value``: τ already read by the caller (HNClipLoss reads ``logit_scale``
    once), so that τ is not read again."""
    try:
        validation.check_features(image_features, text_features, "image_features", "text_features")
    except (TypeError, ValueError) as exc:
        return 1, exc, None, None
    try:  # before τ: its overflow bound (2 + γ)/τ needs a valid γ
        if not isinstance(options, LossOptions):
            options = options()
    except (TypeError, ValueError) as exc:
        return 3, exc, None, None
    try:  # the global N is known after the collective, which checks the bound again with it
        tau_value = options.checked_tau(
            image_features,
            text_features,
            tau,
            n_rows=image_features.shape[0],
            tau_value=tau_value,
            feature_range=world_size == 1,
            names=("image_features", "text_features"),
        )
    except (TypeError, ValueError) as exc:
        return 2, exc, options, None
    try:
        bound = options.resolved(image_features, tau_value)
    except (TypeError, ValueError) as exc:
        return 3, exc, options, None
    if world_size > 1:
        g_rank, g_world = group_rank_world(group)
        if (g_rank, g_world) != (rank, world_size):
            return (
                4,
                ValueError(
                    f"rank={rank}, world_size={world_size} were passed but the process group says "
                    f"rank {g_rank} of {g_world}; pass torch.distributed.get_rank() / get_world_size()"
                ),
                options,
                None,
            )
    return 0, None, options, bound


def _meta_row(
    status, image_features, text_features, flags, gamma, label_smoothing, world_size, precision=None, threshold=None
) -> List[int]:
    """This rank's metadata row (see the layout above)."""
    row = [0] * _META_LEN
    row[_STATUS] = status
    ok_tensors = isinstance(image_features, torch.Tensor) and isinstance(text_features, torch.Tensor)
    row[_N_IMG] = image_features.shape[0] if ok_tensors and image_features.dim() >= 1 else -1
    row[_N_TXT] = text_features.shape[0] if ok_tensors and text_features.dim() >= 1 else -1
    row[_DIM] = image_features.shape[-1] if ok_tensors and image_features.dim() >= 1 else -1
    dtypes = list(validation.FLOAT_DTYPES)
    row[_DTYPE] = dtypes.index(image_features.dtype) if ok_tensors and image_features.dtype in dtypes else -1
    row[_FLAGS] = flags
    try:
        row[_GAMMA] = _float_bits(gamma)
        row[_EPS] = _float_bits(label_smoothing)
    except (TypeError, ValueError):
        row[_GAMMA] = row[_EPS] = -1
    row[_WORLD] = int(world_size)
    modes = (None,) + validation.FP32_PRECISIONS
    row[_PREC] = modes.index(precision) if precision in modes else -1
    try:
        row[_THRESHOLD] = NO_THRESHOLD if threshold is None else _float_bits(float(threshold) + 0.0)
    except (TypeError, ValueError):
        row[_THRESHOLD] = -1
    return row


def _range_fields(row, tau_value, image_features, text_features, normalize) -> None:
    """τ (as read by the local check; None where it was not: under compile, meta tensors) and,
    without normalisation, the largest row norms, for the global overflow check."""
    if tau_value is None:
        return
    norms = (1.0, 1.0)
    if not normalize:
        (img_norm, img_off), (txt_norm, txt_off) = validation.row_norm_extremes(image_features, text_features)
        norms = (img_norm, txt_norm)
        warn_if_not_unit_norm(max(img_off, txt_off), ("image_features", "text_features"))
    row[_TAU], row[_IMG_NORM], row[_TXT_NORM] = (_float_bits(v) for v in (tau_value, *norms))


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _global_range_problem(meta, gamma, label_smoothing, dtype_index) -> Optional[str]:
    """The overflow check of the whole global batch (every rank runs it on the same metadata)."""
    if any(m[_TAU] == 0 for m in meta):
        return None  # not read (compile / meta)
    tau_value = min(_bits_float(m[_TAU]) for m in meta)
    img_norm = max(_bits_float(m[_IMG_NORM]) for m in meta)
    txt_norm = max(_bits_float(m[_TXT_NORM]) for m in meta)
    n_total = sum(m[_N_IMG] for m in meta)
    tau_grad = any(m[_FLAGS] >> 3 & 1 for m in meta)  # a rank's τ requires grad: dL/dτ is formed
    largest = validation.largest_intermediate(
        tau_value, float(gamma), float(label_smoothing), n_total, img_norm, txt_norm, n_rows=n_total, tau_grad=tau_grad
    )
    dtype = validation.FLOAT_DTYPES[dtype_index]
    if largest < validation.finite_limit(dtype):
        return None
    return (
        f"the global batch (N = {n_total}, smallest tau = {tau_value:g}, largest row norms {img_norm:.3g} / "
        f"{txt_norm:.3g}) gives logit gaps{' or dL/dtau' if tau_grad else ''} up to {largest:.3g}, beyond the "
        f"range of {dtype}; raise tau, pass "
        "normalize=True or scale the features down"
    )


def family_checks(image_features, text_features, negatives, group_ids, bound, tau, negatives_mask=None):
    """This rank's hard-negative arguments checked without raising: (status, exception or None,
    the checked :class:`Family` or None: negatives (M, D) (M = 0 is None) or each row's own (n, K, D)
    with ``negatives_mask``, group_ids). With ``normalize=False`` the negatives' norms enter this
    rank's overflow bound (the local batch's; the global bound covers img/txt)."""
    names = ("image_features", "text_features")
    try:
        family = family_of(
            image_features, text_features, negatives, group_ids, bound.margin, names, negatives_mask=negatives_mask,
            group_mode=bound.group_mode,
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        return 5, exc, None
    negatives = None if family is None else family.negatives
    if family is not None and family.own_negatives is not None:
        negatives = family.own_negatives.reshape(-1, family.own_negatives.shape[-1])  # the range bound's rows
        if family.own_mask is not None:
            negatives = family.own_negatives[family.own_mask]
    if not bound.normalize and family is not None and (negatives is not None or family.margin is not Margin.TEXT):
        tau_grad = validation.tau_requires_grad(tau)
        try:
            check_family_range(
                image_features, text_features, negatives, bound.margin, bound.tau_value, bound.gamma,
                bound.label_smoothing, image_features.shape[0], tau_grad, ("image_features", "text_features"),
            )  # fmt: skip
        except ValueError as exc:
            return 2, exc, None
    return 0, None, family


def collective_check(
    image_features, text_features, tau, options, flags, rank, world_size, group, tau_value=None, family=None
) -> Tuple[List[int], LossOptions, Optional[Tuple[List[int], Family]]]:
    """Check inputs on every rank at once; return (sizes, bound options, family) or raise on every
    rank. ``options``/``tau_value`` as :func:`local_checks`. ``family``: this rank's
    ``(negatives, group_ids, negatives_mask)`` (each may be None) or None; the returned ``family`` is
    None where no rank uses the hard-negative family (no negatives anywhere, no ids, margin "text":
    today's loss), else ``(every rank's M_r, this rank's checked Family, every rank's K_r)``: shared
    (M_r, D) negatives or each row's own (n_r, K_r, D), never both across ranks."""
    status, exc, requested, bound = local_checks(
        image_features, text_features, tau, options, rank, world_size, group, tau_value
    )
    checked = None
    if status == 0 and (family is not None or bound.group_mode.positives):  # positives need ids: checked there
        family = (None, None, None) if family is None else family
        status, exc, checked = family_checks(image_features, text_features, *family[:2], bound, tau, family[2])
    own = None if checked is None else checked.own_negatives
    # local_loss: the rank's rows are the directional ops', which only the reference extends by own
    # columns; reduction="directions" extends them itself on every backend (backends.directions.own_rows)
    if own is not None and flags & 1 and bound.backend != "torch" and bound.reduction != "directions":
        status, exc = (
            5,
            ValueError(
                f"each row's own negatives (N, K, D) across ranks with local_loss=True run on backend='torch' only "
                f"(got {bound.backend!r}): pass backend='torch', or local_loss=False (every backend), or "
                "reduction='directions' (every backend)"
            ),
        )
    like = image_features if isinstance(image_features, torch.Tensor) else None
    if requested is not None:
        flags |= int(bool(requested.normalize)) << 2
        flags |= int(validation.tau_requires_grad(tau)) << 3  # dτ's overflow bound: not compared across ranks
        flags |= int(requested.reduction == "directions") << 4
        row = _meta_row(
            status,
            image_features,
            text_features,
            flags,
            requested.gamma,
            requested.label_smoothing,
            world_size,
            requested.precision,
            requested.false_negative_threshold,
        )
    else:  # this rank raises: its options are not compared
        row = _meta_row(status, image_features, text_features, flags, 0.0, 0.0, world_size)
    if status == 0:
        _range_fields(row, bound.tau_value, image_features, text_features, bound.normalize)
        row[_N_NEG] = 0 if checked is None or checked.negatives is None else checked.negatives.shape[0]
        row[_OWN_K] = 0 if own is None else own.shape[1]
        row[_FAMILY] = int(checked is not None and checked.group_ids is not None)
        row[_FAMILY] |= bound.margin.code << 1 | bound.group_mode.code << 3
    mine = torch.tensor(row, dtype=torch.int64, device=meta_device(group, like))
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(rows, mine, group=group)
    meta = torch.stack(rows).cpu().tolist()
    if exc is not None:
        raise exc
    bad = [r for r, m in enumerate(meta) if m[_STATUS] != 0]
    if bad:
        what = ", ".join(f"rank {r}: {_STATUS_TEXT.get(meta[r][_STATUS], 'error')}" for r in bad)
        raise ValueError(
            f"HN-CLIP distributed loss: invalid input on another rank ({what}); "
            "see the error raised on that rank. No collective was started."
        )
    problems = []
    if len({m[_DIM] for m in meta}) > 1:
        problems.append(f"feature dims differ across ranks: {[m[_DIM] for m in meta]}")
    if len({m[_DTYPE] for m in meta}) > 1:
        names = [str(validation.FLOAT_DTYPES[m[_DTYPE]]) for m in meta]
        problems.append(f"feature dtypes differ across ranks: {names}")
    if len({(m[_FLAGS] & 0b10111, m[_GAMMA], m[_EPS], m[_WORLD], m[_PREC]) for m in meta}) > 1:
        problems.append(
            "loss options (local_loss, gather_with_grad, normalize, reduction, gamma, "
            "label_smoothing, world_size, precision) differ across ranks"
        )
    if len({m[_THRESHOLD] for m in meta}) > 1:
        values = [None if m[_THRESHOLD] == NO_THRESHOLD else _bits_float(m[_THRESHOLD]) for m in meta]
        problems.append(f"false_negative_threshold values differ across ranks: {values}")
    if len({m[_FAMILY] >> 1 & 0b11 for m in meta}) > 1:
        margins = [Margin.from_code(m[_FAMILY] >> 1 & 0b11).value for m in meta]
        problems.append(f"margin differs across ranks: {margins}")
    if len({m[_FAMILY] >> 3 for m in meta}) > 1:
        modes = [GroupMode.from_code(m[_FAMILY] >> 3).value for m in meta]
        problems.append(f"group_mode differs across ranks: {modes}")
    if len({m[_FAMILY] & 1 for m in meta}) > 1:
        problems.append(
            f"group_ids were given on ranks {[r for r, m in enumerate(meta) if m[_FAMILY] & 1]} only: pass them on "
            "every rank or on none"
        )
    if any(m[_N_NEG] for m in meta) and any(m[_OWN_K] for m in meta):
        problems.append(
            f"negatives are shared (M, D) on ranks {[r for r, m in enumerate(meta) if m[_N_NEG]]} and each row's own "
            f"(N, K, D) on ranks {[r for r, m in enumerate(meta) if m[_OWN_K]]}: pass one layout on every rank"
        )
    if problems:
        raise ValueError(
            "HN-CLIP distributed loss: inconsistent inputs across ranks: "
            + "; ".join(problems)
            + ". Every rank raised this error."
        )
    problem = _global_range_problem(meta, bound.gamma, bound.label_smoothing, meta[0][_DTYPE])
    if problem is not None:
        raise ValueError(f"HN-CLIP distributed loss: {problem}. Every rank raised this error.")
    sizes, neg_sizes, own_sizes = ([m[f] for m in meta] for f in (_N_IMG, _N_NEG, _OWN_K))
    if not any(neg_sizes) and not any(own_sizes) and not any(m[_FAMILY] for m in meta):
        return sizes, bound, None
    return sizes, bound, (neg_sizes, checked if checked is not None else Family(margin=bound.margin), own_sizes)
