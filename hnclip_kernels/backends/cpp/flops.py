"""FLOPs of the C++ operators for ``torch.utils.flop_counter.FlopCounterMode``.

The mode runs an operator with itself popped off the mode stack, so it never sees the BLAS
products inside the kernels and counts 0 without these formulas. Each formula states the
multiply-adds of the kernels' products (``at::mm_out``/``addmm_`` in ``csrc/``), as torch counts a
matmul (2·M·N·K FLOPs), in M×N×D products ("P", 2·M·N·D FLOPs; M = N for the loss), with
f = 1 under false-negative masking (the captions' tile G formed beside each logit tile), else 0:

* the loss (``cpp_symmetric_nll``, raw ``cpp_raw_symmetric_fwd``/``_bwd``): forward (1 + f) P, the
  margin folded into the left factor ((v̂ + γt̂)/τ against t̂); backward (1 + f) P recomputed plus
  ds·t̂ and dsᵀ·v̂: (3 + f) P;
* the directional op (``cpp_directional_nll``, raw ``cpp_raw_directional_fwd``/``_bwd``): Z = L Rᵀ
  of inner width w·D, w = 1 (γ = 0, or the margin folded in where the margin's factors are the
  keys or the queries, as in every call the distributed loss makes) or 2 ([q̂, γâ]·[k̂, b̂]ᵀ
  otherwise); forward (w + f) P, plus the negatives' shares P·k̂ and Pᵀ·q̂ (2 P) when a gradient
  will follow (``need_grad``); backward 0 when those shares were kept and the upstream gradient is
  the same for every row (a rescale: ``mean``/``sum``), else (w + f) P recomputed, Pᵀ·q̂, and P·k̂
  unless the shares were kept;
* the family's single-process op (``cpp_family_nll``, :mod:`.family_sym`): the loss's counts over
  the N×N block plus the directional op's over the N×M negative block (i2t rows only, w = 1: its
  margin folds into the left factor for either margin): forward (1 + f)·N²·D + (1 + f + 2)·N·M·D
  (the shares only with ``need_grad``), backward (3 + f)·N²·D plus the block's 0 (shares kept,
  uniform upstream gradient) or (2 + f)·N·M·D; f = 1 only when the threshold's caption tile is
  formed (ids alone: 0);
* a backward asked for dτ alone (no feature gradient) runs no kernel: 0;
* the family's directional op (``cpp_family_directional_nll``, :mod:`.family`): the directional op's
  counts over its N + M key columns (the negatives' products, no more), with f = 1 only when the
  threshold's caption tile is formed (group ids alone, threshold +inf: no tile, f = 0).

What depends on the data (w; a uniform upstream gradient) is read from real tensors, as the
kernels decide it; on fake or meta tensors the formulas assume the distributed loss's case
(w = 1, a uniform gradient). ``tests/backends/test_cpp_flops.py`` holds the formulas equal to the
products the kernels run (aten's matmuls recorded by ``torch.profiler``).
"""

from __future__ import annotations

import math

import torch

from ...numerics import compute_dtype
from .. import epilogue, glue
from ..outputs import CppDirectionalOut


def _readable(*tensors) -> bool:
    """Can the formula read these tensors' values (not fake, not meta)?"""
    from torch._subclasses.fake_tensor import is_fake

    return not any(is_fake(t) or t.device.type == "meta" for t in tensors)


def _width(q_hat, k_hat, a, b, ra, rb, gamma: float) -> int:
    """w of ``make_factors`` (csrc/factors.h): 1 without the margin or where â = q̂ or b̂ = k̂ to the
    bit (the margin folds into one factor), else 2."""
    if gamma == 0.0 or not _readable(q_hat, k_hat, a, b):
        return 1
    return 1 if _scaled_equals(b, rb, k_hat) or _scaled_equals(a, ra, q_hat) else 2


def _scaled_equals(x, inv, ref) -> bool:
    """``scaled_equals`` of csrc/factors.h: is x·inv, rounded to ref's dtype, ref to the bit?"""
    return x.shape == ref.shape and torch.equal(epilogue.scaled(x, inv.to(ref.dtype), ref.dtype), ref)


def _value(x) -> float:
    """γ as the kernels read it (a 0-dim tensor or a float); unreadable: taken as non-zero."""
    if isinstance(x, torch.Tensor):
        return float(x.item()) if _readable(x) else 1.0
    return float(x)


def _uniform(g: torch.Tensor, dt) -> bool:
    if g.numel() == 0 or not _readable(g):
        return True
    g = g.to(dt)
    return bool((g == g.reshape(-1)[0]).all())


def _directional_fwd(m: int, n: int, d: int, width: int, masked: bool, need_grad: bool) -> int:
    return 2 * m * n * d * (width + int(masked) + (2 if need_grad else 0))


def _directional_bwd(m, n, d, width, masked, have_acc: bool, uniform: bool) -> int:
    if have_acc and uniform:
        return 0
    return 2 * m * n * d * (width + int(masked) + 1 + (0 if have_acc else 1))


def _has_acc(row_acc, col_acc, m, n, d) -> bool:
    return tuple(row_acc.shape) == (m, d) and tuple(col_acc.shape) == (n, d)


# ---- the operators of ops.py: (argument names as their schemas)
def directional_forward(q, k, a, b, tau, gamma, eps, thr, offset, normalize, masked, need_grad, out_val=None, **_):
    (m, d), n = q.shape, k.shape[0]
    width = 1
    if out_val is not None and _value(gamma) != 0.0 and _readable(q, k):
        dt = compute_dtype(q.dtype)
        out = CppDirectionalOut._make(out_val)
        q_hat, k_hat = epilogue.scaled(q, out.rq, dt), epilogue.scaled(k, out.rk, dt)
        width = _width(q_hat, k_hat, a, b, out.ra, out.rb, _value(gamma))
    return _directional_fwd(m, n, d, width, masked, need_grad)


def directional_backward(grad, q, k, a, b, tau, gamma, eps, thr, rq, rk, ra, rb, *rest, **_):
    *_stats, row_acc, col_acc, _offset, _normalize, masked, _need_grad, need_qk = rest
    if not need_qk:
        return 0
    (m, d), n = q.shape, k.shape[0]
    dt = compute_dtype(q.dtype)
    width = 1
    if _value(gamma) != 0.0 and _readable(q, k):
        q_hat, k_hat = epilogue.scaled(q, rq, dt), epilogue.scaled(k, rk, dt)
        width = _width(q_hat, k_hat, a, b, ra, rb, _value(gamma))
    have_acc = _has_acc(row_acc, col_acc, m, n, d)
    return _directional_bwd(m, n, d, width, masked, have_acc, _uniform(grad, dt))


# ---- the family's operator (family.py): the directional op's formulas with the caption tile's f
def _cosine(masked: bool, thr, query_groups) -> bool:
    """Is the caption tile formed: masking, and not by ids alone (threshold +inf)?"""
    return masked and not (query_groups.numel() > 0 and math.isinf(_value(thr)))


def family_forward(q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, offset, normalize, masked, need_grad, **kw):
    f = _cosine(masked, thr, qg)
    return directional_forward(q, k, a, b, tau, gamma, eps, thr, offset, normalize, f, need_grad, **kw)


def family_backward(grad, q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, *rest, **kw):
    *stats, offset, normalize, masked, need_grad, need_qk = rest
    f = _cosine(masked, thr, qg)
    return directional_backward(
        grad, q, k, a, b, tau, gamma, eps, thr, *stats, offset, normalize, f, need_grad, need_qk, **kw
    )


# ---- the family's single-process operator (family_sym.py): the symmetric op's counts over the N×N
# block plus the negative block's N×M, at the same factor per column (width 1: b̂ = n̂ folds in)
def family_symmetric_forward(
    img, txt, neg, groups, tau, gamma, eps, thr, normalize, masked, image_text, need_grad, **_
):
    (n, d), m = img.shape, neg.shape[0]
    f = _cosine(masked, thr, groups)
    return 2 * n * n * d * (1 + int(f)) + (_directional_fwd(n, m, d, 1, f, need_grad) if m > 0 else 0)


def family_symmetric_backward(grad, img, txt, neg, groups, tau, gamma, eps, thr, *rest, **_):
    *_stats, row_acc, col_acc, _normalize, masked, _image_text, _need_grad, need = rest
    if not need:
        return 0
    (n, d), m = img.shape, neg.shape[0]
    f = _cosine(masked, thr, groups)
    block = 0
    if m > 0:
        uniform = _uniform(grad, compute_dtype(img.dtype))
        block = _directional_bwd(n, m, d, 1, f, _has_acc(row_acc, col_acc, n, m, d), uniform)
    return 2 * n * n * d * (3 + int(f)) + block


def symmetric_forward(img, txt, tau, gamma, eps, thr, normalize, masked, **_):
    n, d = img.shape
    return 2 * n * n * d * (1 + int(masked))


def symmetric_backward(grad, img, txt, *rest, **_):
    masked, need_vt = rest[-2:]
    n, d = img.shape
    return 2 * n * n * d * (3 + int(masked)) if need_vt else 0


# ---- the raw kernels (raw.py): inputs already normalised, γ and the threshold floats
def _raw_cosine(threshold, rest, kw, at: int) -> bool:
    """Does a raw directional kernel form the caption tile: a threshold, unless the group ids
    ``qg`` (argument ``at`` of ``rest``, or a keyword) mask alone (threshold +inf)?"""
    qg = rest[at] if len(rest) > at else kw.get("qg")
    return threshold is not None and not (qg is not None and math.isinf(threshold))


def raw_directional_fwd(q_hat, k_hat, a, b, ra, rb, pos, inv_tau, offset, gamma, need_grad, threshold, *rest, **kw):
    (m, d), n = q_hat.shape, k_hat.shape[0]
    width = _width(q_hat, k_hat, a, b, ra, rb, float(gamma))
    return _directional_fwd(m, n, d, width, _raw_cosine(threshold, rest, kw, 5), need_grad)  # eps ca cb ma mb qg


def raw_directional_bwd(
    q_hat, k_hat, a, b, ra, rb, pos, inv_tau, delta, row_acc, col_acc, g, offset, gamma, threshold, *rest, **kw
):
    (m, d), n = q_hat.shape, k_hat.shape[0]
    width = _width(q_hat, k_hat, a, b, ra, rb, float(gamma))
    have_acc = _has_acc(row_acc, col_acc, m, n, d)
    f = _raw_cosine(threshold, rest, kw, 5)  # shift ca cb ma mb qg
    return _directional_bwd(m, n, d, width, f, have_acc, _uniform(g, q_hat.dtype))


def raw_symmetric_fwd(v_hat, t_hat, pos, inv_tau, gamma, threshold, *_, **__):
    n, d = v_hat.shape
    return 2 * n * n * d * (1 + int(threshold is not None))


def raw_symmetric_bwd(v_hat, t_hat, pos, inv_tau, delta_r, delta_c, g, gamma, threshold, *_, **__):
    n, d = v_hat.shape
    return 2 * n * n * d * (3 + int(threshold is not None))


FORMULAS = {
    "cpp_directional_nll": directional_forward,
    "cpp_directional_nll_backward": directional_backward,
    "cpp_symmetric_nll": symmetric_forward,
    "cpp_symmetric_nll_backward": symmetric_backward,
    "cpp_raw_directional_fwd": raw_directional_fwd,
    "cpp_raw_directional_bwd": raw_directional_bwd,
    "cpp_raw_symmetric_fwd": raw_symmetric_fwd,
    "cpp_raw_symmetric_bwd": raw_symmetric_bwd,
}


def register_family() -> None:
    """Register the family operator's formulas (:mod:`.family`, once it exists)."""
    glue.register_flops("cpp_family_directional_nll", family_forward)
    glue.register_flops("cpp_family_directional_nll_backward", family_backward)


def register_family_symmetric() -> None:
    """Register the family's single-process operator's formulas (:mod:`.family_sym`)."""
    glue.register_flops("cpp_family_nll", family_symmetric_forward)
    glue.register_flops("cpp_family_nll_backward", family_symmetric_backward)


def register() -> None:
    """Register every formula with ``FlopCounterMode`` (once; the operators must exist)."""
    for name, formula in FORMULAS.items():
        glue.register_flops(name, formula)
