"""``hnclip::cpp_sigmoid_nll``: the sigmoid (SigLIP) loss on the C++ kernels, the operator body
and its public entry :func:`sigmoid_pairs_cpp` (what ``backends.sigmoid_fn("cpp")`` returns).

R image rows against the columns k̂ = [txt (C); negatives (M)], row i's positive at caption
``offset + i``: one process has R = C = N and offset 0, a distributed rank its local rows
against the gathered captions. The raw kernels (``csrc/sigmoid_pairs.cpp``, the kind in
``csrc/sigmoid.h``) sweep the logit tiles without an R×(C + M) buffer: the forward (one product;
two with group positives under a margin) returns the rows' losses and their sums for dL/ds and
dL/db (:mod:`..sigmoid`), the backward recomputes the tiles and applies dS to v̂ and k̂ (three
products; four). Registered with its backward, autograd formula, fakes and vmap rule by
:func:`..glue.fused_op`; s takes the formula's τ slot and b rides with the features, so a
backward asked for b alone still sweeps (a frozen-tower rarity).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ...margin import Margin
from ...numerics import compute_dtype
from .. import epilogue, glue, sigmoid
from ..outputs import schema
from ..sigmoid import SigmoidOut
from .layouts import Saved, SigmoidFlags, SigmoidInputs, operator
from .raw import RAW, value_of

_GRADS = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # dL/dimg, dL/dtxt, dL/dnegatives, dL/db, dL/ds


def _raw_args(x: SigmoidInputs, f: SigmoidFlags, s: Tensor, b: Tensor) -> tuple:
    """The raw kernels' arguments after the features, pos (and g): ``scale, bias, offset, captions,
    gamma, margin, qg, kg, groups_positive``."""
    ids = x.query_groups.numel() > 0
    qg, kg = (x.query_groups, x.key_groups) if ids else (None, None)
    return s, b, f.offset, x.txt.shape[0], value_of(x.gamma), f.margin, qg, kg, f.groups_positive


def _scalars(x: SigmoidInputs):
    """(compute dtype, s, b): the scale and bias detached in the compute dtype."""
    dt = compute_dtype(x.img.dtype)
    return dt, x.logit_scale.detach().to(dt), x.logit_bias.detach().to(dt)


@operator(SigmoidInputs, SigmoidFlags, returns=schema(SigmoidOut))
def _forward(x: SigmoidInputs, f: SigmoidFlags):
    """Per-row losses (R,) and what the backward needs (:class:`..sigmoid.SigmoidOut`)."""
    dt, s, b = _scalars(x)
    keys = sigmoid.columns(x.txt, x.negatives)
    rv, rk = epilogue.inv_norms(x.img, f.normalize, dt), epilogue.inv_norms(keys, f.normalize, dt)
    v_hat, k_hat = epilogue.scaled(x.img, rv, dt), epilogue.scaled(keys, rk, dt)
    pos = epilogue.positive_logits(v_hat, k_hat, f.offset, s)  # s·v̂_i·k̂_{offset+i}: no margin
    rows, ds_rows, db_rows = RAW.cpp_raw_sigmoid_fwd(v_hat, k_hat, pos, *_raw_args(x, f, s, b))
    return SigmoidOut(rows, rv, rk, pos, ds_rows, db_rows)


@operator(SigmoidInputs, SigmoidFlags, returns=schema(SigmoidOut))
def _forward_fake(x: SigmoidInputs, f: SigmoidFlags):
    return SigmoidOut.fake(x.img, x.txt.shape[0] + x.negatives.shape[0], compute_dtype(x.img.dtype))


_BACKWARD = (("grad", Tensor), SigmoidInputs, Saved(SigmoidOut), SigmoidFlags, ("need_features", bool))


@operator(*_BACKWARD, returns=_GRADS)
def _backward(grad: Tensor, x: SigmoidInputs, out: SigmoidOut, f: SigmoidFlags, need_features: bool):
    """(dL/dimg, dL/dtxt, dL/dnegatives in their dtypes, dL/db and dL/ds in the scalars' dtypes
    and shapes)."""
    dt, s, b = _scalars(x)
    g = grad.to(dt).contiguous()
    d_s, d_b = sigmoid.scale_bias_grads(g, out, s, x.logit_scale, x.logit_bias)
    if not need_features:  # s alone wants a gradient: the forward's row sums hold it
        return (*(t.new_zeros(t.shape) for t in (x.img, x.txt, x.negatives)), d_b, d_s)
    keys = sigmoid.columns(x.txt, x.negatives)
    v_hat, k_hat = epilogue.scaled(x.img, out.rv, dt), epilogue.scaled(keys, out.rk, dt)
    d_v, d_k = RAW.cpp_raw_sigmoid_bwd(v_hat, k_hat, out.pos, s, b, g, *_raw_args(x, f, s, b)[2:])
    del v_hat, k_hat, keys  # peak memory: the chain rule forms x̂ again
    return (*sigmoid.feature_grads(x.img, x.txt, x.negatives, out, d_v, d_k, f.normalize), d_b, d_s)


@operator(*_BACKWARD, returns=_GRADS)
def _backward_fake(grad, x: SigmoidInputs, out, f, need_features):
    return tuple(t.new_empty(t.shape) for t in (x.img, x.txt, x.negatives, x.logit_bias, x.logit_scale))


_FIELDS = SigmoidInputs._fields
SigmoidNLL = glue.fused_op(
    "cpp",
    "cpp_sigmoid_nll",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    tau_input=_FIELDS.index("logit_scale"),
    feature_inputs=tuple(_FIELDS.index(n) for n in ("img", "txt", "negatives", "logit_bias")),
    device_types="cpu",
)


def sigmoid_pairs_cpp(
    img: Tensor,
    txt: Tensor,
    logit_scale: Tensor,
    logit_bias: Optional[Tensor],
    *,
    offset: int = 0,
    gamma=0.5,
    margin=Margin.TEXT,
    normalize: bool = True,
    negatives: Optional[Tensor] = None,
    query_groups: Optional[Tensor] = None,
    key_groups: Optional[Tensor] = None,
    groups_positive: bool = False,
) -> Tensor:
    """C++ counterpart of :func:`hnclip_kernels.backends.pytorch.sigmoid_pairs.sigmoid_pairs_torch`
    (same keyword-only protocol and result): per-row sigmoid losses (R,), float32 (float64 for
    float64 features; 16-bit features computed in float32, their gradients in their dtypes).

    ``img`` (R, D), ``txt`` (C, D) with offset + R ≤ C, ``negatives`` (M, D) or None; ``logit_scale``
    s > 0 and ``logit_bias`` b 0-dim tensors (None: b = 0); ``query_groups`` (R,), ``key_groups``
    (C,) integer ids or None; ``gamma`` a float or 0-dim tensor (no gradient; under
    ``torch.compile`` a new value does not recompile). Gradients reach img, txt, negatives, s, b.

    Raises:
        ValueError: an offset outside [0, C − R].
        RuntimeError: other shapes that do not fit (the raw kernels' checks), non-CPU tensors.
    """
    if not 0 <= offset <= txt.shape[0] - img.shape[0]:
        raise ValueError(f"need 0 <= offset <= C - R, got offset {offset}, R {img.shape[0]}, C {txt.shape[0]}")
    if negatives is None:
        negatives = img.new_empty((0, img.shape[1]))
    bias = torch.zeros_like(logit_scale) if logit_bias is None else logit_bias
    ids = query_groups is not None
    out = SigmoidOut._make(
        glue.call(
            SigmoidNLL,
            torch.ops.hnclip.cpp_sigmoid_nll,
            img,
            txt,
            negatives,
            _ids(query_groups, img) if ids else _ids(None, img),
            _ids(key_groups, img) if ids else _ids(None, img),
            logit_scale,
            bias,
            glue.hyperparameter(gamma, img),
            int(offset),
            bool(normalize),
            Margin(margin).code,
            bool(groups_positive),
        )
    )
    return out.rows


def _ids(groups, like):
    """Group ids as the operator takes them: int64, or an empty int64 tensor when absent."""
    if groups is None:
        return torch.empty((0,), dtype=torch.long, device=like.device)
    return groups.to(torch.long)
