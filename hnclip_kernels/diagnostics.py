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
(:class:`hnclip_kernels.backends.epilogue.RowStats`: ``delta``, ``mean_neg``, ``dsum``).

**False-negative masking** (``false_negative_threshold``, not in the paper): the sums over k ≠ p
run over the row's kept negatives only (a row whose negatives are all masked has δ = −inf, loss
0 and 0 effective negatives), and ``masked_pairs`` reports how many entries of the logits the
mask removed (the kernels' ``kept`` counts give it at no extra pass).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

import torch
import torch.nn.functional as F

from . import validation as _validation
from .backends.epilogue import RowStats
from .loss import _warn_if_tau_looks_like_logit_scale, hn_clip_loss
from .numerics import NORM_EPS, compute_dtype
from .options import LossOptions

__all__ = ["SaturationReport", "saturation_report", "report_from_row_stats"]


@dataclasses.dataclass(frozen=True)
class SaturationReport:
    """What naive cross-entropy would make of a batch (see the module docstring for rows, δ, μ, H).

    Always present (:func:`saturation_report` and :func:`report_from_row_stats`):

    * ``loss``: the exact HN-CLIP loss, mean over the 2N directional rows of ℓ_r = softplus(δ_r)
      (= ½[mean_i ℓ^i2t_i + mean_j ℓ^t2i_j], what ``hn_clip_loss(reduction="mean")`` returns;
      with label smoothing ε passed to :func:`report_from_row_stats`, ℓ_r − (ε/N)·Σ_k d_k).
    * ``saturated_rows``: #{r : softplus(δ_r) < threshold} / (2N), the fraction of directional
      rows whose cross-entropy (without label smoothing) is below ``threshold``.
    * ``effective_negatives``: mean_r exp(H_r), H_r = δ_r − μ_r the entropy of the softmax over
      the row's N − 1 negatives: 1 when one hard negative takes all the negatives' mass,
      N − 1 when they share it evenly (0 for a row without negatives, N = 1).
    * ``rows``: the number of directional rows, 2N. ``threshold``: the threshold used.
    * ``masked_pairs``: with false-negative masking, the number of entries (i, j), i ≠ j, of the
      logits the mask removed, ½ Σ over the 2N directional rows of the row's masked negatives
      (each masked entry leaves one i2t and one t2i row: a pair of duplicate captions counts 2,
      (i, j) and (j, i)); on a rank of a distributed job, its own rows' entries. None without
      masking.

    Only from :func:`saturation_report`'s materialising pass (``None`` from
    :func:`report_from_row_stats`):

    * ``naive_fp32_loss``, ``naive_bf16_loss``: mean over the 2N rows of
      ``F.cross_entropy(Z_r·, p, reduction="none")`` with the logits Z built in float32 from
      float32 normalised features and cast to float32 / bfloat16: each row's value exactly as
      ``F.cross_entropy`` computes it in that dtype, averaged in float64. Saturated rows come
      out as exactly 0 (float32 rounds 1 + Σ_k e^{d_k} to 1 once Σ_k e^{d_k} < 2⁻²⁴).
    * ``lost_positive_rows_fp32``: #{r : ∂CE/∂Z_rp = 0 exactly} / (2N), the gradient of the
      float32 ``F.cross_entropy`` on the positive logit, softmax(Z_r·)_p − 1, as autograd
      computes it (``exp(log_softmax) − 1``): the rows whose positive no longer pulls.
    * ``hardest_margin_mean``, ``hardest_margin_max``: mean / max over the 2N rows of
      γ·cos(t_r, t_h) at the row's hardest negative h = argmax_{k≠p} Z_rk (margin included;
      t_r is the row's own caption: the query text for t2i, the paired caption for i2t).
    """

    loss: float
    saturated_rows: float
    effective_negatives: float
    rows: int
    threshold: float
    naive_fp32_loss: Optional[float] = None
    naive_bf16_loss: Optional[float] = None
    lost_positive_rows_fp32: Optional[float] = None
    hardest_margin_mean: Optional[float] = None
    hardest_margin_max: Optional[float] = None
    masked_pairs: Optional[int] = None

    def as_dict(self) -> dict:
        """The fields as a plain dict (for loggers, CSV writers)."""
        return dataclasses.asdict(self)


def _check_threshold(threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"threshold must be a real number (float), got {type(threshold).__name__}")
    value = float(threshold)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"threshold must be finite and > 0 (a per-row loss level such as 1e-3), got {threshold}")
    return value


def _check_chunk_rows(chunk_rows) -> int:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral):
        raise TypeError(f"chunk_rows must be an int, got {type(chunk_rows).__name__}")
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return int(chunk_rows)


def _stats_fields(i2t: RowStats, t2i: RowStats, threshold: float, label_smoothing: float = 0.0,
                  n_keys: Optional[int] = None) -> dict:
    """loss, saturated_rows, effective_negatives, rows (and masked_pairs with false-negative
    masking, from the ``kept`` counts and ``n_keys``) from both directions' statistics."""
    delta = torch.cat([i2t.delta.reshape(-1), t2i.delta.reshape(-1)]).double()
    mean_neg = torch.cat([i2t.mean_neg.reshape(-1), t2i.mean_neg.reshape(-1)]).double()
    masked = i2t.kept is not None and t2i.kept is not None
    kept = torch.cat([i2t.kept.reshape(-1), t2i.kept.reshape(-1)]).double() if masked else None
    nll = F.softplus(delta)
    losses = nll
    if label_smoothing != 0.0:
        dsum = torch.cat([i2t.dsum.reshape(-1), t2i.dsum.reshape(-1)]).double()
        losses = nll - (label_smoothing / (n_keys if kept is None else kept + 1.0)) * dsum
    # H = δ − μ ≥ 0; the clamp only removes rounding below 0. No negatives (δ = −inf): 0.
    entropy = (delta - mean_neg).clamp_min(0.0)
    eff = torch.where(delta == float("-inf"), torch.zeros_like(entropy), entropy.exp())
    parts = [losses.mean(), (nll < threshold).double().mean(), eff.mean()]
    if masked:
        parts.append(0.5 * (n_keys - 1.0 - kept).sum())
    values = torch.stack(parts).tolist()  # one sync
    return dict(loss=values[0], saturated_rows=values[1], effective_negatives=values[2], rows=int(delta.numel()),
                threshold=threshold, masked_pairs=int(round(values[3])) if masked else None)


def report_of_call(i2t: RowStats, t2i: RowStats, like: torch.Tensor, *, label_smoothing,
                   n_keys: int) -> Optional[SaturationReport]:
    """:func:`report_from_row_stats` for a loss call on ``like``'s device, or None where a report
    (host floats) cannot be made: for meta tensors (no values) and inside a compiled graph."""
    if torch.compiler.is_compiling() or like.device.type == "meta":
        return None
    return report_from_row_stats(i2t, t2i, label_smoothing=label_smoothing, n_keys=n_keys)


def report_from_row_stats(i2t: RowStats, t2i: RowStats, *, threshold: float = 1e-3,
                          label_smoothing: float = 0.0, n_keys: Optional[int] = None) -> SaturationReport:
    """A :class:`SaturationReport` from the row statistics a fused kernel saved in its forward.

    ``i2t`` and ``t2i`` are the two directions' :class:`~hnclip_kernels.backends.epilogue.RowStats`
    (only ``delta`` and ``mean_neg`` are read, and ``dsum`` with label smoothing), 1-D tensors of
    the same length M (M = N on one process; a rank's local rows in distributed training, where
    the fields describe those rows only). Fills ``loss``, ``saturated_rows``,
    ``effective_negatives``, ``rows`` (2M) and ``threshold``; the fields that need the logits
    themselves (``naive_*``, ``lost_positive_rows_fp32``, ``hardest_margin_*``) are ``None``.
    Costs O(M) and one host sync; nothing is recomputed.

    ``label_smoothing`` ε (with ``n_keys``, the number of key columns N) makes ``loss`` the
    smoothed loss the model trains on; ``saturated_rows`` always counts the cross-entropy
    without smoothing, softplus(δ). Statistics of a false-negative-masked loss (``kept`` set in
    both) also fill ``masked_pairs`` (``n_keys`` needed).
    """
    thr = _check_threshold(threshold)
    ls = _validation._real("label_smoothing", label_smoothing)
    if not 0.0 <= ls < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    masked = getattr(i2t, "kept", None) is not None and getattr(t2i, "kept", None) is not None
    if (masked or ls != 0.0) and (isinstance(n_keys, bool) or not isinstance(n_keys, numbers.Integral) or n_keys < 1):
        why = ("for statistics of a false-negative-masked loss (they count the masked pairs)" if masked
               else "when label_smoothing is not 0")
        raise ValueError(f"n_keys (the number of key columns N) must be a positive int {why}, got {n_keys!r}")
    for name, stats in (("i2t", i2t), ("t2i", t2i)):
        fields = ("delta", "mean_neg") + (("dsum",) if ls != 0.0 else ())
        for field in fields:
            x = getattr(stats, field, None)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}.{field} must be a tensor (pass epilogue.RowStats), got {type(x).__name__}")
            if x.dim() != 1 or not x.is_floating_point():
                raise ValueError(f"{name}.{field} must be a 1-D floating tensor, got {x.dtype} of shape "
                                 f"{tuple(x.shape)}")
    if i2t.delta.shape != t2i.delta.shape or i2t.mean_neg.shape != i2t.delta.shape \
            or t2i.mean_neg.shape != t2i.delta.shape:
        raise ValueError(f"i2t and t2i statistics must all have the same length, got delta {tuple(i2t.delta.shape)}/"
                         f"{tuple(t2i.delta.shape)}, mean_neg {tuple(i2t.mean_neg.shape)}/{tuple(t2i.mean_neg.shape)}")
    if ls != 0.0 and (i2t.dsum.shape != i2t.delta.shape or t2i.dsum.shape != t2i.delta.shape):
        raise ValueError(f"dsum must have the length of delta, got {tuple(i2t.dsum.shape)}/{tuple(t2i.dsum.shape)} "
                         f"for delta {tuple(i2t.delta.shape)}")
    if i2t.delta.numel() == 0:
        raise ValueError("i2t and t2i statistics are empty (M = 0 rows)")
    with torch.no_grad():
        return SaturationReport(**_stats_fields(i2t, t2i, thr, ls, n_keys))


def _normalised(x: torch.Tensor, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    x = x.detach().to(dtype)
    return F.normalize(x, dim=1, eps=NORM_EPS) if normalize else x


def _chunk_logits(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, t_all: torch.Tensor, start: int,
                  gamma: float, tau: float) -> tuple:
    """(logits, margin) of query rows [start, start + m): (q kᵀ + γ·a tᵀ·[k ≠ pos]) / τ and a tᵀ
    (the caption cosines, which false-negative masking compares with its threshold)."""
    m = q.shape[0]
    margin = a @ t_all.T
    rows = torch.arange(m, device=q.device)
    gm = margin.clone()
    gm[rows, rows + start] = 0.0  # the positive carries no margin
    logits = (q @ k.T + gamma * gm) / tau
    return logits, margin


def _false_negatives(margin: torch.Tensor, start: int, fn_threshold: Optional[float]):
    """The masked entries of a chunk (caption cosine ≥ the threshold, off the positives), or None."""
    if fn_threshold is None:
        return None
    rows = torch.arange(margin.shape[0], device=margin.device)
    masked = margin >= fn_threshold
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
        ``false_negative_threshold`` not None or a float in (−1, 1].
    """
    _validation.check_features(img, txt)
    LossOptions(gamma=gamma, backend=backend, normalize=normalize,
                false_negative_threshold=false_negative_threshold)  # raises for a bad option
    fn_thr = None if false_negative_threshold is None else float(false_negative_threshold)
    thr = _check_threshold(threshold)
    chunk = _check_chunk_rows(chunk_rows)
    if img.device.type == "meta":
        raise ValueError("saturation_report needs tensors with values; img and txt are on the meta device")
    n = img.shape[0]
    if n < 2:
        raise ValueError(f"img and txt have N = {n} pair; saturation_report needs N >= 2 (a row needs negatives)")
    tau_value = _validation.check_tau(tau, img.device, img.dtype, float(gamma))
    gamma = float(gamma)
    _warn_if_tau_looks_like_logit_scale(tau_value, "saturation_report")  # once: hn_clip_loss below stays quiet

    with torch.no_grad():
        loss = float(hn_clip_loss(img, txt, tau_value, gamma=gamma, normalize=normalize, backend=backend,
                                  false_negative_threshold=fn_thr))

        dt = compute_dtype(img.dtype)
        v, t = _normalised(img, dt, normalize), _normalised(txt, dt, normalize)
        if dt == torch.float32:
            v32, t32 = v, t
        else:  # the naive losses always see float32 logits from float32 features
            v32, t32 = _normalised(img, torch.float32, normalize), _normalised(txt, torch.float32, normalize)

        rho = 1.0 / torch.linalg.vector_norm(t, dim=1, dtype=torch.float64).clamp_min(NORM_EPS).to(dt)
        per_dir = {}
        for name, (q, k, q32, k32) in (("i2t", (v, t, v32, t32)), ("t2i", (t, v, t32, v32))):
            parts = {key: [] for key in ("delta", "mean_neg", "dsum", "hard", "ce32", "ce16", "lost", "masked")}
            for start in range(0, n, chunk):
                stop = min(start + chunk, n)
                logits, margin = _chunk_logits(q[start:stop], k, t[start:stop], t, start, gamma, tau_value)
                # the threshold is a cosine whatever normalize says: the raw product over the norms
                cosine = margin if normalize or fn_thr is None else margin * rho[start:stop, None] * rho[None, :]
                masked = _false_negatives(cosine, start, fn_thr)
                delta, mean_neg, dsum, hard = _direction_chunk(logits, margin, start, gamma, masked)
                del margin
                if dt != torch.float32:
                    logits, _ = _chunk_logits(q32[start:stop], k32, t32[start:stop], t32, start, gamma, tau_value)
                ce32, ce16, lost = _naive_chunk(logits, start, masked)
                del logits
                n_masked = masked.sum(dim=1) if masked is not None else torch.zeros_like(delta)
                for key, val in zip(parts, (delta, mean_neg, dsum, hard, ce32, ce16, lost, n_masked)):
                    parts[key].append(val)
            per_dir[name] = {key: torch.cat(vals) for key, vals in parts.items()}

        i2t, t2i = per_dir["i2t"], per_dir["t2i"]
        fields = _stats_fields(RowStats(None, i2t["delta"], i2t["mean_neg"], i2t["dsum"]),
                               RowStats(None, t2i["delta"], t2i["mean_neg"], t2i["dsum"]), thr)
        fields["loss"] = loss
        both = {key: torch.cat([i2t[key], t2i[key]]) for key in ("hard", "ce32", "ce16", "lost", "masked")}
        hard = both["hard"].double()
        values = torch.stack([both["ce32"].mean(), both["ce16"].mean(), both["lost"].double().mean(),
                              hard.mean(), hard.max(), 0.5 * both["masked"].double().sum()]).tolist()  # one sync
        fields["masked_pairs"] = int(round(values[5])) if fn_thr is not None else None
    return SaturationReport(naive_fp32_loss=values[0], naive_bf16_loss=values[1], lost_positive_rows_fp32=values[2],
                            hardest_margin_mean=values[3], hardest_margin_max=values[4], **fields)
