"""The sigmoid (SigLIP) loss across ranks: each rank's image rows against every rank's captions.

Rank r holds n_r pairs (n_r may differ across ranks) and m_r hard negatives (m_r ≥ 0). The global
batch is the concatenation in rank order of the pairs (N = Σ n_r), of the negatives (K = Σ m_r)
and of the group ids, and rank r's first row is global row ``offset_r = Σ_{r' < r} n_r'``. A rank
gathers the captions, negatives and ids (never the images: the sigmoid loss has no text→image
direction) and runs the backend's sigmoid op (``backends.sigmoid_fn``) on its n_r image rows
against the N + K gathered columns, positives at ``offset_r + i``: the fused backends never hold
an n_r × N matrix. The captions and negatives are gathered with autograd (their backward sums
every rank's gradient into the owner), so each rank's texts receive the gradient of every rank's
rows, as open_clip's ``SigLipLoss`` delivers it through its neighbour exchanges.

Rank r returns ``(W / N) · Σ_{i on r} r_i``, r_i the row's sum over its N + K columns: with equal
local batches (open_clip's setting) ``(1/n_r)·Σ_i r_i``, open_clip's value; the mean over the W
ranks is the single-process loss of the global batch for any sizes, so DDP's gradient averaging
gives every parameter the global loss's gradient.

16-bit features run in float32 from the gather on (as the hard-negative family of
``distributed.family``): a caption's gradient is the sum of every rank's part, summed in float32
by the gather's backward and rounded to the caption's dtype once.

Bad input never hangs the job: one small all_gather carries every rank's checks, sizes and
options before any feature moves, and every rank raises (the offending rank its own
``TypeError``/``ValueError``, the others a ``ValueError`` naming it).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import validation
from ..backends import sigmoid_fn
from ..numerics import autocast_disabled, compute_dtype
from ..options_sigmoid import SigmoidOptions, logit_bound, scalar_tensor
from ..validation_family import family_arguments
from .consensus import _STATUS_TEXT, _bits_float, _float_bits
from .gather import dist, gather_ids, gather_rows, group_rank_world, meta_device, require_distributed

Scalar = Union[float, torch.Tensor]

NAMES = ("image_features", "text_features")
# metadata row, one int64 row per rank
_STATUS, _N, _DIM, _DTYPE, _OPTIONS, _GAMMA, _WORLD, _N_NEG, _IDS, _BOUND = range(10)
_META_LEN = 10


def distributed_siglip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: Scalar,
    logit_bias: Optional[Scalar] = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group=None,
    gamma: float = 0.5,
    margin: str = "text",
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    group_mode: str = "mask",
    normalize: bool = True,
    backend: str = "auto",
    precision: Optional[str] = None,
) -> torch.Tensor:
    """This rank's sigmoid loss of the global batch (a collective: call it on every rank).

    Args:
        image_features, text_features: this rank's (n_r, D) features, row i paired; n_r may
            differ across ranks; D, dtype and device as :func:`hnclip_kernels.hn_siglip_loss`.
        logit_scale, logit_bias: s > 0 (already exponentiated) and b (or None), floats or
            one-element tensors; each rank's receive this rank's loss's gradient.
        rank, world_size, group: the process group (default: the global group, its rank and
            size); ``world_size == 1`` is :func:`hnclip_kernels.hn_siglip_loss` (mean).
        gamma, margin, group_mode, normalize, backend, precision: as
            :func:`hnclip_kernels.hn_siglip_loss`; gamma, margin, group_mode and normalize must
            agree across ranks.
        negatives: this rank's (m_r, D) hard-negative captions or None (m_r may differ, be 0):
            every rank's rows see every rank's negatives.
        group_ids: this rank's (n_r,) integer ids, on every rank or on none; compared across
            ranks (a rank's caption can share a group with another rank's image).

    Returns:
        ``(W / N)·Σ_{i on r} r_i`` (module docstring): float32 (float64 for float64 features).

    Raises:
        TypeError, ValueError: as :func:`hnclip_kernels.hn_siglip_loss`, on every rank when any
            rank's input is invalid; ``ValueError`` when the ranks' dims, dtypes or options
            differ, or ``rank``/``world_size`` do not match ``group``.
    """

    def options():  # built inside the checks: a bad option on one rank raises on every rank
        return SigmoidOptions(
            gamma=gamma,
            margin=margin,
            group_mode=group_mode,
            normalize=normalize,
            backend=backend,
            precision=precision,
        )

    return sigmoid_rank_loss(
        image_features,
        text_features,
        logit_scale,
        logit_bias,
        options,
        rank=rank,
        world_size=world_size,
        group=group,
        negatives=negatives,
        group_ids=group_ids,
    )


def sigmoid_rank_loss(img, txt, logit_scale, logit_bias, options, *, rank=None, world_size=None, group=None,
                      negatives=None, group_ids=None) -> torch.Tensor:  # fmt: skip
    """:func:`distributed_siglip_loss` with its options as a :class:`SigmoidOptions` (or a function
    building one, whose error then raises on every rank)."""
    if world_size is None:
        world_size = dist.get_world_size(group=group) if dist is not None and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank(group=group) if world_size > 1 else 0
    if world_size == 1:
        status, exc, checked = _local_checks(img, txt, logit_scale, logit_bias, options, negatives, group_ids)
        if exc is not None:
            raise exc
        _check_global_range(checked[4], img.shape[0], _columns(txt, checked[3]), img.dtype)
        return _rows(img, txt, 0, checked).mean()
    require_distributed()
    status, exc, checked = _local_checks(img, txt, logit_scale, logit_bias, options, negatives, group_ids)
    if status == 0:
        g_rank, g_world = group_rank_world(group)
        if (g_rank, g_world) != (rank, world_size):
            status, exc = (
                4,
                ValueError(
                    f"rank={rank}, world_size={world_size} were passed but the process group says rank {g_rank} of "
                    f"{g_world}; pass torch.distributed.get_rank() / get_world_size()"
                ),
            )
    meta = _all_meta(_meta_row(status, img, world_size, checked), group, img)
    if exc is not None:
        raise exc
    _check_consensus(meta)
    sizes, neg_sizes = [m[_N] for m in meta], [m[_N_NEG] for m in meta]
    bound = max(_bits_float(m[_BOUND]) for m in meta) if all(m[_BOUND] != 0 for m in meta) else None
    _check_global_range(bound, sum(sizes), sum(sizes) + sum(neg_sizes), img.dtype, every_rank=True)
    _, _, _, negatives, _, group_ids = checked
    if img.dtype in (torch.float16, torch.bfloat16):  # one float32 gradient sum per caption (docstring)
        img, txt = img.float(), txt.float()
        negatives = None if negatives is None else negatives.float()
    all_txt = gather_rows(txt, sizes, rank, with_grad=True, keep_local=False, like=txt, group=group)
    all_neg = None
    if any(neg_sizes):
        all_neg = gather_rows(negatives, neg_sizes, rank, with_grad=True, keep_local=False, like=txt, group=group)
    all_ids = None if group_ids is None else gather_ids(group_ids, sizes, group)
    offset = sum(sizes[:rank])
    gathered = (*checked[:3], all_neg, None, all_ids)
    rows = _rows(img, all_txt, offset, gathered)
    n_total = sum(sizes)
    if n_total == world_size * img.shape[0]:
        return rows.mean()  # equal sizes: open_clip's (1/n)·Σ of the local rows
    return rows.sum() / (n_total / world_size)


def _local_checks(img, txt, logit_scale, logit_bias, options, negatives, group_ids):
    """Every local check without raising: (status, exception or None, checked) where ``checked``
    is (bound options, s, b, negatives or None, the logits' bound or None, group_ids or None)."""
    try:
        validation.check_features(img, txt, *NAMES)
    except (TypeError, ValueError) as exc:
        return 1, exc, None
    try:
        if not isinstance(options, SigmoidOptions):
            options = options()
        bound = options.bind(img, txt, NAMES)
    except (TypeError, ValueError) as exc:
        return 3, exc, None
    try:
        s = scalar_tensor("logit_scale", validation.plain_number(logit_scale), img, positive=True)
        b = None
        if logit_bias is not None:
            b = scalar_tensor("logit_bias", validation.plain_number(logit_bias), img, positive=False)
    except (TypeError, ValueError) as exc:
        return 2, exc, None
    try:
        negatives, group_ids = family_arguments(img, txt, negatives, group_ids, NAMES)
    except (TypeError, ValueError) as exc:
        return 5, exc, None
    return 0, None, (bound, s, b, negatives, logit_bound(img, txt, negatives, s, b, bound), group_ids)


def _meta_row(status, img, world_size, checked) -> list:
    """This rank's metadata row: its status, sizes and options (γ and the logits' bound as float64 bits)."""
    row = [0] * _META_LEN
    row[_STATUS], row[_WORLD] = status, int(world_size)
    if isinstance(img, torch.Tensor) and img.dim() >= 1:
        row[_N], row[_DIM] = img.shape[0], img.shape[-1]
    dtypes = list(validation.FLOAT_DTYPES)
    row[_DTYPE] = dtypes.index(img.dtype) if isinstance(img, torch.Tensor) and img.dtype in dtypes else -1
    if status == 0:
        bound, _, _, negatives, pair_bound, group_ids = checked
        row[_OPTIONS] = int(bound.normalize) | int(bound.groups_positive) << 1 | bound.margin.code << 2
        row[_GAMMA] = -1 if isinstance(bound.gamma, torch.Tensor) else _float_bits(bound.gamma)
        row[_N_NEG] = 0 if negatives is None else negatives.shape[0]
        row[_IDS] = int(group_ids is not None)
        row[_BOUND] = 0 if pair_bound is None else _float_bits(pair_bound)
    return row


def _all_meta(row, group, like) -> list:
    device = meta_device(group, like if isinstance(like, torch.Tensor) else None)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows).cpu().tolist()


def _check_consensus(meta) -> None:
    """The same ``ValueError`` on every rank where another rank's input failed or the ranks disagree."""
    bad = [r for r, m in enumerate(meta) if m[_STATUS] != 0]
    if bad:
        what = ", ".join(f"rank {r}: {_STATUS_TEXT.get(meta[r][_STATUS], 'error')}" for r in bad)
        raise ValueError(
            f"HN-SigLIP distributed loss: invalid input on another rank ({what}); see the error raised on that "
            "rank. No collective was started."
        )
    problems = []
    for field, what in ((_DIM, "feature dims"), (_DTYPE, "feature dtypes")):
        if len({m[field] for m in meta}) > 1:
            values = [m[field] if field == _DIM else str(validation.FLOAT_DTYPES[m[field]]) for m in meta]
            problems.append(f"{what} differ across ranks: {values}")
    if len({(m[_OPTIONS], m[_GAMMA], m[_WORLD]) for m in meta}) > 1:
        problems.append("loss options (gamma, margin, group_mode, normalize, world_size) differ across ranks")
    if len({m[_IDS] for m in meta}) > 1:
        given = [r for r, m in enumerate(meta) if m[_IDS]]
        problems.append(f"group_ids were given on ranks {given} only: pass them on every rank or on none")
    if problems:
        raise ValueError(
            "HN-SigLIP distributed loss: inconsistent inputs across ranks: "
            + "; ".join(problems)
            + ". Every rank raised this error."
        )


def _columns(txt, negatives) -> int:
    return txt.shape[0] + (0 if negatives is None else negatives.shape[0])


def _check_global_range(bound, rows, columns, dtype, every_rank=False) -> None:
    """ValueError where the global batch's pair sum could overflow the compute dtype (``bound``:
    the largest |z| over every rank, None where not read)."""
    if bound is None:
        return
    limit = torch.finfo(compute_dtype(dtype)).max
    if not math.isfinite(bound) or bound * rows * columns >= limit:
        raise ValueError(
            f"the sigmoid loss's logits reach {bound:.3g} (logit_scale·(1 + gamma)·‖v‖‖k‖ + |logit_bias|), so its "
            f"sum over {rows}×{columns} pairs overflows {compute_dtype(dtype)}; check logit_scale (already "
            "exponentiated?) or normalise the features" + (". Every rank raised this error." if every_rank else "")
        )


def _rows(img, columns_txt, offset, checked) -> torch.Tensor:
    """The backend's (n,) row sums of ``img`` against ``columns_txt`` (and the checked negatives),
    positives at ``offset + i``."""
    bound, s, b, negatives, _, group_ids = checked
    query_groups = None if group_ids is None else group_ids[offset : offset + img.shape[0]]
    fn = sigmoid_fn(bound.backend, bound.precision)
    with autocast_disabled(img.device):
        return fn(
            img,
            columns_txt,
            s,
            b,
            offset=offset,
            gamma=bound.gamma,
            margin=bound.margin,
            normalize=bound.normalize,
            negatives=negatives,
            query_groups=query_groups,
            key_groups=group_ids,
            groups_positive=bound.groups_positive,
        )
