"""Global batches across ranks with ``torch.distributed``: gathering and this rank's loss.

Layout: rank r holds n_r image-text pairs; the global batch is the concatenation over
ranks in rank order, N = Σ n_r, and rank r's rows start at the global row
``offset_r = Σ_{r' < r} n_r'``. Every backend's *directional* function
``fn(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize)``
(``loss.directional_fn``) takes M local query rows, N global key columns and that offset,
so the fused kernels (Triton, C++) never hold an n×N or N×N matrix. Where a rank computes
the whole global batch (``local_loss=False``, or one process) it runs the single-process
fused op instead (``loss.pair_losses``).

Unequal local batch sizes are exact: every call all-gathers each rank's metadata (sizes,
feature dim, dtype, options) in one small collective, pads each rank's features to the
largest n_r, all-gathers them and strips the padding again (autograd flows through the
pad and the strip, so ``gather_with_grad`` is exact too). Rank r's loss is then
``(W / N) · Σ_{i on r} ½(i2t_i + t2i_i)`` in local mode, whose mean over the W ranks is the
global mean loss; with equal sizes that is the plain mean over the local rows, as in
open_clip's ``ClipLoss``.

Bad input never hangs the job: the metadata collective runs before any feature gather,
and every rank inspects every rank's metadata, so an invalid input on one rank (wrong
shape, dtype, non-finite scale, mismatched feature dim or options across ranks, an
empty local batch) raises on *every* rank: the offending rank raises its own
``TypeError``/``ValueError``, the others a ``ValueError`` naming the offending rank.

The communication is plain ``torch.distributed`` (NCCL on GPUs, gloo on CPU):
a differentiable all_gather when gradients must flow through the gather
(``torch.distributed._functional_collectives.all_gather_single``, which recent torch
recommends over open_clip's deprecated ``torch.distributed.nn.all_gather``; the latter on
older torch; see ``AUTOGRAD_GATHER``), ``torch.distributed.all_gather`` otherwise, as open_clip.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .. import validation as _validation
from ..loss import as_tau_tensor, directional_fn, pair_losses, resolve_backend
from ..numerics import autocast_disabled

try:
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (the autograd-aware collectives)

    HAS_DISTRIBUTED = dist.is_available()
except ImportError:  # pragma: no cover - torch built without distributed
    dist = None
    HAS_DISTRIBUTED = False

try:  # the differentiable all_gather that torch.distributed.nn.all_gather's deprecation points to
    from torch.distributed._functional_collectives import all_gather_single as _fc_all_gather
except ImportError:  # pragma: no cover - older torch
    _fc_all_gather = None

# "functional": torch.distributed._functional_collectives.all_gather_single (when present);
# "nn": torch.distributed.nn.all_gather (open_clip's; deprecated in recent torch). Both
# backpropagate by summing every rank's gradient into the owner (reduce-scatter).
AUTOGRAD_GATHER = "functional" if _fc_all_gather is not None else "nn"

__all__ = [
    "gather_features",
    "gather_sizes",
    "rank_hn_clip_loss",
    "distributed_hn_clip_loss",
]

# metadata vector layout, one int64 row per rank
_STATUS, _N_IMG, _N_TXT, _DIM, _DTYPE, _FLAGS, _GAMMA, _EPS, _WORLD, _PREC, _TAU, _IMG_NORM, _TXT_NORM = range(13)
_META_LEN = 13
_STATUS_TEXT = {
    0: "ok",
    1: "invalid features",
    2: "invalid logit scale / temperature",
    3: "invalid options or backend",
    4: "rank / world_size do not match the process group",
}


def _require_distributed() -> None:
    if not HAS_DISTRIBUTED:
        raise RuntimeError("this torch build has no torch.distributed; world_size > 1 needs it")
    if not dist.is_initialized():
        raise ValueError(
            "world_size > 1 but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group (torchrun does the environment setup) first, "
            "or pass world_size=1"
        )


def _group_rank_world(group) -> Tuple[int, int]:
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _meta_device(group, like: Optional[torch.Tensor]) -> torch.device:
    """Where the small metadata tensor lives: NCCL needs CUDA, everything else takes CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or like is None:
        return torch.device("cpu")
    return like.device


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def gather_sizes(n: int, device: Union[str, torch.device] = "cpu", group=None) -> List[int]:
    """All ranks' local batch sizes, in rank order (one small all_gather; every rank must call)."""
    _require_distributed()
    world = dist.get_world_size(group=group)
    mine = torch.tensor([int(n)], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(v) for v in torch.cat(out).tolist()]  # one host sync


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))], dim=0)


def _autograd_all_gather(x: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's ``x`` (same shape on all ranks), differentiable: grads are summed into the owner."""
    if AUTOGRAD_GATHER == "functional" and _fc_all_gather is not None:
        out = _fc_all_gather(x, 0, group if group is not None else dist.group.WORLD)
        return list(out.split(x.shape[0], dim=0))
    return list(torch.distributed.nn.all_gather(x, group=group if group is not None else dist.group.WORLD))


def _all_gather_one(x: torch.Tensor, sizes: Sequence[int], rank: int, with_grad: bool,
                    keep_local: bool, group) -> torch.Tensor:
    """Concatenation over ranks of every rank's ``x`` (sizes[r] rows each), padding as needed.

    ``with_grad``: through a differentiable all_gather, whose backward sums every rank's
    gradient into the owner (a reduce-scatter). Otherwise a plain all_gather without
    autograd, and ``keep_local`` puts this rank's own (differentiable) tensor in its slot.
    """
    max_n = max(sizes)
    if with_grad:
        parts = _autograd_all_gather(_pad_rows(x, max_n), group)
    else:
        buf = _pad_rows(x.detach(), max_n)
        parts = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(parts, buf, group=group)
    parts = [p if p.shape[0] == s else p[:s] for p, s in zip(parts, sizes)]
    if not with_grad and keep_local:
        parts[rank] = x
    return torch.cat(parts, dim=0)


def gather_features(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    local_loss: bool = False,
    gather_with_grad: bool = False,
    rank: int = 0,
    world_size: int = 1,
    use_horovod: bool = False,
    *,
    sizes: Optional[Sequence[int]] = None,
    group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """All-gather image and text features across ranks, as ``open_clip.loss.gather_features``.

    Same arguments and semantics as open_clip's (``use_horovod`` is not supported):

    * ``gather_with_grad=True``: a differentiable all_gather (see ``AUTOGRAD_GATHER``);
      gradients of every rank's loss w.r.t. the gathered copies are summed into the owner.
    * ``gather_with_grad=False``: plain ``torch.distributed.all_gather`` (no gradient through
      the copies); unless ``local_loss``, this rank's own slot is replaced by its local
      tensors so that the local features still receive gradients.

    Unlike open_clip's, the local batch sizes may differ across ranks: ``sizes`` (every
    rank's row count, in rank order, identical on all ranks) is all-gathered when not given;
    features are padded to the largest size, gathered, and stripped. Returns
    ``(all_image_features, all_text_features)`` of Σ sizes rows each, in rank order.
    Every rank of ``group`` must call it (it is a collective). ``world_size == 1`` returns
    the inputs unchanged.
    """
    if use_horovod:
        raise ValueError("hnclip_kernels does not support horovod; use torch.distributed (torchrun)")
    if world_size == 1:
        return image_features, text_features
    _require_distributed()
    if sizes is None:
        sizes = gather_sizes(image_features.shape[0], _meta_device(group, image_features), group)
    sizes = [int(s) for s in sizes]
    if len(sizes) != world_size:
        raise ValueError(f"sizes has {len(sizes)} entries but world_size is {world_size}")
    keep_local = not local_loss
    all_img = _all_gather_one(image_features, sizes, rank, gather_with_grad, keep_local, group)
    all_txt = _all_gather_one(text_features, sizes, rank, gather_with_grad, keep_local, group)
    return all_img, all_txt


def rank_hn_clip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    all_image_features: torch.Tensor,
    all_text_features: torch.Tensor,
    tau: Union[float, torch.Tensor],
    offset: int,
    *,
    local_loss: bool = True,
    world_size: int = 1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    backend: str = "auto",
    normalize: bool = True,
    precision: Optional[str] = None,
    return_stats: bool = False,
):
    """This rank's HN-CLIP loss from its local features and the gathered global ones.

    ``local_loss=True`` (and ``world_size > 1``): rank rows only. i2t rows are the local
    images against all N texts, t2i rows the local texts against all N images, positive of
    local row i at global column ``offset + i`` (``offset`` = this rank's first global row),
    margins from the local texts against all texts (global margins); two calls of the
    backend's directional op. Returns ``(W / N) · Σ_i ½(i2t_i + t2i_i)``: the mean over ranks
    of this value is the global mean loss (equal sizes: the mean of local rows).

    ``local_loss=False`` or ``world_size == 1``: the full global batch on this rank, all N
    images against all N texts, offset 0: exactly the single-process loss, computed by the
    same fused symmetric op as :func:`hnclip_kernels.hn_clip_loss` (one logit tile serves
    both directions; 16-bit features upcast once). ``offset`` and the local tensors are not
    used. Returns the global mean loss.

    ``return_stats``: also ``(i2t, t2i, n_keys)``: the detached ``ops.epilogue.RowStats`` of
    this rank's rows in both directions and the number of key columns N (what
    :func:`hnclip_kernels.diagnostics.report_from_row_stats` reads).
    No input checks (``distributed_hn_clip_loss`` does them collectively).
    """
    resolved = resolve_backend(backend, all_image_features)
    tau_t = as_tau_tensor(tau, all_image_features)
    gamma, eps = float(gamma), float(label_smoothing)
    if not local_loss or world_size == 1:
        out = pair_losses(resolved, all_image_features, all_text_features, tau_t, gamma, eps, normalize, precision,
                          return_stats)
        rows, stats = out if return_stats else (out, None)
        loss = rows.mean()
        return (loss, (*stats, all_image_features.shape[0])) if return_stats else loss
    fn = directional_fn(resolved, precision)
    options = dict(tau=tau_t, gamma=gamma, label_smoothing=eps, normalize=normalize, offset=int(offset),
                   return_stats=return_stats)
    i2t = fn(image_features, all_text_features, query_txt=text_features, key_txt=all_text_features, **options)
    t2i = fn(text_features, all_image_features, query_txt=text_features, key_txt=all_text_features, **options)
    (i2t, i2t_stats), (t2i, t2i_stats) = (i2t, t2i) if return_stats else ((i2t, None), (t2i, None))
    rows = 0.5 * (i2t + t2i)
    n_total = all_image_features.shape[0]
    if n_total == world_size * image_features.shape[0]:
        loss = rows.mean()  # equal sizes: exactly ClipLoss's mean of the local rows
    else:
        loss = rows.sum() / (n_total / world_size)
    return (loss, (i2t_stats, t2i_stats, n_total)) if return_stats else loss


def _local_checks(image_features, text_features, tau, gamma, label_smoothing, backend, precision,
                  rank, world_size, group, normalize=True):
    """Run every local check without raising: (status, exception or None, resolved backend or None,
    τ's value or None where it was not read)."""
    try:
        _validation.check_features(image_features, text_features, "image_features", "text_features")
    except (TypeError, ValueError) as exc:
        return 1, exc, None, None
    try:  # before τ: its overflow bound (2 + γ)/τ needs a valid γ
        _validation.check_options(gamma, label_smoothing, "mean", backend, normalize)
    except (TypeError, ValueError) as exc:
        return 3, exc, None, None
    try:  # the global N is known after the collective, which checks the bound again with it
        n = image_features.shape[0]
        tau_value = _validation.check_tau(tau, image_features.device, image_features.dtype, gamma,
                                          label_smoothing=label_smoothing, n_keys=n, n_rows=n)
        if world_size == 1 and not normalize:
            _validation.check_feature_range(image_features, text_features, tau_value, gamma, label_smoothing,
                                            "image_features", "text_features", n_rows=n)
    except (TypeError, ValueError) as exc:
        return 2, exc, None, None
    try:
        _validation.check_precision(precision)
        resolved = resolve_backend(backend, image_features)
        if resolved == "triton":
            directional_fn(resolved)  # the install hint now, on every rank, not inside the loss
    except (TypeError, ValueError) as exc:
        return 3, exc, None, None
    if world_size > 1:
        g_rank, g_world = _group_rank_world(group)
        if (g_rank, g_world) != (rank, world_size):
            return 4, ValueError(
                f"rank={rank}, world_size={world_size} were passed but the process group says "
                f"rank {g_rank} of {g_world}; pass torch.distributed.get_rank() / get_world_size()"
            ), None, None
    return 0, None, resolved, tau_value


def _meta_row(status, image_features, text_features, flags, gamma, label_smoothing, world_size,
              precision=None) -> List[int]:
    row = [0] * _META_LEN
    row[_STATUS] = status
    ok_tensors = isinstance(image_features, torch.Tensor) and isinstance(text_features, torch.Tensor)
    row[_N_IMG] = image_features.shape[0] if ok_tensors and image_features.dim() >= 1 else -1
    row[_N_TXT] = text_features.shape[0] if ok_tensors and text_features.dim() >= 1 else -1
    row[_DIM] = image_features.shape[-1] if ok_tensors and image_features.dim() >= 1 else -1
    dtypes = list(_validation.FLOAT_DTYPES)
    row[_DTYPE] = dtypes.index(image_features.dtype) if ok_tensors and image_features.dtype in dtypes else -1
    row[_FLAGS] = flags
    try:
        row[_GAMMA] = _float_bits(gamma)
        row[_EPS] = _float_bits(label_smoothing)
    except (TypeError, ValueError):
        row[_GAMMA] = row[_EPS] = -1
    row[_WORLD] = int(world_size)
    modes = (None,) + _validation.FP32_PRECISIONS
    row[_PREC] = modes.index(precision) if precision in modes else -1
    return row


def _range_fields(row, tau_value, image_features, text_features, normalize) -> None:
    """τ (as read by the local check; None where it was not: under compile, meta tensors) and,
    without normalisation, the largest row norms, for the global overflow check."""
    if tau_value is None:
        return
    norms = (1.0, 1.0) if normalize else _validation.max_row_norms(image_features, text_features)
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
    largest = _validation.largest_intermediate(tau_value, float(gamma), float(label_smoothing), n_total,
                                               img_norm, txt_norm, n_rows=n_total)
    dtype = _validation.FLOAT_DTYPES[dtype_index]
    if largest < _validation._finite_limit(dtype):
        return None
    return (f"the global batch (N = {n_total}, smallest tau = {tau_value:g}, largest row norms {img_norm:.3g} / "
            f"{txt_norm:.3g}) gives logit gaps up to {largest:.3g}, beyond the range of {dtype}; raise tau, pass "
            "normalize=True or scale the features down")


def _collective_check(image_features, text_features, tau, gamma, label_smoothing, backend, precision,
                      flags, rank, world_size, group, normalize=True) -> Tuple[List[int], str]:
    """Check inputs on every rank at once; return (sizes, resolved backend) or raise on every rank."""
    status, exc, resolved, tau_value = _local_checks(image_features, text_features, tau, gamma, label_smoothing,
                                                     backend, precision, rank, world_size, group, normalize)
    like = image_features if isinstance(image_features, torch.Tensor) else None
    row = _meta_row(status, image_features, text_features, flags, gamma, label_smoothing, world_size, precision)
    if status == 0:
        _range_fields(row, tau_value, image_features, text_features, normalize)
    mine = torch.tensor(row, dtype=torch.int64, device=_meta_device(group, like))
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(rows, mine, group=group)
    meta = torch.stack(rows).cpu().tolist()
    if exc is not None:
        raise exc
    bad = [r for r, m in enumerate(meta) if m[_STATUS] != 0]
    if bad:
        what = ", ".join(f"rank {r}: {_STATUS_TEXT.get(meta[r][_STATUS], 'error')}" for r in bad)
        raise ValueError(f"HN-CLIP distributed loss: invalid input on another rank ({what}); "
                         "see the error raised on that rank. No collective was started.")
    problems = []
    if len({m[_DIM] for m in meta}) > 1:
        problems.append(f"feature dims differ across ranks: {[m[_DIM] for m in meta]}")
    if len({m[_DTYPE] for m in meta}) > 1:
        names = [str(_validation.FLOAT_DTYPES[m[_DTYPE]]) for m in meta]
        problems.append(f"feature dtypes differ across ranks: {names}")
    if len({(m[_FLAGS], m[_GAMMA], m[_EPS], m[_WORLD], m[_PREC]) for m in meta}) > 1:
        problems.append("loss options (local_loss, gather_with_grad, normalize, gamma, "
                        "label_smoothing, world_size, precision) differ across ranks")
    if problems:
        raise ValueError("HN-CLIP distributed loss: inconsistent inputs across ranks: "
                         + "; ".join(problems) + ". Every rank raised this error.")
    problem = _global_range_problem(meta, gamma, label_smoothing, meta[0][_DTYPE])
    if problem is not None:
        raise ValueError(f"HN-CLIP distributed loss: {problem}. Every rank raised this error.")
    return [m[_N_IMG] for m in meta], resolved


def distributed_hn_clip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    tau: Union[float, torch.Tensor],
    *,
    local_loss: bool = True,
    gather_with_grad: bool = True,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group=None,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    backend: str = "auto",
    normalize: bool = True,
    precision: Optional[str] = None,
    return_stats: bool = False,
) -> torch.Tensor:
    """HN-CLIP loss of this rank's share of the global batch (a collective: call on every rank).

    Checks the inputs of all ranks in one metadata collective (raising on every rank if any
    rank's input is invalid), gathers the features (``gather_features``), then computes
    ``rank_hn_clip_loss`` with this rank's global offset. The defaults
    (``local_loss=True, gather_with_grad=True``) are the exact convention: with DDP's
    gradient averaging every parameter's gradient equals that of the single-process loss on
    the concatenated global batch. See :class:`hnclip_kernels.HNClipLoss` for the other modes.

    ``rank``/``world_size`` default to the process group's; ``world_size == 1`` (or
    torch.distributed not initialised and no ``world_size`` given) is the single-process loss.
    Autocast is disabled inside: the loss accumulates in float32 whatever the feature dtype.
    ``return_stats``: return ``(loss, (i2t, t2i, n_keys))`` with this rank's detached row
    statistics (see :func:`rank_hn_clip_loss`).
    """
    if world_size is None:
        world_size = dist.get_world_size(group=group) if HAS_DISTRIBUTED and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank(group=group) if world_size > 1 else 0
    flags = int(bool(local_loss)) | (int(bool(gather_with_grad)) << 1) | (int(bool(normalize)) << 2)
    if world_size > 1:
        _require_distributed()
        sizes, resolved = _collective_check(image_features, text_features, tau, gamma, label_smoothing,
                                            backend, precision, flags, rank, world_size, group, normalize)
    else:
        status, exc, resolved, _ = _local_checks(image_features, text_features, tau, gamma, label_smoothing,
                                                 backend, precision, rank, world_size, group, normalize)
        if exc is not None:
            raise exc
        sizes = [image_features.shape[0]]
    all_img, all_txt = gather_features(image_features, text_features, local_loss, gather_with_grad,
                                       rank, world_size, sizes=sizes, group=group)
    offset = sum(sizes[:rank])
    with autocast_disabled(image_features.device):
        return rank_hn_clip_loss(image_features, text_features, all_img, all_txt, tau, offset,
                                 local_loss=local_loss, world_size=world_size, gamma=gamma,
                                 label_smoothing=label_smoothing, normalize=normalize, backend=resolved,
                                 precision=precision, return_stats=return_stats)
