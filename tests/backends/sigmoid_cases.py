"""Shared inputs and checks of the fused sigmoid (SigLIP) backends' tests: a backend's
``sigmoid_pairs_*`` entry against the float64 oracle (tests/sigmoid_oracle.py), row by row, every
gradient (img, txt, negatives, s, b) with an upstream gradient that differs per row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sigmoid_oracle import sigmoid_rows_f64

from hnclip_kernels.margin import Margin

# per row, relative: float64; float32 (rows, gradient rows) with the lead's absolute floor of the
# gradients (a row the normalisation's projection cancels keeps float32 rounding of ~eps·s·columns)
TOL = {torch.float64: (1e-11, 1e-9), torch.float32: (2e-5, 1e-4)}


def features(n, d, seed, dtype=torch.float32, clusters=None, spread=0.02):
    """(n, d) random features; ``clusters``: rows near that many centres (near-duplicates)."""
    g = torch.Generator().manual_seed(seed)
    if clusters is None:
        return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    centres = torch.randn(clusters, d, generator=g, dtype=torch.float64)
    x = centres[torch.arange(n) % clusters] + spread * torch.randn(n, d, generator=g, dtype=torch.float64)
    return x.to(dtype)


def saturated(r, c, m, d, dtype, offset=0, seed=0):
    """Images next to their captions (cosine ≈ 1), the first ``c // 2`` captions in clusters of 3
    near-duplicates (cosine ≈ 0.9998), the rest apart (D = 64: cosines ≲ 0.4): at s = 100, b = −80
    every positive sits at z ≈ 20 (dL/dz ≈ −2e-9, which a float32 σ(z) − 1 rounds to 0); the
    clusters' rows have hard negatives, the others are saturated (loss ≈ 2e-9)."""
    near = features(c // 2, d, seed, torch.float64, clusters=max(1, c // 6), spread=0.02)
    t = F.normalize(torch.cat([near, features(c - c // 2, d, seed + 3, torch.float64)]), dim=1)
    v = F.normalize(t + 0.002 * features(c, d, seed + 1, torch.float64), dim=1)
    return v[offset : offset + r].to(dtype), t.to(dtype), features(m, d, seed + 2, dtype)


def run(fn, img, txt, neg, scale, bias, *, offset=0, gamma=0.5, margin="text", normalize=True, ids=None,
        positive=False, loss_scale=1.0, seed=0):  # fmt: skip
    """(rows, oracle rows, {name: grad}, {name: oracle grad}, {name: row norms}) of ``fn`` (a ``sigmoid_pairs_*``
    entry) on these values; ``ids`` = (query_groups, key_groups) or None; ``bias`` None: b = 0.
    The backward is taken of Σ_i u_i·r_i·``loss_scale``, u drawn in [½, 1½)."""
    dt = torch.float64 if img.dtype == torch.float64 else torch.float32
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt, neg)]
    s = torch.tensor(scale, dtype=dt, requires_grad=True)
    b = None if bias is None else torch.tensor(bias, dtype=dt, requires_grad=True)
    qg, kg = ids if ids is not None else (None, None)
    kw = dict(offset=offset, gamma=gamma, normalize=normalize, query_groups=qg, key_groups=kg, groups_positive=positive)
    got = fn(leaves[0], leaves[1], s, b, negatives=leaves[2] if neg.shape[0] else None, margin=Margin(margin), **kw)
    u = 0.5 + torch.rand(img.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    wants = [x.detach().double().requires_grad_(True) for x in (*leaves, s)]
    wb = torch.tensor(0.0 if bias is None else bias, dtype=torch.float64, requires_grad=True)
    want = sigmoid_rows_f64(wants[0], wants[1], wants[3], wb, negatives=wants[2], margin=margin, **kw)
    names = ["img", "txt", "negatives", "s"] + (["b"] if bias is not None else [])
    got_leaves = [*leaves, s] + ([b] if bias is not None else [])
    gg = torch.autograd.grad((got.double() * u * loss_scale).sum(), got_leaves, allow_unused=True)
    wg = torch.autograd.grad((want * u * loss_scale).sum(), [*wants, wb], allow_unused=True)
    gg = [torch.zeros_like(x) if g is None else g for g, x in zip(gg, got_leaves)]
    wg = [torch.zeros_like(x) if g is None else g for g, x in zip(wg, [*wants, wb])]
    norms = {n: x.detach().double().norm(dim=1) for n, x in zip(names, leaves)}
    return got, want, dict(zip(names, gg)), dict(zip(names, wg)), norms


def assert_rows(got, want, gg, wg, norms, dtype, scale, columns, floor=True):
    """Each loss row and each gradient row within ``TOL`` of float64 (16-bit features: rows 1e-3,
    every representable gradient row within 2× its rounding error + 2e-3); dL/ds, dL/db against
    float64 with an absolute floor of rounding over the batch. ``floor``: a gradient row may also
    be within eps·s·columns/‖x_i‖ (the rounding the normalisation's projection leaves where it
    cancels the row, D = 1: the truth is 0); off, each row stands alone (the saturated rows)."""
    lowp = dtype in (torch.float16, torch.bfloat16)
    row_tol, grad_tol = (1e-3, None) if lowp else TOL[dtype]
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    eps, subnormal = torch.finfo(compute).eps, 4 * torch.finfo(compute).tiny  # below: no relative precision
    for i in range(got.shape[0]):
        diff = abs(got[i].item() - want[i].item())
        assert diff <= row_tol * abs(want[i].item()) or diff <= subnormal, (
            f"row {i}: {got[i].item():.9e} vs {want[i].item():.9e}"
        )
    for name, g in gg.items():
        w = wg[name]
        assert torch.isfinite(g).all(), f"d {name} not finite"
        if g.dim() == 0:
            tiny = 10 * eps * got.shape[0] * columns  # each pair's dz rounded, |dz| ≤ 1
            assert abs(g.item() - w.item()) <= 1e-5 * abs(w.item()) + tiny, f"d {name}: {g.item()} vs {w.item()}"
            continue
        assert g.dtype == dtype, f"d {name}: dtype {g.dtype}"
        reach = 10 * eps * scale * columns / norms[name].clamp_min(1e-30) if floor else None
        for i in range(g.shape[0]):
            gi, wi = g[i].double(), w[i]
            norm, diff = wi.norm().item(), (gi - wi).norm().item()
            bound = grad_tol
            if lowp:
                rounded = wi.to(dtype).double()
                if not rounded.any():
                    continue  # not representable in the dtype
                bound = 2 * (rounded - wi).norm().item() / norm + 2e-3
            tiny = max(subnormal * scale * columns, 0.0 if reach is None else reach[i].item())
            assert diff <= bound * norm or diff <= tiny, (
                f"d {name} row {i}: relative {diff / max(norm, 1e-300):.3e} > {bound:.1e}"
            )
