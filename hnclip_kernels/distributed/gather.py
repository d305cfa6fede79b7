"""Gathering features across ranks with ``torch.distributed``, as open_clip's ``gather_features``
but exact for unequal local batch sizes (padded to the largest, gathered, stripped)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

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


def require_distributed() -> None:
    if not HAS_DISTRIBUTED:
        raise RuntimeError("this torch build has no torch.distributed; world_size > 1 needs it")
    if not dist.is_initialized():
        raise ValueError(
            "world_size > 1 but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group (torchrun does the environment setup) first, "
            "or pass world_size=1"
        )


def group_rank_world(group) -> Tuple[int, int]:
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def meta_device(group, like: Optional[torch.Tensor]) -> torch.device:
    """Where the small metadata tensor lives: NCCL needs CUDA, everything else takes CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or like is None:
        return torch.device("cpu")
    return like.device


def gather_sizes(n: int, device: Union[str, torch.device] = "cpu", group=None) -> List[int]:
    """All ranks' local batch sizes, in rank order (one small all_gather; every rank must call)."""
    require_distributed()
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


def _all_gather_one(
    x: torch.Tensor, sizes: Sequence[int], rank: int, with_grad: bool, keep_local: bool, group
) -> torch.Tensor:
    """Concatenation over ranks of every rank's ``x`` (sizes[r] rows each), padding as needed.

    ``with_grad``: through a differentiable all_gather, whose backward sums every rank's
    gradient into the owner (a reduce-scatter). Otherwise a plain all_gather without
    autograd, and ``keep_local`` puts this rank's own (differentiable) tensor in its slot.
    """
    max_n = max(sizes)
    if max_n == 0:  # nothing on any rank (hard negatives: M_r = 0 everywhere): no collective
        return x[:0]
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
    require_distributed()
    if sizes is None:
        sizes = gather_sizes(image_features.shape[0], meta_device(group, image_features), group)
    sizes = [int(s) for s in sizes]
    if len(sizes) != world_size:
        raise ValueError(f"sizes has {len(sizes)} entries but world_size is {world_size}")
    keep_local = not local_loss
    all_img = _all_gather_one(image_features, sizes, rank, gather_with_grad, keep_local, group)
    all_txt = _all_gather_one(text_features, sizes, rank, gather_with_grad, keep_local, group)
    return all_img, all_txt


def gather_rows(
    x: Optional[torch.Tensor],
    sizes: Sequence[int],
    rank: int,
    *,
    with_grad: bool,
    keep_local: bool,
    like: torch.Tensor,
    group=None,
) -> torch.Tensor:
    """Every rank's ``x`` (sizes[r] rows, sizes may differ and be 0), concatenated in rank order.

    ``x``: this rank's (sizes[rank], ...) tensor, or None for zero rows (a ``like``-typed (0, D)
    then takes its place: ``like`` gives dtype, device and trailing shape). Padded to the largest
    size, all-gathered and stripped; no collective when every size is 0. ``with_grad`` and
    ``keep_local`` as :func:`gather_features` (gradients through the gather summed into the owner;
    or this rank's own differentiable tensor in its slot); with ``with_grad`` (and grad mode on)
    the result requires grad on every rank, so that every rank runs the backward's collective.
    Every rank of ``group`` must call it.
    """
    if x is None:
        x = like.new_zeros((0,) + tuple(like.shape[1:]))
    if with_grad and torch.is_grad_enabled() and not x.requires_grad:
        # the gather's backward is a collective (a reduce-scatter): every rank must run it, also
        # one whose rows need no gradient (none, or constants), else the ranks' backwards mismatch
        x = x.detach().requires_grad_()
    return _all_gather_one(x, [int(s) for s in sizes], rank, with_grad, keep_local, group)


def gather_ids(ids: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """Every rank's integer ids (sizes[r] each), concatenated in rank order, as int64 (ranks may
    hold different integer dtypes). No gradient."""
    ids = ids.to(torch.int64)
    if len(sizes) == 1:
        return ids
    return _all_gather_one(ids, [int(s) for s in sizes], 0, False, False, group)
