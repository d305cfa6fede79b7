"""A float64 oracle of the sigmoid (SigLIP) loss with the adaptive margin, written from the
formula (docs/siglip.md), independently of the torch backend: one row at a time, its pairs'
softplus in closed form, gradients by autograd in float64.

    z_ij = s·(v̂_i·k̂_j + γ·sg(h_ij)·[y_ij = −1]) + b,   r_i = Σ_j log(1 + exp(−y_ij·z_ij))

over the columns k = [txt; negatives]; y = +1 on the positive j = offset + i (and, with
``groups_positive``, the caption columns of the row's group), −1 elsewhere; without
``groups_positive`` the row's group's other caption columns are dropped. h: "text" t̂_{offset+i}·k̂_j,
"image_text" v̂_i·k̂_j.
"""

from __future__ import annotations

import torch


def _unit(x, normalize):
    x = x.double()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-300) if normalize else x


def _log1p_exp(x):
    """log(1 + e^x) without overflow, in float64; its derivative e^x / (1 + e^x) everywhere (a
    max(x, 0) + log1p(e^-|x|) form gets autograd's subgradient 0 of |x| and max at x = 0)."""
    return torch.logaddexp(torch.zeros_like(x), x)


# h(i, j) per margin kind, from (v̂_i, the row's own caption k̂_{offset+i}, column k̂_j), all
# detached: a kind missing here fails tests/api/test_margin_kinds.py with a KeyError
SIGMOID_MARGIN = {
    "text": lambda v, own, k: own @ k,
    "image_text": lambda v, own, k: v @ k,
}


def sigmoid_rows_f64(img, txt, logit_scale, logit_bias=None, *, negatives=None, offset=0, gamma=0.5,
                     margin="text", normalize=True, query_groups=None, key_groups=None,
                     groups_positive=False):  # fmt: skip
    """(R,) float64 row losses; differentiable in float64 wrt every float input that requires grad
    (pass float64 leaves to read the oracle's gradients). ``logit_scale`` / ``logit_bias`` may be
    (R, C + M) per pair, which reads each pair's term of ds and db (a float32 sum over the pairs is
    accurate to eps·Σ|term|, not to eps·|Σ term|)."""
    v = _unit(img, normalize)
    cols = [txt] if negatives is None or negatives.shape[0] == 0 else [txt, negatives]
    k = _unit(torch.cat([c.double() for c in cols]), normalize)
    c = txt.shape[0]
    s = torch.as_tensor(logit_scale).double()
    b = torch.zeros((), dtype=torch.float64) if logit_bias is None else torch.as_tensor(logit_bias).double()
    rows = []
    for i in range(v.shape[0]):
        own = k[offset + i].detach()
        total = torch.zeros((), dtype=torch.float64)
        for j in range(k.shape[0]):
            same = query_groups is not None and j < c and int(query_groups[i]) == int(key_groups[j])
            if j == offset + i or (same and groups_positive):
                y = 1.0
            elif same:
                continue  # masked: neither a positive nor a negative
            else:
                y = -1.0
            score = v[i] @ k[j]
            if y < 0:
                score = score + gamma * SIGMOID_MARGIN[str(margin)](v[i].detach(), own, k[j].detach())
            s_ij = s[i, j] if s.dim() == 2 else s
            b_ij = b[i, j] if b.dim() == 2 else b
            total = total + _log1p_exp(-y * (s_ij * score + b_ij))
        rows.append(total)
    return torch.stack(rows)
