"""The operator glue of the fused backends, written once for C++ and Triton.

A fused backend supplies, for each of its two losses (symmetric, directional), a forward and
a backward implementation with their fake (meta) versions; :func:`fused_op` registers them as
``hnclip::<name>`` and ``hnclip::<name>_backward`` and wires everything else:

* the autograd formula (``torch.library.register_autograd``): the forward saves its tensor
  inputs and its outputs after the first (statistics, non-differentiable), and the backward
  operator gets ``(grad, *saved, *non-tensor inputs, need_features_grad)`` and returns
  (d first input, d second input, dτ) (a rank's op: the gradients of its four features, dτ);
* a raising formula on the backward operator: a second derivative is one ``RuntimeError``
  naming backend="torch" (:mod:`.first_order`);
* a vmap rule for both operators: one call per batch entry, results stacked;
* a ``torch.func``-capable ``autograd.Function`` for the public wrappers (see below).

Operator signatures follow one convention, so that the formula above fits every op: tensors
first (the two feature matrices, then any margin factors, then τ, γ, ε, the threshold), then
the flags in one order on both backends (``offset`` where there is one, ``normalize``,
``masked``, then the backend's own: Triton's ``has_margin, smoothing, precision``, C++'s
``need_grad``); the outputs are named in :mod:`.outputs`. γ and ε are 0-dim float64 tensors (:func:`hyperparameter`): a ``float`` argument of an
operator is a constant of a ``torch.compile``d graph, and a new γ or ε of a schedule would
recompile it.

``torch.library.register_autograd`` builds an ``autograd.Function`` without a
``setup_context`` staticmethod, which functorch transforms refuse ("it must override the
setup_context staticmethod"; pytorch/pytorch#168393). So the public wrappers call their
forward operator through :func:`func_capable`'s Function (the same setup_context and
backward, a generated vmap rule); under ``torch.compile``/``torch.export`` they call the
operator itself (:func:`call`), one node with its registered formula.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..numerics import compute_dtype
from .first_order import first_order_call, forward_mode_error, raising_backward


def hyperparameter(x, like: Tensor) -> Tensor:
    """γ or ε as the 0-dim float64 tensor the fused operators take, on ``like``'s device.

    A tensor computed from the Python float is a graph input under ``torch.compile`` (once
    Dynamo has seen a second value and made the float dynamic), so the graph is reused. ``zeros
    + x`` rather than ``torch.tensor(x)``: Inductor's pass that turns dynamic floats into tensors
    handles arithmetic only, and specialises (recompiles) on anything else. A tensor argument is
    detached (γ and ε get no gradient)."""
    if isinstance(x, Tensor):
        return x.detach().to(device=like.device, dtype=torch.float64).reshape(())
    return torch.zeros((), dtype=torch.float64, device=like.device) + x


def threshold_args(false_negative_threshold, like: Tensor) -> Tuple[Tensor, bool]:
    """The fused operators' false-negative masking arguments: (the threshold as a
    :func:`hyperparameter` tensor, 0 when there is none; ``masked``, the kernels' flag)."""
    masked = false_negative_threshold is not None
    return hyperparameter(false_negative_threshold if masked else 0.0, like), masked


def _savable(x: Tensor) -> Tensor:
    """``x``, or a copy of it where autograd cannot save it: a tensor made under
    ``torch.inference_mode`` (a frozen tower's features, LiT-style) raises "Inference tensors
    cannot be saved for backward" when saved; the torch backend trains with them, so the fused
    backends save a normal copy instead (one copy of that input, only in that case)."""
    if x.is_inference() and not torch.is_inference_mode_enabled():
        return x.clone()
    return x


def _operator(name: str, fn: Callable, fake: Callable, device_types: Optional[str], use_triton_op: bool):
    """``fn`` as the operator ``hnclip::<name>`` (no mutated arguments).

    ``use_triton_op``: ``torch.library.triton_op``, so ``torch.compile`` sees the Triton kernel
    launches (``wrap_triton``) and Inductor compiles them into its graph; ``fn`` run on fake
    tensors is the fake implementation. Otherwise ``torch.library.custom_op`` with the explicit
    ``fake``: opaque to tracing (the C++ kernels, and interpreted Triton kernels, which cannot
    run on fake tensors)."""
    if use_triton_op:
        return torch.library.triton_op(f"hnclip::{name}", fn, mutates_args=())
    op = torch.library.custom_op(f"hnclip::{name}", fn, mutates_args=(), device_types=device_types)
    op.register_fake(fake)
    return op


def _autograd_rules(backend: str, backward_name: str, feature_inputs: Sequence[int], tau_input: int):
    """(setup_context, backward) of a fused forward operator (the convention above)."""

    def setup_context(ctx, inputs, output):
        saved = output[1:]
        ctx.mark_non_differentiable(*saved)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*(_savable(x) for x in inputs if isinstance(x, Tensor)), *saved)
        ctx.statics = tuple(x for x in inputs if not isinstance(x, Tensor))

    def backward(ctx, grad, *_statistics):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if grad is None:  # only a statistic's gradient was asked for: zero loss gradient
            grad = torch.zeros(saved[0].shape[0], dtype=compute_dtype(saved[0].dtype), device=saved[0].device)
        need_features = any(needs[i] for i in feature_inputs)
        op = getattr(torch.ops.hnclip, backward_name)
        results = first_order_call(backend, op, grad, *saved, *ctx.statics, need_features)
        grads = [None] * len(needs)
        for i, d in zip((*feature_inputs, tau_input), results):
            grads[i] = d if needs[i] else None
        return tuple(grads)

    return setup_context, backward


def func_capable(name: str, op, setup_context: Callable, backward: Callable, backend: str, doc: str) -> type:
    """An ``autograd.Function`` running ``op`` with the registered ``setup_context``/``backward``,
    a generated vmap rule and a jvp that raises :func:`forward_mode_error`."""

    def forward(*args):
        return op(*args)

    def jvp(ctx, *tangents):
        raise forward_mode_error(backend)

    return type(
        name,
        (torch.autograd.Function,),
        {
            "__doc__": doc,
            "__module__": __name__,
            "generate_vmap_rule": True,
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
        },
    )


def _looped(op):
    def rule(info, in_dims, *args):
        per_entry = [
            op(*(x if d is None else x.select(d, i) for x, d in zip(args, in_dims))) for i in range(info.batch_size)
        ]
        outs = tuple(torch.stack(results) for results in zip(*per_entry))
        return outs, (0,) * len(outs)

    return rule


def fused_op(
    backend: str,
    name: str,
    *,
    forward: Callable,
    forward_fake: Callable,
    backward: Callable,
    backward_fake: Callable,
    tau_input: int,
    feature_inputs: Sequence[int] = (0, 1),
    device_types: Optional[str] = None,
    use_triton_op: bool = False,
) -> type:
    """Register ``hnclip::<name>`` (``forward``) and ``hnclip::<name>_backward`` (``backward``)
    with their fakes, autograd formulas and vmap rules; return the ``torch.func``-capable
    Function of the forward operator (for :func:`call`).

    ``tau_input``: the position of τ among the forward's inputs; ``feature_inputs``: the
    features with gradients (inputs 0 and 1; a rank's op: its local and gathered features,
    0 … 3). The backward operator returns their gradients in that order, then dτ."""
    fwd = _operator(name, forward, forward_fake, device_types, use_triton_op)
    bwd = _operator(f"{name}_backward", backward, backward_fake, device_types, use_triton_op)
    setup_context, autograd_backward = _autograd_rules(backend, f"{name}_backward", tuple(feature_inputs), tau_input)
    torch.library.register_autograd(f"hnclip::{name}", autograd_backward, setup_context=setup_context)
    # the backward is not differentiable again: a second derivative is one clear error naming backend="torch"
    torch.library.register_autograd(f"hnclip::{name}_backward", raising_backward(backend))
    for op_name in (name, f"{name}_backward"):
        torch.library.register_vmap(f"hnclip::{op_name}", _looped(getattr(torch.ops.hnclip, op_name)))
    del fwd, bwd
    doc = f"``hnclip::{name}`` with its registered autograd formula, usable under ``torch.func``."
    return func_capable(
        f"{backend.capitalize()}_{name}",
        getattr(torch.ops.hnclip, name),
        setup_context,
        autograd_backward,
        backend,
        doc,
    )


def logit_flops(rows: int, cols: int, d: int, *, backward: bool = False) -> int:
    """The FLOPs every operator's formula states for one logit matrix S = q kᵀ of ``rows`` ×
    ``cols`` over D = ``d``: the loss's useful products in the real shapes, 2 per multiply-add as
    torch counts a matmul. Forward: S, 2·rows·cols·d; ``backward`` (feature gradients wanted):
    dS·k and dSᵀ·q, twice that. The same on every backend, whatever its kernels execute to get them
    (tiles and their padding, tensor-core passes, recomputation, a margin folded into S or formed
    beside it: ``tools.work`` counts that work); the detached margin and mask products are no
    useful work (the benchmarks' 6·N²·D FLOPs per forward + backward)."""
    return (4 if backward else 2) * rows * cols * d


def forward_flops(q, k, *_, **__) -> int:
    """The formula of a forward operator of queries ``q`` (R, D) against keys ``k`` (C, D) (the
    loss's img and txt, a directional op's queries and keys, a raw kernel's normalised ones)."""
    return logit_flops(q.shape[0], k.shape[0], q.shape[1])


def backward_flops(grad, q, k, *rest, **_) -> int:
    """The formula of a backward operator (``grad``, then the forward's inputs): its last flag says
    whether feature gradients are wanted (dτ alone: 0)."""
    return logit_flops(q.shape[0], k.shape[0], q.shape[1], backward=True) if rest[-1] else 0


def family_forward_flops(img, txt, negatives, *_, **__) -> int:
    """The family loss's forward: its N×(N + M) logits, v [t; n]ᵀ (both directions read the N×N part)."""
    return logit_flops(img.shape[0], txt.shape[0] + negatives.shape[0], img.shape[1])


def family_backward_flops(grad, img, txt, negatives, *rest, **_) -> int:
    if not rest[-1]:
        return 0
    return logit_flops(img.shape[0], txt.shape[0] + negatives.shape[0], img.shape[1], backward=True)


def symmetric_forward_flops(img, txt, negatives, own_negatives, *_, **__) -> int:
    """The single-process family operators' forward (``negatives``, then ``own_negatives`` (N, K, D)):
    :func:`family_forward_flops` plus each row's own K products, 2·N·K·D."""
    own = (
        logit_flops(1, own_negatives.shape[0] * own_negatives.shape[1], img.shape[1]) if own_negatives.dim() == 3 else 0
    )
    return family_forward_flops(img, txt, negatives) + own


def symmetric_backward_flops(grad, img, txt, negatives, own_negatives, *rest, **_) -> int:
    if not rest[-1]:
        return 0
    own = own_negatives.shape[0] * own_negatives.shape[1] if own_negatives.dim() == 3 else 0
    return family_backward_flops(grad, img, txt, negatives, True) + logit_flops(1, own, img.shape[1], backward=True)


def register_flops(formulas: dict) -> None:
    """Each ``formulas[name]`` as ``torch.utils.flop_counter.FlopCounterMode``'s count of
    ``hnclip::<name>``: called with the operator's arguments as they are (tensors, real or fake,
    and flags) and ``out_val`` (its outputs), it returns the FLOPs the operator states
    (:func:`logit_flops`). Without a formula the mode counts 0 for an operator: it runs one with
    itself popped off the mode stack, so it never sees the kernels or GEMMs inside. Registered once
    (a second registration of a target raises in torch); skipped on a torch without the API.

    A counter copies torch's table when it is made, and the operators are defined (this is
    called) when a backend is first used: so the formulas are also added to every counter that
    exists already, an MFU logger made at start-up included (found by the garbage collector's
    list, once per backend, only once ``torch.utils.flop_counter`` was imported at all)."""
    try:
        from torch.utils.flop_counter import flop_registry, register_flop_formula
    except ImportError:  # pragma: no cover - torch < 2.4
        return
    added = {}
    for name, formula in formulas.items():
        packet = getattr(torch.ops.hnclip, name)
        if packet not in flop_registry:
            added[packet] = register_flop_formula(packet, get_raw=True)(formula)
    if added:
        for counter in _live_flop_counters():
            for packet, formula in added.items():
                counter.flop_registry.setdefault(packet, formula)


def _live_flop_counters() -> list:
    """Every ``FlopCounterMode`` alive now (none where its module was never imported)."""
    module = sys.modules.get("torch.utils.flop_counter")
    if module is None:
        return []
    kind = module.FlopCounterMode
    # issubclass of the type, not isinstance: isinstance also reads __class__, a property on some objects
    return [x for x in gc.get_objects() if issubclass(type(x), kind)]


def call(function: type, op, *args):
    """``op(*args)`` under ``torch.compile``/``torch.export`` (the operator and its registered
    formula: Dynamo cannot trace a ``Function.apply`` that gets one tensor twice, as a
    direction's keys and margin factors often are), else ``function.apply(*args)``."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args)
