"""Pure-PyTorch HN-CLIP loss: the reference every fused kernel is checked against.

It materialises the (M, N) logits, so it is for testing, small batches, float64 and
devices without a fused kernel. Autograd supplies every gradient.

Everything is phrased per direction ("directional"): M query rows (the local
images for i2t, the local texts for t2i) against N key columns (all texts, all
images), the positive of row i at column ``offset + i``. One process uses
offset 0 and M = N; a rank of a distributed job uses its global offset.
"""

from __future__ import annotations

import torch

from ...group_mode import GroupMode
from ...numerics import NORM_EPS, compute_dtype, ieee_float32, matmul_nt, normalized, softplus
from ...validation import check_directional
from ...validation_family import check_family_directional
from ..softmax import RowStats, smooths
from .positives import positive_rows


def directional_nll_torch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    query_txt: torch.Tensor,
    key_txt: torch.Tensor,
    tau: torch.Tensor,
    offset: int,
    gamma: float,
    label_smoothing: float,
    normalize: bool,
    return_stats: bool = False,
    false_negative_threshold=None,
    mask_query=None,
    mask_key=None,
    query_groups=None,
    key_groups=None,
    group_mode: GroupMode = GroupMode.MASK,
    own_keys=None,
    own_mask=None,
):
    """Per-row cross-entropy of one direction of the HN-CLIP logits (arXiv 2608.18521, Eq. 2).

    Logits ``Z[i, k] = (q_i · k_k + γ · stopgrad(a_i · b_k) · [k != offset + i]) / τ`` where
    q = ``queries`` (M, D), k = ``keys`` (N, D), a = ``query_txt`` (M, D), b = ``key_txt``
    (N, D), all L2-normalised when ``normalize``. For i2t pass ``(img, txt, query_txt=txt,
    key_txt=txt)``; for t2i ``(txt, img, query_txt=txt, key_txt=txt)``. Every argument after
    the features is keyword-only: this is the *directional protocol* that every backend's op
    follows (``hnclip_kernels.backends.directional_fn``), so margins cannot be swapped by position.

    Each row's NLL is ``softplus(LSE_{k != pos} Z[i, k] - Z[i, pos])``, so a loss of 1e-30
    survives in float32 where ``LSE - Z_pos`` would round to 0. Label smoothing ε adds
    ``ε · mean_k (Z[i, pos] - Z[i, k])``, which equals PyTorch's ``cross_entropy`` semantics.

    False-negative masking (``false_negative_threshold`` c, not in the paper): column k ≠ offset + i
    with caption cosine ``â_i · b̂_k ≥ c`` (the margin's own product, in the compute dtype: float32,
    float64 for float64 inputs, c rounded to it; with ``normalize=False`` that product times the
    captions' inverse norms, ``(a_i · b_k)·ρ_i·ρ_k``: the threshold is a cosine whatever
    ``normalize`` says) is no negative of row i: it leaves the LSE, gets
    no margin and no gradient, and label smoothing spreads ε over the row's n_i kept classes,
    ``ε · mean_{k kept} (Z[i, pos] - Z[i, k])``.

    The hard-negative family (``hn_clip_loss(negatives=, group_ids=, margin=)``; every keyword
    below absent is today's call, on today's code path):

    * ``mask_query`` (M, D) and ``mask_key`` (N, D), passed together: the captions whose cosine
      the threshold compares, when they are not the margin's factors a, b (with
      ``margin="image_text"`` the margin is sg(v_i·x) but the mask still compares captions).
      Detached; normalised like a, b (with ``normalize=False`` divided by their norms).
    * ``query_groups`` (M,) and ``key_groups`` (K,), K ≤ N, integer ids, passed together: column
      k < K is masked in row i when ``query_groups[i] == key_groups[k]`` (k ≠ offset + i); the
      columns from K on (the negative captions appended after the N captions) carry no id.

    * ``own_keys`` (M, K, D) with ``own_mask`` (M, K) bool or None (all real): row i's own K
      extra columns, after the N keys, none of them the positive: Z_ik = (q_i·o_ik + γ·sg(a_i·o_ik))/τ
      (each is its own margin factor and mask caption); masked-out entries are no columns, the
      threshold compares (mask_query or a)_i·ô_ik, group ids do not reach them.

    Masked entries leave the row exactly as with the threshold above (union of both rules).

    * ``group_mode`` (a :class:`~hnclip_kernels.group_mode.GroupMode`, the ids required):
      ``"supcon"`` or ``"mil_nce"`` make column k < K a *positive* of row i when the ids are equal
      (:mod:`.positives`): P(i) = {offset + i} ∪ {k < K: same id}; positives get no margin and are
      never masked, the threshold masks only the other columns, ``return_stats`` is refused.

    Returns a float32 (float64 for float64 inputs) tensor of shape (M,); with
    ``return_stats``, also the detached row statistics ``backends.softmax.RowStats`` (what the
    fused kernels save for their backward; :mod:`hnclip_kernels.diagnostics` reads them).
    """
    check_directional(queries, keys, query_txt, key_txt, offset)
    dt = compute_dtype(queries.dtype)
    q, k = queries.to(dt), keys.to(dt)
    a, b = query_txt.detach().to(dt), key_txt.detach().to(dt)
    if normalize:
        q, k, a, b = (normalized(x) for x in (q, k, a, b))
    m, n = q.shape[0], k.shape[0]
    rows = torch.arange(m, device=q.device)
    pos_cols = rows + offset
    with ieee_float32(a.device):  # never TF32 (open_clip's trainer allows it); matmul_nt does the same
        margin = a @ b.T
    margin[rows, pos_cols] = 0.0  # the positive carries no margin
    positives = None
    if group_mode.positives:
        positives = _positives(group_mode, query_groups, key_groups, rows, pos_cols, n, return_stats)
        margin = margin.masked_fill(positives, 0.0)  # nor does any positive
    logits = (matmul_nt(q, k) + gamma * margin) / tau.to(dt)
    pos = logits[rows, pos_cols]
    delta = logits - pos[:, None]  # Z_ik - Z_i,pos: exactly 0 at the positive
    is_pos = torch.zeros_like(delta, dtype=torch.bool)
    is_pos[rows, pos_cols] = True
    if own_keys is not None:
        return _with_own(
            (q, a, b, delta, pos, is_pos, margin), (mask_query, mask_key, query_groups, key_groups), own_keys, own_mask,
            tau.to(dt), gamma, label_smoothing, normalize, false_negative_threshold, return_stats,
            (group_mode, positives),
        )  # fmt: skip
    if any(x is not None for x in (mask_query, mask_key, query_groups, key_groups)):
        check_family_directional(m, n, mask_query, mask_key, query_groups, key_groups)
        cosine = None
        if false_negative_threshold is not None:
            cosine = margin if normalize else margin * _inv_norms(a)[:, None] * _inv_norms(b)[None, :]
            if mask_query is not None:
                cosine = _caption_cosine(mask_query.detach().to(dt), mask_key.detach().to(dt), normalize)
        if positives is not None:  # the ids name positives here, the threshold masks the rest
            masked = _family_mask(cosine, false_negative_threshold, None, None, n)
            masked = torch.zeros_like(positives) if masked is None else masked & ~positives
            return positive_rows(delta, positives, masked, label_smoothing, group_mode, _lse_of_kept)
        masked = _family_mask(cosine, false_negative_threshold, query_groups, key_groups, n)
        if masked is not None:
            return _masked_rows(delta, pos, is_pos, masked, label_smoothing, return_stats)
    elif false_negative_threshold is not None:
        cosine = margin if normalize else margin * _inv_norms(a)[:, None] * _inv_norms(b)[None, :]
        return _masked_rows(delta, pos, is_pos, cosine >= false_negative_threshold, label_smoothing, return_stats)
    lse_neg = _lse_of_kept(delta, is_pos)
    nll = softplus(lse_neg)
    if smooths(label_smoothing):  # a tensor ε (under torch.compile) is taken to be non-zero
        nll = nll - (label_smoothing / n) * delta.sum(dim=1)
    if not return_stats:
        return nll
    return nll, _row_stats(pos, delta.detach(), is_pos, lse_neg.detach())


def _positives(group_mode, query_groups, key_groups, rows, pos_cols, n, return_stats):
    """(M, N) bool P: each row's own positive and the first K columns of its group."""
    if query_groups is None or key_groups is None:
        raise ValueError(
            f"group_mode={group_mode.value!r} needs query_groups and key_groups (the ids of its positives)"
        )
    if return_stats:
        raise ValueError(
            f"return_stats=True is not supported with group_mode={group_mode.value!r}: the row statistics assume "
            "one positive per row; use group_mode='mask' for the report"
        )
    check_family_directional(rows.shape[0], n, None, None, query_groups, key_groups)
    same = query_groups[:, None] == key_groups[None, :]
    if same.shape[1] < n:  # the negative captions' columns carry no id: never positives
        same = torch.cat([same, same.new_zeros(same.shape[0], n - same.shape[1])], dim=1)
    same[rows, pos_cols] = True
    return same


def _with_own(
    formed, family, own_keys, own_mask, tau, gamma, label_smoothing, normalize, threshold, return_stats, positive
):
    """The rows with each row's own columns appended: (M, N + K) gaps, every row through
    :func:`_masked_rows` (its class count varies with its real own columns). ``positive`` =
    (group_mode, P (M, N) or None): with positives the own columns are extra negatives of
    :func:`.positives.positive_rows` (never positives, the threshold masks them as above)."""
    q, a, b, delta, pos, is_pos, margin = formed
    mask_query, mask_key, query_groups, key_groups = family
    m, n = delta.shape
    check_family_directional(m, n, mask_query, mask_key, query_groups, key_groups)
    if own_keys.dim() != 3 or own_keys.shape[0] != m or own_keys.shape[2] != q.shape[1]:
        raise ValueError(f"own_keys must be (M, K, D) = ({m}, K, {q.shape[1]}), got {tuple(own_keys.shape)}")
    o = own_keys.to(q.dtype)
    if normalize:
        o = o / torch.linalg.vector_norm(o, dim=2, keepdim=True, dtype=torch.float64).clamp_min(NORM_EPS).to(o.dtype)
    with ieee_float32(q.device):
        own_margin = torch.einsum("mkd,md->mk", o.detach(), a)
    own_logits = (torch.einsum("mkd,md->mk", o, q) + gamma * own_margin) / tau
    dropped = torch.zeros_like(delta, dtype=torch.bool)
    cosine = None
    if threshold is not None:
        cosine = margin if normalize else margin * _inv_norms(a)[:, None] * _inv_norms(b)[None, :]
        if mask_query is not None:
            cosine = _caption_cosine(mask_query.detach().to(q.dtype), mask_key.detach().to(q.dtype), normalize)
        caption = a if mask_query is None else mask_query.detach().to(q.dtype)
        unit_o = o.detach() / torch.linalg.vector_norm(o.detach(), dim=2, keepdim=True).clamp_min(NORM_EPS)
        with ieee_float32(q.device):
            own_cosine = torch.einsum("mkd,md->mk", unit_o, normalized(caption))
    group_mode, positives = positive
    # with positives the ids name them (they are never masked), the threshold masks the rest
    masked = _family_mask(
        cosine, threshold, *((None, None) if positives is not None else (query_groups, key_groups)), n
    )
    if masked is None and threshold is not None:
        masked = cosine >= threshold
    if masked is not None:
        dropped = masked if positives is None else masked & ~positives
    own_dropped = torch.zeros(o.shape[:2], dtype=torch.bool, device=o.device) if own_mask is None else ~own_mask
    if threshold is not None:
        own_dropped = own_dropped | (own_cosine >= threshold)
    delta = torch.cat([delta, own_logits - pos[:, None]], dim=1)
    if positives is not None:  # the own columns: negatives of the row, never positives
        positives = torch.cat([positives, torch.zeros_like(own_dropped)], dim=1)
        masked = torch.cat([dropped, own_dropped], dim=1)
        return positive_rows(delta, positives, masked, label_smoothing, group_mode, _lse_of_kept)
    is_pos = torch.cat([is_pos, torch.zeros_like(own_dropped)], dim=1)
    return _masked_rows(delta, pos, is_pos, torch.cat([dropped, own_dropped], dim=1), label_smoothing, return_stats)


def _inv_norms(x):
    """1 / max(‖x_i‖, eps) per row, the norm in float64 (``normalized``'s), in x's dtype."""
    return (1.0 / torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).clamp_min(NORM_EPS)).to(x.dtype)


def _caption_cosine(a, b, normalize):
    """The captions' cosine â_i·b̂_k (IEEE float32 products, as the margin's)."""
    if normalize:
        a, b = normalized(a), normalized(b)
    with ieee_float32(a.device):
        product = a @ b.T
    return product if normalize else product * _inv_norms(a)[:, None] * _inv_norms(b)[None, :]


def _family_mask(cosine, threshold, query_groups, key_groups, n):
    """(M, N) bool: caption cosine ≥ threshold, or the same group id (first K columns only);
    None when neither rule is on."""
    masked = None if cosine is None else cosine >= threshold
    if query_groups is not None:
        same = query_groups[:, None] == key_groups[None, :]
        if same.shape[1] < n:  # the negative captions' columns carry no id
            same = torch.cat([same, same.new_zeros(same.shape[0], n - same.shape[1])], dim=1)
        masked = same if masked is None else masked | same
    return masked


def _masked_rows(delta, pos, is_pos, masked, label_smoothing, return_stats):
    """The rows of :func:`directional_nll_torch` with the masked columns ``masked`` (caption
    cosine ≥ threshold; the positive's own entry is ignored) removed from each row."""
    dropped = is_pos | masked
    lse_neg = _lse_of_kept(delta, dropped)
    nll = softplus(lse_neg)
    kept_delta = delta.masked_fill(dropped, 0.0)  # no gradient reaches a masked column
    kept = (~dropped).sum(dim=1).to(delta.dtype)
    if label_smoothing != 0.0:
        nll = nll - (label_smoothing / (kept + 1.0)) * kept_delta.sum(dim=1)
    if not return_stats:
        return nll
    stats = _row_stats(pos, kept_delta.detach(), dropped, lse_neg.detach())
    return nll, stats._replace(kept=kept)


def _lse_of_kept(delta, dropped):
    """Each row's LSE over its entries not ``dropped`` (the negatives it keeps); -inf, the LSE
    of an empty set, for a row that keeps none (N = 1, or every negative masked). Such a row is
    formed over a finite stand-in and set to -inf after: logsumexp over an all -inf row would
    make 0·exp(-inf - -inf) = NaN in its backward, which autograd's anomaly mode reports (the
    gradient is 0 either way)."""
    empty = dropped.all(dim=1)
    lse = torch.logsumexp(delta.masked_fill(dropped, float("-inf")).masked_fill(empty[:, None], 0.0), dim=1)
    return lse.masked_fill(empty, float("-inf"))


def _row_stats(pos, delta, is_pos, lse_neg):
    p_neg = torch.exp(delta - lse_neg[:, None]).masked_fill(is_pos, 0.0)
    return RowStats(pos.detach(), lse_neg, (p_neg * delta).sum(dim=1), delta.sum(dim=1))
