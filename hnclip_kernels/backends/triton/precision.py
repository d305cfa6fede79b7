"""Tensor-core precision, emulated under Triton's interpreter.

On a GPU, ``_dot`` is ``tl.dot`` with ``input_precision=PREC``. Under the interpreter, which
multiplies exactly in float32 (and mis-multiplies raw bf16 bits, triton#11584), the operands
are upcast and rounded as the tensor cores round them for PREC, and the multi-pass modes
are spelled out: a CPU run computes what a GPU computes.

``PREC`` (a constexpr string): "ieee", "tf32", "tf32x3", "bf16x3", "bf16x6" (float32
operands). The backward's GEMMs are torch's (``backward.py``), outside this emulation.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_tf32(x, NEAREST: tl.constexpr):
    """x rounded to tf32 (10-bit mantissa): truncated, as a tensor core reads float32
    registers, or to nearest (ties away), as Triton's tf32x3 split does."""
    bits = x.to(tl.uint32, bitcast=True)
    if NEAREST:
        bits = bits + 0x1000
    return (bits & 0xFFFFE000).to(tl.float32, bitcast=True)


# Are the kernels interpreted? Read as a global constexpr inside @triton.jit (compiled code
# folds it away; the interpreter reads it as a Python value): triton.jit hands back an
# InterpretedFunction when TRITON_INTERPRET=1 was set when it ran.
INTERPRET = tl.constexpr("Interpreted" in type(_round_tf32).__name__)


@triton.jit
def _round_bf16(x):
    """x rounded to bfloat16, to nearest even (the GPU's conversion; the interpreter's
    own conversion truncates), returned as float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _head(x, BF16: tl.constexpr):
    """The leading part of a multi-pass split: bf16 to nearest even, or tf32 to nearest."""
    if BF16:
        return _round_bf16(x)
    return _round_tf32(x, True)


@triton.jit
def _tail(x, BF16: tl.constexpr):
    """A remainder as the tensor core reads it: bf16 to nearest even, or tf32 truncated."""
    if BF16:
        return _round_bf16(x)
    return _round_tf32(x, False)


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b with float32 accumulation, a and b rounded as the tensor cores round
    them for PREC (used for float32 operands only; 16-bit products are exact in float32)."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if PREC == "tf32":
            acc = tl.dot(_round_tf32(a, False), _round_tf32(b, False), acc)
        elif PREC == "tf32x3" or PREC == "bf16x3":
            # Σ of three products: tail·head + head·tail + head·head (the tails' product dropped)
            a_hi = _head(a, PREC == "bf16x3")
            b_hi = _head(b, PREC == "bf16x3")
            acc = tl.dot(_tail(a - a_hi, PREC == "bf16x3"), b_hi, acc)
            acc = tl.dot(a_hi, _tail(b - b_hi, PREC == "bf16x3"), acc)
            acc = tl.dot(a_hi, b_hi, acc)
        elif PREC == "bf16x6":
            a1 = _round_bf16(a)
            b1 = _round_bf16(b)
            a2 = _round_bf16(a - a1)
            b2 = _round_bf16(b - b1)
            a3 = _round_bf16(a - a1 - a2)
            b3 = _round_bf16(b - b1 - b2)
            acc = tl.dot(a1, b3, acc)
            acc = tl.dot(a2, b2, acc)
            acc = tl.dot(a3, b1, acc)
            acc = tl.dot(a1, b2, acc)
            acc = tl.dot(a2, b1, acc)
            acc = tl.dot(a1, b1, acc)
        else:
            acc = tl.dot(a, b, acc)
    else:
        if a.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            acc = tl.dot(a, b, acc)
    return acc
