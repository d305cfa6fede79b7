"""The scalars every launcher of one operator body reads, built once per body (:func:`scalars`).

The kernels read 1/τ, γ and the false-negative threshold from device memory as float32
tensors and take no float argument at all: Inductor types a Python float fp64 inside a user
kernel, and with γ a float argument the float32 tiles become fp64 and the forward kernel fails
to compile ("Loop-carried variable run_max has initial type fp32 but is re-assigned to fp64");
a tensor also lets a compiled graph take a new τ or γ without recompiling. The kernels take the
host's logit scale (1/τ, the value the positives and the epilogue use, or (1 + γ)/τ where the
margin is the logit's own score). A pointer a kernel does not read is
None (γ without the margin, the threshold without masking), and the kernel's flag derives from
it (``triton.heuristics``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...validation import resolve_precision
from .. import epilogue, glue
from . import config as cfg


class Family(NamedTuple):
    """The hard-negative family's masking inputs of the directional kernels (``family_tiles``), each
    None when absent (its flag derives from that): ``captions`` = (c_q (M, D), c_k (N, D)), the
    contiguous masking captions the threshold compares (CAPTIONS); ``groups`` = (ids (M,), ids (K,)),
    K ≤ N, in one integer dtype (GROUPS: also turns the masking on)."""

    captions: Optional[Tuple[Tensor, Tensor]] = None
    groups: Optional[Tuple[Tensor, Tensor]] = None

    def pair_ids(self) -> Optional[Tensor]:
        """The symmetric walk's group ids (``gk_ptr`` of the pair kernels): the N pairs' ids, the
        same for rows and columns, or None."""
        return None if self.groups is None else self.groups[1]

    def pointers(self) -> dict:
        """The kernels' ``cq_ptr, ck_ptr, gq_ptr, gk_ptr, K`` by name (None, 0 where absent)."""
        cq, ck = self.captions if self.captions is not None else (None, None)
        gq, gk = self.groups if self.groups is not None else (None, None)
        return dict(cq_ptr=cq, ck_ptr=ck, gq_ptr=gq, gk_ptr=gk, K=0 if gk is None else gk.shape[0])


NO_FAMILY = Family()


class Scalars(NamedTuple):
    """One operator body's scalars and flags, as its launchers pass them to the kernels.

    logit_scale: (1,) float32, what the kernels multiply a tile's scores by (``logit_scale_ptr``):
        1/τ, or (1 + γ)/τ where the margin is the logit's own score (``margin="image_text"`` on the
        symmetric walk, :func:`scalars`' ``own_score``: no margin tile, a scale).
    inv_tau: (1,) float32, always 1/τ: the positives, the epilogue and dτ (the margin carries no
        gradient).
    gamma: (1,) float32 γ, or None without a margin tile (``gamma_ptr``, read with HAS_MARGIN).
    thr: the false-negative masking block (:func:`threshold_block`), or None (``thr_ptr``; MASK).
    margin_tile: the kernels form γ·m̂_q m̂_kᵀ (their HAS_MARGIN): γ ≠ 0 and the margin is not
        the logit's own score. smoothing: ε ≠ 0, the forward's SMOOTHING.
    prec: the score products' ``input_precision`` for the features' dtype (``cfg.dot_precision``).
    family: the directional kernels' family masking inputs (:class:`Family`; none by default).
    """

    logit_scale: Tensor
    inv_tau: Tensor
    gamma: Optional[Tensor]
    thr: Optional[Tensor]
    margin_tile: bool
    smoothing: bool
    prec: str
    family: Family = NO_FAMILY

    @property
    def masked(self) -> bool:
        """False-negative masking (the kernels' MASK): a threshold, or the family's group ids."""
        return self.thr is not None or self.family.groups is not None

    @property
    def pointers(self) -> tuple:
        """(logit_scale, gamma, thr): the kernels' ``logit_scale_ptr, gamma_ptr, thr_ptr``, in their order."""
        return self.logit_scale, self.gamma, self.thr


def scalar32(x: Tensor, like: Tensor) -> Tensor:
    """A one-element tensor (τ, γ) as the kernels read it: float32, shape (1,), on ``like``'s device."""
    return x.to(device=like.device, dtype=torch.float32).reshape(1)


def scalars(
    like: Tensor,
    tau: Tensor,
    gamma: Tensor,
    has_margin: bool,
    smoothing: bool,
    precision: str,
    thr: Optional[Tensor] = None,
    family: Family = NO_FAMILY,
    own_score: bool = False,
) -> Scalars:
    """The :class:`Scalars` of an operator body on features ``like``: 1/τ in float32 (one
    division, on the host), γ (None without ``has_margin``), the masking block ``thr`` (None:
    no masking), the flags, ``precision`` (a resolved mode) for ``like``'s dtype and the directional
    kernels' ``family`` masking inputs. ``own_score``: the margin's operands are the logits' own
    (:func:`hnclip_kernels.margin.margin_operands`), so with γ ≠ 0 the kernels scale by (1 + γ)/τ
    and form no margin tile."""
    inv_tau = 1.0 / scalar32(tau, like)
    gamma32 = scalar32(gamma, like) if has_margin else None
    prec = cfg.dot_precision(like.dtype, precision)
    if own_score and has_margin:  # the margin is the logit's own score: one product, a scale
        return Scalars(inv_tau * (1.0 + gamma32), inv_tau, None, thr, False, smoothing, prec, family)
    return Scalars(inv_tau, inv_tau, gamma32, thr, has_margin, smoothing, prec, family)


def threshold_block(threshold: Tensor, captions, norms, normalize: bool) -> Tensor:
    """The kernels' false-negative masking block (``tiles._caption_keep``), float32, 1-D: the
    threshold c twice, then the key captions' and the query captions' inverse norms interleaved
    (key k at 2 + 2k, query i at 3 + 2i; zeros pad the shorter side).

    ``captions`` = (query captions (M, D), key captions (N, D)), ``norms`` their inverse norms as
    the margin uses them. The masking compares the captions' cosine G_ik·ρ_i·ρ_k whatever
    ``normalize`` says: normalising, ρ is ``norms`` itself (the margin's product, to the bit);
    otherwise ρ = 1/‖t‖ is taken here (``norms`` are ones then)."""
    rho_q, rho_k = norms if normalize else (epilogue.inv_norms(x, True) for x in captions)
    m, n = rho_q.shape[0], rho_k.shape[0]
    size = max(m, n)
    pairs = torch.stack((F.pad(rho_k, (0, size - n)), F.pad(rho_q, (0, size - m))), dim=1).reshape(-1)
    return torch.cat((scalar32(threshold, rho_q).expand(2), pairs))


def scalar_args(gamma, label_smoothing, precision, like: torch.Tensor):
    """The public wrappers' hyperparameters as the operators take them: (γ, ε as
    :func:`..glue.hyperparameter` tensors, has_margin, smoothing, precision string).

    has_margin (γ ≠ 0) and smoothing (ε ≠ 0), the kernels' HAS_MARGIN and SMOOTHING, stay
    bools: under ``torch.compile`` γ = 0 and γ ≠ 0 are two graphs, every other new γ reuses
    the second (ε alike). A tensor γ or ε is taken to be non-zero."""
    has_margin = True if isinstance(gamma, torch.Tensor) else gamma != 0.0
    smoothing = True if isinstance(label_smoothing, torch.Tensor) else label_smoothing != 0.0
    return (
        glue.hyperparameter(gamma, like),
        glue.hyperparameter(label_smoothing, like),
        has_margin,
        smoothing,
        resolve_precision(precision),
    )


BIG_ROW = 2.0**60  # a row norm above this: its raw products with another such row can overflow float32


def tamed(x: Tensor, scale_free: bool = True) -> Tensor:
    """``x`` (rows, D) with each row of norm above 2⁶⁰ multiplied by 2⁻⁶⁰ (twice where once leaves it
    above 2⁶⁰: float32 rows reach 2¹²⁸·√D), every other row by 1: the same values bit for bit where
    no row is that large. Only for rows the loss normalises (``scale_free``: normalize=True, or the
    mask captions, whose cosine is always normalised): x̂ is unchanged (a power of two scales
    exactly), while the kernels form a tile's raw products x·y before multiplying by the inverse
    norms, which overflow float32 (inf·0 = NaN) for ‖x‖·‖y‖ ≳ 3.4e38, e.g. two rows of norm 2e19
    (the torch and C++ backends normalise first); after it every product is below 2¹²⁰.
    Differentiable: autograd multiplies dL/dx by the same factor. Float constants and ``where``
    only (Inductor's CPU code cannot vectorise ``frexp``'s int exponents), normal factors only
    (≥ 2⁻¹²⁰). float16 rows (norms below 65504·√D) and ``scale_free`` False are returned as they are."""
    if not scale_free or x.dtype == torch.float16 or x.dim() != 2 or x.shape[0] == 0:
        return x
    norm = torch.linalg.vector_norm(x.detach(), dim=1, dtype=torch.float64)
    factor = torch.where(norm > BIG_ROW, 2.0**-60, 1.0)
    factor = factor * torch.where(norm * factor > BIG_ROW, 2.0**-60, 1.0)
    return x * factor.to(x.dtype)[:, None]
