"""The raw C++ kernels of ``csrc/``: loading the extension, their argument conventions, their fakes.

The extension ``hnclip_kernels._C`` registers the raw kernels with ``TORCH_LIBRARY`` (inputs
already normalised and scaled; no autograd):

* ``torch.ops.hnclip.cpp_raw_directional_fwd``: per-row ``delta``, ``mean_neg``, ``dsum`` over the
  negatives (the same three numbers as the Triton forward kernel) and, when a gradient
  will be needed, the negatives' gradient shares for an upstream gradient of 1
  (``Σ_k P_ik k̂_k`` per query row and ``Σ_i P_ik q̂_i`` per key row), computed from the
  same logit tiles, so the backward usually recomputes nothing.
* ``torch.ops.hnclip.cpp_raw_directional_bwd``: the negatives' shares for the actual upstream
  gradient ``g`` (a rescale of the forward's shares when ``g`` is the same for every row,
  as for ``mean``/``sum``; otherwise a column sweep that recomputes the tiles).

* Both directional kernels take the hard-negative family's masking as optional trailing inputs
  (:class:`FamilyMasks`): mask captions ``ma``, ``mb`` (the threshold's cosine, with their norms
  ``ca``, ``cb``) and int64 group ids ``qg`` (M,), ``kg`` (K ≤ N,). Group ids turn the masking on
  as a threshold does; with ids a threshold of +inf (or none) forms no caption tile. ``offset`` = N
  (the key count): no column is a positive (the family's negative columns, every one a negative).
  The forward's ``prior`` (4, M) (optional): the rows' delta, mean_neg, dsum, kept over other
  columns (the family's symmetric tile); its outputs are then merged over both column sets and
  its shares hold P normalised over both.

* ``torch.ops.hnclip.cpp_raw_symmetric_fwd`` / ``cpp_raw_symmetric_bwd``: the single-process loss (N images
  against N texts, positives on the diagonal). Each logit tile Z = (v̂ + γ t̂) t̂ᵀ / τ is
  computed once for both directions: its rows give the i2t statistics and its columns the
  t2i ones (Zᵀ holds the t2i logits): one product in the forward. The backward recomputes
  a strip of tiles (one product), forms ds_ij = g_i P_ij + g_j P'_ji and applies it to t̂ and
  v̂ (two products). The family's inputs (optional): ``groups`` (N,) int64 ids (pairs with equal
  ids masked in both directions; with ids a threshold of +inf forms no caption tile) and
  ``margin``, the margin's kind as :attr:`hnclip_kernels.margin.Margin.code` (range-checked: an
  unknown code raises; image_text's margin γ·sg(v̂·t̂ᵀ): L = (v̂ + γ v̂)/τ, the same one product). Four N×N×D
  products for forward + backward, against six for two directional calls (ten when the
  upstream gradient differs per row).

* ``torch.ops.hnclip.cpp_raw_positive_fwd`` / ``cpp_raw_positive_bwd``: the multi-positive targets'
  pass (``csrc/positives.cpp``, ``group_mode="supcon"`` / ``"mil_nce"``) beside a directional or
  symmetric kernel that masks the same-group columns: q̂ (M, D) against k̂ (N, D), row i's own
  positive at ``offset + i`` (logit ``pos``), its other positives the columns j < K with equal int64
  ids ``qg`` (M,), ``kg`` (K,). The forward returns (4, M): those other positives' LSE of the gaps,
  softmax-mean gap, Σ gap and count; the backward, for row gradients ``g`` and the rows' ``factors``
  (4, M) of :func:`..softmax.positive_factors`, every positive's share (times τ) of dL/dq̂ and
  dL/dk̂ and Σ_p dS·d per row; ``group_mode`` the mode's code (1 supcon, 2 mil_nce; others raise).

* ``torch.ops.hnclip.cpp_raw_sigmoid_fwd`` / ``cpp_raw_sigmoid_bwd``: the sigmoid (SigLIP) loss
  (``csrc/sigmoid_pairs.cpp``), R rows v̂ against the columns k̂ = [captions; negatives], the
  positive at caption ``offset + i`` with its score ``pos`` (s·v̂_i·k̂_{offset+i}), s and b 0-dim,
  γ, the margin's code, group ids ``qg`` (R,), ``kg`` (captions,) masked or (``groups_positive``)
  positives. The forward returns each row's loss, Σ dz·S and Σ dz (dL/ds·s and dL/db for an
  upstream gradient of 1), the backward dL/dv̂ and dL/dk̂ for row gradients ``g``.

Importing this module raises ImportError when the extension was not built.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ...numerics import compute_dtype
from .. import epilogue, softmax
from ..outputs import DIRECTIONAL_STATS, SYMMETRIC_STATS, CppDirectionalOut, SymmetricOut

try:
    from ... import _C  # noqa: F401  (loading the library runs its TORCH_LIBRARY registrations)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"hnclip_kernels._C, the C++ CPU kernel, is not available ({exc}); reinstall with "
        "`pip install --no-build-isolation -e .` to compile csrc/"
    ) from exc

RAW = torch.ops.hnclip  # the raw C++ kernels (``cpp_raw_*``), see the module docstring
if not hasattr(RAW, "cpp_raw_directional_fwd"):  # pragma: no cover
    raise ImportError("hnclip_kernels._C loaded but did not register the raw C++ kernels")


def value_of(x: Tensor) -> float:
    """The Python float of a :func:`glue.hyperparameter` tensor (the eager implementations read it:
    the operators are opaque ``custom_op``s, so Dynamo never traces this read)."""
    return float(x.item())


def threshold_arg(threshold: Tensor, masked: bool):
    """The raw kernels' ``float? threshold``: the caption cosine of the masking, or None."""
    return value_of(threshold) if masked else None


class Scalars(NamedTuple):
    """What an operator body reads of its scalar inputs (:func:`scalars`)."""

    gamma: float
    eps: float  # label smoothing
    threshold: Optional[float]  # the raw kernels' threshold: None without masking
    dt: torch.dtype  # the compute dtype
    inv_tau: Tensor  # 1/τ in dt, detached


def scalars(x: Tensor, tau: Tensor, gamma: Tensor, label_smoothing: Tensor, threshold: Tensor, masked: bool):
    """:class:`Scalars` of an operator on features ``x`` (γ, ε and the threshold
    :func:`glue.hyperparameter` tensors)."""
    dt = compute_dtype(x.dtype)
    return Scalars(
        value_of(gamma), value_of(label_smoothing), threshold_arg(threshold, masked), dt, 1.0 / tau.detach().to(dt)
    )


def caption_norms(captions, normalize: bool, masked: bool, dt) -> list:
    """The raw kernels' caption norms of the masking, one per caption matrix: None (the kernels
    normalise the captions with the margin's norms) unless masking without ``normalize``, where
    the margin's norms are ones: then 1/‖t‖ in ``dt``, so the threshold stays a cosine."""
    return [epilogue.inv_norms(x, True, dt) if masked and not normalize else None for x in captions]


def shift_arg(stats: softmax.RowStats, label_smoothing: float, masked: bool) -> Tensor:
    """The raw backward kernels' ``shift``: ε/n_i per row with masking, else an empty tensor."""
    return softmax.smoothing_shift(stats, label_smoothing) if masked else stats.pos.new_empty((0,))


class FamilyMasks(NamedTuple):
    """The hard-negative family's masking inputs of ``hnclip::cpp_directional_nll``, each an
    empty tensor when absent (an operator's inputs are tensors): the mask captions (M, D) and
    (N, D) whose cosine the threshold compares in place of the margin factors (``margin="image_text"``),
    and the int64 group ids (M,) and (K,), K ≤ N (the columns from K on carry none)."""

    mask_query: Tensor
    mask_key: Tensor
    query_groups: Tensor
    key_groups: Tensor

    def raw_args(self, a: Tensor, b: Tensor, normalize: bool, masked: bool, dt) -> list:
        """The raw kernels' ``ca, cb, ma, mb, qg, kg``: mask captions with their inverse norms (the
        threshold a cosine whatever ``normalize`` says), else :func:`caption_norms` of a, b; ids."""
        if self.mask_query.dim() == 2:
            captions = [epilogue.inv_norms(x, True, dt) for x in (self.mask_query, self.mask_key)]
            captions += [self.mask_query, self.mask_key]
        else:
            captions = [*caption_norms((a, b), normalize, masked, dt), None, None]
        ids = [self.query_groups, self.key_groups] if self.query_groups.numel() > 0 else [None, None]
        return captions + ids


# ---- fakes of the raw C++ kernels (so they can be traced on their own too)
@torch.library.register_fake("hnclip::cpp_raw_directional_fwd")
def _directional_fwd_fake(
    q_hat, k_hat, a, b, ra, rb, pos, inv_tau, offset, gamma, need_grad, threshold, eps, ca=None, cb=None, ma=None,
    mb=None, qg=None, kg=None, prior=None,
):  # fmt: skip
    masked = threshold is not None or qg is not None  # group ids mask too
    return CppDirectionalOut.fake(q_hat, k_hat, masked, need_grad, q_hat.dtype)[DIRECTIONAL_STATS]


@torch.library.register_fake("hnclip::cpp_raw_directional_bwd")
def _directional_bwd_fake(
    q_hat,
    k_hat,
    a,
    b,
    ra,
    rb,
    pos,
    inv_tau,
    delta,
    row_acc,
    col_acc,
    g,
    offset,
    gamma,
    threshold,
    shift,
    ca=None,
    cb=None,
    ma=None,
    mb=None,
    qg=None,
    kg=None,
):
    return q_hat.new_empty(q_hat.shape), k_hat.new_empty(k_hat.shape)


@torch.library.register_fake("hnclip::cpp_raw_symmetric_fwd")
def _symmetric_fwd_fake(v_hat, t_hat, pos, inv_tau, gamma, threshold, rc=None, groups=None, margin=0):
    return SymmetricOut.fake(v_hat, threshold is not None, v_hat.dtype)[SYMMETRIC_STATS]


@torch.library.register_fake("hnclip::cpp_raw_symmetric_bwd")
def _symmetric_bwd_fake(
    v_hat, t_hat, pos, inv_tau, delta_r, delta_c, g, gamma, threshold, shift_r, shift_c, rc=None, groups=None,
    margin=0,
):  # fmt: skip
    return v_hat.new_empty(v_hat.shape), t_hat.new_empty(t_hat.shape)


@torch.library.register_fake("hnclip::cpp_raw_positive_fwd")
def _positive_fwd_fake(q_hat, k_hat, pos, inv_tau, offset, qg, kg):
    return q_hat.new_empty((4, q_hat.shape[0]))


@torch.library.register_fake("hnclip::cpp_raw_positive_bwd")
def _positive_bwd_fake(q_hat, k_hat, pos, inv_tau, offset, qg, kg, factors, g, eps, group_mode):
    return q_hat.new_empty(q_hat.shape), k_hat.new_empty(k_hat.shape), q_hat.new_empty((q_hat.shape[0],))


@torch.library.register_fake("hnclip::cpp_raw_sigmoid_fwd")
def _sigmoid_fwd_fake(v_hat, k_hat, pos, scale, bias, offset, captions, gamma, margin, qg=None, kg=None,
                      groups_positive=False):  # fmt: skip
    return tuple(v_hat.new_empty((v_hat.shape[0],)) for _ in range(3))


@torch.library.register_fake("hnclip::cpp_raw_sigmoid_bwd")
def _sigmoid_bwd_fake(v_hat, k_hat, pos, scale, bias, g, offset, captions, gamma, margin, qg=None, kg=None,
                      groups_positive=False):  # fmt: skip
    return v_hat.new_empty(v_hat.shape), k_hat.new_empty(k_hat.shape)
