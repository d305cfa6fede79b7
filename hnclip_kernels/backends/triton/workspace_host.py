"""The workspace of the host blocks beside the Triton kernels, for :func:`.workspace.workspace_bytes`:
each row's own negatives (:mod:`...own_negatives`, in the symmetric operator and under
``reduction="directions"``) and the multi-positive targets' pass (:mod:`...positives`). Each
function returns (forward, backward) bytes: the (rows, K, D) or (pairs, D) buffers counted, the
per-pair and per-row ones bounded (``tests/backends/test_workspace.py`` logs them)."""

from __future__ import annotations

import torch

from ..positives import CHUNK_ELEMENTS

# bytes per (row, own negative) the own block's (N, K) temporaries reach at most (gaps, logits, keep
# masks, float64 inverse norms; 17 to 33 measured over the options): a bound, not a count
OWN_ROW_BYTES = 40


def own_bytes(n: int, k: int, d: int, dtype: torch.dtype, threshold: bool, normalize: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes of each row's own negatives (``own_negatives`` of
    ``hnclip::triton_symmetric_nll``, :mod:`..own_negatives`) for N rows of K own negatives of
    width D in ``dtype``: the peak of their float32 (N, K, D) buffers, counted, plus
    ``OWN_ROW_BYTES``·N·K for their (N, K) ones, bounded.

    Forward (``block``): n̂, with 16-bit negatives their float32 copy, with a ``threshold`` their
    unit copy: 1 + [16-bit] + [threshold] buffers. Backward: the block again, then dL/dn̂ beside
    n̂ (2), then the normalisation's chain rule (``epilogue.unnormalize_grad``, n̂ freed before:
    dL/dn̂, its 1/τ multiple, x̂, x̂·radial and the projection): 5 with ``normalize``, else the
    larger of the block's and 2. The (N, K, D) gradient in ``dtype`` is an output."""
    block = 1 + (dtype != torch.float32) + bool(threshold)
    rows = OWN_ROW_BYTES * n * k
    return 4 * n * k * d * block + rows, 4 * n * k * d * (5 if normalize else max(block, 2)) + rows


# bytes per (row, own negative) the directions' own block's (N, K) temporaries reach at most
# (gaps, logits, keep masks, the float64 inverse norms autograd saves; 22 to 62 measured): a bound
DIRECTIONS_OWN_ROW_BYTES = 72


def directions_own_bytes(
    rows: int, k: int, d: int, dtype: torch.dtype, threshold: bool, normalize: bool = True
) -> tuple[int, int]:
    """(forward, backward) bytes of ``reduction="directions"``'s own columns
    (``backends.directions.own_block``/``own_rows``, differentiated by autograd) for ``rows`` i2t
    rows of K own negatives of width D in ``dtype``: the peak of their (R, K, D) buffers, counted,
    plus ``DIRECTIONS_OWN_ROW_BYTES``·R·K for their (R, K) ones, bounded. Autograd's saved tensors
    are workspace from the forward to the backward (they count in both phases while alive).

    Forward (``own_negatives.block``): n̂ (saved), with 16-bit negatives their float32 copy
    (``backends.direction_losses``' upcast, saved by the normalisation), with a ``threshold`` their
    unit copy (freed at once): 4·R·K·D·(1 + [16-bit] + [threshold]). Backward: with ``normalize``
    the float64 norm's backward (its two float64 (R·K, D) temporaries, beside the float32 dL/d own
    of n̂ = own·r and the float32 copy): 4·R·K·D·(5 + [16-bit]); else dL/dn̂ beside the saved n̂:
    4·R·K·D·2. The gradient in ``dtype`` is an output; for 16-bit its float32 one is counted. The
    block runs after the directional walks and autograd runs its backward before theirs, but a
    16-bit copy (4·R·K·D) is made before the forward's walks and its float32 gradient is rounded to
    ``dtype`` after the backward's: :func:`workspace_bytes` adds it to each phase's walks."""
    block = 4 * rows * k * d
    wide = dtype != torch.float32
    row_bytes = DIRECTIONS_OWN_ROW_BYTES * rows * k
    fwd = block * (1 + wide + bool(threshold))
    bwd = block * ((5 + wide) if normalize else 2)
    return fwd + row_bytes, bwd + row_bytes


# bytes per same-group pair (gathered index vectors, gaps, dS: 33 measured) and per row (sorted ids,
# each row's range, segment lengths, the (4, M) statistics: 40 to 48 measured) of the host pass: bounds
POSITIVE_PAIR_BYTES = 40
POSITIVE_ROW_BYTES = 64


def positive_bytes(n: int, d: int, positive_pairs: int) -> tuple[int, int]:
    """(forward, backward) bytes of one direction's host pass (``hnclip::host_positive_fwd`` / ``_bwd``,
    :mod:`..positives`) over N rows and N keys of width D with ``positive_pairs`` = Σ over groups
    of |G|² same-group (row, key) pairs, the rows' own included. A chunk gathers at most
    P = min(pairs, max(CHUNK_ELEMENTS // D, N)) pairs (a row's pairs are never split), P − N of
    them other positives with N = 1 chunk: three float32 (P, D) buffers (q̂ and k̂ gathered, their
    product; in the backward dS·k̂ and dS·q̂ with a gather) counted, plus ``POSITIVE_PAIR_BYTES``·P
    and ``POSITIVE_ROW_BYTES``·N bounded. The backward adds its float32 dL/dq̂ and dL/dk̂ (4·2·N·D),
    live through its chunks. 16-bit features are gathered from their float32 q̂, k̂."""
    chunk = min(positive_pairs, max(CHUNK_ELEMENTS // d, n))
    others = min(chunk, positive_pairs - n)
    bounded = POSITIVE_PAIR_BYTES * chunk + POSITIVE_ROW_BYTES * n
    return 12 * others * d + bounded, 12 * others * d + 8 * n * d + bounded
