"""Backend dispatch: which backend runs a call, and its ops.

Three backends compute the same loss (arXiv 2608.18521, Eq. 2):

* ``"torch"`` — :mod:`.pytorch`: the pure-PyTorch reference (materialises the logits);
* ``"cpp"`` — :mod:`.cpp`: the fused C++ CPU kernels of ``csrc/`` (``hnclip_kernels._C``);
* ``"triton"`` — :mod:`.triton`: the fused Triton kernels (CUDA; CPU under TRITON_INTERPRET=1).

Each exposes two ops. The *symmetric* op is the single-process loss (N images against N
texts, both directions from the same logit tiles). The *directional* op is one direction of
a distributed rank (M query rows against N gathered key columns, positive of row i at column
``offset + i``); a rank's two directions run through :func:`rank_losses` (one fused op on
Triton, sharing the margin's product; two directional calls elsewhere). The directional op has
the keyword-only protocol of
:func:`hnclip_kernels.backends.pytorch.reference.directional_nll_torch`::

    fn(queries, keys, *, query_txt, key_txt, tau, offset, gamma, label_smoothing, normalize,
       return_stats=False, false_negative_threshold=None,
       mask_query=None, mask_key=None, query_groups=None, key_groups=None, group_mode=<mask>)

(``group_mode``: passed only when it makes the ids positives,
``docs/hard_negatives.md#multi-positive-targets``; every backend's op takes it.)

The hard-negative family is optional inputs of both ops, absent for today's loss: the symmetric
op's ``negatives``, ``group_ids`` and ``margin``, the directional op's masking captions and group ids.

The fused backends are imported lazily: triton is optional, and the C++ extension may not
have been built.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from ..group_mode import GroupMode
from ..margin import Margin, margin_operands
from ..plausibility import warn_once
from .directions import assemble, mean_positive_logits, merged_stats, own_block, own_rows, positive_logits
from .pytorch.reference import directional_nll_torch
from .pytorch.sigmoid_pairs import sigmoid_pairs_torch
from .softmax import smooths


def triton_directional() -> Callable:
    """The Triton directional op, imported lazily: triton is optional on CPU-only installs."""
    try:
        from .triton.ops import directional_nll_triton
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError(
            f"backend='triton' needs the triton package ({exc}); install triton or use backend='torch'"
        ) from exc
    return directional_nll_triton


def _triton_interpreting() -> bool:
    """Do the Triton kernels run in the interpreter (on CPU tensors)? The gate of
    backend="triton" on CPU tensors: ``triton.launch.interpreting`` (which raises ``ValueError``
    when ``TRITON_INTERPRET=1`` came after ``import triton``), after the install hint."""
    triton_directional()  # the install hint first
    from .triton.launch import interpreting

    return interpreting()


def cpp_directional():
    """The C++ directional op, or None when the extension was not built."""
    try:
        from .cpp.ops import directional_nll_cpp
    except ImportError:
        return None
    return directional_nll_cpp


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """Map ``backend`` to "torch", "triton" or "cpp" for tensors like ``x``, or raise
    ``ValueError``/``TypeError`` saying which backend can run them."""
    if backend == "auto":
        if x.device.type == "cuda" and x.dtype != torch.float64:
            return "triton"
        if x.device.type == "cpu" and x.dtype != torch.float64 and cpp_directional() is not None:
            return "cpp"
        if x.device.type == "cpu" and cpp_directional() is None:
            warn_once(
                "auto-cpu",
                "hnclip_kernels: the C++ extension is not built; backend='auto' uses "
                "the pure-PyTorch backend (materialises N×N logits) on CPU",
            )
        return "torch"
    if backend in ("cpp", "triton") and x.device.type == "meta":
        raise ValueError(
            f"backend={backend!r} cannot run on meta tensors; backend='torch' (or 'auto') "
            "gives a meta result of the right shape"
        )
    if backend == "triton":
        if x.dtype == torch.float64:
            raise TypeError(
                "backend='triton' supports float16, bfloat16 and float32 inputs; use backend='torch' for float64"
            )
        if x.device.type == "cpu" and not _triton_interpreting():
            raise ValueError(
                "backend='triton' got CPU tensors but Triton is not interpreting; move the "
                "tensors to CUDA, set TRITON_INTERPRET=1 before importing triton, or use "
                "backend='cpp' / 'torch'"
            )
        if x.device.type not in ("cuda", "cpu"):
            raise ValueError(f"backend='triton' needs CUDA tensors, got device {x.device}")
        triton_directional()  # the install hint now, not inside the loss
    if backend == "cpp":
        if x.device.type != "cpu":
            raise ValueError(f"backend='cpp' needs CPU tensors, got device {x.device}; use backend='triton'")
        if cpp_directional() is None:
            raise ValueError(
                "backend='cpp' needs the C++ extension, which is not built; reinstall with the "
                "README's install command (it compiles csrc/), or use backend='torch'"
            )
    return backend


def directional_fn(backend: str, precision: Optional[str] = None) -> Callable:
    """The directional op of a resolved backend (the keyword-only protocol above).
    ``precision`` reaches the Triton op only (the other backends compute float32 products in
    IEEE float32)."""
    if backend == "triton":
        fn = triton_directional()  # raises the install hint now rather than at the first call
        return functools.partial(fn, precision=precision) if precision is not None else fn
    if backend == "cpp":
        return cpp_directional()
    return directional_nll_torch


def sigmoid_fn(backend: str, precision: Optional[str] = None) -> Callable:
    """The sigmoid (SigLIP) pairs op of a resolved backend, with the keyword-only protocol of
    :func:`hnclip_kernels.backends.pytorch.sigmoid_pairs.sigmoid_pairs_torch`::

        fn(img, txt, logit_scale, logit_bias, *, offset, gamma, margin, normalize,
           negatives=None, query_groups=None, key_groups=None, groups_positive=False)

    R image rows against the C captions and M negatives as columns, row i's positive at
    ``offset + i``: one process has R = C = N and offset 0; a rank its local rows."""
    if backend == "triton":
        triton_directional()  # the install hint first
        from .triton.sigmoid_pairs import sigmoid_pairs_triton

        return functools.partial(sigmoid_pairs_triton, precision=precision)
    if backend == "cpp":
        from .cpp.sigmoid_pairs import sigmoid_pairs_cpp

        return sigmoid_pairs_cpp
    return sigmoid_pairs_torch


def symmetric_losses(
    img: torch.Tensor,
    txt: torch.Tensor,
    tau: torch.Tensor,
    options,
    return_stats: bool = False,
    family=None,
):
    """½(i2t_k + t2i_k) for every pair k, shape (N,), on the backend of resolved ``options``
    (:class:`hnclip_kernels.options.LossOptions` after ``bind``); with ``return_stats`` also
    ``(i2t, t2i)``, both directions' detached ``RowStats`` (i2t's over its N + M columns).

    ``family``: None (today's loss) or a :class:`~hnclip_kernels.validation_family.Family`
    (``docs/hard_negatives.md``): i2t rows over the N captions and its M ``negatives``, t2i rows
    over the N images, the margin's operands from :func:`~hnclip_kernels.margin.margin_operands`,
    pairs with equal ``group_ids`` masked, or with a positive ``options.group_mode`` positives (the
    negatives carry no id). Triton and cpp: one operator
    for both directions (each logit tile serves i2t and t2i; the negatives' N × M block in one more
    walk); torch: two directional calls of the reference. 16-bit features run as they are on Triton
    and upcast to float32 once elsewhere, so each feature's two gradient halves are summed in float32."""
    kwargs = _op_kwargs(tau, options, return_stats)
    if options.backend == "triton":
        from .triton.ops import hn_clip_pairs_triton  # one fused op for both directions, family or not

        return hn_clip_pairs_triton(img, txt, **_family_inputs(family), **kwargs, precision=options.precision)
    if img.dtype in (torch.float16, torch.bfloat16):
        # each tensor feeds both directions: upcast once, so its two gradient halves are summed
        # in float32 and rounded to the input dtype once (two bf16 halves summed lose ~1e-3)
        img, txt, family = img.float(), txt.float(), _upcast(family)
    if options.backend == "cpp":
        from .cpp.ops import hn_clip_pairs_cpp  # one operator: each logit tile serves i2t and t2i

        return hn_clip_pairs_cpp(img, txt, **_family_inputs(family), **kwargs)
    ids = None if family is None else family.group_ids
    i2t, t2i = _two_directions(
        directional_nll_torch, (img, txt), (img, txt), family, (ids, ids), dict(offset=0, **kwargs)
    )
    return _pair_average(i2t, t2i, return_stats)


def rank_losses(
    img: torch.Tensor,
    txt: torch.Tensor,
    all_img: torch.Tensor,
    all_txt: torch.Tensor,
    tau: torch.Tensor,
    offset: int,
    options,
    return_stats: bool = False,
    family=None,
):
    """A distributed rank's ½(i2t_i + t2i_i) for its M local rows (shape (M,)) against the N
    gathered columns, local row i's positive at column ``offset + i``, on the backend of resolved
    ``options``; with ``return_stats`` also ``(i2t, t2i)``, both directions' detached ``RowStats``.

    ``family``: None, or the gathered :class:`~hnclip_kernels.validation_family.Family` (all ranks'
    negatives (K, D), all N group ids; the local rows' ids are its rows offset … offset + M): i2t
    rows of the local images over [all N captions; all K negatives], t2i rows over the N images.

    Triton without the family: one op forms both directions' tiles from 3 products (the margin's
    t tᵀ_all once). Otherwise two calls of the directional op; 16-bit features then run in float32
    (inside one rank no tensor feeds both directions: a feature's two gradient halves meet in the
    gather's backward, which is why ``distributed.family`` upcasts before gathering)."""
    kwargs = _op_kwargs(tau, options, return_stats, offset=int(offset))
    if family is None and options.backend == "triton":
        from .triton.ops import rank_nll_triton

        return rank_nll_triton(img, txt, all_img, all_txt, **kwargs, precision=options.precision)
    if family is not None and img.dtype in (torch.float16, torch.bfloat16):
        img, txt, all_img, all_txt = (x.float() for x in (img, txt, all_img, all_txt))
        family = _upcast(family)
    fn = directional_fn(options.backend, options.precision)
    ids = (None, None)
    if family is not None:
        if family.group_ids is not None:
            ids = (family.group_ids[offset : offset + img.shape[0]], family.group_ids)
    i2t, t2i = _two_directions(fn, (img, txt), (all_img, all_txt), family, ids, kwargs)
    return _pair_average(i2t, t2i, return_stats)


def direction_losses(
    img: torch.Tensor,
    txt: torch.Tensor,
    all_img: torch.Tensor,
    all_txt: torch.Tensor,
    tau: torch.Tensor,
    offset: int,
    options,
    return_stats: bool = False,
    family=None,
):
    """Each direction's rows and LSE (:class:`~hnclip_kernels.backends.directions.DirectionRows`,
    each (R,)) of R query rows (``img``, ``txt``) against the gathered columns (``all_img``,
    ``all_txt``), row i's positive at column ``offset + i``, on the backend of resolved
    ``options``: one process passes its batch twice and offset 0. With ``return_stats`` also
    ``(i2t, t2i)``, the detached ``RowStats``.

    ``family``: as :func:`rank_losses`'s (the gathered negatives and all ids), or each of the R rows'
    own negatives (R, K, D) with their mask. Every backend runs its directional op once per direction
    (twice with ε > 0 or ``group_mode="mil_nce"``: the unsmoothed (SupCon) rows give the LSE,
    :mod:`.directions`); ``ValueError`` for own negatives with a positive ``group_mode``; own negatives extend
    the i2t rows by autograd (:func:`.directions.own_rows`); 16-bit features run in float32, each
    feature's gradients summed in float32 and rounded to its dtype once."""
    if img.dtype in (torch.float16, torch.bfloat16):
        # one cast per tensor (one process passes its batch as rows and as columns): each feature's
        # gradients meet in float32 and are rounded to its dtype once
        cast = {id(x): x.float() for x in (img, txt, all_img, all_txt)}
        img, txt, all_img, all_txt = (cast[id(x)] for x in (img, txt, all_img, all_txt))
        family = _upcast(family)
    own = family if family is not None and family.own_negatives is not None else None
    if own is not None and options.group_mode.positives:  # own_rows' algebra assumes one positive
        raise ValueError(
            f"reduction='directions' does not take each row's own negatives (N, K, D) with "
            f"group_mode={options.group_mode.value!r} yet; pass shared negatives (M, D), "
            "or reduction='none' for the per-row losses"
        )
    if own is not None:  # no directional op takes them: its i2t call runs over the captions
        family = dataclasses.replace(family, own_negatives=None, own_mask=None)
    kwargs = _op_kwargs(tau, options, return_stats or own is not None, offset=int(offset))
    fn = directional_fn(options.backend, options.precision)
    ids = (None, None)
    if family is not None and family.group_ids is not None:
        ids = (family.group_ids[offset : offset + img.shape[0]], family.group_ids)
    queries, keys = (img, txt), (all_img, all_txt)
    out = _two_directions(fn, queries, keys, family, ids, kwargs)
    losses = [x[0] for x in out] if kwargs["return_stats"] else out
    unsmoothed = losses
    # the LSE needs the unsmoothed rows, with the positive modes SupCon's (LSE − mean_P Z, .directions)
    if smooths(options.label_smoothing) or options.group_mode is GroupMode.MIL_NCE:
        plain = dict(kwargs, label_smoothing=0.0, return_stats=False)
        if options.group_mode.positives:
            plain["group_mode"] = GroupMode.SUPCON
        unsmoothed = _two_directions(fn, queries, keys, family, ids, plain)
    pairs = ((img, all_txt), (txt, all_img))
    if options.group_mode.positives:
        positives = [mean_positive_logits(q, k, int(offset), tau, options.normalize, ids[1]) for q, k in pairs]
    else:
        positives = [positive_logits(q, k, int(offset), tau, options.normalize) for q, k in pairs]
    stats = (out[0][1], out[1][1]) if kwargs["return_stats"] else None
    if own is not None:  # each i2t row's own columns (t2i rows have none)
        block = own_block(img, txt, own, positives[0], tau, options)
        n_keys = all_txt.shape[0] + (0 if family.negatives is None else family.negatives.shape[0])
        i2t, nll = own_rows(losses[0], unsmoothed[0], stats[0], block, n_keys, options.label_smoothing)
        losses, unsmoothed = [i2t, losses[1]], [nll, unsmoothed[1]]
        stats = (merged_stats(stats[0], block), stats[1])
    rows = assemble(losses, unsmoothed, positives)
    return (rows, stats) if return_stats else rows


def _family_inputs(family) -> dict:
    """The symmetric operators' optional family inputs: absent without the family (today's loss;
    the own negatives' keywords only where there are some, so a plain call is today's call)."""
    if family is None:
        return dict(negatives=None, group_ids=None, margin=Margin.TEXT)
    inputs = dict(negatives=family.negatives, group_ids=family.group_ids, margin=family.margin)
    if family.own_negatives is not None:
        inputs.update(own_negatives=family.own_negatives, own_mask=family.own_mask)
    return inputs


def _two_directions(fn, queries, keys, family, ids, kwargs):
    """i2t and t2i of the directional op ``fn``: ``queries`` (images, captions) (M, D) against
    ``keys`` (images, captions) (N, D), the family's negatives (if any) after the captions; each
    direction's margin operands from :func:`margin_operands`, group ids ``ids`` = (the queries',
    the keys') or (None, None)."""
    img, txt = queries
    key_img, key_txt = keys
    negatives = None if family is None else family.negatives
    margin = Margin.TEXT if family is None else family.margin
    captions = key_txt if negatives is None else torch.cat([key_txt, negatives])
    groups = {} if ids[0] is None else dict(query_groups=ids[0], key_groups=ids[1])
    own = {}  # each i2t row's own negatives (the reference only: one process)
    if family is not None and family.own_negatives is not None:
        own = dict(own_keys=family.own_negatives, own_mask=family.own_mask)
    out = []
    for q, k, q_txt, k_txt in ((img, captions, txt, captions), (txt, key_img, txt, key_txt)):
        a, b, mask_a, mask_b = margin_operands(margin, q, k, q_txt, k_txt)
        masks = {} if mask_a is None else dict(mask_query=mask_a, mask_key=mask_b)
        out.append(fn(q, k, query_txt=a, key_txt=b, **masks, **groups, **own, **kwargs))
        own = {}
    return out


def _upcast(family):
    """``family`` with its negatives in float32 (16-bit features run in float32 off Triton)."""
    if family is None:
        return family
    if family.own_negatives is not None:
        return dataclasses.replace(family, own_negatives=family.own_negatives.float())
    if family.negatives is None:
        return family
    return dataclasses.replace(family, negatives=family.negatives.float())


def _op_kwargs(tau: torch.Tensor, options, return_stats: bool, **extra) -> dict:
    """The keyword arguments every loss op takes, from resolved ``options``."""
    kwargs = dict(
        tau=tau,
        gamma=options.gamma,
        label_smoothing=options.label_smoothing,
        normalize=options.normalize,
        return_stats=return_stats,
        **extra,
    )
    if options.false_negative_threshold is not None:  # absent otherwise: each op's default, None
        kwargs["false_negative_threshold"] = options.false_negative_threshold
    if options.group_mode.positives:  # absent otherwise ("mask", today's): every backend's ops take it
        kwargs["group_mode"] = options.group_mode
    return kwargs


def _pair_average(i2t, t2i, return_stats: bool):
    """½(i2t + t2i) of two directional calls; with ``return_stats`` also their statistics."""
    if not return_stats:
        return 0.5 * (i2t + t2i)
    return 0.5 * (i2t[0] + t2i[0]), (i2t[1], t2i[1])
