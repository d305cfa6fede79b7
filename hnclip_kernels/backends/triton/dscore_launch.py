"""The dS kernels' launchers (split from :mod:`.dscore` by role): their autotuned twins, the
argument builders of the pair and rank kernels (``dscore.dscore_args`` stays beside its kernel),
and one named launcher per kernel (``launch_dscore`` … ``launch_dscore_rank``), which the backward
walks (:mod:`.backward`) call by name: ``torch.library.triton_op`` follows those calls down to
``wrap_triton(<kernel>)`` (see :mod:`.launch`).
"""
from __future__ import annotations

import triton

from . import config as cfg
from .dscore import _dscore_kernel, _dscore_pair_kernel, _dscore_rank_kernel, dscore_args
from .launch import launch, wrap_triton
from .params import Scalars

# autotuned twins (GPU only; the interpreter and HNCLIP_AUTOTUNE=0 use cfg.heuristic). Key: D,
# HAS_MARGIN, PREC (MASK, SHIFT and ROUND16 derive from their pointers: ``launch.derived``);
# the pruner keeps the operand width's candidates, less those SHIFT spills with
_KEY = ["D", "HAS_MARGIN", "PREC"]
_dscore_tuned = triton.autotune(cfg.all_candidates("dscore"), key=_KEY,
                                prune_configs_by={"early_config_prune": cfg.pruner("dscore", "q_ptr")})(_dscore_kernel)
_dscore_pair_tuned = triton.autotune(cfg.all_candidates("dscore_pair"), key=_KEY,
                                     prune_configs_by={"early_config_prune": cfg.pruner("dscore_pair", "v_ptr")}
                                     )(_dscore_pair_kernel)
_dscore_rank_tuned = triton.autotune(cfg.all_candidates("dscore_rank"), key=_KEY,
                                     prune_configs_by={"early_config_prune": cfg.pruner("dscore_rank", "v_ptr")}
                                     )(_dscore_rank_kernel)


def _chunk_grid(args: dict):
    """The launch grid of a chunk [row0, row_end) × [col0, col_end) for the chosen tiles."""
    rows, cols = args["row_end"] - args["row0"], args["col_end"] - args["col0"]
    return lambda tiles: (triton.cdiv(rows, tiles["BLOCK_M"]), triton.cdiv(cols, tiles["BLOCK_N"]))


def _constexprs(sc: Scalars, width: int) -> dict:  # the dS kernels' explicit constexprs
    return dict(HAS_MARGIN=sc.margin_tile, PREC=sc.prec, SLICE=cfg.RESIDUAL_SLICE, BLOCK_K=cfg.score_block_k(width))


def dscore_pair_args(features, per_row, sc: Scalars, outputs, shapes) -> dict:
    """``_dscore_pair_kernel``'s arguments by name (as :func:`dscore_args`): ``features`` = (v, t);
    ``per_row`` = (rv, rt, pos, nll, g, nll_c, g_c, a, b, s, s_c); the scalars and ``sc.family``'s
    group ids; ``outputs`` = (w, res_r, res_c,
    (W_ba's offset, its row maxima's, its column maxima's)); ``shapes`` = (row0, row_end, col0, col_end, D)."""
    v, t = features
    rv, rt, pos, nll, g, nll_c, g_c, a, b, s, s_c = per_row
    logit_scale, gamma, thr = sc.pointers
    ids = sc.family.pair_ids()
    w, res_r, res_c, (mirror_w, mirror_r, mirror_c) = outputs
    row0, row_end, col0, col_end, d = shapes
    return dict(
        v_ptr=v, t_ptr=t, stride_vm=v.stride(0), stride_vd=v.stride(1), stride_tm=t.stride(0), stride_td=t.stride(1),
        rv_ptr=rv, rt_ptr=rt, pos_ptr=pos, nll_ptr=nll, g_ptr=g, nll_c_ptr=nll_c, g_c_ptr=g_c,
        a_ptr=a, b_ptr=b, s_ptr=s, s_c_ptr=s_c,
        logit_scale_ptr=logit_scale, gamma_ptr=gamma, thr_ptr=thr, gk_ptr=ids, K=0 if ids is None else ids.shape[0],
        w_ptr=w, res_r_ptr=res_r, res_c_ptr=res_c, mirror_w=mirror_w, mirror_r=mirror_r, mirror_c=mirror_c,
        row0=row0, row_end=row_end, col0=col0, col_end=col_end, D=d,
    )


def dscore_rank_args(features, per_row, sc: Scalars, outputs, shapes) -> dict:
    """``_dscore_rank_kernel``'s arguments by name (as :func:`dscore_args`): ``features`` = (v, t,
    v_all, t_all); ``per_row`` = (rv, rt, rv_all, rt_all, pos, nll, g, a, b, s); ``outputs`` = (w,
    res_r, res_c, (the t2i W's offset, its row maxima's, its column maxima's)); ``shapes`` = (M, N,
    row0, row_end, col0, col_end, D, offset)."""
    v, t, va, ta = features
    rv, rt, rva, rta, pos, nll, g, a, b, s = per_row
    logit_scale, gamma, thr = sc.pointers
    w, res_r, res_c, (second_w, second_r, second_c) = outputs
    m, n, row0, row_end, col0, col_end, d, offset = shapes
    return dict(
        v_ptr=v, t_ptr=t, va_ptr=va, ta_ptr=ta,
        stride_vm=v.stride(0), stride_vd=v.stride(1), stride_tm=t.stride(0), stride_td=t.stride(1),
        stride_van=va.stride(0), stride_vad=va.stride(1), stride_tan=ta.stride(0), stride_tad=ta.stride(1),
        rv_ptr=rv, rt_ptr=rt, rva_ptr=rva, rta_ptr=rta, pos_ptr=pos, nll_ptr=nll, g_ptr=g, a_ptr=a, b_ptr=b, s_ptr=s,
        logit_scale_ptr=logit_scale, gamma_ptr=gamma, thr_ptr=thr,
        w_ptr=w, res_r_ptr=res_r, res_c_ptr=res_c, second_w=second_w, second_r=second_r, second_c=second_c,
        M=m, N=n, row0=row0, row_end=row_end, col0=col0, col_end=col_end, D=d, offset=offset,
    )


def launch_dscore(sc: Scalars, features, per_row, outputs, shapes):
    """Launch ``_dscore_kernel`` over one chunk (arguments: :func:`dscore_args`; autotuned, or
    ``cfg.heuristic``, see :func:`.launch.launch`)."""
    args, width = dscore_args(features, per_row, sc, outputs, shapes), features[0].element_size()
    launch(lambda tuned: wrap_triton(_dscore_tuned) if tuned else wrap_triton(_dscore_kernel), "dscore", width,
           _chunk_grid(args), args, **_constexprs(sc, width))


def launch_dscore_pair(sc: Scalars, features, per_row, outputs, shapes):
    """Launch ``_dscore_pair_kernel`` over a chunk pair (arguments: :func:`dscore_pair_args`)."""
    args, width = dscore_pair_args(features, per_row, sc, outputs, shapes), features[0].element_size()
    launch(lambda tuned: wrap_triton(_dscore_pair_tuned) if tuned else wrap_triton(_dscore_pair_kernel),
           "dscore_pair", width, _chunk_grid(args), args, **_constexprs(sc, width))


def launch_dscore_rank(sc: Scalars, features, per_row, outputs, shapes):
    """Launch ``_dscore_rank_kernel`` over one chunk (arguments: :func:`dscore_rank_args`)."""
    args, width = dscore_rank_args(features, per_row, sc, outputs, shapes), features[0].element_size()
    launch(lambda tuned: wrap_triton(_dscore_rank_tuned) if tuned else wrap_triton(_dscore_rank_kernel),
           "dscore_rank", width, _chunk_grid(args), args, **_constexprs(sc, width))
