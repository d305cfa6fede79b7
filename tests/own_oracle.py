"""The float64 oracle of each row's own negatives (``hn_clip_loss(negatives=(N, K, D),
negatives_mask=)``), written from the formula (docs/hard_negatives.md, "Each row's own
negatives") without calling the package, and the hypothesis draws of its tests.

i2t row i over x ∈ [t_1..t_N, n_i1..n_iK] (its own K only, the masked-out ones no columns):
Z_ix = (v_i·x + γ·h(i, x)·[x ≠ t_i]) / τ, h = sg(t_i·x) ("text") or sg(v_i·x) ("image_text");
t2i row k over the images as without negatives. Dropped: captions' cosine t_i·x ≥ ``threshold``
(x a caption or an own negative), equal group ids (caption columns only). ε spreads over each row's
kept classes, the positive included. A row with every column dropped has loss 0.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from family_oracle import MARGIN_FACTORS


def own_rows_f64(v, t, own, mask, tau, *, margin="text", gamma=0.5, label_smoothing=0.0, threshold=None,
                 group_ids=None):  # fmt: skip
    """Per-pair rows ½(CE_i2t_i + CE_t2i_i), dense, autograd kept; inputs already unit rows
    (float64): v, t (N, D), own (N, K, D), mask (N, K) bool (True: real)."""
    n, k = own.shape[:2]
    eye = torch.eye(n, dtype=torch.bool)
    qf, kf = MARGIN_FACTORS[str(margin)](v, t, v, t)
    # i2t: the N captions, then row i's own K
    h_cap = (qf @ t.T).detach().masked_fill(eye, 0.0)
    h_own = torch.einsum("nd,nkd->nk", qf.detach(), own.detach())
    z_i2t = torch.cat([(v @ t.T + gamma * h_cap) / tau, (torch.einsum("nd,nkd->nk", v, own) + gamma * h_own) / tau], 1)
    drop_i2t = torch.cat([eye, ~mask], dim=1)
    h_t2i = (t @ kf.T).detach().masked_fill(eye, 0.0)
    z_t2i = (t @ v.T + gamma * h_t2i) / tau
    drop_t2i = eye.clone()
    if threshold is not None:
        td = t.detach()
        drop_i2t |= torch.cat([td @ td.T, torch.einsum("nd,nkd->nk", td, own.detach())], 1) >= threshold
        drop_t2i |= td @ td.T >= threshold
    if group_ids is not None:
        same = group_ids[:, None] == group_ids[None, :]
        drop_i2t[:, :n] |= same
        drop_t2i |= same
    rows = []
    for z, drop in ((z_i2t, drop_i2t), (z_t2i, drop_t2i)):
        pos = z[:, :n].diagonal()
        is_pos = torch.zeros_like(drop)
        is_pos[:, :n] = eye
        gone = drop | is_pos
        empty = gone.all(dim=1)
        gaps = (z - pos[:, None]).masked_fill(gone, float("-inf")).masked_fill(empty[:, None], 0.0)
        nll = torch.logaddexp(torch.zeros_like(pos), torch.logsumexp(gaps, dim=1).masked_fill(empty, float("-inf")))
        kept = (~gone).sum(dim=1) + 1
        kept_mean = (z.masked_fill(gone, 0.0).sum(dim=1) + pos) / kept
        rows.append(nll + label_smoothing * (pos - kept_mean))
    return 0.5 * (rows[0] + rows[1])


@st.composite
def own_cases(draw, max_n=6, max_k=4):
    """(N, K, D, mask pattern name, seed): rows with 0 real negatives, all real, random."""
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max_k))
    d = draw(st.sampled_from([3, 8, 17]))
    pattern = draw(st.sampled_from(["all", "none", "first-empty", "random", "one"]))
    seed = draw(st.integers(0, 2**16))
    return n, k, d, pattern, seed


def own_inputs(n, k, d, pattern, seed, dtype=torch.float32, scale=1.0):
    """Features (N, D), own negatives (N, K, D) (padding entries zeros, as a collator pads) and the mask."""
    g = torch.Generator().manual_seed(seed)
    img, txt = (torch.randn(n, d, generator=g, dtype=torch.float64) * scale for _ in range(2))
    own = torch.randn(n, k, d, generator=g, dtype=torch.float64) * scale
    if pattern == "all":
        mask = torch.ones(n, k, dtype=torch.bool)
    elif pattern == "none":
        mask = torch.zeros(n, k, dtype=torch.bool)
    elif pattern == "first-empty":
        mask = torch.rand(n, k, generator=g) < 0.6
        mask[0] = False
    elif pattern == "one":
        mask = torch.zeros(n, k, dtype=torch.bool)
        mask[:, 0] = True
    else:
        mask = torch.rand(n, k, generator=g) < 0.5
    own = own.masked_fill(~mask[..., None], 0.0)
    return img.to(dtype), txt.to(dtype), own.to(dtype), mask


def difference_bounds(leaves, hats, d_hats, w, eps, plain_rows):
    """Each feature row's float64 scale for a float32 gradient's error: the magnitudes it is a
    difference of. The normalisation's backward projects dL/dx̂ off x̂ and divides by |x| (D = 3
    draws cancel there), and ε's uniform target cancels a negative's P (dS = g(P − ε/n)): with ε,
    the hard target's part (``plain_rows()``, the rows at ε = 0, times 1 − ε) and the rest apart.
    ``leaves``: the raw features; ``hats``: their unit rows; ``d_hats``: dL/dx̂; ``w``: the upstream."""
    parts = [g.abs() for g in d_hats]
    if eps:
        hard = torch.autograd.grad(((1.0 - eps) * plain_rows() * w).sum(), hats)
        parts = [h.abs() + (g - h).abs() for g, h in zip(d_hats, hard)]
    return [p / x.norm(dim=-1, keepdim=True).clamp_min(1e-300) for p, x in zip(parts, leaves)]


def row_error(got, want, bound=None) -> float:
    """Row i's error over the norm of its float64 value, or over ``bound``'s row
    (:func:`difference_bounds`, at least as large) where that is given; rows under 1e-6 of the
    largest compared against that floor."""
    got, want = got.double(), want.double()
    if got.dim() == 0:
        return ((got - want).abs() / want.abs().clamp_min(1e-300)).item()
    diff = (got - want).reshape(got.shape[0], -1).norm(dim=1)
    scale = (want if bound is None else bound).reshape(want.shape[0], -1).norm(dim=1)
    floor = 1e-6 * scale.max().clamp_min(1e-300)
    return (diff / torch.maximum(scale, floor)).max().item()
