"""Host side of the Triton kernels: autotuned twins, the launch switch, workspaces and the
forward/backward launchers the operators call."""
from __future__ import annotations

import torch
import triton

from .. import epilogue
from . import config as cfg
from .kernels import _dscore_kernel, _fwd_kernel, _grad_gemm_kernel, _merge_kernel


def _is_interpreting() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at import
    return "Interpreted" in type(_fwd_kernel).__name__


# autotuned twins of the kernels (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic)
_KEY = ["D", "HAS_MARGIN", "PREC"]
_fwd_tuned = triton.autotune(cfg.all_candidates("fwd"), key=_KEY + ["COL_STATS"],
                             prune_configs_by={"early_config_prune": cfg.pruner("fwd", "q_ptr")})(_fwd_kernel)
_dscore_tuned = triton.autotune(cfg.all_candidates("dscore"), key=_KEY + ["SYMMETRIC"],
                                prune_configs_by={"early_config_prune": cfg.pruner("dscore", "q_ptr")})(_dscore_kernel)
_gemm_tuned = triton.autotune(cfg.all_candidates("gemm"), key=["N", "PREC", "ACCUMULATE"], restore_value=["c_ptr"],
                              prune_configs_by={"early_config_prune": cfg.pruner("gemm", "b_ptr")})(_grad_gemm_kernel)

# How the operators are registered (see the module docstring): triton_op for compiled kernels,
# custom_op under the interpreter (and on a torch without triton_op)
_INTERPRETED = _is_interpreting()
_USE_TRITON_OP = not _INTERPRETED and hasattr(torch.library, "triton_op")
if _USE_TRITON_OP:
    from torch.library import wrap_triton
else:
    def wrap_triton(kernel):
        """Under the interpreter the kernels are launched as they are."""
        return kernel


def _kernel(name: str, tuned: bool):
    """Kernel ``name`` ("fwd", "merge", "dscore", "gemm"), its autotuned twin when ``tuned``, through
    ``torch.library.wrap_triton``: the kernel itself in an eager call of an operator, a traceable
    wrapper (a ``triton_kernel_wrapper`` node per launch) while ``torch.compile`` traces one.
    Spelled out kernel by kernel so that ``triton_op`` finds every kernel of its operators in
    this source (torch hashes their code into its compile-cache keys)."""
    if name == "fwd":
        return wrap_triton(_fwd_tuned) if tuned else wrap_triton(_fwd_kernel)
    if name == "dscore":
        return wrap_triton(_dscore_tuned) if tuned else wrap_triton(_dscore_kernel)
    if name == "gemm":
        return wrap_triton(_gemm_tuned) if tuned else wrap_triton(_grad_gemm_kernel)
    return wrap_triton(_merge_kernel)


def _traced(kernel) -> bool:
    """Is ``kernel`` (from :func:`_kernel`) a traceable wrapper, i.e. is an operator being traced?"""
    return _USE_TRITON_OP and not isinstance(kernel, (triton.runtime.JITFunction, triton.runtime.Autotuner))


def _launch(name: str, width: int, grid, args, **constexprs):
    """Launch kernel ``name`` (its autotuned twin in mode "autotune"); ``grid(tiles)`` maps the
    chosen constexprs to the launch grid.

    Traced, an accumulating GEMM (ACCUMULATE) takes the fixed configuration: torch re-wraps a
    traced autotuner without its ``restore_value``, so benchmarking the candidates outside
    Inductor (``backend="aot_eager"``) would add the product into the output once per candidate."""
    if cfg.launch_mode() == "autotune":
        tuned = _kernel(name, True)
        if not (constexprs.get("ACCUMULATE") and _traced(tuned)):
            tuned[lambda meta: grid(meta)](*args, **constexprs)
            return
    fixed = cfg.heuristic(name, width)
    tiles = {**constexprs, **fixed.constexprs}
    _kernel(name, False)[grid(tiles)](*args, **tiles, num_warps=fixed.num_warps, num_stages=fixed.num_stages)


# ------------------------------------------------------------------ launchers
def _strides(*xs):
    return [s for x in xs for s in x.stride()]


def _merge(part: torch.Tensor, smoothing: bool):
    """(delta, mean_neg, dsum) of each line from its partial summaries (n_parts, planes, L):
    three separate tensors (an operator's outputs may not alias each other)."""
    n_parts, _, length = part.shape
    delta, mean_neg, dsum = (torch.empty(length, device=part.device, dtype=torch.float32) for _ in range(3))
    block = 128 if cfg.launch_mode() != "interpret" else 64
    _kernel("merge", False)[(triton.cdiv(length, block),)](part, n_parts, length, delta, mean_neg, dsum,
                                                           SMOOTHING=smoothing, BLOCK=block)
    return delta, mean_neg, dsum


def _forward_stats(ops, norms, pos, tau32, gamma32, has_margin: bool, offset: int, smoothing: bool, precision,
                   columns: bool = False):
    """Statistics of Z's rows (``epilogue.RowStats``), and with ``columns`` also of Zᵀ's rows
    (M = N, offset 0), from one walk over the tiles. ``tau32``/``gamma32``: 1-element float32
    tensors on the features' device; ``has_margin``: γ ≠ 0 (the kernels skip â b̂ᵀ without it).

    Workspace: 4 bytes × (3, or 4 with label smoothing) × (M · splits + N · ⌈M / BLOCK_M⌉), e.g.
    384 MiB at N = 65536 with 16-bit features (BLOCK_M = 128), nothing at all of size N × N.
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    width = q.element_size()
    block_m = cfg.fwd_block_m(width)
    row_blocks = triton.cdiv(m, block_m)
    splits, per_split = cfg.column_splits(row_blocks, n, q.device)
    planes = 4 if smoothing else 3
    row_part = torch.empty(splits, planes, m, device=q.device, dtype=torch.float32)
    col_part = (torch.empty(row_blocks, planes, n, device=q.device, dtype=torch.float32) if columns
                else row_part)  # unused without COL_STATS
    args = (*ops, *_strides(*ops), *norms, pos, tau32, gamma32, row_part, col_part, m, n, d, offset, per_split)
    _launch("fwd", width, lambda t: (row_blocks, splits), args,
            COL_STATS=columns, SMOOTHING=smoothing, HAS_MARGIN=has_margin, INTERPRET=cfg.is_interpreting(),
            PREC=cfg.dot_precision(q.dtype, precision), BLOCK_M=block_m, BLOCK_K=cfg.score_block_k(width))
    rows = epilogue.RowStats(pos, *_merge(row_part, smoothing))
    if not columns:
        return rows
    return rows, epilogue.RowStats(pos, *_merge(col_part, smoothing))


def _pow2_unit(r: torch.Tensor) -> torch.Tensor:
    """The power of two (a 1-element float32 tensor, no host sync) that brings max(r) into [0.5, 1)."""
    _, exponent = torch.frexp(r.max().reshape(1))
    return torch.ldexp(torch.ones(1, device=r.device), -exponent)


def _gemm(a, b, c, r, accumulate: bool, precision: str):
    """c (+)= (a @ b) / r[:, None] (a may be a transposed view of the workspace)."""
    m, kk = a.shape
    n = b.shape[1]
    args = (a, b, c, r, m, n, kk, *a.stride(), *b.stride(), *c.stride())
    _launch("gemm", b.element_size(), lambda t: (triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"]),), args,
            ACCUMULATE=accumulate, INTERPRET=cfg.is_interpreting(), PREC=precision, GROUP_M=8)


def _rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """x[start:end], or x itself when that is all of it (a traced operator then writes the
    tensor, not a view of it: no scatter back into a base)."""
    return x if (start, end) == (0, x.shape[0]) else x[start:end]


def _backward_shares(ops, norms, stats, g, tau32, gamma32, has_margin: bool, offset: int, precision, key_side=None):
    """Negatives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D), float32.

    ``key_side = (stats, g)`` of the transposed direction makes it symmetric (M = N, offset 0).
    dS is materialised one R × C chunk at a time (R·C·elem ≤ ``cfg.BWD_WORKSPACE_BYTES``: e.g.
    11520 × 11648 for bf16, 8192 × 8192 for float32, 256 MiB); square chunks keep both GEMMs'
    grids full and their reductions long. Chunks run in a fixed order: deterministic.
    """
    q, k, _, _ = ops
    m, d = q.shape
    n = k.shape[0]
    wq, wk = _pow2_unit(norms[0]), _pow2_unit(norms[1])
    # what each GEMM divides out of W = diag(r_q wq) dS diag(r_k wk): its own side's scale and
    # the other side's power of two (all exact: powers of two)
    rq, rk = norms[0] * wq * wk, norms[1] * wk * wq
    width = q.element_size()
    nll = epilogue.row_nll(stats)
    nll_c, g_c = (epilogue.row_nll(key_side[0]), key_side[1]) if key_side else (nll, g)
    rows, cols = cfg.chunk_shape(m, n)
    d_q = torch.empty(m, d, device=q.device, dtype=torch.float32)
    d_k = torch.empty(n, d, device=q.device, dtype=torch.float32)
    prec, grad_prec = cfg.dot_precision(q.dtype, precision), cfg.grad_precision(q.dtype, precision)
    for row0 in range(0, m, rows):
        row_end = min(row0 + rows, m)
        for col0 in range(0, n, cols):
            col_end = min(col0 + cols, n)
            # a fresh workspace per chunk, the previous one freed first (the allocator hands its
            # memory back): never a view into a shared buffer, which a traced operator would
            # write through a scatter
            w = torch.empty(row_end - row0, col_end - col0, device=q.device, dtype=torch.float32)
            args = (*ops, *_strides(*ops), *norms, stats.pos, nll, g, tau32, gamma32, nll_c, g_c, wq, wk, w,
                    *w.stride(), row0, row_end, col0, col_end, d, offset)
            _launch("dscore", width,
                    lambda t: (triton.cdiv(row_end - row0, t["BLOCK_M"]), triton.cdiv(col_end - col0, t["BLOCK_N"])),
                    args, SYMMETRIC=key_side is not None, HAS_MARGIN=has_margin, INTERPRET=cfg.is_interpreting(),
                    PREC=prec, BLOCK_K=cfg.score_block_k(width))
            _gemm(w, _rows(k, col0, col_end), _rows(d_q, row0, row_end), _rows(rq, row0, row_end), col0 > 0,
                  grad_prec)
            _gemm(w.t(), _rows(q, row0, row_end), _rows(d_k, col0, col_end), _rows(rk, col0, col_end), row0 > 0,
                  grad_prec)
            del w
    return d_q, d_k
