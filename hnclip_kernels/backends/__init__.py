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
       return_stats=False, false_negative_threshold=None)

The fused backends are imported lazily: triton is optional, and the C++ extension may not
have been built.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..plausibility import warn_once
from .pytorch.reference import directional_nll_torch


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


def symmetric_losses(img: torch.Tensor, txt: torch.Tensor, tau: torch.Tensor, options, return_stats: bool = False):
    """½(i2t_k + t2i_k) for every pair k, shape (N,), on the backend of resolved ``options``
    (:class:`hnclip_kernels.options.LossOptions` after ``bind``); with ``return_stats`` also
    ``(i2t, t2i)``, both directions' detached ``RowStats``."""
    kwargs = _op_kwargs(tau, options, return_stats)
    if options.backend == "triton":
        from .triton.ops import hn_clip_pairs_triton  # one fused op for both directions

        return hn_clip_pairs_triton(img, txt, **kwargs, precision=options.precision)
    if img.dtype in (torch.float16, torch.bfloat16):
        # each tensor feeds both directions: upcast once, so its two gradient halves are summed
        # in float32 and rounded to the input dtype once (two bf16 halves summed lose ~1e-3)
        img, txt = img.float(), txt.float()
    if options.backend == "cpp":
        from .cpp.ops import hn_clip_pairs_cpp  # one operator: each logit tile serves i2t and t2i

        return hn_clip_pairs_cpp(img, txt, **kwargs)
    i2t = directional_nll_torch(img, txt, query_txt=txt, key_txt=txt, offset=0, **kwargs)
    t2i = directional_nll_torch(txt, img, query_txt=txt, key_txt=txt, offset=0, **kwargs)
    return _pair_average(i2t, t2i, return_stats)


def family_losses(
    img: torch.Tensor,
    txt: torch.Tensor,
    negatives: Optional[torch.Tensor],
    group_ids: Optional[torch.Tensor],
    tau: torch.Tensor,
    options,
    return_stats: bool = False,
):
    """:func:`symmetric_losses` of the hard-negative family (``docs/hard_negatives.md``): i2t
    rows over the N captions and the M ``negatives`` (M, D) (None: M = 0), t2i rows over the N
    images; the margin's score from ``options.margin``; pairs with equal ``group_ids`` (N,) masked
    (the negatives carry no id). Shape (N,); with ``return_stats`` also both directions'
    ``RowStats`` (i2t's over its N + M columns). backend "torch" (the reference, two directional
    calls), "cpp" (``hnclip::cpp_family_nll``: the symmetric tile for both directions plus one
    pass over the N×M negative block; 16-bit inputs upcast to float32 first, as
    :func:`symmetric_losses`) or "triton" (``hnclip::triton_family_nll``: the same two walks, 16-bit
    features as they are)."""
    kwargs = _op_kwargs(tau, options, return_stats)
    if options.backend == "triton":  # one operator: the symmetric walk plus the negatives' block, 16-bit as it is
        from .triton.family_sym import family_pairs_triton

        return family_pairs_triton(img, txt, negatives, group_ids, margin=options.margin, precision=options.precision,
                                   **kwargs)  # fmt: skip
    if img.dtype in (torch.float16, torch.bfloat16):  # as symmetric_losses: one float32 gradient sum per tensor
        img, txt = img.float(), txt.float()
        negatives = None if negatives is None else negatives.float()
    if options.backend == "cpp":  # one operator: the symmetric tile plus the negatives' block
        from .cpp.family_sym import family_pairs_cpp

        return family_pairs_cpp(img, txt, negatives, group_ids, margin=options.margin, **kwargs)
    fn = directional_nll_torch
    keys = txt if negatives is None else torch.cat([txt, negatives])
    groups = {} if group_ids is None else dict(query_groups=group_ids, key_groups=group_ids)
    if options.margin == "text":
        i2t = fn(img, keys, query_txt=txt, key_txt=keys, offset=0, **groups, **kwargs)
        t2i = fn(txt, img, query_txt=txt, key_txt=txt, offset=0, **groups, **kwargs)
    else:  # margin sg(v_i·x) in both directions; the mask still compares captions
        i2t = fn(img, keys, query_txt=img, key_txt=keys, mask_query=txt, mask_key=keys, offset=0, **groups, **kwargs)
        t2i = fn(txt, img, query_txt=txt, key_txt=img, mask_query=txt, mask_key=txt, offset=0, **groups, **kwargs)
    return _pair_average(i2t, t2i, return_stats)


def rank_family_losses(
    img: torch.Tensor,
    txt: torch.Tensor,
    all_img: torch.Tensor,
    all_txt: torch.Tensor,
    all_negatives: Optional[torch.Tensor],
    group_ids: Optional[torch.Tensor],
    all_group_ids: Optional[torch.Tensor],
    tau: torch.Tensor,
    offset: int,
    options,
    return_stats: bool = False,
):
    """:func:`rank_losses` of the hard-negative family (:func:`family_losses` across ranks): this
    rank's M local rows, shape (M,). i2t rows of the local images over the keys [all N captions;
    all negatives (K, D), None: K = 0], t2i rows of the local captions over the N images, local
    row i's positive at column ``offset + i``; ``group_ids`` (M,) the local rows' ids against
    ``all_group_ids`` (N,) (the negatives carry none). Two directional calls on every backend:
    "torch" (the reference), "cpp" (``hnclip::cpp_family_directional_nll``) or "triton"
    (``hnclip::triton_family_directional_nll``, ``options.precision``); with ``return_stats`` also
    both ``RowStats`` (i2t's over its N + K columns).

    16-bit features (float16/bfloat16, all of one dtype) run in float32, as in
    :func:`family_losses`: the result and the statistics are float32 and each input's gradient is
    rounded to its dtype once. Inside one rank no tensor feeds both directions (the local images are
    i2t's queries, the gathered ones t2i's keys); a feature's two gradient halves meet in the
    gather's backward, which is why :func:`hnclip_kernels.distributed.family.family_rank_loss`
    upcasts before gathering (so they are summed in float32 too); the upcast here is then a no-op."""
    kwargs = _op_kwargs(tau, options, return_stats, offset=int(offset))
    if img.dtype in (torch.float16, torch.bfloat16):
        img, txt, all_img, all_txt = (x.float() for x in (img, txt, all_img, all_txt))
        all_negatives = None if all_negatives is None else all_negatives.float()
    fn = directional_nll_torch
    if options.backend == "cpp":
        from .cpp.family import family_directional_nll_cpp as fn
    elif options.backend == "triton":
        from .triton.family import family_directional_nll_triton

        fn = functools.partial(family_directional_nll_triton, precision=options.precision)
    keys = all_txt if all_negatives is None else torch.cat([all_txt, all_negatives])
    groups = {} if group_ids is None else dict(query_groups=group_ids, key_groups=all_group_ids)
    if options.margin == "text":
        i2t = fn(img, keys, query_txt=txt, key_txt=keys, **groups, **kwargs)
        t2i = fn(txt, all_img, query_txt=txt, key_txt=all_txt, **groups, **kwargs)
    else:  # margin sg(v_i·x) in both directions; the mask still compares captions
        i2t = fn(img, keys, query_txt=img, key_txt=keys, mask_query=txt, mask_key=keys, **groups, **kwargs)
        t2i = fn(txt, all_img, query_txt=txt, key_txt=all_img, mask_query=txt, mask_key=all_txt, **groups, **kwargs)
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
):
    """A distributed rank's ½(i2t_i + t2i_i) for its M local rows (shape (M,)) against the N
    gathered columns, local row i's positive at column ``offset + i``, on the backend of resolved
    ``options``; with ``return_stats`` also ``(i2t, t2i)``, both directions' detached ``RowStats``.

    Triton: one op forms both directions' tiles from 3 products (the margin's t tᵀ_all once).
    torch and cpp: two calls of the directional op."""
    # masking: the local captions against all gathered captions
    kwargs = _op_kwargs(tau, options, return_stats, offset=int(offset))
    if options.backend == "triton":
        from .triton.ops import rank_nll_triton

        return rank_nll_triton(img, txt, all_img, all_txt, **kwargs, precision=options.precision)
    fn = directional_fn(options.backend, options.precision)
    i2t = fn(img, all_txt, query_txt=txt, key_txt=all_txt, **kwargs)
    t2i = fn(txt, all_img, query_txt=txt, key_txt=all_txt, **kwargs)
    return _pair_average(i2t, t2i, return_stats)


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
    return kwargs


def _pair_average(i2t, t2i, return_stats: bool):
    """½(i2t + t2i) of two directional calls; with ``return_stats`` also their statistics."""
    if not return_stats:
        return 0.5 * (i2t + t2i)
    return 0.5 * (i2t[0] + t2i[0]), (i2t[1], t2i[1])
