"""The float64 oracle of ``reduction="directions"`` (each direction's rows and LSE) and the check
every backend's test runs against it (tests/api/test_directions.py, the distributed test, the
FastCLIP example's test).

The oracle forms each direction's dense logits (positive included) straight from the formula and
writes each row as a cross-entropy against its target distribution: ``loss_i = −Σ_{k kept} y_ik
log p_ik``, y = (1 − ε)·onehot(pos) + ε/n_i over the row's n_i kept columns, and ``LSE_i = Z_i,pos −
log p_i,pos`` (docs/api.md, "Per-direction rows"), log p formed from the gaps to the positive so a
saturated row's loss of 1e-40 is not lost next to its LSE of 100. Autograd gives the gradients.
With each row's own negatives (``own`` (N, K, D), ``own_mask`` (N, K)) i2t row i's columns are
its N captions plus its own real K (docs/hard_negatives.md, "Each row's own negatives"); t2i rows
are unchanged.

Tolerances (:data:`VALUE_TOL`, :data:`GRAD_TOL`), relative per row (each row of each output, each
row of each feature gradient against that row, dτ as a scalar): float64 1e-10 (gradients 1e-9),
float32 1e-5 (gradients 1e-4), 16-bit inputs (the oracle on the 16-bit values; the rows in
float32) 1e-5 and gradients 2^-7 (bf16) / 2^-10 (fp16), rounded once to the input dtype. A
gradient row's error is relative to max(its norm, 1% of the largest gradient row of any feature):
a random signed weighting can cancel a row's gradient far below the terms whose rounding it
carries (a draw with N = 1 cancelled d txt to 3e-4 of d img, and float32 then leaves 1.5e-4 of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hnclip_kernels import hn_clip_loss

VALUE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
FIELDS = ("i2t", "t2i", "lse_i2t", "lse_t2i")


def direction_rows_f64(img, txt, tau, *, negatives=None, group_ids=None, margin="text", gamma=0.5,
                       label_smoothing=0.0, normalize=True, threshold=None, own=None, own_mask=None,
                       group_mode="mask"):  # fmt: skip
    """(i2t, t2i, lse_i2t, lse_t2i), each (N,), in float64 with autograd, from the formula.

    i2t row i over x ∈ [t_1..t_N, n_1..n_M, o_i1..o_iK]: Z_ix = (v_i·x + γ·h_ix·[x ≠ t_i]) / τ,
    h = sg(t_i·x) ("text") or sg(v_i·x) ("image_text"), o_ik row i's own negatives (``own``
    (N, K, D); ``own_mask`` (N, K) False: no column); t2i row k over the images: Z_ki = (t_k·v_i +
    γ·h'_ki·[i ≠ k]) / τ, h' = sg(t_k·t_i) or sg(v_i·t_k). A column other than the positive is
    dropped when the unit captions' cosine (t̂_i·x̂) is ≥ ``threshold`` or (caption columns only) the
    ids are equal.

    ``group_mode`` "supcon" / "mil_nce": equal ids make the caption (image) columns positives P(i)
    instead (no margin, never dropped by the threshold), C(i) = P(i) ∪ the kept columns, p = softmax
    over C(i) of Z_i, and (docs/api.md, "Per-direction rows")::

        LSE_i  = log Σ_{k∈C(i)} e^Z_ik
        supcon:  loss_i = −(1 − ε)·mean_{p∈P(i)} log p_ip − ε·mean_{k∈C(i)} log p_ik
        mil_nce: loss_i = −(1 − ε)·log Σ_{p∈P(i)} p_ip   − ε·mean_{k∈C(i)} log p_ik

    −log p_ip of SupCon formed as logaddexp(0, LSE_{k∈C,k≠p} (Z_ik − Z_ip)), MIL-NCE's row as
    log(1 + Σ_{k∈C∖P} e^(Z_ik − LSE_P)) (a row whose classes are all positives is exactly 0), so a
    row far below its LSE keeps its digits; ε's term as log p = Z − LSE_i."""
    if group_mode not in ("mask", "supcon", "mil_nce"):
        raise KeyError(group_mode)  # a new mode needs its formula written here
    positive_mode = group_mode != "mask"
    v, t = img.double(), txt.double()
    neg = torch.zeros(0, v.shape[1], dtype=torch.float64) if negatives is None else negatives.double()
    tau = tau.double() if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float64)
    if normalize:
        v, t, neg = (F.normalize(x, dim=1) for x in (v, t, neg))
    n, m = v.shape[0], neg.shape[0]
    keys = torch.cat([t, neg])
    off_i2t = torch.ones(n, n + m, dtype=torch.float64)
    off_i2t[:, :n] -= torch.eye(n, dtype=torch.float64)
    off_t2i = 1.0 - torch.eye(n, dtype=torch.float64)
    if positive_mode and group_ids is not None:  # positives carry no margin
        same = group_ids[:, None] == group_ids[None, :]
        off_i2t[:, :n] = (~same).double()
        off_t2i = (~same).double()
    if str(margin) == "text":
        h_i2t, h_t2i = t @ keys.T, t @ t.T
    elif str(margin) == "image_text":
        h_i2t, h_t2i = v @ keys.T, t @ v.T
    else:
        raise KeyError(margin)  # a new margin kind needs its formula written here
    z_i2t = (v @ keys.T + gamma * h_i2t.detach() * off_i2t) / tau
    z_t2i = (t @ v.T + gamma * h_t2i.detach() * off_t2i) / tau
    drop_i2t = torch.zeros(n, n + m, dtype=torch.bool)
    drop_t2i = torch.zeros(n, n, dtype=torch.bool)
    if threshold is not None:
        cu = F.normalize(txt.double().detach(), dim=1)
        nu = cu[:0] if negatives is None else F.normalize(negatives.double().detach(), dim=1)
        drop_i2t |= cu @ torch.cat([cu, nu]).T >= threshold
        drop_t2i |= cu @ cu.T >= threshold
    if group_ids is not None:
        same = group_ids[:, None] == group_ids[None, :]
        if positive_mode:  # never dropped (their margin is off above)
            drop_i2t[:, :n] &= ~same
            drop_t2i &= ~same
        else:
            drop_i2t[:, :n] |= same
            drop_t2i |= same
    if own is not None:  # row i's own columns, after its N + M: none is a positive, no id reaches them
        o = F.normalize(own.double(), dim=2) if normalize else own.double()
        h_own = torch.einsum("nd,nkd->nk", t if str(margin) == "text" else v, o)
        z_i2t = torch.cat([z_i2t, (torch.einsum("nd,nkd->nk", v, o) + gamma * h_own.detach()) / tau], dim=1)
        off_i2t = torch.cat([off_i2t, torch.ones(o.shape[:2], dtype=torch.float64)], dim=1)
        gone = torch.zeros(o.shape[:2], dtype=torch.bool) if own_mask is None else ~own_mask
        if threshold is not None:
            ou = F.normalize(own.double().detach(), dim=2)
            gone = gone | (torch.einsum("nd,nkd->nk", F.normalize(txt.double().detach(), dim=1), ou) >= threshold)
        drop_i2t = torch.cat([drop_i2t, gone], dim=1)
    if positive_mode:
        assert own is None, "own negatives with the positive modes: no formula here"
        return _positive_rows(z_i2t, drop_i2t, off_i2t == 0, z_t2i, drop_t2i, off_t2i == 0, group_mode, label_smoothing)
    out = []
    for z, drop, is_pos in ((z_i2t, drop_i2t, off_i2t == 0), (z_t2i, drop_t2i, off_t2i == 0)):
        keep = is_pos | ~drop
        pos = z[is_pos]  # one positive a row
        gaps = z - pos[:, None]
        # −log p_pos = log(1 + Σ_{kept negatives} e^gap), as logaddexp(0, ·): a saturated row's
        # 1e-40 survives (logsumexp over [0, gaps] would round it to 0 next to the 1); a row that
        # keeps no negative has −log p_pos = 0 (its stand-in 0 keeps the backward finite)
        negs = keep & ~is_pos
        empty = ~negs.any(dim=1)
        neg_lse = torch.logsumexp(gaps.masked_fill(~negs, float("-inf")).masked_fill(empty[:, None], 0.0), dim=1)
        nll_pos = torch.logaddexp(torch.zeros_like(pos), neg_lse.masked_fill(empty, float("-inf")))
        n_kept = keep.sum(dim=1, keepdim=True).double()
        target = (1.0 - label_smoothing) * is_pos.double() + label_smoothing * keep.double() / n_kept
        log_p = (gaps - nll_pos[:, None]).masked_fill(~keep, 0.0)
        out.append((-(target * log_p).sum(dim=1), pos + nll_pos))
    (i2t, lse_i2t), (t2i, lse_t2i) = out
    return i2t, t2i, lse_i2t, lse_t2i


def _positive_rows(z_i2t, drop_i2t, pos_i2t, z_t2i, drop_t2i, pos_t2i, mode, eps):
    """(i2t, t2i, lse_i2t, lse_t2i) of the positive modes (the docstring above), dense float64."""
    out = []
    for z, drop, is_pos in ((z_i2t, drop_i2t, pos_i2t), (z_t2i, drop_t2i, pos_t2i)):
        keep = is_pos | ~drop
        lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=1)
        log_p = z - lse[:, None]
        mean_c = log_p.masked_fill(~keep, 0.0).sum(dim=1) / keep.sum(dim=1)
        if mode == "supcon":  # mean_p logaddexp(0, LSE_{k∈C, k≠p} (Z_ik − Z_ip)): a small row keeps its digits
            n_cols = z.shape[1]
            others = keep[:, None, :] & ~torch.eye(n_cols, dtype=torch.bool)[None]  # [i, p, k]
            gaps = (z[:, None, :] - z[:, :, None]).masked_fill(~others, float("-inf"))
            minus_log_p = torch.logaddexp(torch.zeros_like(z), torch.logsumexp(gaps, dim=2))
            row = minus_log_p.masked_fill(~is_pos, 0.0).sum(dim=1) / is_pos.sum(dim=1)
        else:  # log(1 + Σ_{C∖P} e^(Z − LSE_P)): exactly 0 for a row whose classes are all positives
            lse_p = torch.logsumexp(z.masked_fill(~is_pos, float("-inf")), dim=1, keepdim=True)
            row = torch.log1p(torch.exp((z - lse_p).masked_fill(~keep | is_pos, float("-inf"))).sum(dim=1))
        out.append(((1.0 - eps) * row - eps * mean_c, lse))
    (i2t, lse_i2t), (t2i, lse_t2i) = out
    return i2t, t2i, lse_i2t, lse_t2i


def weights(n, seed):
    """Four random signed per-row weights (a, b, c, d) in float64 for Σ a·i2t + b·lse_i2t + c·t2i + d·lse_t2i."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(n, generator=gen, dtype=torch.float64) * 3.0 - 1.0 for _ in FIELDS]


def run_both(img, txt, neg, tau, *, backend, seed=0, negatives_mask=None, **kw):
    """(got rows, want rows, got grads, want grads) of ``hn_clip_loss(reduction="directions")`` on
    ``backend`` and of the oracle on the same values; the gradients are those of a random weighted
    combination (:func:`weights`) of all four outputs, w.r.t. img, txt, negatives (if any) and τ.
    ``neg`` (M, D) shared, or (N, K, D) each row's own with ``negatives_mask`` (N, K) or None."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt) + ((neg,) if neg is not None else ())]
    tau_dtype = torch.float64 if img.dtype == torch.float64 else torch.float32
    tau_t = torch.tensor(tau, dtype=tau_dtype, requires_grad=True)
    api = dict(kw)
    if "threshold" in api:
        api["false_negative_threshold"] = api.pop("threshold")
    if negatives_mask is not None:
        api["negatives_mask"] = negatives_mask
    got = hn_clip_loss(leaves[0], leaves[1], tau_t, negatives=leaves[2] if neg is not None else None,
                       reduction="directions", backend=backend, **api)  # fmt: skip
    w = weights(img.shape[0], seed)
    objective = sum((x.double() * wi).sum() for x, wi in zip(got, w))
    got_grads = torch.autograd.grad(objective, leaves + [tau_t])
    ref = [x.detach().double().requires_grad_(True) for x in leaves]
    ref_tau = torch.tensor(float(tau_t.detach()), dtype=torch.float64, requires_grad=True)
    family = {}
    if neg is not None:
        family = dict(own=ref[2], own_mask=negatives_mask) if neg.dim() == 3 else dict(negatives=ref[2])
    want = direction_rows_f64(ref[0], ref[1], ref_tau, **family, **kw)
    want_grads = torch.autograd.grad(sum((x * wi).sum() for x, wi in zip(want, w)), ref + [ref_tau])
    names = ["img", "txt"] + (["negatives"] if neg is not None else []) + ["tau"]
    return got, want, dict(zip(names, got_grads)), dict(zip(names, want_grads))


def row_errors(got, want, gg, wg, floor=1e-2):
    """{output or "d name": the largest per-row relative error}; a feature gradient's row error is
    taken relative to max(its norm, ``floor`` × the largest row norm of every feature gradient):
    a random signed weighting can cancel a row's gradient far below its terms (one row of N = 1
    came to 3e-4 of its terms), where rounding is relative to the terms, not to the row. Own
    negatives' gradients (N, K, D) are taken row by row of their (N·K, D) embeddings."""
    gg, wg = ({k: v.reshape(-1, v.shape[-1]) if v.dim() > 2 else v for k, v in x.items()} for x in (gg, wg))
    errs = {}
    for name, g, w in zip(FIELDS, got, want):
        g, w = g.detach().double(), w.detach()
        errs[name] = ((g - w).abs() / w.abs().clamp_min(1e-300)).max().item()
    largest = max(wg[name].norm(dim=1).max().item() for name in wg if wg[name].dim() > 0 and wg[name].numel())
    for name in gg:
        g, w = gg[name].double(), wg[name]
        if g.dim() == 0:
            errs[f"d {name}"] = ((g - w).abs() / w.abs().clamp_min(1e-300)).item()
            continue
        scale = w.norm(dim=1).clamp_min(max(floor * largest, 1e-300))
        errs[f"d {name}"] = ((g - w).norm(dim=1) / scale).max().item()
    return errs


def check(img, txt, neg, tau, *, backend, dtype=torch.float32, seed=0, value_tol=None, **kw):
    """Every row of the four outputs and every gradient row of the weighted combination within the
    tolerances of ``dtype``; returns the errors. ``kw``: the options, ``negatives_mask`` with own
    (N, K, D) ``neg``."""
    got, want, gg, wg = run_both(img, txt, neg, tau, backend=backend, seed=seed, **kw)
    for x in got:
        assert x.shape == (img.shape[0],) and x.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    errs = row_errors(got, want, gg, wg)
    for name, err in errs.items():
        tol = (value_tol or VALUE_TOL[dtype]) if name in FIELDS else GRAD_TOL[dtype]
        assert err <= tol, f"{backend} {name}: per-row relative error {err:.3e} > {tol:.1e} ({kw})"
    return errs
