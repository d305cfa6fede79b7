"""Saturation reports: what naive cross-entropy would make of a batch, as host floats.

:class:`SaturationReport` and :func:`report_from_row_stats` (the fields a fused kernel's saved
row statistics determine) live here, below :mod:`hnclip_kernels.loss`, which builds a report
for ``return_stats=True``; :mod:`hnclip_kernels.diagnostics` adds the materialising pass
(:func:`~hnclip_kernels.diagnostics.saturation_report`) on top. Rows, δ, μ and H: see
:mod:`hnclip_kernels.diagnostics`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

from .backends.softmax import RowStats
from .numerics import softplus
from .validation_scalars import real_number

__all__ = ["SaturationReport", "report_from_row_stats", "report_of_call"]


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
      (i, j) and (j, i)); with hard negatives (M > 0), the masked entries of the N × (N + M)
      image→text logits (a masked negative column counts once, a masked caption pair twice, as
      without negatives); on a rank of a distributed job, its own rows' entries. None without
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


def check_chunk_rows(chunk_rows) -> int:
    """``chunk_rows`` of the diagnostics' chunked passes: TypeError unless an int, ValueError below 1."""
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral):
        raise TypeError(f"chunk_rows must be an int, got {type(chunk_rows).__name__}")
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return int(chunk_rows)


def check_threshold(threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"threshold must be a real number (float), got {type(threshold).__name__}")
    value = float(threshold)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"threshold must be finite and > 0 (a per-row loss level such as 1e-3), got {threshold}")
    return value


def stats_fields(
    i2t: RowStats, t2i: RowStats, threshold: float, label_smoothing: float = 0.0, n_keys: Optional[int] = None
) -> dict:
    """loss, saturated_rows, effective_negatives, rows (and masked_pairs with false-negative
    masking, from the ``kept`` counts and ``n_keys``) from both directions' statistics."""
    delta = torch.cat([i2t.delta.reshape(-1), t2i.delta.reshape(-1)]).double()
    with_negatives = isinstance(n_keys, tuple) and (isinstance(n_keys[0], torch.Tensor) or n_keys[0] != n_keys[1])
    if isinstance(n_keys, tuple):  # the hard-negative family: (N + M i2t columns, or (N,) per row; N t2i columns)
        n_keys = torch.cat([_columns(st, k) for st, k in zip((i2t, t2i), n_keys)])
    mean_neg = torch.cat([i2t.mean_neg.reshape(-1), t2i.mean_neg.reshape(-1)]).double()
    masked = i2t.kept is not None and t2i.kept is not None
    kept = torch.cat([i2t.kept.reshape(-1), t2i.kept.reshape(-1)]).double() if masked else None
    nll = softplus(delta)
    losses = nll
    if label_smoothing != 0.0:
        dsum = torch.cat([i2t.dsum.reshape(-1), t2i.dsum.reshape(-1)]).double()
        losses = nll - (label_smoothing / (n_keys if kept is None else kept + 1.0)) * dsum
    # H = δ − μ ≥ 0; the clamp only removes rounding below 0. No negatives (δ = −inf): 0.
    entropy = (delta - mean_neg).clamp_min(0.0)
    eff = torch.where(delta == float("-inf"), torch.zeros_like(entropy), entropy.exp())
    parts = [losses.mean(), (nll < threshold).double().mean(), eff.mean()]
    if masked:
        removed = n_keys - 1.0 - kept
        if with_negatives:  # the negative columns are in the i2t rows only
            parts.append(removed[: i2t.delta.numel()].sum())  # the N × (N + M) i2t logits' masked entries
        else:
            parts.append(0.5 * removed.sum())
    values = torch.stack(parts).tolist()  # one sync
    return dict(
        loss=values[0],
        saturated_rows=values[1],
        effective_negatives=values[2],
        rows=int(delta.numel()),
        threshold=threshold,
        masked_pairs=int(round(values[3])) if masked else None,
    )


def _columns(stats: RowStats, n_keys) -> torch.Tensor:
    """Each row's key columns in float64: ``n_keys`` an int, or a per-row tensor (own negatives)."""
    if isinstance(n_keys, torch.Tensor):
        return n_keys.reshape(-1).to(torch.float64)
    return torch.full_like(stats.delta.reshape(-1), n_keys, dtype=torch.float64)


def report_of_call(
    i2t: RowStats, t2i: RowStats, like: torch.Tensor, *, label_smoothing, n_keys: int
) -> Optional[SaturationReport]:
    """:func:`report_from_row_stats` for a loss call on ``like``'s device, or None where a report
    (host floats) cannot be made: for meta tensors (no values) and inside a compiled graph."""
    if torch.compiler.is_compiling() or like.device.type == "meta":
        return None
    if isinstance(n_keys, tuple):  # per direction (loss.pair_losses with a family): the defaults of the below
        with torch.no_grad():
            return SaturationReport(**stats_fields(i2t, t2i, 1e-3, float(label_smoothing), n_keys))
    return report_from_row_stats(i2t, t2i, label_smoothing=label_smoothing, n_keys=n_keys)


def report_from_row_stats(
    i2t: RowStats, t2i: RowStats, *, threshold: float = 1e-3, label_smoothing: float = 0.0, n_keys: Optional[int] = None
) -> SaturationReport:
    """A :class:`SaturationReport` from the row statistics a fused kernel saved in its forward.

    ``i2t`` and ``t2i`` are the two directions' :class:`~hnclip_kernels.backends.softmax.RowStats`
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
    thr = check_threshold(threshold)
    ls = real_number("label_smoothing", label_smoothing)
    if not 0.0 <= ls < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    masked = getattr(i2t, "kept", None) is not None and getattr(t2i, "kept", None) is not None
    if (masked or ls != 0.0) and (isinstance(n_keys, bool) or not isinstance(n_keys, numbers.Integral) or n_keys < 1):
        why = (
            "for statistics of a false-negative-masked loss (they count the masked pairs)"
            if masked
            else "when label_smoothing is not 0"
        )
        raise ValueError(f"n_keys (the number of key columns N) must be a positive int {why}, got {n_keys!r}")
    for name, stats in (("i2t", i2t), ("t2i", t2i)):
        fields = ("delta", "mean_neg") + (("dsum",) if ls != 0.0 else ())
        for field in fields:
            x = getattr(stats, field, None)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}.{field} must be a tensor (pass softmax.RowStats), got {type(x).__name__}")
            if x.dim() != 1 or not x.is_floating_point():
                raise ValueError(
                    f"{name}.{field} must be a 1-D floating tensor, got {x.dtype} of shape {tuple(x.shape)}"
                )
    if (
        i2t.delta.shape != t2i.delta.shape
        or i2t.mean_neg.shape != i2t.delta.shape
        or t2i.mean_neg.shape != t2i.delta.shape
    ):
        raise ValueError(
            f"i2t and t2i statistics must all have the same length, got delta {tuple(i2t.delta.shape)}/"
            f"{tuple(t2i.delta.shape)}, mean_neg {tuple(i2t.mean_neg.shape)}/{tuple(t2i.mean_neg.shape)}"
        )
    if ls != 0.0 and (i2t.dsum.shape != i2t.delta.shape or t2i.dsum.shape != t2i.delta.shape):
        raise ValueError(
            f"dsum must have the length of delta, got {tuple(i2t.dsum.shape)}/{tuple(t2i.dsum.shape)} "
            f"for delta {tuple(i2t.delta.shape)}"
        )
    if i2t.delta.numel() == 0:
        raise ValueError("i2t and t2i statistics are empty (M = 0 rows)")
    with torch.no_grad():
        return SaturationReport(**stats_fields(i2t, t2i, thr, ls, n_keys))
