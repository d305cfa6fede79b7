"""What a fused backend's ``torch.library`` operators need beyond their registration to work
under ``torch.func`` and ``torch.compile`` (shared by ``hn_clip_cpp`` and ``hn_clip_triton``).

``torch.library.register_autograd`` builds an ``autograd.Function`` without a
``setup_context`` staticmethod, which functorch transforms refuse ("it must override the
setup_context staticmethod"; pytorch/pytorch#168393). So each backend's public wrappers call
its forward operator through :func:`func_capable`, an ``autograd.Function`` with the same
setup_context and backward as the registration and a generated vmap rule; under
``torch.compile``/``torch.export`` they call the operator itself (:func:`call`), one node with
its registered formula. :func:`register_looped_vmap` gives the operators a vmap rule (one call
per batch entry), which the generated rules reach.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .first_order import forward_mode_error


def func_capable(name: str, op, setup_context: Callable, backward: Callable, backend: str, doc: str) -> type:
    """An ``autograd.Function`` running ``op`` with the registered ``setup_context``/``backward``,
    a generated vmap rule and a jvp that raises :func:`forward_mode_error`."""

    def forward(*args):
        return op(*args)

    def jvp(ctx, *tangents):
        raise forward_mode_error(backend)

    return type(name, (torch.autograd.Function,), {
        "__doc__": doc, "__module__": getattr(setup_context, "__module__", __name__), "generate_vmap_rule": True,
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp),
    })


def call(function: type, op, *args):
    """``op(*args)`` under ``torch.compile``/``torch.export`` (the operator and its registered
    formula: Dynamo cannot trace a ``Function.apply`` that gets one tensor twice, as a
    direction's keys and margin factors often are), else ``function.apply(*args)``."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args)


def _looped(op):
    def rule(info, in_dims, *args):
        per_entry = [op(*(x if d is None else x.select(d, i) for x, d in zip(args, in_dims)))
                     for i in range(info.batch_size)]
        outs = tuple(torch.stack(results) for results in zip(*per_entry))
        return outs, (0,) * len(outs)

    return rule


def register_looped_vmap(names: Iterable[str]) -> None:
    """A vmap rule for each ``hnclip::<name>`` operator: one call per batch entry, results
    stacked along dim 0 (exact: no output depends on another entry; a batch of B costs B calls)."""
    for name in names:
        torch.library.register_vmap(f"hnclip::{name}", _looped(getattr(torch.ops.hnclip, name)))
