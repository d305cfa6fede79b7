"""FLOPs of the Triton operators for ``torch.utils.flop_counter.FlopCounterMode``.

The operators are opaque to the mode (it runs a custom operator with itself popped off the mode
stack, so it never sees the kernels' ``tl.dot`` nor the backward's torch GEMMs inside): without
these formulas it counts 0 for the loss. Each formula states the loss's useful products in the
real shapes (:func:`..glue.logit_flops`, the convention of both fused backends: the C++ operators
state the same for the same call): with P = 2·R·C·D for a logit matrix of R rows × C columns,

* the loss (``triton_symmetric_nll``), N × N (both directions read one S): forward P, backward 2 P;
* the directional op (``triton_directional_nll``), M × N: forward P, backward 2 P;
* a rank's op (``triton_rank_nll``), both directions of M × N, two logit matrices: forward 2 P,
  backward 4 P;
* with the hard-negative family's M negatives the loss's i2t rows cover N + M columns: N × (N + M)
  (both directions read the N × N part), forward P, backward 2 P;
* each row's K own negatives (``own_negatives`` (N, K, D), host-side products in
  :mod:`..own_negatives`): N·K more logits, forward 2·N·K·D (v̂_i·n̂_ik), backward 4·N·K·D
  (dS·n̂ and dS ⊗ v̂); the margin's detached t̂_i·n̂_ik and a threshold's caption cosines are not
  stated, as the N × N margin is not;
* ``reduction="directions"``: the directional op once a direction (i2t N × (N + M), t2i N × N),
  twice with ε > 0 (the unsmoothed rows): the sum of those calls' formulas, about twice the
  shared-tile loss's (``tests/backends/test_flop_formulas.py``); with each row's own negatives the
  i2t call runs over the N captions and the own columns are autograd einsums outside any
  operator (``backends.directions.own_block``), which the mode counts as executed: 2·N·K·D
  forward (v̂·n̂), 2·N·K·D more for the "text" margin's detached t̂·n̂ and for a threshold's caption
  cosines, 4·N·K·D backward;
* ``group_mode="supcon"``/``"mil_nce"``: the formulas above (the host's positives' pass,
  :mod:`..positives`, forms entries of the same logit matrix: 0 of its own);
* a backward asked for dτ alone (no feature gradient): 0.

Not stated: what the kernels execute beyond that: the margin's and the mask's products, the
backward's recomputation of the logits and its torch GEMMs' fp16 tails, float32 tensor-core passes
(tf32x3: 3 a product) and tile padding. ``python -m tools.work`` counts that work from the kernels'
own ``tl.dot`` calls (its ``total_flops``, beside these formulas' ``formula_flops``).
"""

from __future__ import annotations

from .. import glue


def rank_forward(img, txt, all_img, all_txt, *_, **__):
    """i2t's local images against all captions and t2i's local captions against all images."""
    return 2 * glue.forward_flops(img, all_txt)


def rank_backward(grad, img, txt, all_img, all_txt, *rest, **_):
    return 2 * glue.backward_flops(grad, img, all_txt, rest[-1])


FORMULAS = {
    "triton_symmetric_nll": glue.symmetric_forward_flops,
    "triton_symmetric_nll_backward": glue.symmetric_backward_flops,
    "triton_directional_nll": glue.forward_flops,
    "triton_directional_nll_backward": glue.backward_flops,
    "triton_rank_nll": rank_forward,
    "triton_rank_nll_backward": rank_backward,
}


def register() -> None:
    """Register every formula with ``FlopCounterMode`` (once; the operators must exist)."""
    glue.register_flops(FORMULAS)


# the sigmoid loss's operator (``triton_sigmoid_nll``, :mod:`.sigmoid_pairs`): R images against the
# C + M keys [captions; negatives], one logit matrix: forward P, backward 2 P (0 for dL/ds, dL/db alone)
SIGMOID_FORMULAS = {
    "triton_sigmoid_nll": glue.forward_flops,
    "triton_sigmoid_nll_backward": glue.backward_flops,
}


def register_sigmoid() -> None:
    """Register the sigmoid operator's formulas (once it exists)."""
    glue.register_flops(SIGMOID_FORMULAS)
