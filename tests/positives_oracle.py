"""The float64 oracle of the multi-positive targets (``group_mode="supcon"`` and ``"mil_nce"``),
written from the formulas of docs/hard_negatives.md ("Multi-positive targets"), without calling the
package and in another form than the reference (one log1p per positive, see below).

Row i of a direction over its columns, Z its logits, P(i) its positives (its own pair and every
caption / image with its group id; the negative captions never), C(i) its classes (every column the
false-negative threshold keeps; positives are never masked), p_ik = softmax over C(i) of Z_i::

    supcon:   −(1 − ε)·mean_{p∈P(i)} log p_ip        − ε·mean_{k∈C(i)} log p_ik
    mil_nce:  −(1 − ε)·log Σ_{p∈P(i)} p_ip           − ε·mean_{k∈C(i)} log p_ik

(−log p_ip formed as log1p of the other classes' e^(Z_ik − Z_ip) per positive, MIL-NCE's as log1p of
the non-positives' mass over Σ_P; the reference forms softplus(LSE_K − LSE_P) + (LSE_P − mean_P Z).)

Logits: Z_ix = (v_i·x + γ·h(i, x)·[x ∉ P(i)]) / τ (i2t, x ∈ [t; n]); Z_ki = (t_k·v_i + γ·h'(k, i)·[i ∉ P(k)]) / τ
(t2i), h and h' the margin's scores as in ``family_oracle.MARGIN_FACTORS``. Loss rows ½(i2t_i + t2i_i).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from family_oracle import MARGIN_FACTORS


def _row_losses(z, positives, classes, mode, label_smoothing):
    """Each row's loss from the formulas above (dense, float64). −log p_ip = log(1 + Σ_{k∈C, k≠p}
    e^(Z_ik − Z_ip)) and −log Σ_P p = log(1 + Σ_{k∈C∖P} e^(Z_ik − LSE_P)), formed with log1p: a
    row's loss far below 1 keeps its relative precision (LSE − Z would cancel)."""
    n_cols = z.shape[1]
    if mode == "supcon":
        others = classes[:, None, :] & ~torch.eye(n_cols, dtype=torch.bool)[None] & positives[:, :, None]
        gaps = (z[:, None, :] - z[:, :, None]).masked_fill(~others, float("-inf"))  # [i, p, k] = Z_ik − Z_ip
        minus_log_p = torch.log1p(torch.exp(gaps).sum(dim=2))  # 0 where p ∉ P(i)
        target = minus_log_p.sum(dim=1) / positives.sum(dim=1)
    elif mode == "mil_nce":
        lse_p = torch.logsumexp(z.masked_fill(~positives, float("-inf")), dim=1, keepdim=True)
        outside = (z - lse_p).masked_fill(~classes | positives, float("-inf"))
        target = torch.log1p(torch.exp(outside).sum(dim=1))
    else:
        raise KeyError(mode)  # a new mode fails until its formula is written here
    lse = torch.logsumexp(z.masked_fill(~classes, float("-inf")), dim=1)
    uniform = lse - z.masked_fill(~classes, 0.0).sum(dim=1) / classes.sum(dim=1)  # −mean_C log p
    return (1.0 - label_smoothing) * target + label_smoothing * uniform


def positive_rows_f64(vq, tq, vk, tk, nk, tau, group_ids, *, mode, margin="text", gamma=0.5, label_smoothing=0.0,
                      threshold=None, captions=None):  # fmt: skip
    """Per-pair rows (N,) from the formulas, in the dtype given (float64), autograd kept: queries
    (vq, tq) against keys (vk, tk) and negatives nk (equal values as separate tensors: a caller may
    hold one side constant), used as given (normalise first). ``captions``: the unit (query, key,
    negative) captions the threshold compares (default the detached tq, tk, nk)."""
    n, m = vq.shape[0], nk.shape[0]
    same = group_ids[:, None] == group_ids[None, :]
    pos_i2t = torch.cat([same, torch.zeros(n, m, dtype=torch.bool)], dim=1)
    pos_t2i = same
    x = torch.cat([tk, nk])
    query_factor, key_factor = MARGIN_FACTORS[str(margin)](vq, tq, vk, tk)
    z_i2t = (vq @ x.T + gamma * (query_factor @ x.T).detach() * ~pos_i2t) / tau
    z_t2i = (tq @ vk.T + gamma * (tq @ key_factor.T).detach() * ~pos_t2i) / tau
    keep_i2t = torch.ones_like(pos_i2t)
    keep_t2i = torch.ones_like(pos_t2i)
    if threshold is not None:
        cq, ck, cn = (tq.detach(), tk.detach(), nk.detach()) if captions is None else captions
        keep_i2t = (cq @ torch.cat([ck, cn]).T < threshold) | pos_i2t
        keep_t2i = (cq @ ck.T < threshold) | pos_t2i
    i2t = _row_losses(z_i2t, pos_i2t, keep_i2t, mode, label_smoothing)
    t2i = _row_losses(z_t2i, pos_t2i, keep_t2i, mode, label_smoothing)
    return 0.5 * (i2t + t2i)


def positives_f64(img, txt, tau, group_ids, mode, negatives=None, normalize=True, threshold=None, **kw):
    """:func:`positive_rows_f64` of one batch in float64 (queries and keys the same tensors),
    normalised when ``normalize``; the threshold compares the captions' cosine, also with
    ``normalize=False``."""
    v, t = img.double(), txt.double()
    n = torch.zeros(0, v.shape[1], dtype=torch.float64) if negatives is None else negatives.double()
    tau = tau.double() if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float64)
    if normalize:
        v, t, n = (F.normalize(x, dim=1) for x in (v, t, n))
    captions = None
    if threshold is not None:
        tu = F.normalize(txt.double().detach(), dim=1)
        nu = tu[:0] if negatives is None else F.normalize(negatives.double().detach(), dim=1)
        captions = (tu, tu, nu)
    return positive_rows_f64(v, t, v, t, n, tau, group_ids, mode=mode, threshold=threshold, captions=captions, **kw)


def own_positive_rows_f64(v, t, own, mask, tau, group_ids, *, mode, margin="text", gamma=0.5, label_smoothing=0.0,
                          threshold=None):  # fmt: skip
    """Per-pair rows (N,) with each row's own negatives under a positive mode, from the formulas above,
    autograd kept; inputs already unit rows (float64): v, t (N, D), own (N, K, D), mask (N, K) bool.

    i2t row i over x ∈ [t_1..t_N, n_i1..n_iK]: P(i) = the captions of its group (its own t_i among
    them), never an own negative; C(i) = P(i) ∪ the captions with t_i·t_k < threshold ∪ its real own
    n_ik with t_i·n_ik < threshold; every non-positive column (own ones included) gets the margin
    γ·h(i, x). t2i rows as in :func:`positive_rows_f64` (no own columns)."""
    n, k = own.shape[:2]
    same = group_ids[:, None] == group_ids[None, :]
    qf, kf = MARGIN_FACTORS[str(margin)](v, t, v, t)
    z_cap = (v @ t.T + gamma * (qf @ t.T).detach() * ~same) / tau
    z_own = (torch.einsum("nd,nkd->nk", v, own) + gamma * torch.einsum("nd,nkd->nk", qf, own).detach()) / tau
    z_i2t = torch.cat([z_cap, z_own], dim=1)
    pos_i2t = torch.cat([same, torch.zeros(n, k, dtype=torch.bool)], dim=1)
    keep_i2t = torch.cat([torch.ones_like(same), mask], dim=1)
    z_t2i = (t @ v.T + gamma * (t @ kf.T).detach() * ~same) / tau
    keep_t2i = torch.ones_like(same)
    if threshold is not None:
        td = t.detach()
        cosine = torch.cat([td @ td.T, torch.einsum("nd,nkd->nk", td, own.detach())], dim=1)
        keep_i2t = keep_i2t & (cosine < threshold)
        keep_t2i = td @ td.T < threshold
    i2t = _row_losses(z_i2t, pos_i2t, keep_i2t | pos_i2t, mode, label_smoothing)
    t2i = _row_losses(z_t2i, same, keep_t2i | same, mode, label_smoothing)
    return 0.5 * (i2t + t2i)
