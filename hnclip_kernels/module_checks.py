"""The checks of ``HNClipLoss``'s constructor arguments (open_clip's positional flags, rank and
world size, horovod), split from :mod:`hnclip_kernels.clip_loss` by role: the constructor runs
them, and the attributes backed by them (``loss.rank = 3``) run them again on assignment."""

from __future__ import annotations

import numbers


def check_positional_flags(*, rank, world_size, **flags) -> None:
    """ClipLoss's constructor arguments are positional: ``HNClipLoss(0.0)`` would mean
    ``local_loss=0.0`` with the default γ, not γ = 0. Flags must be bools, rank and size ints."""
    for name, value in flags.items():
        _check_flag(name, value)
    for name, value in (("rank", rank), ("world_size", world_size)):
        _check_int(name, value)


def _check_flag(name, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {value!r}; the options of the loss are "
            f"keyword-only (HNClipLoss(gamma=0.0), not HNClipLoss(0.0))"
        )


def _check_int(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")


def check_layout(rank, world_size) -> None:
    if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def check_horovod(value) -> None:
    _check_flag("use_horovod", value)
    if value:
        raise ValueError(
            "HNClipLoss does not support horovod (use_horovod=True); launch with "
            "torchrun / torch.distributed (NCCL on GPUs, gloo on CPU) instead"
        )


def checked_attribute(name: str) -> property:
    """A constructor argument kept as a plain instance attribute (``self.__dict__[name]``, its one
    copy: pickles and deep copies carry it as before), checked on assignment as the constructor
    checks it."""

    def set_(self, value):
        if name == "use_horovod":
            check_horovod(value)
        elif name == "return_stats":
            if not isinstance(value, bool):
                raise TypeError(f"return_stats must be True or False, got {value!r}")
        elif name in ("rank", "world_size"):
            _check_int(name, value)
            layout = {"rank": self.__dict__.get("rank", 0), "world_size": self.__dict__.get("world_size", 1)}
            check_layout(**{**layout, name: value})
            value = int(value)
        else:
            _check_flag(name, value)
        self.__dict__[name] = value

    return property(lambda self: self.__dict__[name], set_)
