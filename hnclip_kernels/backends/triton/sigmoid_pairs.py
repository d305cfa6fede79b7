"""The sigmoid (SigLIP) loss on Triton: ``hnclip::triton_sigmoid_nll`` and its backward, their fakes,
and the public entry :func:`sigmoid_pairs_triton` (what ``backends.sigmoid_fn("triton")`` runs).

One operator for one process and a distributed rank alike: R image rows against C gathered captions
and M hard negatives, the keys [txt; negatives] (C + M, D), row i's positive at column offset + i.
The forward (``sigmoid_kernels._sig_fwd_kernel``) returns each row's loss and the factors of dL/ds,
dL/db (``backends.sigmoid``); the backward runs its kernels only for the features' gradients: the
InfoNCE directional walk (:func:`.backward._walk`: chunks of W = diag(a)·dS·diag(b) from
``_sig_dscore_kernel``, torch GEMMs, 16-bit W rounded per line with its compensation). Nothing of
size R × (C + M) is kept: the forward's partials (splits, 3, R), the backward's chunks
(``cfg.BWD_WORKSPACE_BYTES``).

Operator: ``triton_sigmoid_nll(img, keys, query_groups, key_groups, scale_bias, gamma, offset,
normalize, has_margin, margin, groups_positive, precision) -> (rows, rq, rk, factors)``: ids (0,)
when absent, ``scale_bias`` (2,) float32 (s, b), γ a 0-dim float64 tensor, ``margin`` the
:class:`hnclip_kernels.margin.Margin` code; the backward returns (d img, d keys, d scale_bias).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ...margin import Margin
from ...validation import resolve_precision
from .. import epilogue, glue, sigmoid
from . import config as cfg
from . import flops
from .backward import _modes, _walk
from .launch import USE_TRITON_OP
from .params import scalar32, tamed
from .scales import w_scales
from .sigmoid_kernels import launch_sig_dscore, launch_sig_fwd


def _setup(img: Tensor, keys: Tensor, query_groups: Tensor, key_groups: Tensor, scale_bias: Tensor, gamma: Tensor,
           flags: tuple, norms: tuple, offset: int):  # fmt: skip
    """What both kernels read: ((img, keys, margin_q), (rq, rk, r_mq), (s, b; γ or None), ids or None,
    the constexpr flags (HAS_MARGIN, OWN_SCORE, GROUPS_POSITIVE, PREC)). ``flags`` = (has_margin,
    margin code, groups_positive, precision). The text margin's rows are the rows' own captions,
    keys[offset + i]."""
    has_margin, margin, groups_positive, precision = flags
    rq, rk = norms
    r = img.shape[0]
    own_score = margin == Margin.IMAGE_TEXT.code
    text = has_margin and not own_score
    mq, r_mq = (keys[offset : offset + r], rk[offset : offset + r]) if text else (img, rq)
    groups = None
    if key_groups.shape[0] > 0:
        same = query_groups.dtype == key_groups.dtype
        groups = tuple(
            x.contiguous() for x in ((query_groups, key_groups) if same else (query_groups.long(), key_groups.long()))
        )
    scalars = (scale_bias.to(torch.float32).contiguous(), scalar32(gamma, img) if has_margin else None)
    constexprs = (has_margin, own_score, groups_positive, cfg.dot_precision(img.dtype, precision))
    return (img, keys, mq), (rq, rk, r_mq), scalars, groups, constexprs


def _sigmoid_nll(
    img: Tensor,
    keys: Tensor,
    query_groups: Tensor,
    key_groups: Tensor,
    scale_bias: Tensor,
    gamma: Tensor,
    offset: int,
    normalize: bool,
    has_margin: bool,
    margin: int,
    groups_positive: bool,
    precision: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rows (R,), 1/‖img‖ (R,), 1/‖keys‖ (N,), factors (2, R): Σ u·x̃, Σ u), float32."""
    r, n, d = img.shape[0], keys.shape[0], img.shape[1]
    norms = (epilogue.inv_norms(img, normalize), epilogue.inv_norms(keys, normalize))
    feats, per_row, scalars, groups, flags = _setup(
        img, keys, query_groups, key_groups, scale_bias, gamma, (has_margin, margin, groups_positive, precision),
        norms, offset,
    )  # fmt: skip
    if r == 0:
        return img.new_zeros((0,), dtype=torch.float32), *norms, img.new_zeros((2, 0), dtype=torch.float32)
    _, row_blocks, splits, per_split = cfg.fwd_grid(r, n, img.element_size(), False, img.device)
    part = torch.empty(splits, 3, r, device=img.device, dtype=torch.float32)
    shapes = (r, n, d, offset, per_split, cfg.n_bucket(n))
    launch_sig_fwd(flags, lambda _: (row_blocks, splits), feats, per_row, scalars, groups, part, shapes)
    # the splits' partials added in split order; two outputs, no views of one another
    return part[:, 0].sum(dim=0), *norms, part[:, 1:].sum(dim=0)


def _sigmoid_nll_fake(img, keys, *_):
    f32 = dict(dtype=torch.float32)
    r, n = img.shape[0], keys.shape[0]
    return (
        img.new_empty((r,), **f32),
        img.new_empty((r,), **f32),
        img.new_empty((n,), **f32),
        img.new_empty((2, r), **f32),
    )


def _sigmoid_nll_backward(
    grad: Tensor,
    img: Tensor,
    keys: Tensor,
    query_groups: Tensor,
    key_groups: Tensor,
    scale_bias: Tensor,
    gamma: Tensor,
    rq: Tensor,
    rk: Tensor,
    factors: Tensor,
    offset: int,
    normalize: bool,
    has_margin: bool,
    margin: int,
    groups_positive: bool,
    precision: str,
    need_features: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dL/dimg in img's dtype, dL/dkeys in keys', dL/d(s, b) (2,) in scale_bias's)."""
    g = grad.float().contiguous()
    d_sb = sigmoid.packed_scale_bias_grad(g, factors).to(scale_bias.dtype)
    if not need_features or img.shape[0] == 0:
        return torch.zeros_like(img), torch.zeros_like(keys), d_sb
    feats, (_, _, r_mq), scalars, groups, flags = _setup(
        img, keys, query_groups, key_groups, scale_bias, gamma, (has_margin, margin, groups_positive, precision),
        (rq, rk), offset,
    )  # fmt: skip
    round16, tail = _modes(img)
    scale = w_scales(img, keys, rq, rk, (g,), round16, tail)
    per_row = (rq, rk, r_mq, g * scale.a, scale.b)  # every chunk's alike

    def launch_chunk(bounds, buffers):
        launch_sig_dscore(flags, feats, per_row, scalars, groups, buffers, (*bounds, img.shape[1], offset))

    ((d_q, d_k),) = _walk(((img, keys, rq, rk),), [scale], offset, launch_chunk)
    d_img, d_keys = sigmoid.scaled_feature_grads(scalars[0][0], (d_q, d_k), (img, keys), (rq, rk), normalize)
    return d_img, d_keys, d_sb


def _sigmoid_grads_fake(grad, img, keys, qg, kg, scale_bias, *_):
    return img.new_empty(img.shape), keys.new_empty(keys.shape), scale_bias.new_empty(scale_bias.shape)


HNClipSigmoidTriton = glue.fused_op(
    "triton",
    "triton_sigmoid_nll",
    forward=_sigmoid_nll,
    forward_fake=_sigmoid_nll_fake,
    backward=_sigmoid_nll_backward,
    backward_fake=_sigmoid_grads_fake,
    tau_input=4,
    use_triton_op=USE_TRITON_OP,
)
flops.register_sigmoid()


def sigmoid_pairs_triton(
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
    precision: Optional[str] = None,
) -> Tensor:
    """Per-row sigmoid losses (R,) float32, fused (``hnclip::triton_sigmoid_nll``): the protocol and
    the result of :func:`hnclip_kernels.backends.pytorch.sigmoid_pairs.sigmoid_pairs_torch`.

    ``img`` (R, D), ``txt`` (C, D), ``negatives`` (M, D) or None: float32, bfloat16 or float16, one
    dtype (16-bit stays 16-bit in the kernels); ``logit_scale`` (s > 0) and ``logit_bias`` (or None:
    b = 0) 0-dim tensors; ``query_groups`` (R,), ``key_groups`` (C,) integer ids or None. Gradients
    reach img, txt, negatives (their dtypes), s and b (theirs). ``precision``: the tensor-core input
    precision for float32 features (``validation.FP32_PRECISIONS``; None: the default). Works under
    ``torch.compile(fullgraph=True)`` (a new s, b or γ does not recompile), ``torch.func`` and vmap
    (one call per batch entry); a second derivative raises the ``RuntimeError`` naming
    backend="torch". The checks are the public entry's (:func:`hnclip_kernels.siglip.sigmoid_rows`)."""
    keys = txt if negatives is None or negatives.shape[0] == 0 else torch.cat([txt, negatives])
    bias = torch.zeros_like(logit_scale) if logit_bias is None else logit_bias
    scale_bias = torch.stack([logit_scale.to(torch.float32).reshape(()), bias.to(torch.float32).reshape(())])
    has_margin = True if isinstance(gamma, Tensor) else gamma != 0.0
    ids = query_groups is not None and key_groups is not None and key_groups.shape[0] > 0
    no_id = torch.empty((0,), dtype=torch.long, device=img.device)
    out = glue.call(
        HNClipSigmoidTriton,
        torch.ops.hnclip.triton_sigmoid_nll,
        tamed(img, normalize),
        tamed(keys, normalize),
        query_groups if ids else no_id,
        key_groups if ids else no_id,
        scale_bias,
        glue.hyperparameter(gamma, img),
        int(offset),
        bool(normalize),
        has_margin,
        Margin.parse(margin).code,
        bool(groups_positive),
        resolve_precision(precision),
    )
    return out[0]
