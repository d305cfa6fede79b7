"""Numerics shared by every backend: the norm clamp, the accumulation dtype, autocast off, IEEE
float32 matmuls (no TF32), a float32 ``a @ bᵀ`` whose backward keeps both, and softplus."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

NORM_EPS = 1e-12  # same clamp as torch.nn.functional.normalize


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + eˣ), a row's loss from its δ, to the rounding of x's dtype. ``F.softplus`` returns x
    itself above its threshold 20: exact in float32 (e^-20 is below half an ulp of 20), 2e-9 off in
    float64 (value and derivative), where e^-x drops below half an ulp of x only from x ≈ 37; float64
    takes threshold 40 (no overflow: e^40 ≈ 2e17). float32 is F.softplus's, bit for bit."""
    return F.softplus(x, threshold=40.0) if x.dtype == torch.float64 else F.softplus(x)


class _MatmulNTCompiled(torch.autograd.Function):
    """a @ bᵀ with autocast off in the forward *and* the backward.

    ``hn_clip_loss`` turns autocast off around the forward, but a ``backward()`` called inside
    an autocast region would run the matmuls' backward in bf16/fp16 (3e-3 gradient error
    for float32 inputs), eager or compiled. The backward is written with this same op, so
    second derivatives (and their backward) keep float32 too. Setup_context style with a vmap
    rule, so ``torch.func`` transforms go through it; this class (no jvp) is the one
    ``torch.compile`` traces, :class:`_MatmulNT` adds the jvp for forward-mode transforms.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        with autocast_disabled(a.device), ieee_float32(a.device):
            return a @ b.transpose(-1, -2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        with autocast_disabled(grad.device):
            d_a = matmul_nt(grad, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
            d_b = matmul_nt(grad.transpose(-1, -2), a.transpose(-1, -2)) if ctx.needs_input_grad[1] else None
        return d_a, d_b


class _MatmulNT(_MatmulNTCompiled):
    @staticmethod
    def jvp(ctx, t_a, t_b):
        a, b = ctx.saved_tensors
        out = None
        if t_a is not None:
            out = matmul_nt(t_a, b)
        if t_b is not None:
            out = matmul_nt(a, t_b) if out is None else out + matmul_nt(a, t_b)
        return out


@contextlib.contextmanager
def ieee_float32(device: torch.device):
    """float32 matmuls in IEEE float32, never TF32, within the block (on CUDA; the CPU's are).

    open_clip's trainer sets ``torch.backends.cuda.matmul.allow_tf32 = True``; TF32 products
    (10-bit mantissa) would cost the torch backend its float32 accuracy (README, "Numerical
    guarantees"). Eager only: under ``torch.compile`` a global flag cannot be switched inside
    the graph, and the flags in force when it compiles apply."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, ieee = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    saved = getattr(matmul, name)
    setattr(matmul, name, ieee)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def autocast_disabled(device: torch.device):
    """A context with autocast off on ``device``'s type (a no-op on devices without autocast,
    such as "meta", where ``torch.autocast`` itself raises)."""
    if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ bᵀ`` whose forward and backward run with autocast off (see :class:`_MatmulNTCompiled`;
    Dynamo cannot trace a Function with a custom jvp, hence the jvp-less twin under compile)."""
    if torch.compiler.is_compiling():
        return _MatmulNTCompiled.apply(a, b)
    return _MatmulNT.apply(a, b)


def normalized(x: torch.Tensor) -> torch.Tensor:
    """``F.normalize(x, dim=1)`` with the norm taken in float64: a float32 norm overflows for
    finite rows with entries ≳ 1.8e19, and F.normalize then returns a zero vector."""
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float64).clamp_min(NORM_EPS)
    return x / norm.to(x.dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
