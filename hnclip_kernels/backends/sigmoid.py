"""The sigmoid (SigLIP) kind's host algebra, shared by the fused backends (beside :mod:`.softmax`,
the softmax kind's): the columns k̂ = [captions; negatives], the operators' outputs, dL/ds and
dL/db from the forward's row sums, and the features' gradients through the normalisation.

A pair (i, j) has z_ij = s·w_ij + b with w_ij = v̂_i·k̂_j + γ·sg(h_ij)·[y_ij = −1], loss
softplus(−y_ij·z_ij) and logit gradient dz_ij = σ(z_ij) − [y_ij = 1], formed without
cancellation as −y·σ(−y·z) by the kernels. The forward also returns per row
Σ_j dz_ij·(s·w_ij) and Σ_j dz_ij (an upstream gradient of 1): z is linear in s and b, so
dL/ds = Σ_i g_i·Σ_j dz_ij·w_ij and dL/db = Σ_i g_i·Σ_j dz_ij need no second sweep.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from . import epilogue
from .outputs import fake


class SigmoidOut(NamedTuple):
    """A sigmoid operator's outputs, each (R,) in the compute dtype except ``rk`` ((C + M,)):
    the loss, then what its backward takes back."""

    rows: Tensor  # r_i = Σ_j softplus(−y_ij·z_ij)
    rv: Tensor  # 1/‖v_i‖ (ones without normalize)
    rk: Tensor  # 1/‖k_j‖ of the columns [captions; negatives]
    pos: Tensor  # s·v̂_i·k̂_{offset+i}: the positive's score, no margin, no bias
    ds_rows: Tensor  # Σ_j dz_ij·s·w_ij (upstream gradient 1)
    db_rows: Tensor  # Σ_j dz_ij

    @classmethod
    def fake(cls, img: Tensor, columns: int, dtype: torch.dtype) -> "SigmoidOut":
        return fake(cls, img, dtype, img.shape[0], rk=columns)


def columns(txt: Tensor, negatives: Tensor) -> Tensor:
    """k = [txt (C, D); negatives (M, D)] (txt itself when M = 0)."""
    return txt if negatives.shape[0] == 0 else torch.cat([txt, negatives])


def scale_bias_grads(
    g: Tensor, out: SigmoidOut, s: Tensor, logit_scale: Tensor, logit_bias: Tensor
) -> Tuple[Tensor, Tensor]:
    """(dL/ds, dL/db) in ``logit_scale``'s and ``logit_bias``'s dtypes and shapes for upstream row
    gradients ``g`` (R,): Σ g_i·ds_rows_i / s (the rows hold s·w) and Σ g_i·db_rows_i."""
    d_s = (g * out.ds_rows).sum() / s
    d_b = (g * out.db_rows).sum()
    return (
        d_s.to(logit_scale.dtype).reshape(logit_scale.shape).contiguous(),
        d_b.to(logit_bias.dtype).reshape(logit_bias.shape).contiguous(),
    )


def feature_grads(img: Tensor, txt: Tensor, negatives: Tensor, out: SigmoidOut, d_v: Tensor, d_k: Tensor,
                  normalize: bool) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dL/dimg, dL/dtxt, dL/dnegatives in their dtypes from dL/dv̂ (R, D) and dL/dk̂ (C + M, D)
    (the normalisation's chain rule of :func:`.epilogue.unnormalize_grad`)."""
    c = txt.shape[0]
    d_img = epilogue.unnormalize_grad(img, out.rv, d_v, normalize).to(img.dtype).contiguous()
    d_t, d_n = d_k[:c], d_k[c:]
    d_txt = epilogue.unnormalize_grad(txt, out.rk[:c], d_t, normalize).to(txt.dtype).contiguous()
    d_neg = epilogue.unnormalize_grad(negatives, out.rk[c:], d_n, normalize).to(negatives.dtype).contiguous()
    if not normalize:  # unnormalize_grad returns views of d_k then: an operator's outputs may not alias
        d_txt, d_neg = d_txt.clone(), d_neg.clone()
    return d_img, d_txt, d_neg


# The Triton operator packs its scalars as scale_bias = (s, b) and its columns as keys = [txt;
# negatives], and its forward returns the factors (2, R) = (Σ_j dz_ij·w_ij, Σ_j dz_ij) (w without s).


def packed_scale_bias_grad(g: Tensor, factors: Tensor) -> Tensor:
    """(dL/ds, dL/db) as a (2,) tensor in ``factors``' dtype: ``g`` (R,) the rows' upstream
    gradient, ``factors`` (2, R) the kernels' per-row (Σ dz·w, Σ dz)."""
    return (factors * g.to(factors.dtype)[None, :]).sum(dim=1)


def scaled_feature_grads(logit_scale: Tensor, shares, features, norms, normalize: bool):
    """(dL/dimg, dL/dkeys), each in its features' dtype: ``shares`` = (dS·K̂ (R, D), dSᵀ·V̂ (C + M, D))
    from the kernels (float32), scaled by s (``logit_scale``, a 0-dim tensor) and chained through
    x̂ = x / max(‖x‖, eps) where ``normalize`` (``features`` = (img, keys), ``norms`` their inverse
    norms)."""
    return tuple(
        epilogue.unnormalize_grad(x, r, d * logit_scale, normalize).to(x.dtype)
        for x, r, d in zip(features, norms, shares)
    )
