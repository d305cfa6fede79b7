"""Fused HN-CLIP loss in Triton: forward, backward, their operators and autograd.

A tile of logits ``Z = (q̂ k̂ᵀ + γ · stopgrad(â b̂ᵀ)) / τ`` is formed on the fly from the raw
features and their float32 inverse row norms. Nothing of size M×N is stored.

Forward (``_fwd_kernel``, one walk over the tiles): program (row block, column split)
forms each of its tiles once and folds it into an online LSE along its rows (i2t) and,
for the symmetric loss, into complete statistics of the tile's columns (t2i). Both are
partial (the rows' over one column split, the columns' over one row block) and
``_merge_kernel`` combines them in a fixed order: deterministic, no atomics.

Backward, per R × C chunk of Z (R·C·elem ≤ ``BWD_WORKSPACE_BYTES``, 256 MiB): ``_dscore_kernel``
forms each tile once more and writes W = diag(r_q) · dS · diag(r_k) (dS = dL/dZ times τ,
negatives only) to a float32 workspace; ``_grad_gemm_kernel`` then adds (W k) / r_q to dq̂ and
(Wᵀ q) / r_k to dk̂. Why a workspace and not full-D accumulators: at D = 768 a 64-row
float32 accumulator alone is 192 KiB, more than a program's registers, so a fused
backward must slice D and re-form each tile once per slice (6× at D = 768); materialising
dS costs one write and two reads of 2 bytes per logit, and both products become plain
GEMMs with long reductions, whatever D is. Matmul work per step, in N×N×D products:
2 forward + 2 dS + 2 × 2 GEMM passes with the margin (2.67× the 3 useful ones), 1 + 1 + 4
without (2.0×). The GEMMs take two passes because W is kept in float32 and split into a
head and a tail in the features' type: a single bf16 pass would round dS to 8 bits, and
for near-duplicate captions (the hard negatives the margin is for) the gradient
Σ_k dS_ik (t̂_k − t̂_i) is small against its terms, so that rounding reached 2% of it.

Every output element is written by one program, chunks run in order: bit-reproducible.
One direction at a time (M query rows vs N key columns, positive of row i at column
``offset + i``) serves a rank of a distributed job; the symmetric operator is the fused
single-process loss (both directions from the same tiles).

Registration. Four operators, registered once at import:

* ``hnclip::triton_symmetric_nll(img, txt, tau, gamma, has_margin, label_smoothing, normalize,
  precision)`` → (pairs, rv, rt, pos, and the (delta, mean_neg, dsum) of i2t then of t2i), what
  ``hn_clip_loss(backend="triton")`` runs, and ``hnclip::triton_directional_nll(q, k, a, b,
  tau, gamma, offset, has_margin, label_smoothing, normalize, precision)`` → (loss, rq, rk,
  ra, rb, pos, delta, mean_neg, dsum), what a rank of the distributed loss runs;
* their ``*_backward`` operators → (dL/dq, dL/dk, dL/dτ) in the inputs' dtypes.

τ and γ are tensors (γ: shape (1,), float32; ``has_margin`` = γ ≠ 0 is the kernels' HAS_MARGIN),
so a schedule of either reuses a compiled graph; the kernels read both from device memory and
take no float argument at all: Inductor types a Python float fp64 inside a user kernel, and
with γ a float argument the float32 tiles became fp64 and the forward kernel failed to compile
("Loop-carried variable run_max has initial type fp32 but is re-assigned to fp64").
``python -m tools.sm90 --wide-scalars`` compiles the kernels with Inductor's scalar types.
``label_smoothing`` stays a float (a new ε is a new graph); ``precision`` is the tensor-core mode
string (``triton_config.FP32_PRECISIONS``).

With compiled kernels the operators are ``torch.library.triton_op``s launching every kernel
through ``torch.library.wrap_triton`` (:func:`_kernel`): ``torch.compile`` traces them into
one ``triton_kernel_wrapper`` node per launch that Inductor compiles with the rest of the
graph, and the operator function run on fake tensors is its own fake implementation.
Under the interpreter (``TRITON_INTERPRET=1``) ``wrap_triton`` hands back the interpreted
kernel, which cannot run on fake tensors, so the same functions are registered with
``torch.library.custom_op`` and explicit fake implementations: opaque to tracing, the same
kernels run eagerly inside (``torch.compile`` with "eager"/"aot_eager", ``torch.export`` and
``opcheck`` work on CPU tensors; Inductor cannot compile user Triton kernels for CPU tensors).

Autograd: ``torch.library.register_autograd`` on the forward operators (what a compiled or
exported graph uses) and a raising formula on the backward operators (a second derivative is
one ``RuntimeError`` naming backend="torch", ``hnclip_kernels.backends.first_order``). In eager mode
the public wrappers call the operators through :class:`HNClipTriton` /
:class:`HNClipDirectionalTriton`, ``autograd.Function``s with the same ``setup_context`` and
backward, because ``torch.func`` refuses the Function that ``register_autograd`` builds;
``torch.library.register_vmap`` gives every operator a loop over the batch, so
``torch.func.grad``, ``vjp`` and ``vmap`` (and ``vmap`` of ``grad``) work.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ...validation import check_directional
from .. import epilogue, glue
from ..first_order import first_order_call, raising_backward
from . import config as cfg
from .backward import backward_shares as _backward_shares
from .forward import forward_stats as _forward_stats
from .launch import USE_TRITON_OP as _USE_TRITON_OP


# ------------------------------------------------------------------ operators
_SymOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_DirOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_Grads = Tuple[Tensor, Tensor, Tensor]


def _register(name: str, fake):
    """Decorator: the function as the operator ``hnclip::<name>`` (no mutated arguments).

    Compiled kernels: ``torch.library.triton_op``, so ``torch.compile`` sees the kernel launches
    (``wrap_triton``) and Inductor compiles them into its graph; the function itself, run on
    fake tensors, is the fake implementation. Interpreter (or a torch without ``triton_op``):
    ``torch.library.custom_op`` with the explicit ``fake``: ``wrap_triton`` hands back an
    interpreted kernel as it is, and that cannot run on fake tensors, so the operator is
    opaque to tracing there (the same kernels run eagerly inside it)."""

    def wrap(fn):
        if _USE_TRITON_OP:
            return torch.library.triton_op(f"hnclip::{name}", fn, mutates_args=())
        op = torch.library.custom_op(f"hnclip::{name}", fn, mutates_args=())
        op.register_fake(fake)
        return op

    return wrap


def _scalar32(x: Tensor, like: Tensor) -> Tensor:
    """A one-element tensor (τ, γ) as the kernels read it: float32, shape (1,), on ``like``'s device."""
    return x.to(device=like.device, dtype=torch.float32).reshape(1)


def _sym_fake(img, txt, tau, gamma, has_margin, label_smoothing, normalize, precision):
    return tuple(img.new_empty((img.shape[0],), dtype=torch.float32) for _ in range(10))


@_register("triton_symmetric_nll", _sym_fake)
def _symmetric_nll(img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor, has_margin: bool, label_smoothing: float,
                   normalize: bool, precision: str) -> _SymOut:
    """Per-pair losses ½(i2t_k + t2i_k) (N,) and what the backward needs:
    (pairs, rv, rt, pos, delta_i2t, mean_neg_i2t, dsum_i2t, delta_t2i, mean_neg_t2i, dsum_t2i).

    Forward: one walk over the tiles of Z gives its rows' (i2t) and columns' (t2i) statistics."""
    rv, rt = epilogue.inv_norms(img, normalize), epilogue.inv_norms(txt, normalize)
    tau32, gamma32 = _scalar32(tau, img), _scalar32(gamma, img)
    inv_tau = 1.0 / tau32
    pos = epilogue.positive_logits(epilogue.scaled(img, rv), epilogue.scaled(txt, rt), 0, inv_tau)
    i2t, t2i = _forward_stats((img, txt, txt, txt), (rv, rt, rt, rt), pos, tau32, gamma32, has_margin, 0,
                              label_smoothing != 0.0, precision, columns=True)
    pairs = epilogue.pair_losses(i2t, t2i, img.shape[0], label_smoothing)
    return (pairs, rv, rt, pos, *i2t[1:], *t2i[1:])


def _grads_fake(grad, q, k, tau, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), tau.new_empty(tau.shape)


@_register("triton_symmetric_nll_backward", _grads_fake)
def _symmetric_nll_backward(
    grad: Tensor, img: Tensor, txt: Tensor, tau: Tensor, gamma: Tensor,
    rv: Tensor, rt: Tensor, pos: Tensor, delta_r: Tensor, mean_neg_r: Tensor, dsum_r: Tensor,
    delta_c: Tensor, mean_neg_c: Tensor, dsum_c: Tensor,
    has_margin: bool, label_smoothing: float, normalize: bool, precision: str, need_vt: bool,
) -> _Grads:
    """(dL/dimg in img's dtype, dL/dtxt in txt's dtype, dL/dτ in τ's dtype and shape). Each
    recomputed tile carries both directions' softmax into one dS workspace."""
    i2t = epilogue.RowStats(pos, delta_r, mean_neg_r, dsum_r)
    t2i = epilogue.RowStats(pos, delta_c, mean_neg_c, dsum_c)
    tau32, gamma32 = _scalar32(tau, img), _scalar32(gamma, img)
    inv_tau = 1.0 / tau32
    g = 0.5 * grad.float().contiguous()  # each direction's rows get half
    if need_vt:
        d_v, d_t = _backward_shares((img, txt, txt, txt), (rv, rt, rt, rt), i2t, g, tau32, gamma32, has_margin, 0,
                                    precision, key_side=(t2i, g))
    else:  # only τ wants a gradient: it needs the statistics alone
        d_v, d_t = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (img, txt))
    d_img, d_txt, dz_z = epilogue.finish_symmetric(i2t, t2i, g, img, txt, rv, rt, d_v, d_t, inv_tau,
                                                   label_smoothing, normalize)
    return d_img, d_txt, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


def _dir_fake(q, k, a, b, tau, gamma, offset, has_margin, label_smoothing, normalize, precision):
    m, n = q.shape[0], k.shape[0]
    return tuple(q.new_empty((n if i in (2, 4) else m,), dtype=torch.float32) for i in range(9))


@_register("triton_directional_nll", _dir_fake)
def _directional_nll(q: Tensor, k: Tensor, a: Tensor, b: Tensor, tau: Tensor, gamma: Tensor, offset: int,
                     has_margin: bool, label_smoothing: float, normalize: bool, precision: str) -> _DirOut:
    """Per-row losses (M,) of one direction and what the backward needs:
    (loss, rq, rk, ra, rb, pos, delta, mean_neg, dsum)."""
    norms = tuple(epilogue.inv_norms(x, normalize) for x in (q, k, a, b))
    tau32, gamma32 = _scalar32(tau, q), _scalar32(gamma, q)
    inv_tau = 1.0 / tau32
    pos = epilogue.positive_logits(epilogue.scaled(q, norms[0]), epilogue.scaled(k, norms[1]), offset, inv_tau)
    stats = _forward_stats((q, k, a, b), norms, pos, tau32, gamma32, has_margin, offset, label_smoothing != 0.0,
                           precision)
    return (epilogue.row_losses(stats, k.shape[0], label_smoothing), *norms, *stats)


@_register("triton_directional_nll_backward", _grads_fake)
def _directional_nll_backward(
    grad: Tensor, q: Tensor, k: Tensor, tau: Tensor, a: Tensor, b: Tensor, gamma: Tensor,
    rq: Tensor, rk: Tensor, ra: Tensor, rb: Tensor, pos: Tensor, delta: Tensor, mean_neg: Tensor, dsum: Tensor,
    offset: int, has_margin: bool, label_smoothing: float, normalize: bool, precision: str, need_qk: bool,
) -> _Grads:
    """(dL/dq in q's dtype, dL/dk in k's dtype, dL/dτ in τ's dtype and shape)."""
    stats = epilogue.RowStats(pos, delta, mean_neg, dsum)
    tau32, gamma32 = _scalar32(tau, q), _scalar32(gamma, q)
    inv_tau = 1.0 / tau32
    g = grad.float().contiguous()
    if need_qk:
        d_q, d_k = _backward_shares((q, k, a, b), (rq, rk, ra, rb), stats, g, tau32, gamma32, has_margin, offset,
                                    precision)
    else:  # only τ wants a gradient: it needs the row statistics alone
        d_q, d_k = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k))
    d_q_in, d_k_in, dz_z = epilogue.finish_directional(stats, g, q, k, rq, rk, d_q, d_k, offset, inv_tau,
                                                       label_smoothing, normalize)
    return d_q_in, d_k_in, epilogue.tau_grad(dz_z, inv_tau, tau.dtype, tau.shape)


# ------------------------------------------------------------------ autograd
def _sym_setup_context(ctx, inputs, output):
    img, txt, tau, gamma, has_margin, label_smoothing, normalize, precision = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(img, txt, tau, gamma, *saved)
    ctx.options = (bool(has_margin), float(label_smoothing), bool(normalize), str(precision))


def _sym_backward(ctx, grad_pairs, *_stats):
    img, txt, tau, gamma, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_pairs is None:
        grad_pairs = torch.zeros(img.shape[0], dtype=torch.float32, device=img.device)
    need_vt = bool(needs[0] or needs[1])
    d_img, d_txt, d_tau = first_order_call("triton", torch.ops.hnclip.triton_symmetric_nll_backward, grad_pairs,
                                           img, txt, tau, gamma, *saved, *ctx.options, need_vt)
    return (d_img if needs[0] else None, d_txt if needs[1] else None, d_tau if needs[2] else None,
            None, None, None, None, None)


def _dir_setup_context(ctx, inputs, output):
    q, k, a, b, tau, gamma, offset, has_margin, label_smoothing, normalize, precision = inputs
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, tau, a, b, gamma, *saved)
    ctx.options = (int(offset), bool(has_margin), float(label_smoothing), bool(normalize), str(precision))


def _dir_backward(ctx, grad_rows, *_stats):
    q, k, tau, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_rows is None:
        grad_rows = torch.zeros(q.shape[0], dtype=torch.float32, device=q.device)
    need_qk = bool(needs[0] or needs[1])
    d_q, d_k, d_tau = first_order_call("triton", torch.ops.hnclip.triton_directional_nll_backward, grad_rows,
                                       q, k, tau, *saved, *ctx.options, need_qk)
    return (d_q if needs[0] else None, d_k if needs[1] else None, None, None, d_tau if needs[4] else None,
            None, None, None, None, None, None)


torch.library.register_autograd("hnclip::triton_symmetric_nll", _sym_backward, setup_context=_sym_setup_context)
torch.library.register_autograd("hnclip::triton_directional_nll", _dir_backward, setup_context=_dir_setup_context)
# the backward operators are not differentiable: a second derivative is one clear error naming backend="torch"
torch.library.register_autograd("hnclip::triton_symmetric_nll_backward", raising_backward("triton"))
torch.library.register_autograd("hnclip::triton_directional_nll_backward", raising_backward("triton"))


# torch.func-capable Functions (see .registration); the class names are the Triton backend's API
HNClipTriton = glue.func_capable(
    "HNClipTriton", torch.ops.hnclip.triton_symmetric_nll, _sym_setup_context, _sym_backward, "triton",
    "``hnclip::triton_symmetric_nll`` with its registered autograd formula, usable under ``torch.func``.")
HNClipDirectionalTriton = glue.func_capable(
    "HNClipDirectionalTriton", torch.ops.hnclip.triton_directional_nll, _dir_setup_context, _dir_backward, "triton",
    "``hnclip::triton_directional_nll`` with its registered autograd formula, usable under ``torch.func``.")
glue.register_looped_vmap(("triton_symmetric_nll", "triton_symmetric_nll_backward", "triton_directional_nll",
                                   "triton_directional_nll_backward"))


# ------------------------------------------------------------------ public wrappers
def _scalar_args(gamma, precision, like: Tensor):
    """(γ as a (1,) float32 tensor on ``like``'s device, has_margin, precision string).

    γ reaches the kernels through device memory, never as a float argument: a ``float``
    argument of an operator is a constant of a compiled graph (each new γ of a schedule would
    recompile), and Inductor types Python floats fp64 inside user kernels. The tensor is
    ``ones · γ``: a product with the float is what AOTAutograd's tensorify pass turns into a
    graph input (``torch.full``/``torch.tensor(γ)`` specialise the graph on γ's value). has_margin
    (γ ≠ 0, the kernels' HAS_MARGIN) stays a bool: under ``torch.compile`` γ = 0 and γ ≠ 0 are
    two graphs, every other new γ reuses the second. A tensor γ is taken to be non-zero."""
    if isinstance(gamma, torch.Tensor):
        gamma_t, has_margin = gamma.detach().to(device=like.device, dtype=torch.float32).reshape(1), True
    else:
        gamma_t, has_margin = torch.ones(1, dtype=torch.float32, device=like.device) * gamma, gamma != 0.0
    return gamma_t, has_margin, precision or cfg.DEFAULT_FP32_PRECISION


def directional_nll_triton(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize,
                           return_stats=False, precision=None):
    """Triton counterpart of :func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch` (same keyword-only
    protocol and result). ``precision``: tensor-core input precision for float32 features
    (``triton_config.FP32_PRECISIONS``; None: ``DEFAULT_FP32_PRECISION``); ignored for 16-bit features.

    Runs ``hnclip::triton_directional_nll``; works under ``torch.compile(fullgraph=True)`` (a new
    γ or τ does not recompile), ``torch.export``, ``torch.func.grad``/``vjp`` and ``torch.func.vmap``
    (one kernel call per batch entry). Second derivatives raise the ``RuntimeError`` naming
    backend="torch"."""
    check_directional(queries, keys, query_txt, key_txt, offset)
    gamma_t, has_margin, precision = _scalar_args(gamma, precision, queries)
    out = glue.call(HNClipDirectionalTriton, torch.ops.hnclip.triton_directional_nll, queries, keys,
                            query_txt, key_txt, tau, gamma_t, int(offset), has_margin, float(label_smoothing),
                            bool(normalize), precision)
    return (out[0], epilogue.RowStats(*out[5:9])) if return_stats else out[0]


def hn_clip_pairs_triton(img, txt, *, tau, gamma, label_smoothing, normalize, return_stats=False, precision=None):
    """Per-pair losses ½(i2t_k + t2i_k), shape (N,): the fused single-process loss
    (``hnclip::triton_symmetric_nll``; composes as :func:`directional_nll_triton` does).
    ``return_stats``: also ``(i2t, t2i)``, the detached ``epilogue.RowStats`` of both directions."""
    gamma_t, has_margin, precision = _scalar_args(gamma, precision, img)
    out = glue.call(HNClipTriton, torch.ops.hnclip.triton_symmetric_nll, img, txt, tau, gamma_t,
                            has_margin, float(label_smoothing), bool(normalize), precision)
    if not return_stats:
        return out[0]
    pos = out[3]
    return out[0], (epilogue.RowStats(pos, *out[4:7]), epilogue.RowStats(pos, *out[7:10]))
