"""The memory the fused Triton path allocates beyond its inputs and outputs.

Two workspaces, never live together (the forward's is freed before the forward operator
returns, the backward's is allocated inside the backward operator):

* the forward's partial statistics (:mod:`.forward`): float32, planes = 3 (max, Σexp,
  Σexp·d), 4 with label smoothing (also Σd); for a distributed rank's op (both directions of its
  M local rows in one walk) row partials (splits, planes, 2M); for the symmetric loss, over 2N lines (the columns' and the rows' statistics), the running
  summaries (planes, 2N) and one slab's partials: its row blocks' (slab row blocks, planes, 2N)
  and its splits' (splits, planes, 2 · slab rows), the grid of ``config.fwd_grid``;
* the backward's dS chunk (``backward.directional_shares``, ``symmetric_shares``, ``rank_shares``): one R × C chunk
  of ``config.chunk_shape`` at a time (for the symmetric loss one square chunk pair, W_ab and W_ba,
  at a time; for a rank both directions' W of one chunk), float32 (for 16-bit features the
  staging W, with its slice maxima and residual sums and one float16 rounding of it at a time
  (:mod:`.round16`), and for bf16 float16 copies of the chunk's feature rows)
  (:func:`backward_bytes` states it).

:func:`workspace_bytes` reports their sum (a bound on the peak), for the GPU launch
configuration. ``tests/backends/test_workspace.py`` counts what the operators actually allocate
and checks it equals this.

Each row's own negatives (N, K, D) (:mod:`..own_negatives`, host side, after the kernels' walk
in the forward and after their dS chunks in the backward, so never live with either): float32
(N, K, D) buffers, :func:`own_bytes`. ``reduction="directions"``: two directional walks, one after
the other (:func:`directions_bytes`); with own negatives each i2t row's own columns by autograd
after the walks, their saved tensors workspace from the forward into the backward, whose own part
runs before the walks' (:func:`directions_own_bytes`).

O(N)-sized vectors (inverse norms, positive logits, the statistics themselves, the float32
gradient accumulators of (N, D)) and the host's O(N·D) temporaries are inputs, outputs or
gradients of the operators, not workspace.
"""

from __future__ import annotations

import torch
import triton

from ...group_mode import GroupMode
from . import config as cfg
from .workspace_host import directions_own_bytes, own_bytes, positive_bytes

_SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _device(device) -> torch.device:
    """The device whose SM count sizes the forward grid: ``device``, else the current CUDA
    device, else none (the config's ``SM_COUNT_IF_UNKNOWN``, an H100/H200)."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def forward_bytes(
    m: int, n: int, elem_size: int, columns: bool, smoothing: bool, device=None, masked: bool = False
) -> int:
    """Bytes of the forward's partial statistics: M local rows against N columns, ``columns``
    for the symmetric loss (also the columns' statistics; else a rank's two directions, 2M
    lines), features of ``elem_size`` bytes; ``masked`` (false-negative masking) adds the
    kept-count plane."""
    planes = (4 if smoothing else 3) + bool(masked)
    with cfg.forced_launch("gpu"):
        _, slab, splits, _ = cfg.fwd_grid(m, n, elem_size, columns, _device(device))
        block_m = cfg.fwd_block_m(elem_size)
    if not columns:  # row partials of both directions
        return 4 * planes * splits * 2 * m
    # the symmetric walk (2N lines: columns and rows): the running summaries, and at the first
    # (largest) slab its row blocks' partials and its splits' partials of the slab's own lines
    return 4 * planes * (2 * n + slab * 2 * n + splits * 2 * min(slab * block_m, n))


def _chunk_bytes(rows: int, cols: int, d: int, dtype: torch.dtype, buffers: int, copies: int | None = None) -> int:
    """Bytes of ``buffers`` R × C float32 W buffers (for 16-bit features the staging W, with its
    slice maxima, later the residuals' slice sums, and one rounded float16 W, with fp16's tail,
    reused by each rounding), and for bf16 the float16 copies of the feature rows they meet:
    ``copies`` (default ``buffers``) blocks of R rows and as many of C columns (q and k of both
    chunks for a pair: 2·(R + C)·D; a rank's two directions keep both row blocks and one column
    block: 2·R·D + C·D)."""
    w = 4 * rows * cols * buffers
    if dtype == torch.float32:
        return w
    slices = 4 * (triton.cdiv(cols, cfg.RESIDUAL_SLICE) * rows + triton.cdiv(rows, cfg.RESIDUAL_SLICE) * cols) * buffers
    rounded = (4 if dtype == torch.float16 else 2) * rows * cols
    if dtype == torch.float16:
        return w + slices + rounded
    if copies is None:
        return w + slices + rounded + 2 * (rows + cols) * d * buffers
    return w + slices + rounded + 2 * copies


def backward_bytes(
    m: int, n: int, d: int, dtype: torch.dtype = torch.float32, symmetric: bool = False, rank: bool = True
) -> int:
    """Bytes the backward (``backward.directional_shares``, ``symmetric_shares``, ``rank_shares``)
    allocates at its peak for M rows against N columns of ``dtype`` features of width D, in the
    GPU launch configuration: one chunk of ``config.chunk_shape`` (the first, the largest):
    float32 W; for 16-bit features also its slice maxima (then residual sums) and one rounded
    float16 W (bf16) or head and tail (fp16) at a time, and for bf16 the chunk's rows and columns
    of the features in float16 (R·D + C·D). ``symmetric`` (the single-process loss, M = N, square
    chunks): a chunk pair (a, b > a) holds two chunk buffers (W_ab and W_ba) at once, the largest
    pair the first: R × min(R, N − R); a single chunk (N ≤ R) one. Else ``rank`` (a rank's two
    directions): two chunk buffers, both directions' row blocks in float16 and one column block
    at a time; or one direction (the directional op): one chunk buffer."""
    with cfg.forced_launch("gpu"):
        return _backward_bytes(m, n, d, dtype, symmetric, rank)


def _backward_bytes(m: int, n: int, d: int, dtype: torch.dtype, symmetric: bool, rank: bool) -> int:
    if symmetric:
        rows, _ = cfg.chunk_shape(m, n, square=True, dtype=dtype)
        single = _chunk_bytes(rows, rows, d, dtype, 1)
        return single if n <= rows else max(single, _chunk_bytes(rows, min(rows, n - rows), d, dtype, 2))
    rows, cols = cfg.chunk_shape(m, n, dtype=dtype)
    if rank:
        return _chunk_bytes(rows, cols, d, dtype, 2, copies=(2 * rows + cols) * d)
    return _chunk_bytes(rows, cols, d, dtype, 1)


def family_forward_bytes(n: int, m: int, elem_size: int, smoothing: bool, device=None, masked: bool = False) -> int:
    """Bytes of the hard-negative family loss's forward (``triton.symmetric`` with negatives): the symmetric walk's
    (:func:`forward_bytes`), then with M > 0 negatives its running summaries (planes, 2N) while
    the block's row partials (splits, planes, N) and their copy after the walk's i2t summaries
    (1 + splits, planes, N) are live; ``masked``: a threshold or group ids."""
    walk = forward_bytes(n, n, elem_size, True, smoothing, device, masked)
    if m == 0:
        return walk
    planes = (4 if smoothing else 3) + bool(masked)
    with cfg.forced_launch("gpu"):
        _, _, splits, _ = cfg.fwd_grid(n, m, elem_size, False, _device(device))
    return max(walk, 4 * planes * n * (2 + splits + 1 + splits))


def directions_bytes(
    rows: int, n: int, d: int, dtype: torch.dtype, smoothing: bool, device=None, masked: bool = False, m: int = 0
) -> tuple[int, int]:
    """(forward, backward) bytes of ``reduction="directions"``: two directional walks, one after
    the other (``backends.direction_losses``): i2t's ``rows`` queries against the N captions and
    M negatives, t2i's against the N images. 16-bit features run in float32 there, so the walks
    are float32's. Forward: the larger of the two walks' row partials (splits, planes, rows),
    each freed before its op returns (with ε > 0 the unsmoothed calls have one plane less);
    backward: the larger of their dS chunks (:func:`backward_bytes`, one direction). The float32
    copies of 16-bit features (4·(2·rows + M)·D bytes, 4·(2N + M)·D for one process) and
    [captions; negatives] (4·(N + M)·D) are the operators' inputs, not counted."""
    planes = (4 if smoothing else 3) + bool(masked)
    with cfg.forced_launch("gpu"):
        splits = max(cfg.fwd_grid(rows, cols, 4, False, _device(device))[2] for cols in (n + m, n))
    bwd = max(backward_bytes(rows, cols, d, torch.float32, rank=False) for cols in (n + m, n))
    return 4 * planes * splits * rows, bwd


def workspace_bytes(
    n: int,
    d: int,
    dtype: torch.dtype,
    *,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    local_rows: int | None = None,
    device=None,
    false_negative_threshold=None,
    negatives: int = 0,
    group_ids: bool = False,
    own_negatives: int = 0,
    normalize: bool = True,
    reduction: str = "none",
    group_mode: str | GroupMode = "mask",
    positive_pairs: int = 0,
) -> int:
    """Bytes the fused Triton path allocates beyond its inputs and outputs for one forward and
    backward, in the GPU launch configuration: the forward's partial statistics plus the
    backward's dS chunk (see the module docstring).

    ``n``: the batch (the symmetric loss), or the gathered columns of a distributed rank's op
    (its M local rows against N columns, both directions) when ``local_rows`` (the rank's M) is
    given; ``d``, ``gamma``: the layout depends on neither today (kept so a caller states the whole problem); ``dtype``: the features' dtype (the
    forward's tile height); ``label_smoothing``: ≠ 0 adds the Σd plane; ``device``: whose SM
    count sizes the grid (default: the current CUDA device, else an H100/H200's 132);
    ``false_negative_threshold``: not None adds the kept-count plane (the per-row ε/n shifts of
    the backward are O(N) vectors, not workspace). The hard-negative family's loss
    (``hnclip::triton_symmetric_nll`` with negatives, single process): ``negatives`` = M negative captions (the
    block's row partials forward, its dS chunk backward after the pairs', never together),
    ``group_ids`` True adds the kept-count plane. ``own_negatives`` = K, each row's own negatives
    (``hn_clip_loss(negatives=(N, K, D), negatives_mask=)``, never with shared ones): their
    host-side block after the kernels' walk and after their dS chunks, never live with either, so
    each phase takes the larger (:func:`own_bytes`; ``normalize`` False drops the backward's
    normalisation buffers). Across ranks with ``local_loss=False`` every rank runs this loss on
    the gathered batch: pass the global N, K = the largest K_r and ``dtype=torch.float32`` (16-bit
    features are upcast before the gather); the gathered (N, K, D) float32 negatives are an input.
    ``group_mode`` "supcon"/"mil_nce" (with ``group_ids``, single process, reduction "none"/"mean"/
    "sum"): the kernels run as under "mask" (the kept-count plane), then each direction's host pass
    over the same-group pairs (:func:`positive_bytes`) after the walk in the forward and after the
    dS chunks in the backward, each phase the larger; ``positive_pairs`` = Σ over groups of |G|²
    (``torch.bincount(group_ids).pow(2).sum()``, each row's own pair included; a bound such as
    N·largest group also bounds the count).
    ``reduction``: "none", "mean" or "sum" (the same walks), or "directions": two directional
    walks, one after the other (:func:`directions_bytes`; with ``local_rows`` a rank's M rows);
    with ``own_negatives`` = K (one process, or ``local_rows`` = M for ``local_loss=True``'s rows,
    or the gathered N with ``local_loss=False``) each i2t row's own columns by autograd
    (:func:`directions_own_bytes`), after the walks in the forward and before them in the
    backward, each phase the larger; a 16-bit ``dtype`` adds the negatives' float32 copy (then
    its float32 gradient) to the walks' phases.

    E.g. the family at N = M = 262144, D = 768, bf16 on 132 SMs: 84.5 MiB forward + 483 MiB backward
    (the N×N chunk pair; the N×M block's chunk is smaller).

    E.g. N = 262144, D = 768, bf16, γ = 0.5 on 132 SMs: 79 MiB of statistics + 483 MiB of backward
    (a chunk pair of 6656 × 6656: two 169 MiB float32 staging W's, one 84.5 MiB float16 rounding,
    21 MiB of slice sums, 39 MiB of float16 feature rows).

    E.g. own negatives at N = 32768, K = 8, D = 768, bf16 on 132 SMs: the block's 1546 MiB forward
    (2 × 768 MiB: n̂ and the negatives' float32 copy, + 10 MiB of (N, K) ones) and 3850 MiB backward
    (5 × 768 MiB + 10 MiB) outweigh the kernels' 10.5 + 483 MiB: 5396 MiB in all (493 MiB without).
    ``reduction="directions"`` at N = 262144, D = 768, bf16: 3 + 256 MiB (float32 walks of one
    direction's rows; "none": 79 + 483 MiB). With own negatives at N = 32768, K = 8, D = 768,
    bf16: the autograd block's 1554 MiB forward (n̂ and the float32 copy, 2 × 768 MiB, + 18 MiB of
    (N, K) ones) and 4626 MiB backward (6 × 768 MiB: the float64 norm's backward) outweigh the
    walks' 0.4 + 256 MiB: 6180 MiB (4644 MiB for float32 negatives).

    Returns: bytes (an int): the sum of the two workspaces, a bound on the peak (they are never live together).
    Raises: ValueError for a dtype other than float16/bfloat16/float32, n, d, local_rows < 1,
    negatives < 0, or ``negatives``/``group_ids`` with ``local_rows`` (the distributed family runs
    two directional walks per rank: state them as two ``local_rows`` calls); own_negatives < 0,
    with ``negatives`` (the operator takes one kind), or with ``local_rows`` and a reduction other
    than "directions" (``local_loss=True`` runs those on backend "torch" only); a ``reduction``
    other than "none", "mean", "sum", "directions"; an unknown ``group_mode``, or a positive one without
    ``group_ids``, with own_negatives, local_rows or "directions", or ``positive_pairs`` outside [n, n²].
    Source: the allocations of :mod:`.forward` and :mod:`.backward`, and of the own negatives'
    host blocks (``tests/backends/test_workspace.py`` counts them).
    """
    if dtype not in _SIZES:
        raise ValueError(f"workspace_bytes: dtype must be one of {sorted(map(str, _SIZES))}, got {dtype}")
    if n < 1 or d < 1 or (local_rows is not None and local_rows < 1):
        raise ValueError(f"workspace_bytes: n, d and local_rows must be positive, got {n}, {d}, {local_rows}")
    if negatives < 0 or ((negatives or group_ids) and local_rows is not None and reduction != "directions"):
        raise ValueError(
            f"workspace_bytes: negatives must be ≥ 0 and, with group_ids, given without local_rows (the "
            f"single-process family loss), got negatives={negatives}, group_ids={group_ids}, local_rows={local_rows}"
        )
    _check_new_options(negatives, own_negatives, local_rows, reduction)
    mode = _check_group_mode(group_mode, positive_pairs, n, group_ids, own_negatives, local_rows, reduction)
    if mode.positives:  # the kernels as under "mask", then the host pass, never live together
        fwd = family_forward_bytes(n, negatives, _SIZES[dtype], label_smoothing != 0.0, device, True)
        bwd = backward_bytes(n, n, d, dtype, symmetric=True)
        if negatives:
            bwd = max(bwd, backward_bytes(n, negatives, d, dtype, rank=False))
        host_fwd, host_bwd = positive_bytes(n, d, positive_pairs)
        return max(fwd, host_fwd) + max(bwd, host_bwd)
    masked = false_negative_threshold is not None or group_ids
    if reduction == "directions":
        rows = n if local_rows is None else int(local_rows)
        fwd, bwd = directions_bytes(rows, n, d, dtype, label_smoothing != 0.0, device, masked, negatives)
        if own_negatives:  # after the walks in the forward, before them in the backward
            threshold = false_negative_threshold is not None
            own_fwd, own_bwd = directions_own_bytes(rows, own_negatives, d, dtype, threshold, normalize)
            # a 16-bit copy lives through the forward's walks, its float32 gradient through the backward's
            copy = 4 * rows * own_negatives * d * (dtype != torch.float32)
            fwd, bwd = max(fwd + copy, own_fwd), max(bwd + copy, own_bwd)
        return fwd + bwd
    if own_negatives:
        fwd = family_forward_bytes(n, 0, _SIZES[dtype], label_smoothing != 0.0, device, masked)
        own_fwd, own_bwd = own_bytes(n, own_negatives, d, dtype, false_negative_threshold is not None, normalize)
        return max(fwd, own_fwd) + max(backward_bytes(n, n, d, dtype, symmetric=True), own_bwd)
    if negatives or group_ids:
        fwd = family_forward_bytes(n, negatives, _SIZES[dtype], label_smoothing != 0.0, device, masked)
        bwd = backward_bytes(n, n, d, dtype, symmetric=True)
        if negatives:
            bwd = max(bwd, backward_bytes(n, negatives, d, dtype, rank=False))
        return fwd + bwd
    columns = local_rows is None
    m = n if columns else int(local_rows)
    return forward_bytes(
        m, n, _SIZES[dtype], columns, label_smoothing != 0.0, device, masked=false_negative_threshold is not None
    ) + backward_bytes(m, n, d, dtype, symmetric=columns)


def _check_new_options(negatives: int, own_negatives: int, local_rows, reduction: str) -> None:
    """The own negatives' and the reduction's refusals (:func:`workspace_bytes`'s Raises)."""
    if reduction not in ("none", "mean", "sum", "directions"):
        raise ValueError(f"workspace_bytes: reduction must be 'none', 'mean', 'sum' or 'directions', got {reduction!r}")
    if own_negatives < 0:
        raise ValueError(f"workspace_bytes: own_negatives (K per row) must be ≥ 0, got {own_negatives}")
    if own_negatives and (negatives or (local_rows is not None and reduction != "directions")):
        raise ValueError(
            "workspace_bytes: own_negatives (each row's K) takes no shared negatives, and local_rows only with "
            "reduction='directions' (local_loss=True runs the other reductions on backend='torch'; local_loss=False: "
            f"pass the gathered N); got own_negatives={own_negatives}, negatives={negatives}, local_rows={local_rows}, "
            f"reduction={reduction!r}"
        )


def _check_group_mode(group_mode, positive_pairs: int, n: int, group_ids: bool, own, local_rows, reduction):
    """The positive modes' refusals (:func:`workspace_bytes`'s Raises); the mode, typed."""
    try:
        mode = GroupMode(group_mode)
    except ValueError:
        raise ValueError(
            f"workspace_bytes: group_mode must be 'mask', 'supcon' or 'mil_nce', got {group_mode!r}"
        ) from None
    if not mode.positives:
        return mode
    if not group_ids or own or local_rows is not None or reduction == "directions":
        raise ValueError(
            f"workspace_bytes: group_mode={mode.value!r} is stated for the single-process loss with group_ids=True, "
            "without own_negatives, local_rows or reduction='directions'; got "
            f"group_ids={group_ids}, own_negatives={own}, local_rows={local_rows}, reduction={reduction!r}"
        )
    if not n <= positive_pairs <= n * n:
        raise ValueError(
            f"workspace_bytes: positive_pairs (Σ over groups of |G|², e.g. torch.bincount(group_ids).pow(2).sum()) "
            f"must lie in [n, n²] = [{n}, {n * n}] under group_mode={mode.value!r}, got {positive_pairs}"
        )
    return mode


def sigmoid_bytes(rows: int, columns: int, d: int, dtype: torch.dtype, device=None) -> int:
    """Bytes the Triton sigmoid (SigLIP) loss (``hnclip::triton_sigmoid_nll``) allocates beyond its
    inputs and outputs for one forward and backward, in the GPU launch configuration: R = ``rows``
    image rows against ``columns`` = C + M keys, features of ``dtype`` and width D. The forward's
    row partials (splits, 3, R) float32, freed before it returns, plus the backward's dS chunk (the
    directional op's, :func:`backward_bytes` with ``rank=False``); none without feature gradients.
    (With negatives, ``sigmoid_pairs_triton`` also concatenates the keys [txt; negatives], an
    (C + M, D) input of the operator.) Raises ValueError as :func:`workspace_bytes`."""
    if dtype not in _SIZES:
        raise ValueError(f"sigmoid_bytes: dtype must be one of {sorted(map(str, _SIZES))}, got {dtype}")
    if rows < 1 or columns < 1 or d < 1:
        raise ValueError(f"sigmoid_bytes: rows, columns and d must be positive, got {rows}, {columns}, {d}")
    with cfg.forced_launch("gpu"):
        _, _, splits, _ = cfg.fwd_grid(rows, columns, _SIZES[dtype], False, _device(device))
    return 4 * 3 * splits * rows + backward_bytes(rows, columns, d, dtype, rank=False)
