"""The process group a loss module holds (``HNClipLoss``, ``HNSigLipLoss``), through copies and
pickles: one home for both modules.

A process group cannot be copied or pickled ("cannot pickle ... ProcessGroup"), yet EMA/SWA
(``AveragedModel``) deep-copy the model, and checkpoints pickle it."""

from __future__ import annotations

import copy

import torch


class HoldsProcessGroup:
    """Mixin of an ``nn.Module`` whose ``group`` attribute is a process group (or None)."""

    def __deepcopy__(self, memo):
        """A deep copy that shares ``group`` (a process group is a handle on the job's
        communicator, not state of the loss: every copy talks to the same ranks)."""
        group = self.__dict__.get("group")
        if group is not None:
            memo[id(group)] = group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)  # as stored: no attribute checks in between
        return new

    def __getstate__(self):
        """Pickled state without ``group``: the default group (``group=None``) stays the default
        group after unpickling; any other group is dropped, and the first ``forward`` with
        ``world_size > 1`` raises until ``loss.group`` is set again in the new process."""
        state = super().__getstate__().copy()
        group = state.get("group")
        state["group"] = None
        state["_group_dropped"] = group is not None and not _is_default_group(group)
        return state

    def check_group_kept(self) -> None:
        """Raise ValueError if this module was unpickled without the process group it needs."""
        if self.world_size > 1 and self.group is None and self.__dict__.get("_group_dropped", False):
            raise ValueError(
                f"this {type(self).__name__} was unpickled without its process group (process groups "
                "cannot be pickled): set loss.group to the group of this process before the first forward"
            )


def _is_default_group(group) -> bool:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    return group is dist.group.WORLD or group is dist.distributed_c10d._get_default_group()
