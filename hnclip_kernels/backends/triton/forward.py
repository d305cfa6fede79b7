"""Forward host walks: the logits' row (and column) statistics, launched kernel by kernel.

:func:`directional_stats` and :func:`rank_stats` launch one row walk (``_fwd_kernel``,
``_fwd_rank_kernel``) and merge its partials; :func:`symmetric_stats` walks the tile pairs
slab by slab (``_fwd_pair_kernel``), folding each slab's partials into running summaries. The
kernels are in :mod:`.forward_kernels`, the fold and the merge in :mod:`.merge`.

Workspace (float32, planes = 3, or 4 with label smoothing, one more with masking): directional,
the row partials; symmetric, the running summaries (planes, 2N) and one slab's partials (slab
row blocks, planes, 2N) + (splits, planes, 2 · slab rows); :func:`.workspace.forward_bytes`
states it, e.g. 79 MiB at N = 262144 with 16-bit features on 132 SMs. Nothing of size N × N
or N² / BLOCK.
"""

from __future__ import annotations

import torch

from .. import softmax
from . import config as cfg
from .forward_kernels import launch_fwd, launch_fwd_pair, launch_fwd_rank
from .merge import launch_fold, merge_stats
from .params import Scalars


def _planes(sc: Scalars) -> int:
    """Planes of a partial summary: (max, Σexp, Σexp·d), Σd with label smoothing, #kept with masking."""
    return (4 if sc.smoothing else 3) + sc.masked


def symmetric_stats(ops, norms, pos, sc: Scalars):
    """(rows, columns) ``backends.softmax.RowStats`` of the symmetric loss (M = N, offset 0) from one
    walk over the tile pairs: :func:`symmetric_summaries` merged."""
    n = ops[0].shape[0]
    acc = symmetric_summaries(ops, norms, pos, sc)
    return (
        softmax.RowStats(pos, *merge_stats(acc, sc.smoothing, n, n, sc.masked)),
        softmax.RowStats(pos, *merge_stats(acc, sc.smoothing, 0, n, sc.masked)),
    )


def symmetric_summaries(ops, norms, pos, sc: Scalars):
    """The symmetric walk's running summaries (1, planes, 2N) float32, line c column c's (t2i row
    c), line N + r row r's (i2t row r), before :func:`.merge.merge_stats`.

    ``ops`` = (v, t) (N, D), ``norms`` their float32 inverse row norms, ``pos`` the positives Z_ii,
    ``sc`` the operator's scalars (with ``sc.thr`` the masked entries leave both directions'
    statistics, which gain ``kept``).

    ``_fwd_pair_kernel`` walks the tile pairs (Z_IJ and Z_JIᵀ from 3 products sharing G_IJ =
    t_I t_Jᵀ; the diagonal super-tiles 2 per tile) over the row blocks in slabs (``cfg.fwd_grid``:
    ≈ √(2 · SMs) row blocks, 12 × 22 programs on 132 SMs); each slab splits the columns right of
    its first row among the splits anew (``cfg.split_width``). After each slab ``_fold_kernel``
    folds its row blocks' partials and then its splits' partials into running summaries of 2N
    lines (columns, then rows), slab after slab in order: deterministic, no atomics, O(N)."""
    v, t = ops
    n, d = v.shape
    width = v.element_size()
    block_m = cfg.fwd_block_m(width)
    row_blocks, slab, splits, _ = cfg.fwd_grid(n, n, width, True, v.device)
    planes = _planes(sc)
    # running summaries: line c column c, line N + c row c
    acc = torch.empty(1, planes, 2 * n, device=v.device, dtype=torch.float32)
    for block0 in range(0, row_blocks, slab):
        blocks = min(slab, row_blocks - block0)
        col0 = block0 * block_m
        slab_rows = min(blocks * block_m, n - col0)
        per_split = cfg.split_width(n - col0, splits)  # the slab's columns right of col0 among the splits
        # fresh slab workspaces each time (the previous ones freed first): never views
        col_part = torch.empty(blocks, planes, 2 * n, device=v.device, dtype=torch.float32)
        row_part = torch.empty(splits, planes, 2 * slab_rows, device=v.device, dtype=torch.float32)
        shapes = (n, d, block0, col0, per_split, slab_rows, cfg.n_bucket(n))
        launch_fwd_pair(sc, lambda _, b=blocks: (b, splits), ops, (*norms, pos), (row_part, col_part), shapes)
        # in order: the slab's row blocks' partials (columns and rows right of col0), then its splits'
        launch_fold(col_part, blocks, n, acc, n, 0, block0, block_m, block0 == 0, sc.smoothing, sc.masked)
        launch_fold(row_part, splits, slab_rows, acc, n, col0, 0, 0, False, sc.smoothing, sc.masked)
        del col_part, row_part
    return acc


def directional_stats(ops, norms, pos, sc: Scalars, offset: int):
    """Statistics of Z's rows (``backends.softmax.RowStats``) of the directional op: M queries against
    N keys, row i's positive at column ``offset + i``.

    ``ops`` = (q, k, margin_q, margin_k) features, ``norms`` their float32 inverse row norms,
    ``pos`` the positive logits, ``sc`` the operator's scalars (``sc.thr``: the entries whose
    caption cosine, ``tiles._caption_keep``, is ≥ the threshold are no negatives, and the
    statistics gain ``kept``). ``_fwd_kernel`` over (row blocks × column splits), row partials
    (splits, planes, M, :func:`directional_partials`) merged by ``_merge_kernel``."""
    row_part = directional_partials(ops, norms, pos, sc, offset)
    return softmax.RowStats(pos, *merge_stats(row_part, sc.smoothing, masked=sc.masked))


def directional_partials(ops, norms, pos, sc: Scalars, offset: int):
    """:func:`directional_stats`'s row partials (splits, planes, M) float32, before the merge."""
    q = ops[0]
    m, n, width = q.shape[0], ops[3].shape[0], q.element_size()
    _, row_blocks, splits, per_split = cfg.fwd_grid(m, n, width, False, q.device)
    row_part = torch.empty(splits, _planes(sc), m, device=q.device, dtype=torch.float32)
    shapes = (m, n, q.shape[1], offset, per_split, cfg.n_bucket(n))
    launch_fwd(sc, lambda _: (row_blocks, splits), ops, (*norms, pos), (row_part,), shapes)
    return row_part


def rank_stats(ops, norms, pos, sc: Scalars, offset: int):
    """A distributed rank's i2t and t2i row statistics, one ``backends.softmax.RowStats`` of 2M lines
    (i2t rows, then t2i rows), from one walk (``_fwd_rank_kernel``: the margin's G formed once
    per tile for both).

    ``ops`` = (v, t, v_all, t_all): the local (M, D) and gathered (N, D) features, ``norms`` their
    float32 inverse row norms, ``pos`` (2M) the positives (i2t rows, then t2i rows), ``sc`` as
    :func:`directional_stats` (a pair masked in i2t is masked in t2i too). Grid and workspace:
    the directional op's, over 2M lines: (splits, planes, 2M)."""
    v = ops[0]
    m, n, width = v.shape[0], ops[3].shape[0], v.element_size()
    _, row_blocks, splits, per_split = cfg.fwd_grid(m, n, width, False, v.device)
    row_part = torch.empty(splits, _planes(sc), 2 * m, device=v.device, dtype=torch.float32)
    shapes = (m, n, v.shape[1], offset, per_split, cfg.n_bucket(n))
    launch_fwd_rank(sc, lambda _: (row_blocks, splits), ops, (*norms, pos), (row_part,), shapes)
    return softmax.RowStats(pos, *merge_stats(row_part, sc.smoothing, masked=sc.masked))
