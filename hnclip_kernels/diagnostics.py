"""Saturation diagnostics: how much of a batch's contrastive signal naive cross-entropy loses.

HN-CLIP's motivation (arXiv 2608.18521) is measurable: on dense captions most rows' InfoNCE
loss falls far below 1e-3, where ``F.cross_entropy`` on float32 logits rounds the loss to
exactly zero and the positive's gradient p_ii − 1 with it. :func:`saturation_report` measures
this on a batch of features; :func:`report_from_row_stats` fills the fields that the fused
kernels' saved row statistics already determine, for logging during training at no extra
forward pass.

**Rows.** Every fraction and mean below is over the 2N *directional* rows: the N image→text
rows of Z (query image i against all texts) and the N text→image rows of Zᵀ (query text j
against all images), each with its own positive on the diagonal. A pair k counts twice,
once per direction. With Z as in :func:`hnclip_kernels.hn_clip_loss`,

    Z = (v tᵀ + γ · t tᵀ · (1 − I)) / τ,

row i of i2t is Z_i· and row j of t2i is Z_·j (the margin t tᵀ is symmetric, so the t2i row j
is (t_j·v_k + γ t_j·t_k [k ≠ j]) / τ). For a row r with positive column p (= r) write the
gaps d_k = Z_rk − Z_rp over the negatives k ≠ p and

    δ_r = LSE_{k≠p} d_k           ℓ_r = softplus(δ_r) = −log softmax(Z_r·)_p   (the row's loss)
    q_k = softmax_{k≠p}(d)_k      (the softmax over the negatives only)
    μ_r = Σ_{k≠p} q_k d_k         H_r = −Σ_{k≠p} q_k log q_k = δ_r − μ_r.

δ, μ (and Σ_k d_k) are exactly the statistics the fused kernels save per row
(:class:`hnclip_kernels.backends.softmax.RowStats`: ``delta``, ``mean_neg``, ``dsum``).

**False-negative masking** (``false_negative_threshold``, not in the paper): the sums over k ≠ p
run over the row's kept negatives only (a row whose negatives are all masked has δ = −inf, loss
0 and 0 effective negatives), and ``masked_pairs`` reports how many entries of the logits the
mask removed (the kernels' ``kept`` counts give it at no extra pass).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from . import validation as _validation
from .backends.softmax import RowStats
from .loss import hn_clip_loss
from .margin import Margin, margin_operands
from .numerics import NORM_EPS, compute_dtype
from .options import LossOptions
from .plausibility import warn_if_tau_looks_like_logit_scale
from .reports import SaturationReport, check_chunk_rows, check_threshold, report_from_row_stats, stats_fields
from .validation_family import family_arguments

__all__ = ["SaturationReport", "saturation_report", "report_from_row_stats"]


def _normalised(x: torch.Tensor, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    x = x.detach().to(dtype)
    return F.normalize(x, dim=1, eps=NORM_EPS) if normalize else x


def _features(img, txt, negatives, dtype, normalize) -> tuple:
    """(v, t, captions [t; n]) detached in ``dtype``, L2-normalised when ``normalize``."""
    v, t = _normalised(img, dtype, normalize), _normalised(txt, dtype, normalize)
    return v, t, t if negatives is None else torch.cat([t, _normalised(negatives, dtype, normalize)])


def _inv_norms(x: torch.Tensor) -> torch.Tensor:
    """1 / max(‖x_i‖, eps) per row, the norm in float64, in x's dtype."""
    return 1.0 / torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).clamp_min(NORM_EPS).to(x.dtype)


def _chunk_logits(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, start: int, gamma: float, tau: float
) -> tuple:
    """(logits, margin) of query rows [start, start + m): (q kᵀ + γ·a bᵀ·[k ≠ pos]) / τ and a bᵀ
    (with the paper's margin a, b are captions: the cosines false-negative masking compares)."""
    m = q.shape[0]
    margin = a @ b.T
    rows = torch.arange(m, device=q.device)
    gm = margin.clone()
    gm[rows, rows + start] = 0.0  # the positive carries no margin
    logits = (q @ k.T + gamma * gm) / tau
    return logits, margin


def _false_negatives(cosine, start: int, fn_threshold: Optional[float], groups=None):
    """The masked entries of a chunk, or None: caption cosine ≥ the threshold, or (``groups``:
    the chunk's rows' ids and the key columns' ids, the columns past them, negative captions,
    carry none) the same group id; never the positives."""
    masked = None if fn_threshold is None else cosine >= fn_threshold
    if groups is not None:
        row_ids, key_ids, n_cols = groups
        same = row_ids[:, None] == key_ids[None, :]
        if same.shape[1] < n_cols:
            same = torch.cat([same, same.new_zeros(same.shape[0], n_cols - same.shape[1])], dim=1)
        masked = same if masked is None else masked | same
    if masked is None:
        return None
    rows = torch.arange(masked.shape[0], device=masked.device)
    masked[rows, rows + start] = False
    return masked


def _direction_chunk(logits: torch.Tensor, margin: torch.Tensor, start: int, gamma: float, masked=None):
    """δ, μ, Σd and the hardest negative's margin γ·a·t_h for each row of one chunk (over the
    kept negatives with false-negative masking ``masked``; 0 for a row without any)."""
    m = logits.shape[0]
    rows = torch.arange(m, device=logits.device)
    pos_cols = rows + start
    gaps = logits - logits[rows, pos_cols][:, None]
    is_pos = torch.zeros_like(gaps, dtype=torch.bool)
    is_pos[rows, pos_cols] = True
    dropped = is_pos if masked is None else is_pos | masked
    neg = gaps.masked_fill(dropped, float("-inf"))
    delta = torch.logsumexp(neg, dim=1)
    probs = torch.softmax(neg, dim=1)
    if masked is not None:  # a row whose negatives are all masked: no probabilities (not NaN)
        probs = probs.masked_fill((delta == float("-inf"))[:, None], 0.0)
    mean_neg = (probs * gaps.masked_fill(dropped, 0.0)).sum(dim=1)
    dsum = gaps.masked_fill(dropped, 0.0).sum(dim=1)
    hardest = neg.argmax(dim=1)  # the first maximum on ties, as torch.argmax documents
    hard_margin = gamma * margin[rows, hardest]
    if masked is not None:
        hard_margin = hard_margin.masked_fill(delta == float("-inf"), 0.0)
    return delta, mean_neg, dsum, hard_margin


def _naive_chunk(logits32: torch.Tensor, start: int, masked=None):
    """Per-row float32 and bfloat16 ``F.cross_entropy`` values and whether the float32 gradient
    on the positive logit is exactly zero (autograd's own backward of cross_entropy); masked
    entries (false-negative masking) at −inf, as a hand-written masked loss would put them."""
    if masked is not None:
        logits32 = logits32.masked_fill(masked, float("-inf"))
    m = logits32.shape[0]
    target = torch.arange(start, start + m, device=logits32.device)
    ce16 = F.cross_entropy(logits32.to(torch.bfloat16), target, reduction="none")
    with torch.enable_grad():
        leaf = logits32.detach().requires_grad_(True)
        ce32 = F.cross_entropy(leaf, target, reduction="none")
        # upstream 1 per row (reduction="sum"): the gradient is exp(log_softmax) − onehot, exactly
        # what a mean reduction gives times 1/N, which cannot turn a nonzero float32 value into 0
        (grad,) = torch.autograd.grad(ce32.sum(), leaf)
    lost = grad[torch.arange(m, device=grad.device), target] == 0
    return ce32.detach().double(), ce16.double(), lost


class _Pass(NamedTuple):
    """One call's checked arguments, as the loss call and the chunked pass read them."""

    tau: float
    gamma: float
    normalize: bool
    backend: str
    fn_thr: Optional[float]  # false-negative masking's caption cosine, or None
    negatives: Optional[torch.Tensor]
    group_ids: Optional[torch.Tensor]
    margin: Margin
    threshold: float  # a row is saturated below this loss
    chunk: int


class _Direction(NamedTuple):
    """One direction's operands: ``queries`` against ``keys``, the margin γ·sg(a_i·b_k), the
    false-negative mask's captions ``mask_a``·``mask_b`` (None: the margin's own product, see
    :func:`hnclip_kernels.margin.margin_operands`) and the rows' and columns' captions."""

    queries: torch.Tensor
    keys: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    mask_a: Optional[torch.Tensor]
    mask_b: Optional[torch.Tensor]
    query_txt: torch.Tensor
    key_txt: torch.Tensor


_ROW_FIELDS = ("delta", "mean_neg", "dsum", "hard", "ce32", "ce16", "lost", "masked")


def _checked(img, txt, tau, options: LossOptions, threshold, chunk_rows, negatives, group_ids) -> _Pass:
    """The call's arguments checked (the features and ``options`` already are), in the order
    :func:`saturation_report` documents its errors."""
    negatives, group_ids = family_arguments(img, txt, negatives, group_ids)
    thr = check_threshold(threshold)
    chunk = check_chunk_rows(chunk_rows)
    if img.device.type == "meta":
        raise ValueError("saturation_report needs tensors with values; img and txt are on the meta device")
    n = img.shape[0]
    if n < 2:
        raise ValueError(f"img and txt have N = {n} pair; saturation_report needs N >= 2 (a row needs negatives)")
    gamma = float(options.gamma)
    tau_value = _validation.check_tau(tau, img.device, img.dtype, gamma, tau_grad=False)  # no backward here
    fn_thr = None if options.false_negative_threshold is None else float(options.false_negative_threshold)
    return _Pass(
        tau_value, gamma, options.normalize, options.backend, fn_thr, negatives, group_ids, options.margin, thr, chunk
    )


def _loss(img: torch.Tensor, txt: torch.Tensor, call: _Pass) -> float:
    """The report's ``loss``: :func:`hnclip_kernels.hn_clip_loss` of the batch on ``call.backend``."""
    family = dict(negatives=call.negatives, group_ids=call.group_ids, margin=call.margin)
    loss = hn_clip_loss(img, txt, call.tau, gamma=call.gamma, normalize=call.normalize, backend=call.backend,
                        false_negative_threshold=call.fn_thr, **family)  # fmt: skip
    return float(loss)


def _rows(img: torch.Tensor, txt: torch.Tensor, call: _Pass) -> dict:
    """Both directions' row fields ("i2t", "t2i": :func:`_direction_rows`), from the features in
    the compute dtype (float32, float64 for float64 features) and, for the naive losses, float32."""
    dt = compute_dtype(img.dtype)
    feats = _features(img, txt, call.negatives, dt, call.normalize)
    feats32 = None if dt == torch.float32 else _features(img, txt, call.negatives, torch.float32, call.normalize)
    rows = {}
    for name in ("i2t", "t2i"):
        d32 = None if feats32 is None else _direction(name, feats32, call.margin)
        rows[name] = _direction_rows(_direction(name, feats, call.margin), d32, call)
    return rows


def _direction(name: str, feats: tuple, margin: Margin) -> _Direction:
    """The operands of direction ``name`` ("i2t": images against the N + M captions; "t2i":
    captions against images) over ``feats`` = (v, t, captions)."""
    v, t, caps = feats
    queries, keys, query_txt, key_txt = (v, caps, t, caps) if name == "i2t" else (t, v, t, t)
    return _Direction(queries, keys, *margin_operands(margin, queries, keys, query_txt, key_txt), query_txt, key_txt)


def _chunk_rows(d: _Direction, d32: Optional[_Direction], call: _Pass, start: int, stop: int, inv) -> tuple:
    """The fields of :data:`_ROW_FIELDS` for query rows [start, stop) of one direction; ``d32``:
    its float32 operands for the naive losses (None: ``d`` is float32); ``inv``: the captions'
    inverse norms (rows, columns), or None where the products are cosines already."""
    logits, margin = _chunk_logits(d.queries[start:stop], d.keys, d.a[start:stop], d.b, start, call.gamma, call.tau)
    cosine = None
    if call.fn_thr is not None:  # the captions' product (the margin's own with margin="text")
        cosine = margin if d.mask_a is None else d.mask_a[start:stop] @ d.mask_b.T
        if inv is not None:  # the threshold is a cosine whatever normalize says: the raw product over the norms
            cosine = cosine * inv[0][start:stop] * inv[1]
    groups = None if call.group_ids is None else (call.group_ids[start:stop], call.group_ids, d.keys.shape[0])
    masked = _false_negatives(cosine, start, call.fn_thr, groups)
    delta, mean_neg, dsum, hard = _direction_chunk(logits, margin, start, call.gamma, masked)
    del margin, cosine
    if d32 is not None:  # the naive losses always see float32 logits from float32 features
        logits, _ = _chunk_logits(
            d32.queries[start:stop], d32.keys, d32.a[start:stop], d32.b, start, call.gamma, call.tau
        )
    ce32, ce16, lost = _naive_chunk(logits, start, masked)
    n_masked = masked.sum(dim=1) if masked is not None else torch.zeros_like(delta)
    return delta, mean_neg, dsum, hard, ce32, ce16, lost, n_masked


def _direction_rows(d: _Direction, d32: Optional[_Direction], call: _Pass) -> dict:
    """Every row's fields (:data:`_ROW_FIELDS`) of one direction, ``call.chunk`` rows at a time."""
    inv = None
    if call.fn_thr is not None and not call.normalize:
        inv = (_inv_norms(d.query_txt)[:, None], _inv_norms(d.key_txt)[None, :])
    parts = {key: [] for key in _ROW_FIELDS}
    n = d.queries.shape[0]
    for start in range(0, n, call.chunk):
        for key, val in zip(_ROW_FIELDS, _chunk_rows(d, d32, call, start, min(start + call.chunk, n), inv)):
            parts[key].append(val)
    return {key: torch.cat(vals) for key, vals in parts.items()}


def _report(i2t: dict, t2i: dict, call: _Pass, loss: float) -> SaturationReport:
    """The report from both directions' row fields and the loss (one host sync)."""
    fields = stats_fields(
        RowStats(None, i2t["delta"], i2t["mean_neg"], i2t["dsum"]),
        RowStats(None, t2i["delta"], t2i["mean_neg"], t2i["dsum"]),
        call.threshold,
    )
    fields["loss"] = loss
    both = {key: torch.cat([i2t[key], t2i[key]]) for key in ("hard", "ce32", "ce16", "lost", "masked")}
    hard = both["hard"].double()
    values = torch.stack(
        [
            both["ce32"].mean(),
            both["ce16"].mean(),
            both["lost"].double().mean(),
            hard.mean(),
            hard.max(),
            # with negatives the N × (N + M) i2t logits' masked entries (as reports.stats_fields)
            i2t["masked"].double().sum() if call.negatives is not None else 0.5 * both["masked"].double().sum(),
        ]
    ).tolist()  # one sync
    masking = call.fn_thr is not None or call.group_ids is not None
    fields["masked_pairs"] = int(round(values[5])) if masking else None
    return SaturationReport(
        naive_fp32_loss=values[0],
        naive_bf16_loss=values[1],
        lost_positive_rows_fp32=values[2],
        hardest_margin_mean=values[3],
        hardest_margin_max=values[4],
        **fields,
    )


def saturation_report(
    img: torch.Tensor,
    txt: torch.Tensor,
    tau: Union[float, torch.Tensor],
    *,
    gamma: float = 0.5,
    threshold: float = 1e-3,
    normalize: bool = True,
    backend: str = "auto",
    chunk_rows: int = 1024,
    false_negative_threshold: Optional[float] = None,
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    margin: Union[str, Margin] = "text",
) -> SaturationReport:
    """Measure how saturated a batch is and what naive cross-entropy makes of it.

    Args:
        img, txt: (N, D) image and text features (N ≥ 2), as for
            :func:`hnclip_kernels.hn_clip_loss`; never modified, no gradient is taken.
        tau: temperature τ > 0 (open_clip: ``1 / logit_scale``), a float or a one-element tensor.
        gamma: margin scale γ ≥ 0.
        threshold: a directional row counts as saturated when its loss is below this (> 0).
        normalize: L2-normalise the features first (default True, like ``hn_clip_loss``).
        backend: the backend that computes ``loss`` (``hn_clip_loss``'s ``backend``).
        chunk_rows: rows of Z (and of Zᵀ) materialised at a time by the pass that computes the
            other fields; peak memory is about ten float32 (chunk_rows, N) buffers on top of
            the features (N = 65536 at the default 1024: about 2.7 GB; lower it for larger N).
        false_negative_threshold: None, or the loss's false-negative masking (see
            :func:`hnclip_kernels.hn_clip_loss`): every field is then over the kept negatives
            (the naive losses put the masked logits at −inf) and ``masked_pairs`` counts the
            entries removed (the float32 caption cosines of the chunked pass, float64 for
            float64 features, against the threshold).
        negatives, group_ids, margin: the hard-negative family, as in
            :func:`hnclip_kernels.hn_clip_loss` (``docs/hard_negatives.md``): (M, D) negative
            captions, extra columns of the N image→text rows (the statistics of those rows, the
            naive losses and the hardest negative then run over their N + M columns; the N
            text→image rows are unchanged); (N,) integer ids, pairs with equal ids masked as
            false negatives (``masked_pairs`` then counts them, with the threshold's, as the
            loss's ``return_stats`` report does: ½ Σ over the 2N rows of the row's masked
            entries); the margin's score "text" or "image_text" (``hardest_margin_*`` are then
            γ·sg(v_r·x_h), the margin applied).

    Returns:
        A :class:`SaturationReport` with every field filled (formulas in its docstring;
        fractions and means over the 2N directional rows). ``loss`` comes from ``hn_clip_loss``;
        the row statistics come from the chunked pass in float32 (float64 for float64 features),
        and the naive losses from float32 logits however the features arrive.

    Warns:
        RuntimeWarning (once per process, shared with ``hn_clip_loss``): τ > 1, almost always
        open_clip's ``logit_scale`` passed in place of τ = 1 / logit_scale.

    Raises:
        TypeError / ValueError naming the argument, as ``hn_clip_loss`` does, and for
        ``threshold`` ≤ 0 or non-finite, ``chunk_rows`` < 1 or not an int, N < 2, meta tensors,
        ``false_negative_threshold`` not None or a float in (−1, 1]; ``negatives``, ``group_ids``
        and ``margin`` as ``hn_clip_loss`` checks them.
    """
    _validation.check_features(img, txt)
    # raises for a bad option
    options = LossOptions(gamma=gamma, backend=backend, normalize=normalize, margin=margin,
                          false_negative_threshold=false_negative_threshold)  # fmt: skip
    call = _checked(img, txt, tau, options, threshold, chunk_rows, negatives, group_ids)
    # called here: the warning points at the line that called saturation_report; once, hn_clip_loss stays quiet
    warn_if_tau_looks_like_logit_scale(call.tau, "saturation_report")
    with torch.no_grad():
        loss = _loss(img, txt, call)  # first: its checks (the features' range, the family's) raise before the pass
        rows = _rows(img, txt, call)
        return _report(rows["i2t"], rows["t2i"], call, loss)
