"""FLOPs of the Triton operators for ``torch.utils.flop_counter.FlopCounterMode``.

The operators are opaque to the mode (it runs a custom operator with itself popped off the mode
stack, so it never sees the kernels' ``tl.dot`` nor the backward's torch GEMMs inside): without
these formulas it counts 0 for the loss. Each formula states the multiply-adds the kernels
execute, as torch counts a matmul (2·M·N·K FLOPs), in M×N×D products ("P", 2·M·N·D FLOPs; M = N
for the loss), with g = 1 when the margin's product G = t tᵀ is formed (γ ≠ 0, or a
false-negative threshold: the mask reads G), else 0:

* the loss (``triton_symmetric_nll``), N×N: the forward walks tile pairs, each logit formed once:
  a diagonal super-tile (BLOCK_M rows, ``config.fwd_block_m``: 128 for 16-bit features, 64 for
  float32) costs 1 + g products of its square, a tile and its mirror off the diagonal 2 + g for
  the two, i.e. (2 + g)/2 each: (1 + g)·S + (1 + g/2)·(N² − S) entries × D, S = Σ (block rows)²;
  its backward (``_dscore_pair_kernel``, the same tile pairs) the same again, plus 2 P of torch
  GEMMs (W·t and Wᵀ·v; 4 for fp16, W's head and tail);
* the directional op, M×N: forward (1 + g) P, backward (1 + g) P of dS plus 2 P of GEMMs (4 fp16);
* a rank's op, both directions of M×N: forward (2 + g) P (v tᵀ_all, t v_allᵀ and the shared G),
  backward (2 + g) P plus each direction's 2 GEMMs, 4 P (8 fp16);
* the family's directional op (``triton_family_directional_nll``): the directional op's with
  its tile's products (``family_tiles``): 1 + g P, g = 1 for γ ≠ 0 or a threshold on the margin
  factors' cosine, plus 1 P for a threshold on mask captions; group ids cost none;
* the family's loss (``triton_family_nll``): the loss's N×N walks, with g = 1 for γ ≠ 0 under
  ``margin="text"`` or a threshold (``margin="image_text"`` forms no margin product: it is a logit
  scale), plus the N×M block of the negatives as the directional op's (1 + g) P forward and
  (1 + g) P + 2 P (4 fp16) backward; group ids cost none;
* a backward asked for dτ alone (no feature gradient) runs no kernel: 0.

The kernels' products (not the GEMMs, IEEE float32 or 16-bit) count their tensor-core passes:
float32 features under ``precision`` tf32x3 or bf16x3 run 3 per product, bf16x6 6 (16-bit
features and "ieee": 1), as ``tools.work`` counts them in the interpreter. Tile padding is not
counted: with M or N not a multiple of the tiles the GPU runs up to a tile more per edge.
``tests/tooling/test_work_count.py`` holds every formula equal to the work ``tools.work``
counts from the kernels' own ``tl.dot`` calls and torch's GEMMs.
"""

from __future__ import annotations

import torch

from .. import glue
from . import config as cfg

# tensor-core passes per product of float32 features (``validation.FP32_PRECISIONS``)
PASSES = {"ieee": 1, "tf32": 1, "tf32x3": 3, "bf16x3": 3, "bf16x6": 6}


def _passes(x: torch.Tensor, precision: str) -> int:
    return PASSES.get(precision, 1) if x.dtype == torch.float32 else 1


def _gemms(x: torch.Tensor) -> int:
    """GEMM passes per backward product: fp16's dS is a head and a tail."""
    return 2 if x.dtype == torch.float16 else 1


def _margin(has_margin: bool, masked: bool) -> int:
    return int(bool(has_margin) or bool(masked))


def symmetric_score_macs(n: int, d: int, block_m: int, g: int) -> int:
    """Multiply-adds of one walk over the loss's N×N logits in tile pairs (forward, or dS)."""
    diagonal = (n // block_m) * block_m * block_m + (n % block_m) ** 2  # the diagonal super-tiles' entries
    return d * ((1 + g) * diagonal + (2 + g) * (n * n - diagonal) // 2)


def symmetric_forward(img, txt, tau, gamma, eps, thr, normalize, masked, has_margin, smoothing, precision, **_):
    n, d = img.shape
    macs = symmetric_score_macs(n, d, cfg.fwd_block_m(img.element_size()), _margin(has_margin, masked))
    return 2 * _passes(img, precision) * macs


def symmetric_backward(grad, img, txt, *rest, **_):
    _normalize, masked, has_margin, _smoothing, precision, need_vt = rest[-6:]
    if not need_vt:
        return 0
    n, d = img.shape
    macs = symmetric_score_macs(n, d, cfg.fwd_block_m(img.element_size()), _margin(has_margin, masked))
    return 2 * (_passes(img, precision) * macs + 2 * _gemms(img) * n * n * d)


def directional_forward(
    q, k, a, b, tau, gamma, eps, thr, offset, normalize, masked, has_margin, smoothing, precision, **_
):
    (m, d), n = q.shape, k.shape[0]
    return 2 * _passes(q, precision) * (1 + _margin(has_margin, masked)) * m * n * d


def directional_backward(grad, q, k, *rest, **_):
    _normalize, masked, has_margin, _smoothing, precision, need_qk = rest[-6:]
    if not need_qk:
        return 0
    (m, d), n = q.shape, k.shape[0]
    return 2 * m * n * d * (_passes(q, precision) * (1 + _margin(has_margin, masked)) + 2 * _gemms(q))


def rank_forward(
    img, txt, all_img, all_txt, tau, gamma, eps, thr, offset, normalize, masked, has_margin, smoothing, precision, **_
):
    (m, d), n = img.shape, all_img.shape[0]
    return 2 * _passes(img, precision) * (2 + _margin(has_margin, masked)) * m * n * d


def rank_backward(grad, img, txt, all_img, *rest, **_):
    _normalize, masked, has_margin, _smoothing, precision, need_features = rest[-6:]
    if not need_features:
        return 0
    (m, d), n = img.shape, all_img.shape[0]
    return 2 * m * n * d * (_passes(img, precision) * (2 + _margin(has_margin, masked)) + 4 * _gemms(img))


def _family_products(has_margin, masked: bool, mask_query) -> int:
    """The family tile's products (``family_tiles``): q kᵀ, the margin's (γ ≠ 0, or a threshold on
    the margin factors' cosine), the mask captions' (a threshold with mask captions). Ids: none."""
    captions = bool(masked) and mask_query.dim() == 2
    return 1 + _margin(has_margin, bool(masked) and not captions) + int(captions)


def family_forward(q, k, a, b, mq, mk, qg, kg, tau, gamma, eps, thr, offset, normalize, masked, has_margin, *rest,
                   **_):  # fmt: skip
    (m, d), n = q.shape, k.shape[0]
    return 2 * _passes(q, precision=rest[-1]) * _family_products(has_margin, masked, mq) * m * n * d


def family_backward(grad, q, k, a, b, mq, *rest, **_):
    _normalize, masked, has_margin, _smoothing, precision, need_qk = rest[-6:]
    if not need_qk:
        return 0
    (m, d), n = q.shape, k.shape[0]
    return 2 * m * n * d * (_passes(q, precision) * _family_products(has_margin, masked, mq) + 2 * _gemms(q))


def _family_g(has_margin, masked: bool, image_text: bool) -> int:
    """The family loss's margin product (t̂ t̂ᵀ, t̂ n̂ᵀ): the text margin, or a threshold's cosine."""
    return _margin(bool(has_margin) and not image_text, masked)


def _family_score_macs(img, negatives, has_margin, masked: bool, image_text: bool) -> int:
    """Multiply-adds of one walk of the family loss's logits (forward, or dS): the N×N tile pairs
    plus the N×M block, each with the margin's product where :func:`_family_g` says."""
    (n, d), m = img.shape, negatives.shape[0]
    g = _family_g(has_margin, masked, image_text)
    return symmetric_score_macs(n, d, cfg.fwd_block_m(img.element_size()), g) + (1 + g) * n * m * d


def family_symmetric_forward(img, txt, negatives, groups, tau, gamma, eps, thr, normalize, masked, has_margin,
                             smoothing, precision, image_text, **_):  # fmt: skip
    return 2 * _passes(img, precision) * _family_score_macs(img, negatives, has_margin, masked, image_text)


def family_symmetric_backward(grad, img, txt, negatives, *rest, **_):
    _normalize, masked, has_margin, _smoothing, precision, image_text, need_features = rest[-7:]
    if not need_features:
        return 0
    (n, d), m = img.shape, negatives.shape[0]
    macs = _family_score_macs(img, negatives, has_margin, masked, image_text)
    return 2 * (_passes(img, precision) * macs + 2 * _gemms(img) * (n * n + n * m) * d)


FORMULAS = {
    "triton_symmetric_nll": symmetric_forward,
    "triton_symmetric_nll_backward": symmetric_backward,
    "triton_directional_nll": directional_forward,
    "triton_directional_nll_backward": directional_backward,
    "triton_rank_nll": rank_forward,
    "triton_rank_nll_backward": rank_backward,
}


def register_family() -> None:
    """Register the family operator's formulas (:mod:`.family`, once it exists)."""
    glue.register_flops("triton_family_directional_nll", family_forward)
    glue.register_flops("triton_family_directional_nll_backward", family_backward)


def register() -> None:
    """Register every formula with ``FlopCounterMode`` (once; the operators must exist)."""
    for name, formula in FORMULAS.items():
        glue.register_flops(name, formula)


def register_family_symmetric() -> None:
    """Register the family loss's formulas (:mod:`.family_sym`, once it exists)."""
    glue.register_flops("triton_family_nll", family_symmetric_forward)
    glue.register_flops("triton_family_nll_backward", family_symmetric_backward)
