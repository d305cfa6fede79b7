"""FLOPs of the C++ operators for ``torch.utils.flop_counter.FlopCounterMode``.

The mode runs an operator with itself popped off the mode stack, so it never sees the BLAS
products inside the kernels and counts 0 without these formulas. Each formula states the loss's
useful products in the real shapes (:func:`..glue.logit_flops`, the convention of both fused
backends: Triton states the same for the same call): with P = 2·R·C·D for a logit matrix of R
rows × C columns,

* the loss (``cpp_symmetric_nll``, raw ``cpp_raw_symmetric_fwd``/``_bwd``), N × (N + M) with the
  family's M negatives (both directions read the N × N part of S): forward P, backward 2 P;
* the directional op (``cpp_directional_nll``, raw ``cpp_raw_directional_fwd``/``_bwd``), M × N
  (the family's: N + K key columns): forward P, backward 2 P;
* the sigmoid loss (``cpp_sigmoid_nll``, raw ``cpp_raw_sigmoid_fwd``/``_bwd``), R × (C + M):
  forward P, backward 2 P;
* each row's K own negatives (``own_negatives`` (N, K, D) of ``cpp_symmetric_nll``): N·K more
  logits, forward 2·N·K·D, backward 4·N·K·D (the host block's products, not the margin's);
* ``reduction="directions"``: the directional op's formula once a direction (twice with ε > 0);
  with own negatives plus their host einsums as the mode counts them (``triton/flops.py``);
* ``group_mode="supcon"``/``"mil_nce"``: the formulas above (the positives' pass,
  ``cpp_raw_positive_fwd``/``_bwd``, forms entries of the same logit matrix: 0 of its own);
* a backward asked for dτ (the sigmoid loss: ds) alone (no feature gradient): 0.

What the kernels execute differs by call (the margin folded into the left factor, or a second
factor of width D; the captions' tile under masking; the backward's recomputation; the negatives'
shares formed in the forward when a gradient will follow; under a positive ``group_mode`` the
positives' pass, one row dot per same-group pair in the forward and two in the backward, entries
of the same logit matrix, and no forward shares, so the backward recomputes): ``tests/backends/test_cpp_flops.py``
records it with ``torch.profiler`` beside these counts.
"""

from __future__ import annotations

from .. import glue

FORMULAS = {
    "cpp_directional_nll": glue.forward_flops,
    "cpp_directional_nll_backward": glue.backward_flops,
    "cpp_symmetric_nll": glue.symmetric_forward_flops,
    "cpp_symmetric_nll_backward": glue.symmetric_backward_flops,
    "cpp_raw_directional_fwd": glue.forward_flops,
    # a raw backward kernel always forms the feature gradients (or has them from the forward's shares)
    "cpp_raw_directional_bwd": lambda q_hat, k_hat, *_, **__: glue.backward_flops(None, q_hat, k_hat, True),
    "cpp_raw_symmetric_fwd": glue.forward_flops,
    "cpp_raw_symmetric_bwd": lambda v_hat, t_hat, *_, **__: glue.backward_flops(None, v_hat, t_hat, True),
    # the positives' pass (group_mode supcon / mil_nce): entries of the logit matrix the kernels beside
    # it state already (their tiles form and mask them), so no useful product of its own
    "cpp_raw_positive_fwd": lambda *_, **__: 0,
    "cpp_raw_positive_bwd": lambda *_, **__: 0,
    # the sigmoid loss: img against [txt; negatives] (the raw kernels: v̂ against k̂, all columns)
    "cpp_sigmoid_nll": glue.family_forward_flops,
    "cpp_sigmoid_nll_backward": glue.family_backward_flops,
    "cpp_raw_sigmoid_fwd": glue.forward_flops,
    "cpp_raw_sigmoid_bwd": lambda v_hat, k_hat, *_, **__: glue.backward_flops(None, v_hat, k_hat, True),
}


def register() -> None:
    """Register every formula with ``FlopCounterMode`` (once; the operators must exist)."""
    glue.register_flops(FORMULAS)
