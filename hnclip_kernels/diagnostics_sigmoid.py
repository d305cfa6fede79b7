"""Saturation diagnostics of the sigmoid (SigLIP) loss: the pairs a naive float32 gradient loses.

A pair's gradient of the sigmoid loss is dℓ/dz = σ(z) − [y = +1]. Written that way in float32
(the textbook form, and what ``F.binary_cross_entropy_with_logits``' autograd computes), a
positive pair at z ≳ 16.6 gets σ(z) rounded to 1 and its gradient to exactly 0, although its
exact gradient −σ(−z) is not 0 (−2e-9 at z = 20) and its loss softplus(−z) is still counted:
the pair no longer pulls. :func:`sigmoid_saturation_report` measures on a batch how many pairs
that is and how much of the loss they carry, beside the exact float64 loss; this project's
kernels form −σ(−z) without cancellation (``docs/siglip.md``).

open_clip's ``SigLipLoss`` (and Hugging Face's ``SiglipModel``) compute −F.logsigmoid(y·z), whose
float32 autograd is stable: it loses a pair only where e^{−|z|} underflows (|z| ≳ 88–104), which
the report counts separately (``lost_pairs_logsigmoid_fp32``).

Pairs, z and y are those of :func:`hnclip_kernels.hn_siglip_loss`: the N image rows against the
N + M columns [txt; negatives], y = +1 on the positive (and, with ``group_mode="positive"``, on
the row's group's captions), −1 elsewhere; with ``group_mode="mask"`` a row's other captions of
its group are no pair (not counted).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from .margin import Margin
from .numerics import NORM_EPS, softplus
from .options_sigmoid import SigmoidOptions, scalar_tensor
from .reports import check_chunk_rows
from .siglip import check_logit_range
from .validation_family import family_arguments

__all__ = ["SigmoidSaturationReport", "sigmoid_saturation_report"]

Scalar = Union[float, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SigmoidSaturationReport:
    """What a naive float32 sigmoid loss makes of a batch (module docstring: pairs, z, y).

    * ``loss``: the exact loss (1/N)·Σ_pairs softplus(−y·z), from the features in float64
      (``hn_siglip_loss(reduction="mean")``'s value, to float64 rounding).
    * ``naive_fp32_loss``: the same sum of open_clip's float32 pair values −F.logsigmoid(y·z),
      the logits formed in float32 from float32 (normalised) features, summed in float64: it
      differs from ``loss`` by float32 rounding only (the float32 pair losses are stable).
    * ``lost_pairs_fp32``: the share of the counted pairs whose float32 gradient σ(z) − [y = +1]
      (``F.binary_cross_entropy_with_logits``' autograd, upstream 1 per pair) is exactly 0 while
      the float64 gradient is not.
    * ``lost_loss``: (1/N)·Σ over those pairs of their exact loss: the part of ``loss`` that gives
      no gradient in naive float32. ``lost_loss_share``: ``lost_loss / loss`` (0 when ``loss`` is 0).
    * ``lost_pairs_logsigmoid_fp32``: the share of the counted pairs whose float32 gradient of
      −F.logsigmoid(y·z) (open_clip's ``SigLipLoss``, autograd, upstream 1 per pair) is exactly 0
      while the float64 gradient is not.
    * ``pairs``: the number of counted pairs, N·(N + M) less the masked ones.
    * ``masked_pairs``: with ``group_ids`` and ``group_mode="mask"``, the pairs the groups
      removed; None otherwise.
    * ``row_lost_pairs``: (N,) int64, each image row's number of lost pairs (float32 gradient 0).
    * ``row_lost_loss``: (N,) float64, each row's exact loss over its lost pairs (not divided by
      N: ``lost_loss = row_lost_loss.sum() / N``). Both on the CPU.
    """

    loss: float
    naive_fp32_loss: float
    lost_pairs_fp32: float
    lost_loss: float
    lost_loss_share: float
    lost_pairs_logsigmoid_fp32: float
    pairs: int
    masked_pairs: Optional[int]
    row_lost_pairs: torch.Tensor
    row_lost_loss: torch.Tensor

    def as_dict(self) -> dict:
        """The fields as a dict, the per-row tensors as lists (for loggers, JSON)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["row_lost_pairs"], out["row_lost_loss"] = self.row_lost_pairs.tolist(), self.row_lost_loss.tolist()
        return out


class _Call(NamedTuple):
    """One call's checked arguments."""

    s: float
    b: float
    gamma: float
    margin: Margin
    normalize: bool
    groups_positive: bool
    negatives: Optional[torch.Tensor]
    group_ids: Optional[torch.Tensor]
    chunk: int


_ROW_FIELDS = ("loss", "naive", "lost", "lost_loss", "lost_ls", "counted", "masked")


def _features(img, txt, negatives, dtype, normalize) -> tuple:
    """(v, k = [t; n]) detached in ``dtype``, L2-normalised when ``normalize``."""
    cols = txt if negatives is None else torch.cat([txt, negatives])
    v, k = img.detach().to(dtype), cols.detach().to(dtype)
    if normalize:
        v, k = F.normalize(v, dim=1, eps=NORM_EPS), F.normalize(k, dim=1, eps=NORM_EPS)
    return v, k


def _labels(call: _Call, start: int, stop: int, n_cols: int, device) -> tuple:
    """(positive, masked) boolean (rows, columns) masks of image rows [start, stop)."""
    rows = torch.arange(start, stop, device=device)
    cols = torch.arange(n_cols, device=device)
    positive = cols[None, :] == rows[:, None]
    masked = torch.zeros_like(positive)
    if call.group_ids is not None:
        n = call.group_ids.shape[0]
        same = torch.zeros_like(positive)
        same[:, :n] = call.group_ids[start:stop, None] == call.group_ids[None, :]
        if call.groups_positive:
            positive = positive | same
        else:
            masked = same & ~positive
    return positive, masked


def _logits(v: torch.Tensor, k: torch.Tensor, call: _Call, start: int, stop: int, positive) -> torch.Tensor:
    """z of rows [start, stop) in v's dtype: s·(v·k + γ·h·[y = −1]) + b."""
    scores = v[start:stop] @ k.T
    h = k[start:stop] @ k.T if call.margin is Margin.TEXT else scores
    return call.s * torch.where(positive, scores, scores + call.gamma * h) + call.b


def _chunk(f64: tuple, f32: tuple, call: _Call, start: int, stop: int) -> tuple:
    """The per-row fields of :data:`_ROW_FIELDS` for image rows [start, stop)."""
    positive, masked = _labels(call, start, stop, f64[1].shape[0], f64[0].device)
    counted = ~masked
    z64 = _logits(*f64, call, start, stop, positive)
    y64 = torch.where(positive, 1.0, -1.0).to(torch.float64)
    pair64 = softplus(-y64 * z64).masked_fill(masked, 0.0)
    grad64 = torch.where(positive, -torch.sigmoid(-z64), torch.sigmoid(z64))
    del z64
    z32 = _logits(*f32, call, start, stop, positive)
    with torch.enable_grad():
        leaf = z32.detach().requires_grad_(True)
        bce = F.binary_cross_entropy_with_logits(leaf, positive.to(torch.float32), reduction="none")
        (g_bce,) = torch.autograd.grad(bce.sum(), leaf)
        leaf = z32.detach().requires_grad_(True)
        naive = -F.logsigmoid(y64.to(torch.float32) * leaf)
        (g_ls,) = torch.autograd.grad(naive.sum(), leaf)
    live = counted & (grad64 != 0)
    lost, lost_ls = live & (g_bce == 0), live & (g_ls == 0)
    return (
        pair64.sum(dim=1),
        naive.detach().double().masked_fill(masked, 0.0).sum(dim=1),
        lost.sum(dim=1),
        pair64.masked_fill(~lost, 0.0).sum(dim=1),
        lost_ls.sum(dim=1),
        counted.sum(dim=1),
        masked.sum(dim=1),
    )


def _checked(img, txt, logit_scale, logit_bias, options, negatives, group_ids, chunk_rows) -> _Call:
    """The call's arguments checked once, in the order :func:`sigmoid_saturation_report` documents."""
    bound = options.bind(img, txt)
    negatives, group_ids = family_arguments(img, txt, negatives, group_ids)
    s = scalar_tensor("logit_scale", logit_scale, img, positive=True)
    b = None if logit_bias is None else scalar_tensor("logit_bias", logit_bias, img, positive=False)
    chunk = check_chunk_rows(chunk_rows)
    if img.device.type == "meta":
        raise ValueError("sigmoid_saturation_report needs tensors with values; img and txt are on the meta device")
    check_logit_range(img, txt, negatives, s, b, bound)
    return _Call(
        float(s.detach()),
        0.0 if b is None else float(b.detach()),
        float(bound.gamma),
        bound.margin,
        bound.normalize,
        bound.groups_positive,
        negatives,
        group_ids,
        chunk,
    )


def sigmoid_saturation_report(
    img: torch.Tensor,
    txt: torch.Tensor,
    logit_scale: Scalar,
    logit_bias: Optional[Scalar] = None,
    *,
    gamma: float = 0.0,
    margin: Union[str, Margin] = "text",
    negatives: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    group_mode: str = "mask",
    normalize: bool = True,
    chunk_rows: int = 1024,
) -> SigmoidSaturationReport:
    """Measure how many of a batch's sigmoid-loss pairs a naive float32 gradient loses.

    The sigmoid counterpart of :func:`hnclip_kernels.diagnostics.saturation_report`: the
    arguments are :func:`hnclip_kernels.hn_siglip_loss`'s (γ defaults to 0, SigLIP itself).

    Args:
        img, txt: (N, D) image and text features (N ≥ 1), float16 / bfloat16 / float32 /
            float64, same dtype and device; never modified, no gradient is taken.
        logit_scale: s > 0, already exponentiated (open_clip's ``logit_scale.exp()``): a float or
            a one-element tensor.
        logit_bias: b, a float or a one-element tensor, or None for b = 0.
        gamma, margin: the adaptive margin (γ ≥ 0; "text" or "image_text"), as in ``hn_siglip_loss``.
        negatives: None or (M, D) hard-negative captions, M more columns of every row, label −1.
        group_ids, group_mode: None or (N,) integer ids; "mask" (equal ids: no pair) or
            "positive" (equal ids: label +1).
        normalize: L2-normalise the features first (default True, like ``hn_siglip_loss``).
        chunk_rows: image rows whose N + M pairs are materialised at a time: peak memory is
            about twelve float32 / float64 (chunk_rows, N + M) buffers on top of the features
            (N + M = 65536 at the default 1024: about 5 GB; lower it for larger batches).

    Returns:
        A :class:`SigmoidSaturationReport` (fields and formulas in its docstring): the exact loss
        from the features in float64, the naive values from float32 logits however the
        features arrive.

    Raises:
        TypeError: non-tensor or non-floating features, dtype mismatch, non-real
            ``logit_scale`` / ``logit_bias`` / ``gamma``, ``chunk_rows`` not an int,
            ``negatives`` or ``group_ids`` of the wrong kind, non-string ``margin`` / ``group_mode``.
        ValueError: shape or device mismatch, N = 0 or D = 0, s ≤ 0 or non-finite, b non-finite,
            logits beyond the compute dtype's range, γ < 0, unknown ``margin`` or ``group_mode``,
            ``chunk_rows`` < 1, meta tensors; ``negatives`` or ``group_ids`` of the wrong shape
            or device.
    """
    options = SigmoidOptions(gamma=gamma, margin=margin, group_mode=group_mode, normalize=normalize)
    call = _checked(img, txt, logit_scale, logit_bias, options, negatives, group_ids, chunk_rows)
    with torch.no_grad():
        f64 = _features(img, txt, call.negatives, torch.float64, call.normalize)
        f32 = _features(img, txt, call.negatives, torch.float32, call.normalize)
        parts = {key: [] for key in _ROW_FIELDS}
        n = img.shape[0]
        for start in range(0, n, call.chunk):
            for key, val in zip(_ROW_FIELDS, _chunk(f64, f32, call, start, min(start + call.chunk, n))):
                parts[key].append(val)
        rows = {key: torch.cat(vals) for key, vals in parts.items()}
        totals = torch.stack(
            [rows[key].double().sum() for key in ("loss", "naive", "lost", "lost_loss", "lost_ls", "counted", "masked")]
        ).tolist()  # one sync
    loss, naive, lost, lost_loss, lost_ls, counted, masked = totals
    pairs = int(round(counted))
    return SigmoidSaturationReport(
        loss=loss / n,
        naive_fp32_loss=naive / n,
        lost_pairs_fp32=lost / pairs if pairs else 0.0,
        lost_loss=lost_loss / n,
        lost_loss_share=lost_loss / loss if loss > 0 else 0.0,
        lost_pairs_logsigmoid_fp32=lost_ls / pairs if pairs else 0.0,
        pairs=pairs,
        masked_pairs=int(round(masked)) if call.group_ids is not None and not call.groups_positive else None,
        row_lost_pairs=rows["lost"].to("cpu", torch.int64),
        row_lost_loss=rows["lost_loss"].to("cpu", torch.float64),
    )
