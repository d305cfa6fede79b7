"""0-dim parameters (CLIP's ``logit_scale``) under sharded data parallelism: FSDP2 and DeepSpeed ZeRO.

open_clip's and ``transformers``' CLIP models hold ``logit_scale`` as a 0-dim parameter, which
neither sharding engine takes: ``torch.distributed.fsdp.fully_shard`` refuses scalar parameters
(ValueError; its ``ignored_params`` would keep one out of FSDP, gradient not averaged), and
``deepspeed.initialize`` fails broadcasting it at every ZeRO stage ("self.dim() cannot be 0 to
view Float as Byte"). The one recipe for both: train the scalars as shape-(1,) parameters, save
them 0-dim again, so the checkpoint is the unmodified model's (``CLIPModel.from_pretrained``
refuses a (1,) ``logit_scale``, and ``ignore_mismatched_sizes=True`` re-initialises it)::

    names = unsqueeze_scalar_parameters(model)  # ("logit_scale",): before wrapping and the optimizer
    fully_shard(model)  # or deepspeed.initialize(model=model, ...)
    ...
    state = ...  # the full state dict, e.g. get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    model.save_pretrained(out_dir, state_dict=squeeze_scalar_parameters(state, names))

A (1,) ``logit_scale`` gives the same losses and gradients: the models broadcast it,
:class:`hnclip_kernels.HNClipLoss` takes any one-element scale.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Tuple, Union

import torch
from torch import nn

__all__ = ["unsqueeze_scalar_parameters", "squeeze_scalar_parameters"]


def _is_wrapper(model: nn.Module) -> bool:
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return True
    return type(model).__name__ == "DeepSpeedEngine"


def unsqueeze_scalar_parameters(model: nn.Module) -> Tuple[str, ...]:
    """Replace every 0-dim parameter of ``model`` (CLIP's ``logit_scale``) by a shape-(1,) one, in place.

    The new parameter holds the same value, bit for bit, and the same ``requires_grad``; a
    parameter shared by several modules stays shared. Call it on the bare model before
    ``fully_shard`` / ``deepspeed.initialize`` / DDP and before building the optimizer (which
    would otherwise hold the replaced parameter); after loading a checkpoint (the checkpoint's
    scalars are 0-dim, as the model's).

    Returns:
        The state-dict names of the replaced parameters (every name of a shared one), for
        :func:`squeeze_scalar_parameters`; ``()`` when the model has none.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or is already wrapped (DDP, DataParallel,
            a DeepSpeed engine): pass the bare model, before wrapping it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _is_wrapper(model):
        raise TypeError(
            f"model is a {type(model).__name__} wrapper: call unsqueeze_scalar_parameters on the bare model "
            "(its .module) before wrapping it and before building the optimizer"
        )
    replaced = {}  # id(0-dim parameter) -> (it, its (1,) replacement): a shared one is replaced once
    fresh = set()  # ids of the replacements (a module shared under two names is met twice)
    names = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is None or (param.dim() != 0 and id(param) not in fresh):
                continue
            if id(param) not in fresh:
                if id(param) not in replaced:
                    new = nn.Parameter(param.detach().clone().reshape(1), requires_grad=param.requires_grad)
                    replaced[id(param)] = (param, new)
                    fresh.add(id(new))
                setattr(module, name, replaced[id(param)][1])
            names.append(f"{prefix}.{name}" if prefix else name)
    return tuple(names)


def squeeze_scalar_parameters(
    state_dict: Mapping[str, torch.Tensor], names: Union[str, Iterable[str]]
) -> "OrderedDict[str, torch.Tensor]":
    """A copy of ``state_dict`` whose entries ``names`` are 0-dim again (views, nothing copied).

    Undoes :func:`unsqueeze_scalar_parameters` on a full state dict before saving it, so the
    checkpoint is the unmodified model's: ``CLIPModel.from_pretrained`` refuses a (1,)
    ``logit_scale`` (size mismatch; ``ignore_mismatched_sizes=True`` re-initialises it).
    torch's ``load_state_dict`` (open_clip's loader) reads a (1,) entry into a 0-dim parameter
    either way.

    Args:
        state_dict: the model's full state dict, as it is without a wrapper: ``model.state_dict()``,
            FSDP2's ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``,
            ZeRO-2's ``engine.module.state_dict()``, ZeRO-3's the same under
            ``deepspeed.zero.GatheredParameters(list(engine.module.parameters()))``, cloned.
        names: what :func:`unsqueeze_scalar_parameters` returned (or one name).

    Raises:
        TypeError: ``state_dict`` not a mapping, or a sharded entry (a DTensor: gather the full
            state dict first).
        ValueError: a name missing from ``state_dict`` (a wrapper's prefix such as DDP's
            ``module.``), or an entry that is not one value (ZeRO-3's partitioned placeholder).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    names = (names,) if isinstance(names, str) else tuple(names)
    out = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # the per-module versions load_state_dict reads
        out._metadata = metadata
    for name in names:
        if name not in out:
            raise ValueError(
                f"names: {name!r} is not a key of state_dict; pass the names unsqueeze_scalar_parameters returned "
                "and the state dict of that model without a wrapper's prefix (e.g. DDP's 'module.')"
            )
        value = out[name]
        if type(value).__name__ == "DTensor":
            raise TypeError(
                f"state_dict[{name!r}] is a DTensor (a sharded state dict): gather the full state dict first, "
                "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
            )
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"state_dict[{name!r}] must hold one value, got {shape}: pass the full state dict (ZeRO-3: "
                "the parameters gathered with deepspeed.zero.GatheredParameters)"
            )
        out[name] = value.reshape(())
    return out
