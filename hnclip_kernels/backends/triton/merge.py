"""Merging the forward's partial statistics: ``_fold_kernel`` folds each slab's partials of the
symmetric walk into running summaries, ``_merge_kernel`` combines the partials of each line into
its statistics, both in a fixed order (no atomics), with their launchers beside them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import config as cfg
from .launch import wrap_triton
from .softmax import _combine, _load_partial, _merge_stats, _store_partial
from .tiles import _load_count, _store_count


@triton.jit
def _fold_kernel(part_ptr, n_parts, H, acc_ptr, N, acc0, block0, block_rows, FIRST: tl.constexpr,
                 SMOOTHING: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Fold ``n_parts`` summaries of 2H lines into the running summaries of 2N lines, in order.
    Grid: ⌈2H / BLOCK⌉.

    part_ptr (n_parts, planes, 2H) float32 (as ``_fwd_pair_kernel`` stores them): local line
    l < H is line acc0 + l of acc_ptr, line H + l is line N + acc0 + l; acc_ptr (planes, 2N)
    float32, the running summaries (line c: column c, line N + c: row c), read (unless FIRST)
    and written. Part p covers only the lines of columns c ≥ (block0 + p)·block_rows and of rows
    c ≥ (block0 + p + 1)·block_rows (those its row block's tiles reach; the others are left out:
    the empty summary, which changes nothing to the bit). planes =
    3 + SMOOTHING + MASK (MASK: the kept-negative counts, summed). No line is touched by two
    programs: no atomics.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < 2 * H
    upper = offs >= H
    c = acc0 + tl.where(upper, offs - H, offs)
    line = c + tl.where(upper, N, 0)
    acc = _load_partial(acc_ptr, 2 * N, line, mask & (not FIRST), SMOOTHING)
    kept = tl.zeros((BLOCK,), tl.float32)
    if MASK:
        kept = _load_count(acc_ptr, 2 * N, line, mask & (not FIRST), SMOOTHING)
    base = part_ptr
    for p in range(0, n_parts):
        covered = mask & (c >= (block0 + p + upper.to(tl.int32)) * block_rows)
        acc = _merge_stats(acc, _load_partial(base, 2 * H, offs, covered, SMOOTHING))
        if MASK:
            kept += _load_count(base, 2 * H, offs, covered, SMOOTHING)
        base += (3 + SMOOTHING + MASK) * 2 * H  # pointer steps: no int32 product overflows
    _store_partial(acc_ptr, 2 * N, line, mask, acc, SMOOTHING)
    if MASK:
        _store_count(acc_ptr, 2 * N, line, mask, kept, SMOOTHING)


@triton.jit
def _merge_kernel(part_ptr, n_parts, L, line0, plane_stride, delta_ptr, mean_neg_ptr, dsum_ptr, kept_ptr,
                  SMOOTHING: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Combine ``n_parts`` summaries of each of L lines, in order. Grid: ⌈L / BLOCK⌉.

    Input: part_ptr float32, n_parts summaries of planes = 3 + SMOOTHING planes, ``plane_stride``
        entries apart (a part: planes · plane_stride), line l of a plane at line0 + l: the row
        partials (n_parts, planes, L) of ``_fwd_kernel`` (line0 0, plane_stride L), or one half of
        the symmetric walk's summaries (1, planes, 2N) (line0 0 for the columns, N for the rows).
    Outputs (L each, float32): delta_ptr = LSE(d) (−inf without negatives), mean_neg_ptr =
        E_softmax[d], dsum_ptr = Σd (0 without SMOOTHING); with MASK kept_ptr = the kept negatives.
    Constexprs: SMOOTHING (the partials carry Σd), MASK (and the counts), BLOCK lines per program.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    sum_exp = tl.zeros((BLOCK,), tl.float32)
    wsum = tl.zeros((BLOCK,), tl.float32)
    dsum = tl.zeros((BLOCK,), tl.float32)
    kept = tl.zeros((BLOCK,), tl.float32)
    planes = 3 + SMOOTHING + MASK
    base = part_ptr + line0 + offs
    for _ in range(0, n_parts):
        part = (tl.load(base, mask=mask, other=0.0), tl.load(base + plane_stride, mask=mask, other=0.0),
                tl.load(base + 2 * plane_stride, mask=mask, other=0.0))
        top, sum_exp, wsum = _combine((top, sum_exp, wsum), part)
        if SMOOTHING:
            dsum += tl.load(base + 3 * plane_stride, mask=mask, other=0.0)
        if MASK:
            kept += tl.load(base + (3 + SMOOTHING) * plane_stride, mask=mask, other=0.0)
        base += planes * plane_stride  # pointer steps: the workspace passes 2^31 entries near N = 2^18
    has_neg = sum_exp > 0.0
    delta = tl.where(has_neg, top + tl.log(tl.where(has_neg, sum_exp, 1.0)), float("-inf"))
    delta = tl.where(sum_exp != sum_exp, sum_exp, delta)  # a NaN anywhere in the line stays visible in the loss
    tl.store(delta_ptr + offs, delta, mask=mask)
    tl.store(mean_neg_ptr + offs, tl.where(has_neg, wsum / tl.where(has_neg, sum_exp, 1.0), 0.0), mask=mask)
    tl.store(dsum_ptr + offs, dsum, mask=mask)
    if MASK:
        tl.store(kept_ptr + offs, kept, mask=mask)


def _block_lines() -> int:
    """Lines per program of the fold and the merge (fewer programs under the interpreter)."""
    return 128 if cfg.launch_mode() != "interpret" else 64


def launch_fold(part, n_parts: int, h: int, acc, n: int, acc0: int, block0: int, block_rows: int, first: bool,
                smoothing: bool, masked: bool):
    """Fold ``part`` (n_parts, planes, 2H) into ``acc`` (planes, 2N) with ``_fold_kernel`` (its arguments)."""
    block = _block_lines()
    wrap_triton(_fold_kernel)[(triton.cdiv(2 * h, block),)](
        part_ptr=part, n_parts=n_parts, H=h,  # the partial summaries
        acc_ptr=acc, N=n, acc0=acc0, block0=block0, block_rows=block_rows,  # the running ones and where they go
        FIRST=first, SMOOTHING=smoothing, MASK=masked, BLOCK=block,
    )


def merge_stats(part: torch.Tensor, smoothing: bool, line0: int = 0, length: int | None = None, masked: bool = False):
    """(delta, mean_neg, dsum, kept) of lines line0 … line0 + length of the partial summaries
    (n_parts, planes, L) (default: all L), by ``_merge_kernel``: separate tensors (an operator's
    outputs may not alias each other); ``kept`` the kept-negative counts with ``masked``, else None."""
    n_parts, _, plane = part.shape
    length = plane if length is None else length
    delta, mean_neg, dsum = (torch.empty(length, device=part.device, dtype=torch.float32) for _ in range(3))
    kept = torch.empty(length, device=part.device, dtype=torch.float32) if masked else None
    block = _block_lines()
    wrap_triton(_merge_kernel)[(triton.cdiv(length, block),)](
        part_ptr=part, n_parts=n_parts, L=length, line0=line0, plane_stride=plane,  # the partial summaries
        delta_ptr=delta, mean_neg_ptr=mean_neg, dsum_ptr=dsum, kept_ptr=kept,  # the merged statistics
        SMOOTHING=smoothing, MASK=masked, BLOCK=block,
    )
    return delta, mean_neg, dsum, kept
