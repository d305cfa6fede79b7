"""Launch configuration of the Triton kernels: tiles, warps, stages, precision, workspaces.

Three launch modes (``launch_mode()``):

* ``"interpret"``: Triton's CPU interpreter (``TRITON_INTERPRET=1``): fixed small tiles,
  because the interpreter pays per program, not per flop.
* ``"gpu"``: the GPU's configuration, the first autotune candidate that survives pruning
  (a measured-heuristic choice, no benchmarking). Used on a GPU with ``HNCLIP_AUTOTUNE=0``,
  and under the interpreter with ``HNCLIP_TRITON_LAUNCH=gpu`` so that CPU tests and the
  work counter (``python -m tools.work``) see the tiles a GPU runs.
* ``"autotune"``: on a GPU by default: ``triton.autotune`` over the pruned candidates.

Every candidate below compiles for sm_90a (H100/H200) without register spills and within
the 227 KiB shared-memory limit: ``tests/tooling/test_sm90_compile.py`` holds that guarantee on CPU.

Under the interpreter (``precision.INTERPRET``, the one answer to "are the kernels
interpreted?") ``tl.dot`` operands are upcast (the
interpreter multiplies raw bf16 bits, triton#11584) and rounded the way the GPU's tensor
cores round them for the chosen input precision (see ``precision._dot``), so a CPU run
computes what a GPU computes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

# the modes and their default live with the checks (validation.resolve_precision applies it)
from ...validation import DEFAULT_FP32_PRECISION, FP32_PRECISIONS  # noqa: F401
from .precision import INTERPRET

# Backward workspace: dS is materialised chunk by chunk (R rows × C columns) and multiplied by the
# features in torch GEMMs; e·R·C stays within this many bytes, e the bytes a W entry costs
# (``W_ENTRY_BYTES``: float32 W, and for 16-bit features its float16 rounding, fp16's with a tail).
BWD_WORKSPACE_BYTES = 256 << 20
W_ENTRY_BYTES = {torch.float32: 4, torch.bfloat16: 4 + 2, torch.float16: 4 + 4}

SM_COUNT_IF_UNKNOWN = 132  # an H100/H200: the grid heuristics' target when no GPU can be asked
INTERPRET_TILE = 32

# the dS kernels' residual sums' slice: every dS tile (32, 64 or 128 wide) holds whole slices, so
# the partial buffers' layout does not depend on the tile an autotuner picks
RESIDUAL_SLICE = 32


# a launch mode forced for the current context (``forced_launch``): workspace_bytes asks what
# the GPU launch configuration allocates from any process, the interpreter's included
_FORCED_MODE: contextvars.ContextVar = contextvars.ContextVar("hnclip_forced_launch_mode", default=None)


@contextlib.contextmanager
def forced_launch(mode: str):
    """Within the block, ``launch_mode()`` answers ``mode`` (the tiles and grids of that mode)."""
    token = _FORCED_MODE.set(mode)
    try:
        yield
    finally:
        _FORCED_MODE.reset(token)


def launch_mode() -> str:
    """ "interpret", "gpu" or "autotune" (see the module docstring)."""
    forced = _FORCED_MODE.get()
    if forced is not None:
        return forced
    if INTERPRET:
        return "gpu" if os.environ.get("HNCLIP_TRITON_LAUNCH", "") == "gpu" else "interpret"
    return "gpu" if os.environ.get("HNCLIP_AUTOTUNE", "1") == "0" else "autotune"


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # the interpreter: few "SMs", so small test shapes still walk several column blocks per program
    return 4 if launch_mode() == "interpret" else SM_COUNT_IF_UNKNOWN


def dot_precision(dtype: torch.dtype, precision: str) -> str:
    """``input_precision`` of the score products for features of ``dtype``: ``precision`` (a
    resolved mode) for float32; "ieee" for 16-bit operands, whose products are exact in float32
    accumulation (Triton ignores the mode for them)."""
    if dtype == torch.float32:
        return precision
    return "ieee"


# ------------------------------------------------------------------ autotune candidates
# Tiles of the score kernels (forward and dS). BLOCK_K is fixed per input width, never tuned:
# the forward and the backward must form every logit tile with the same reduction order, so
# the backward's probabilities agree to the bit with the forward's statistics (|Z| ~ 1e8).
# BLOCK_M of the forward is fixed too: its slabs (``fwd_grid``) are whole row blocks, and the
# forward workspace (``workspace.forward_bytes``) follows from the grid.
FWD_BLOCK_M = {2: 128, 4: 64}  # by element size
SCORE_BLOCK_K = {2: 64, 4: 32}


def _cfg(num_warps, num_stages, **tiles):
    return triton.Config(tiles, num_warps=num_warps, num_stages=num_stages)


# by operand width (bytes): only candidates that compile for sm_90a without spills
# (registers are the limit: two float32 tiles when γ ≠ 0, plus the column statistics)
CANDIDATES = {
    "fwd": {2: [_cfg(8, 4, BLOCK_N=64), _cfg(8, 3, BLOCK_N=64)], 4: [_cfg(4, 3, BLOCK_N=32), _cfg(8, 2, BLOCK_N=64)]},
    # the symmetric walk over tile pairs: three float32 tiles (Z_IJ, Z_JIᵀ, G_IJ) when γ ≠ 0; sm_90a
    # --quick: 128x64 at 8 warps spills 28-160 B, 128x32 at 4 warps 200-360 B; float32 64x32 spills
    # 44-196 B with the margin (tf32x3), 64x16 at 4 warps is clean (255 registers)
    "pair": {2: [_cfg(8, 3, BLOCK_N=32), _cfg(8, 4, BLOCK_N=32)], 4: [_cfg(4, 2, BLOCK_N=16)]},
    # a rank's two directions (``forward_kernels._fwd_rank_kernel``): three float32 tiles (Z, Z', G) like
    # the pair walk, the forward's BLOCK_M; only row statistics, so 128 x 64 fits (sm_90a, D 512-1024,
    # γ and ε on and off: 236-250 registers, no spills; 128 x 32: 168-197) and tiles as ``_fwd_kernel``
    "rank": {2: [_cfg(8, 3, BLOCK_N=64), _cfg(8, 3, BLOCK_N=32), _cfg(8, 4, BLOCK_N=32)], 4: [_cfg(4, 2, BLOCK_N=16)]},
    "dscore": {
        2: [_cfg(8, 3, BLOCK_M=64, BLOCK_N=128), _cfg(4, 4, BLOCK_M=128, BLOCK_N=64)],
        4: [_cfg(4, 3, BLOCK_M=64, BLOCK_N=32), _cfg(8, 2, BLOCK_M=64, BLOCK_N=64)],
    },
    # the symmetric loss's chunk pairs (``dscore._dscore_pair_kernel``): the pair forward's tiles
    # (Z_IJ, Z_JIᵀ and G_IJ live together), BLOCK_N dividing BLOCK_M
    # (128 x 64 spills 8 B with fp16's tail and the margin: 255 registers)
    "dscore_pair": {
        2: [_cfg(8, 3, BLOCK_M=128, BLOCK_N=32), _cfg(8, 4, BLOCK_M=128, BLOCK_N=32)],
        4: [_cfg(4, 2, BLOCK_M=64, BLOCK_N=16)],
    },
    # a rank's two directions' dS (``dscore._dscore_rank_kernel``): 128 x 64 first (wgmma m64n64;
    # sm_90a, D 512-1024: 184-222 registers, no spills), 128 x 32 (112-130) after it
    "dscore_rank": {
        2: [
            _cfg(8, 3, BLOCK_M=128, BLOCK_N=64),
            _cfg(8, 3, BLOCK_M=128, BLOCK_N=32),
            _cfg(8, 4, BLOCK_M=128, BLOCK_N=32),
        ],
        4: [_cfg(4, 2, BLOCK_M=64, BLOCK_N=16)],
    },
    # the sigmoid loss (``sigmoid_kernels``): the forward's and the dS kernel's tiles (x and, with the
    # text margin, the margin's product live together, as in "fwd" / "dscore")
    "sig_fwd": {
        2: [_cfg(8, 3, BLOCK_N=64), _cfg(8, 4, BLOCK_N=64)],
        4: [_cfg(4, 3, BLOCK_N=32), _cfg(8, 2, BLOCK_N=64)],
    },
    "sig_dscore": {
        2: [_cfg(8, 3, BLOCK_M=64, BLOCK_N=128), _cfg(4, 4, BLOCK_M=128, BLOCK_N=64)],
        4: [_cfg(4, 3, BLOCK_M=64, BLOCK_N=32), _cfg(8, 2, BLOCK_M=64, BLOCK_N=64)],
    },
    # 16-bit W's rounding of a staged float32 chunk (``round16._round16_kernel``): elementwise, memory-bound
    "round16": {2: [_cfg(4, 2, BLOCK_M=64, BLOCK_N=64)]},
    # (the backward's GEMMs are torch's: cuBLAS on CUDA, see backward.py's walks)
}


# the paired dS forms every logit in the forward's role (direct, mirror, diagonal super-tile: the
# split precisions' mirror differs in the last bits, ``tiles._pair_tiles``), so its rows are the forward's
assert all(c.kwargs["BLOCK_M"] == FWD_BLOCK_M[w] for w, cs in CANDIDATES["dscore_pair"].items() for c in cs)


# False-negative masking with label smoothing (the dS kernels' SHIFT constexpr, one more float32
# operand per tile): sm_90a spills 4 B for the fp16 directional dS (head and tail) at 128x64 / 4
# warps (255 registers without it; bf16 fits), so the autotuner drops that candidate there
# (compile_sm90.py --override MASK=True,SHIFT=True shows the spill). By feature dtype.
SHIFT_SPILLS = {"dscore": {torch.float16: [_cfg(4, 4, BLOCK_M=128, BLOCK_N=64)]}}
# The hard-negative family's mask captions (CAPTIONS, from ``cq_ptr``: a threshold with
# margin="image_text"; ``family_tiles``) with group ids and the margin: sm_90a (tools.sm90 --quick
# --thresholds none,0.9) spills 200-224 B for the 16-bit dS at 128x64 / 4 warps and 68-76 B for
# the float32 forward at 64x64 / 8 warps; the first candidates are clean (the "gpu" launch's).
CAPTION_SPILLS = {
    "dscore": {dt: [_cfg(4, 4, BLOCK_M=128, BLOCK_N=64)] for dt in (torch.float16, torch.bfloat16)},
    "fwd": {torch.float32: [_cfg(8, 2, BLOCK_N=64)]},
}


def all_candidates(kernel: str) -> list:
    return [c for width in sorted(CANDIDATES[kernel]) for c in CANDIDATES[kernel][width]]


def candidates(kernel: str, elem_size: int) -> list:
    return CANDIDATES[kernel][elem_size]


def pruner(kernel: str, width_arg: str):
    """``early_config_prune`` for ``triton.autotune``: keep the configs that are candidates of
    the operand width found in the launch's argument ``width_arg`` (a tensor), less those that
    spill with SHIFT (``SHIFT_SPILLS``; SHIFT derives from ``s_ptr``, see ``dscore``: the pruner
    runs before the kernel's heuristics) or with the family's CAPTIONS (``CAPTION_SPILLS``, ``cq_ptr``). The configs are matched by their tiles, warps and
    stages, not by identity: traced, torch hands the pruner copies that also carry the derived
    flags."""

    def prune(configs, named_args, **kwargs):
        x = named_args.get(width_arg, kwargs.get(width_arg))
        allowed = candidates(kernel, x.element_size())
        if named_args.get("s_ptr", kwargs.get("s_ptr")) is not None:
            spills = SHIFT_SPILLS.get(kernel, {}).get(x.dtype, [])
            allowed = [c for c in allowed if not any(_same(c, bad) for bad in spills)] or allowed
        if named_args.get("cq_ptr", kwargs.get("cq_ptr")) is not None:
            spills = CAPTION_SPILLS.get(kernel, {}).get(x.dtype, [])
            allowed = [c for c in allowed if not any(_same(c, bad) for bad in spills)] or allowed
        return [c for c in configs if any(_same(c, a) for a in allowed)]

    return prune


def _same(config, candidate) -> bool:
    """Is ``config`` the launch of ``candidate`` (its tiles, warps and stages; other kwargs aside)?"""
    return all(config.kwargs.get(k) == v for k, v in candidate.kwargs.items()) and (
        config.num_warps,
        config.num_stages,
    ) == (candidate.num_warps, candidate.num_stages)


@dataclass(frozen=True)
class Fixed:
    """The non-tuned launch choice of one kernel call: constexpr tiles plus warps/stages."""

    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2


def heuristic(kernel: str, elem_size: int) -> Fixed:
    """The launch of mode "gpu" (first surviving candidate) or "interpret" (small fixed tiles)."""
    if launch_mode() == "interpret":
        t = INTERPRET_TILE
        tiles = {
            "fwd": dict(BLOCK_N=t),
            "pair": dict(BLOCK_N=t),
            "rank": dict(BLOCK_N=t),
            "dscore": dict(BLOCK_M=t, BLOCK_N=t),
            "dscore_pair": dict(BLOCK_M=t, BLOCK_N=t),
            "dscore_rank": dict(BLOCK_M=t, BLOCK_N=t),
            "round16": dict(BLOCK_M=t, BLOCK_N=t),
            "sig_fwd": dict(BLOCK_N=t),
            "sig_dscore": dict(BLOCK_M=t, BLOCK_N=t),
        }[kernel]
        return Fixed(tiles, 1, 1)
    c = candidates(kernel, elem_size)[0]
    return Fixed(dict(c.kwargs), c.num_warps, c.num_stages)


def fwd_block_m(elem_size: int) -> int:
    return INTERPRET_TILE if launch_mode() == "interpret" else FWD_BLOCK_M[elem_size]


def score_block_k(elem_size: int) -> int:
    return INTERPRET_TILE if launch_mode() == "interpret" else SCORE_BLOCK_K[elem_size]


@functools.lru_cache(maxsize=None)
def max_block_n(kernel: str) -> int:
    return max(c.kwargs["BLOCK_N"] for c in all_candidates(kernel))


def column_splits(row_blocks: int, n: int, device: torch.device) -> tuple[int, int]:
    """(splits, columns per split) for the forward grid (row blocks × splits): enough
    programs for two waves on every SM. Each split's width is a multiple of every
    candidate BLOCK_N, so any tile size tiles it."""
    align = INTERPRET_TILE if launch_mode() == "interpret" else max_block_n("fwd")
    col_blocks = triton.cdiv(n, align)
    want = max(1, min(col_blocks, triton.cdiv(2 * sm_count(device), row_blocks)))
    per_split = triton.cdiv(col_blocks, want) * align
    return triton.cdiv(n, per_split), per_split


def split_width(width: int, splits: int) -> int:
    """Columns per split when ``splits`` programs share ``width`` columns: a multiple of every
    candidate BLOCK_N (the symmetric walk re-splits the columns right of each slab)."""
    align = INTERPRET_TILE if launch_mode() == "interpret" else max_block_n("fwd")
    return triton.cdiv(triton.cdiv(width, align), splits) * align


def n_bucket(n: int) -> int:
    """The autotune bucket of a batch of n columns: the power of two ≥ n (at least 1024).

    The forward kernels' autotune key is (D, N bucket, HAS_MARGIN, PREC, SMOOTHING): a
    configuration tuned at N = 4096 is not reused at N = 262144, where the grid walks ~4000
    times more tiles per program; within a bucket the work per program differs by < 2×."""
    return max(1024, 1 << max(0, int(n) - 1).bit_length())


def _row_groups(row_blocks: int, programs: int) -> int:
    """Row blocks per slab of the symmetric forward: the largest divisor of ``programs`` not
    above √programs (so slab × splits fills whole waves), at most ``row_blocks``."""
    root = math.isqrt(programs)
    best = max(g for g in range(1, root + 1) if programs % g == 0)
    return max(1, min(row_blocks, best))


def fwd_grid(m: int, n: int, elem_size: int, columns: bool, device: torch.device) -> tuple[int, int, int, int]:
    """(row blocks, row blocks per slab, column splits, columns per split) of the forward: it
    walks the row blocks (of the forward's BLOCK_M) in slabs, one launch of (slab row blocks ×
    column splits) programs each; columns per split is a multiple of every candidate BLOCK_N.

    Without column statistics (the directional op) one slab holds every row block. With them
    (the symmetric loss) each slab's column partials (slab, planes, N) are folded into running
    summaries before the next slab: a slab is ≈ √(2 · SMs) row blocks (a divisor of 2 · SMs,
    so slab × splits fills whole waves: 12 × 22 on 132 SMs), and the workspace is O(N), about
    100 MiB at N = 262144 in 16 bits, instead of (N / BLOCK_M, planes, N)."""
    row_blocks = triton.cdiv(m, fwd_block_m(elem_size))
    slab = _row_groups(row_blocks, 2 * sm_count(device)) if columns else row_blocks
    splits, per_split = column_splits(slab, n, device)
    return row_blocks, slab, splits, per_split


def chunk_shape(m: int, n: int, square: bool = False, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(R, C): the dS chunk of the backward for features of ``dtype``, e·R·C ≤ BWD_WORKSPACE_BYTES
    (e = ``W_ENTRY_BYTES[dtype]``), as square as M and N allow, sides multiples of the largest
    tile. ``square`` (the symmetric loss's chunk pairs, M = N): R = C."""
    align = INTERPRET_TILE if launch_mode() == "interpret" else 128
    budget = max(align * align, BWD_WORKSPACE_BYTES // W_ENTRY_BYTES[dtype])
    rows = min(m, max(align, int(budget**0.5) // align * align))
    if square:
        return rows, min(n, rows)
    cols = min(n, max(align, budget // rows // align * align))
    return rows, cols
