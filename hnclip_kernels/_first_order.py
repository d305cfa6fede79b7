"""First-order-only backends: one clear error for a second derivative.

The fused backends (``cpp``, ``triton``) compute the gradient with hand-written kernels whose
own backward is not implemented. A second derivative through them (a gradient penalty,
MAML-style meta-gradients, Hessian-vector products: ``torch.autograd.grad(..., create_graph=True)``
and then a backward through that gradient) raises :data:`SECOND_DERIVATIVE_MESSAGE`, a
``RuntimeError`` that names ``backend="torch"``, whose pure-PyTorch backward is
differentiable. The error is raised when the second derivative is taken, not when
``create_graph=True`` is passed: a first derivative taken with ``create_graph=True`` works.

* :func:`raising_backward`: the autograd formula of a backward operator registered with
  ``torch.library`` (the C++ backend's ``*_backward`` ops): it raises when reached.
* :func:`mark_first_order`: applied to the gradients a backward returns while it runs
  under ``create_graph=True``; each gets a node that raises when differentiated, so no
  second derivative comes back silently without the fused backward's part.
* :func:`first_order_backward`: a decorator that does this for an ``autograd.Function``'s
  backward.
* :func:`guard_inputs`: identity on the inputs of a fused op whose backward does not
  do the above itself: its backward marks the gradients that reach the inputs.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple

import torch

SECOND_DERIVATIVE_MESSAGE = (
    'hnclip_kernels: second derivatives (a backward through a gradient taken with create_graph=True, '
    'e.g. a gradient penalty or a meta-gradient) are not supported by backend="{backend}": its fused '
    'backward kernel is not itself differentiable. Use backend="torch" (pure PyTorch, materialises the '
    'N×N logits) for second derivatives.'
)


def second_derivative_error(backend: str) -> RuntimeError:
    return RuntimeError(SECOND_DERIVATIVE_MESSAGE.format(backend=backend))


def raising_backward(backend: str):
    """An autograd formula for ``torch.library.register_autograd`` that raises the clear error."""

    def backward(ctx, *grads):
        raise second_derivative_error(backend)

    return backward


class _RaiseWhenDifferentiated(torch.autograd.Function):
    """Identity on ``grad`` whose backward raises. The op's inputs are inputs of this node too,
    so every path from a second derivative to them runs through it: ``autograd.grad(penalty,
    img)`` raises the clear error rather than "appears to not have been used in the graph"."""

    generate_vmap_rule = True  # setup_context style and a vmap rule: usable under torch.func

    @staticmethod
    def forward(backend, grad, *inputs):
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.backend = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise second_derivative_error(ctx.backend)

    @staticmethod
    def jvp(ctx, *tangents):  # forward mode over the gradient (torch.func.hessian) is a second derivative too
        raise second_derivative_error(ctx.backend)


def mark_first_order(grads: Sequence[Optional[torch.Tensor]], backend: str,
                     inputs: Sequence[torch.Tensor] = ()) -> Tuple[Optional[torch.Tensor], ...]:
    """``grads`` unchanged, or, inside a backward run with ``create_graph=True``, each tensor
    behind a node that raises :func:`second_derivative_error` when differentiated.

    ``inputs``: the op's differentiable inputs (as the backward saved them); the node links
    to those that require grad, so that a second derivative with respect to them reaches it.
    """
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return tuple(grads)
    linked = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    out = []
    for g in grads:
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            out.append(g)
            continue
        # with no input that requires grad, a fresh leaf still gives the node an edge, so it is recorded
        links = linked or [g.detach().requires_grad_()]
        out.append(_RaiseWhenDifferentiated.apply(backend, g.detach(), *links))
    return tuple(out)


def first_order_backward(backend: str) -> Callable:
    """Decorator for the ``backward`` of an ``autograd.Function`` whose kernels are not
    differentiable, in place of ``once_differentiable`` (whose error is generic and which lets
    a graphless gradient through when the upstream gradient needs none): the body runs without
    recording a graph, and its gradients are marked (:func:`mark_first_order`), linked to the
    saved tensors that require grad."""

    def wrap(fn):
        @functools.wraps(fn)
        def backward(ctx, *grads):
            with torch.no_grad():
                out = fn(ctx, *grads)
            out = out if isinstance(out, tuple) else (out,)
            if not torch.is_grad_enabled():
                return out
            return mark_first_order(out, backend, ctx.saved_tensors)

        return backward

    return wrap


class _GuardInputs(torch.autograd.Function):
    """Identity on tensors; in a ``create_graph=True`` backward, the gradients are marked."""

    generate_vmap_rule = True

    @staticmethod
    def forward(backend, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.backend = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, *grads):
        return (None, *mark_first_order(grads, ctx.backend, ctx.saved_tensors))

    @staticmethod
    def jvp(ctx, _backend_tangent, *tangents):  # identity
        return tuple(tangents)


def guard_inputs(backend: str, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``xs`` themselves when no second derivative could reach them (no grad needed, grad
    mode off, under ``torch.compile``), else identity views whose backward marks the
    gradients of the fused op behind them as first-order only (see :func:`mark_first_order`)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return xs
    which = [i for i, x in enumerate(xs) if x.requires_grad]
    if not which:
        return xs
    out = list(xs)  # only the tensors that need a gradient: the others keep requires_grad=False
    for i, guarded in zip(which, _GuardInputs.apply(backend, *(xs[i] for i in which))):
        out[i] = guarded
    return tuple(out)
