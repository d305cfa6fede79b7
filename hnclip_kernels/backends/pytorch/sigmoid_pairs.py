"""Pure-PyTorch sigmoid (SigLIP) loss with the adaptive margin: the reference of the fused
sigmoid operators (``hnclip::cpp_sigmoid_nll``, ``hnclip::triton_sigmoid_nll``).

It materialises the (R, C + M) logits; autograd supplies every gradient. One process calls it
with R = C = N and ``offset`` 0; a rank of a distributed job with its R local image rows
against the C gathered captions, its rows' positives at ``offset + i``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...margin import Margin
from ...numerics import compute_dtype, ieee_float32, normalized, softplus


def sigmoid_pairs_torch(
    img: torch.Tensor,
    txt: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: Optional[torch.Tensor],
    *,
    offset: int = 0,
    gamma: float = 0.5,
    margin: Margin = Margin.TEXT,
    normalize: bool = True,
    negatives: Optional[torch.Tensor] = None,
    query_groups: Optional[torch.Tensor] = None,
    key_groups: Optional[torch.Tensor] = None,
    groups_positive: bool = False,
    precision: Optional[str] = None,
) -> torch.Tensor:
    """Per-row sigmoid losses r_i = Σ_j softplus(−y_ij·z_ij) (SigLIP, Zhai et al. 2023), shape (R,).

    With v̂ = img (R, D), k̂ the columns [txt (C, D); negatives (M, D)], L2-normalised when
    ``normalize``, s = ``logit_scale`` and b = ``logit_bias`` (0-dim tensors; None is b = 0)::

        z_ij = s·(v̂_i·k̂_j + γ·sg(h_ij)·[y_ij = −1]) + b

    y_ij = +1 on the positive (j = offset + i) and, with ``groups_positive``, on every caption
    column of the row's group; −1 elsewhere (the negatives' columns always). Without
    ``groups_positive`` a caption column of the row's group other than its positive is masked
    (no loss, no gradient). h_ij is the margin's detached score: ``Margin.TEXT`` t̂_{offset+i}·k̂_j
    (the row's own caption against the column), ``Margin.IMAGE_TEXT`` v̂_i·k̂_j.

    Computes in float32 (float64 for float64 features). ``precision`` is the Triton backend's and
    ignored here. Gradients reach img, txt, negatives, s and b.
    """
    del precision
    dt = compute_dtype(img.dtype)
    v = img.to(dt)
    keys = txt.to(dt) if negatives is None else torch.cat([txt, negatives]).to(dt)
    if normalize:
        v, keys = normalized(v), normalized(keys)
    r, c = img.shape[0], txt.shape[0]
    cols = torch.arange(keys.shape[0], device=img.device)
    rows = torch.arange(r, device=img.device)
    positive = cols[None, :] == (rows + offset)[:, None]
    masked = torch.zeros_like(positive)
    if query_groups is not None:
        same = torch.zeros_like(positive)
        same[:, :c] = query_groups[:, None] == key_groups[None, :]
        if groups_positive:
            positive = positive | same
        else:
            masked = same & ~positive
    with ieee_float32(img.device):
        scores = v @ keys.T
        if margin is Margin.TEXT:
            h = keys[offset : offset + r] @ keys.T
        else:
            h = scores
    h = h.detach()
    s = logit_scale.to(dt)
    z = s * torch.where(positive, scores, scores + gamma * h)
    if logit_bias is not None:
        z = z + logit_bias.to(dt)
    y = torch.where(positive, 1.0, -1.0).to(dt)
    pair = softplus(-y * z).masked_fill(masked, 0.0)
    return pair.sum(dim=1)
