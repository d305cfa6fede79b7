"""First-order-only backends: one clear error for a second derivative.

The fused backends (``cpp``, ``triton``) compute the gradient with hand-written kernels whose
own backward is not implemented. A second derivative through them (a gradient penalty,
MAML-style meta-gradients, Hessian-vector products: ``torch.autograd.grad(..., create_graph=True)``
and then a backward through that gradient) raises :data:`SECOND_DERIVATIVE_MESSAGE`, a
``RuntimeError`` that names ``backend="torch"``, whose pure-PyTorch backward is
differentiable. The error is raised when the second derivative is taken, not when
``create_graph=True`` is passed: a first derivative taken with ``create_graph=True`` works.

* :func:`raising_backward`: the autograd formula of a backward operator registered with
  ``torch.library`` (the ``*_backward`` ops of both fused backends): it raises when reached.
* :func:`first_order_call`: how a fused op's autograd formula calls its ``*_backward``
  operator, so that a second derivative through ``torch.func`` (``grad`` of ``grad``,
  ``jacrev`` of ``jacrev``) raises the clear error too.
* :func:`forward_mode_error`: the error of forward-mode transforms (``jvp``, ``jacfwd``,
  ``hessian``) on the fused backends, which compute reverse-mode gradients only.
"""

from __future__ import annotations

import torch

SECOND_DERIVATIVE_MESSAGE = (
    "hnclip_kernels: second derivatives (a backward through a gradient taken with create_graph=True, "
    'e.g. a gradient penalty or a meta-gradient) are not supported by backend="{backend}": its fused '
    'backward kernel is not itself differentiable. Use backend="torch" (pure PyTorch, materialises the '
    "N×N logits) for second derivatives."
)


def second_derivative_error(backend: str) -> RuntimeError:
    return RuntimeError(SECOND_DERIVATIVE_MESSAGE.format(backend=backend))


FORWARD_MODE_MESSAGE = (
    "hnclip_kernels: forward-mode differentiation (torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad) "
    'is not supported by backend="{backend}": its kernels compute reverse-mode gradients only. Use reverse mode '
    '(backward, torch.func.grad / vjp / jacrev) or backend="torch", which supports both and second derivatives.'
)


def forward_mode_error(backend: str) -> RuntimeError:
    return RuntimeError(FORWARD_MODE_MESSAGE.format(backend=backend))


class _FirstOrderOp(torch.autograd.Function):
    """``op(*args)`` for a ``*_backward`` operator called while a graph is being recorded (a
    ``create_graph=True`` backward, the backward of a ``torch.func`` transform): differentiating
    its result (a second derivative, ``torch.func.grad`` of ``grad``, ``hessian``) raises the
    clear error naming backend="torch"."""

    generate_vmap_rule = True

    @staticmethod
    def forward(backend, op, *args):
        return op(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.backend = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise second_derivative_error(ctx.backend)

    @staticmethod
    def jvp(ctx, *tangents):
        raise second_derivative_error(ctx.backend)


def first_order_call(backend: str, op, *args):
    """``op(*args)``; while a graph is recorded (and not under ``torch.compile``), behind a node
    whose backward and jvp raise :func:`second_derivative_error`."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _FirstOrderOp.apply(backend, op, *args)
    return op(*args)


def raising_backward(backend: str):
    """An autograd formula for ``torch.library.register_autograd`` that raises the clear error."""

    def backward(ctx, *grads):
        raise second_derivative_error(backend)

    return backward
