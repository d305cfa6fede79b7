"""Ahead-of-time sm_90a (H100/H200) compile check of the Triton kernels, without a GPU.

    python -m tools.sm90 [--quick] [--dtypes bf16,fp16,fp32] [--d 64,768] [--gammas 0,0.5]
                              [--smoothings 0,0.1] [--n 4096] [--local-m 512] [--jobs J]
                              [--wide-scalars] [--i64-ints] [--thresholds none,0.9] [--json out.json]
                              [--cache-dir DIR] [--markdown] [--sources family-sym,...]

Run it with TRITON_INTERPRET unset. What it does:

1. Drives, on CPU tensors, forward + backward of the three Triton operators through their
   public wrappers in ``hnclip_kernels.backends.triton.ops``, called as the loss functions
   call them: ``hn_clip_pairs_triton`` (N rows; what ``hn_clip_loss(..., backend="triton")``
   runs), the directional op of the distributed path (``directional_nll_triton``, from
   ``hnclip_kernels.backends.triton_directional()``) for one rank: M local query rows against N
   gathered keys, positives at offset M + i, and that rank's op for both directions
   (``rank_nll_triton``, what the distributed loss runs) (see ``drive_single`` /
   ``drive_directional`` / ``drive_rank``), and the hard-negative family's operator as
   ``backends.family_losses`` runs it (``drive_family``: group ids, the threshold's cosine, the
   mask captions of margin="image_text", and margin="text" as src "family-text") and the family's
   single-process loss with the family, ``hnclip::triton_symmetric_nll`` (``drive_family_sym``: the pair kernels with
   group ids, GROUPS, and the N×M block's directional kernels with ids against an empty id set;
   src "family-sym", margin="image_text" as "family-sym-it", no ids as "family-sym-noids"), and the
   sigmoid (SigLIP) loss's operator (``drive_sigmoid``: src "sigmoid", "sigmoid-it", and a rank's
   rows with same-group positives, "sigmoid-rank"). The operators
   themselves take CPU tensors (only ``backend="triton"``'s dispatch refuses them when Triton is not interpreting), and the
   launchers' own choices (tiles, precision, autotune candidates) see real ``JITFunction`` /
   ``Autotuner`` objects, i.e. the GPU configuration.
2. Captures launches instead of running them: ``JITFunction.run`` records the kernel and
   its arguments; ``Autotuner.run`` applies the autotuner's own ``prune_configs`` (no
   benchmarking) and records one launch per surviving config. ``Heuristics`` is left
   alone (it ends in one of those two). No kernel runs, so the launcher's torch code
   computes on garbage: fine, only the launches matter.
3. Binds every launch with Triton's own binder (the specialisation a GPU launch would get:
   integer ==1 / divisibility by 16, pointer alignment) and compiles each distinct
   (kernel, specialisation, constexprs, num_warps, num_stages) once with
   ``triton.compile(..., target=GPUTarget("cuda", 90, 32))``, i.e. sm_90a. ``--wide-scalars``
   types the scalar arguments as Inductor types those of a user kernel it compiles under
   ``torch.compile``: float scalars ``fp64`` (Python floats are fp64 to Inductor; integers
   stay i32 where they fit, as there); a kernel that mixes such a float into float32
   loop-carried state fails to compile ("Loop-carried variable ... has initial type fp32 but
   is re-assigned to fp64") or spills. ``--i64-ints`` also types every integer scalar ``i64``
   (an unbacked SymInt, or a size Inductor cannot bound by 2^31). Cold compiles run
   in ``--jobs`` processes (default: one per CPU, ~2x faster on 2 cores); results are cached
   next to Triton's own cache entry in a persistent TRITON_CACHE_DIR (``--cache-dir``,
   default ``<tempdir>/hnclip-sm90-cache``), so an unchanged kernel is not compiled again.
4. Reads registers / spill bytes from Triton's own ``ptxas -v`` run, shared memory from the
   kernel metadata, MMA instructions (wgmma / mma.sync and their operand type) from the PTX.

Problems (``problems_of``; exit status 1 when there is any, 2 on setup errors):
  * the kernel does not compile (or ptxas -v printed no register count);
  * any spill store or load;
  * shared memory above 227 KiB (232448 bytes, the sm_90 per-block opt-in limit);
  * a tf32 MMA on float32 inputs, unless the launch's precision constexpr (PREC, DOT_PREC or
    any *_PREC) is "tf32x3" (3-pass split: float32 accuracy) and none says plain "tf32";
    on 16-bit inputs a tf32 MMA (on a float32 operand, e.g. fp16's float32 gradient) is
    reported in the table, not a problem;
  * no MMA instruction at all in a kernel whose TTIR has a ``tt.dot`` on bf16/fp16 operands.
A launcher that raises on CPU tensors, or launches nothing, is a problem too.

Table (one line per distinct compiled kernel; --json has everything, constexprs included):
kernel; cfg (i/k: autotune candidate i of the k left after pruning); flags (bool constexprs
that are True); ints=1 (int arguments specialised to the constant 1, e.g. a unit stride);
from (single: the operator of hn_clip_loss, dir: the directional op, rank: a rank's two directions,
family / family-text: the hard-negative family's directional op, family-sym / family-sym-it /
family-sym-noids: its single-process loss); the input dtype, D and gamma values that
led to it; blocks (BLOCK_* constexprs); prec (*PREC constexprs); warps/stages; registers per
thread; spill store/load bytes; shared memory bytes; MMA instructions (shape.operand type);
tf32 (a tf32 MMA is present); status; key (the bind key, to find the kernel in --json).
``--markdown`` prints instead, on stdout, the summary docs/triton.md holds (``markdown_table``:
registers by kernel, operand width and candidate), the rest on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

import hnclip_kernels
import hnclip_kernels.backends

TARGET = GPUTarget("cuda", 90, 32)  # sm_90a: H100 / H200
SMEM_LIMIT = 232448  # bytes of shared memory per block (opt-in maximum on sm_90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RESULT_FILE = "hnclip_sm90.json"  # our analysis, stored in Triton's cache entry of the kernel
DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), "hnclip-sm90-cache")


def missing_toolchain():
    """Why the sm_90a compile cannot run here (None when it can): Triton's CUDA backend and
    its ptxas, looked up the way the backend itself does (TRITON_PTXAS_PATH, then the wheel's)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except Exception as e:  # noqa: BLE001
        return f"triton's CUDA backend cannot be imported ({type(e).__name__}: {e})"
    try:
        _ = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001 - RuntimeError("Cannot find ptxas")
        return f"no ptxas for sm_90 ({e}): set TRITON_PTXAS_PATH or install the triton wheel that ships it"
    return None


# ------------------------------------------------------------------ 1. what is driven
def _features(n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(dtype), torch.randn(n, d, generator=g).to(dtype)


def drive_single(n, d, dtype, gamma, eps, threshold=None):
    """The single-process loss's operator, forward + backward, with the arguments
    ``hn_clip_loss(img, txt, tau, gamma=, label_smoothing=, backend="triton",
    false_negative_threshold=)`` passes it (``backends.symmetric_losses``) and its mean."""
    from hnclip_kernels.backends.triton.ops import hn_clip_pairs_triton

    img, txt = _features(n, d, dtype)
    tau = torch.tensor(0.07, requires_grad=True)
    pairs = hn_clip_pairs_triton(
        img.requires_grad_(),
        txt.requires_grad_(),
        tau=tau,
        gamma=gamma,
        label_smoothing=eps,
        normalize=True,
        false_negative_threshold=threshold,
    )
    pairs.mean().backward()


def drive_directional(m, n, d, dtype, gamma, eps, offset, threshold=None):
    """One rank's i2t direction as ``distributed.rank_hn_clip_loss`` calls it: m local image
    rows against the n gathered texts, positive of row i at column offset + i."""
    op = hnclip_kernels.backends.triton_directional()
    all_img, all_txt = _features(n, d, dtype)
    img = all_img[offset : offset + m].clone().requires_grad_()
    txt = all_txt[offset : offset + m].clone()
    tau = torch.tensor(0.07, requires_grad=True)
    rows = op(
        img,
        all_txt.requires_grad_(),
        query_txt=txt,
        key_txt=all_txt,
        tau=tau,
        offset=offset,
        gamma=gamma,
        label_smoothing=eps,
        normalize=True,
        false_negative_threshold=threshold,
    )
    rows.sum().backward()


def drive_rank(m, n, d, dtype, gamma, eps, offset, threshold=None):
    """One rank's two directions in one op, as ``distributed.rank_hn_clip_loss`` calls them on
    Triton (``backends.rank_losses``): m local rows against the n gathered ones."""
    from hnclip_kernels.backends.triton.ops import rank_nll_triton

    all_img, all_txt = _features(n, d, dtype)
    img, txt = (x[offset : offset + m].clone().requires_grad_() for x in (all_img, all_txt))
    tau = torch.tensor(0.07, requires_grad=True)
    rows = rank_nll_triton(
        img,
        txt,
        all_img.requires_grad_(),
        all_txt.requires_grad_(),
        tau=tau,
        offset=offset,
        gamma=gamma,
        label_smoothing=eps,
        normalize=True,
        false_negative_threshold=threshold,
    )
    rows.sum().backward()


def drive_family(n, d, dtype, gamma, eps, threshold=None, margin="image_text"):
    """The hard-negative family as ``backends.family_losses`` runs it on Triton: two calls of
    ``hnclip::triton_directional_nll`` with the family's inputs, i2t over the keys [t; negatives] (n/4 negatives) and
    t2i over the images, with group ids (GROUPS); with a threshold also its cosine (COSINE), of the
    mask captions with margin="image_text" (CAPTIONS)."""
    from hnclip_kernels.backends.triton.ops import directional_nll_triton

    img, txt = _features(n, d, dtype)
    neg = _features(max(n // 4, 1), d, dtype, seed=1)[0]
    keys = torch.cat([txt, neg])
    ids = torch.arange(n) // 2
    tau = torch.tensor(0.07, requires_grad=True)
    kw = dict(tau=tau, offset=0, gamma=gamma, label_smoothing=eps, normalize=True, false_negative_threshold=threshold)
    ids_kw = dict(query_groups=ids, key_groups=ids)
    img, keys, txt_q = img.requires_grad_(), keys.requires_grad_(), txt.clone().requires_grad_()
    if margin == "text":
        i2t = directional_nll_triton(img, keys, query_txt=txt, key_txt=keys, **ids_kw, **kw)
        t2i = directional_nll_triton(txt_q, img, query_txt=txt, key_txt=txt, **ids_kw, **kw)
    else:
        i2t = directional_nll_triton(
            img, keys, query_txt=img, key_txt=keys, mask_query=txt, mask_key=keys, **ids_kw, **kw
        )
        t2i = directional_nll_triton(
            txt_q, img, query_txt=txt, key_txt=img, mask_query=txt, mask_key=txt, **ids_kw, **kw
        )
    (0.5 * (i2t + t2i)).mean().backward()


def drive_family_sym(n, d, dtype, gamma, eps, threshold=None, margin="text", ids=True):
    """The hard-negative family's single-process loss as ``backends.family_losses`` runs it on
    Triton: ``hnclip::triton_symmetric_nll`` with the family's inputs (``hn_clip_pairs_triton``), the symmetric walk's pair
    kernels (group ids as their ``gk_ptr``: GROUPS; a threshold: COSINE) plus the directional walk
    over the N×M block of n/4 negatives (offset M; group ids against an empty K = 0 id set:
    GROUPS), forward + backward; ``margin="image_text"`` a logit scale, no margin product."""
    from hnclip_kernels.backends.triton.ops import hn_clip_pairs_triton

    img, txt = _features(n, d, dtype)
    neg = _features(max(n // 4, 1), d, dtype, seed=1)[0]
    tau = torch.tensor(0.07, requires_grad=True)
    pairs = hn_clip_pairs_triton(
        img.requires_grad_(),
        txt.requires_grad_(),
        negatives=neg.requires_grad_(),
        group_ids=torch.arange(n) // 2 if ids else None,
        tau=tau,
        gamma=gamma,
        label_smoothing=eps,
        normalize=True,
        margin=margin,
        false_negative_threshold=threshold,
    )
    pairs.mean().backward()


def drive_sigmoid(n, d, dtype, gamma, eps, threshold=None, margin="text", local_m=None):
    """The sigmoid (SigLIP) loss as ``hn_siglip_loss`` runs it on Triton (``sigmoid_pairs_triton``:
    ``hnclip::triton_sigmoid_nll``), forward + backward with s and b learnable: n rows against n
    captions and n/4 negatives with group ids masking (GROUPS), or (``local_m``) a rank's local_m rows
    against the n gathered captions at offset local_m with same-group captions as positives. ``eps``
    and ``threshold`` have no sigmoid meaning (the drive ignores them)."""
    from hnclip_kernels.backends.triton.sigmoid_pairs import sigmoid_pairs_triton

    del eps, threshold
    img, txt = _features(n, d, dtype)
    s, b = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    ids = torch.arange(n) // 2
    if local_m is None:
        neg = _features(max(n // 4, 1), d, dtype, seed=1)[0].requires_grad_()
        kw = dict(negatives=neg, query_groups=ids, key_groups=ids, margin=margin)
    else:
        img = img[local_m : 2 * local_m].clone()
        kw = dict(offset=local_m, query_groups=ids[local_m : 2 * local_m], key_groups=ids, groups_positive=True)
    rows = sigmoid_pairs_triton(img.requires_grad_(), txt.requires_grad_(), s, b, gamma=gamma, **kw)
    rows.mean().backward()


# ------------------------------------------------------------------ 2. capture launches
@dataclasses.dataclass
class Launch:
    fn: JITFunction
    args: tuple
    kwargs: dict
    config: str  # "2/3": autotune candidate 2 of the 3 left after pruning; "" otherwise


@contextlib.contextmanager
def capture_launches():
    """Record every Triton launch made inside the block (list of Launch); run nothing."""
    launches, config = [], [""]
    jit_run, tuner_run = JITFunction.run, Autotuner.run

    def record(self, *args, grid, warmup, **kwargs):
        if not warmup:  # warmup=True is a precompile request, not a launch
            launches.append(Launch(self, args, kwargs, config[0]))

    def each_config(self, *args, **kwargs):
        """Autotuner.run minus the benchmark (and the hooks): every candidate left after pruning."""
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        try:
            for i, c in enumerate(configs):
                config[0] = f"{i + 1}/{len(configs)}" if len(configs) > 1 else ""
                self.fn.run(*args, **kwargs, **c.all_kwargs())
        finally:
            config[0], self.nargs = "", None

    JITFunction.run, Autotuner.run = record, each_config
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = jit_run, tuner_run


# ------------------------------------------------------------------ 3. bind + compile
def kernel_id(fn: JITFunction) -> str:
    return f"{fn.module}:{fn.fn.__qualname__}"


@dataclasses.dataclass
class Job:
    """One distinct compilation: everything triton.compile needs, plus the launch's constexprs."""

    key: str
    fn: JITFunction
    signature: dict
    constexprs: dict  # {(arg index,): value}, as Triton's _pack_args returns them
    attrs: dict
    options: dict
    named: dict  # tl.constexpr parameter name -> value (for the table and the precision rule)
    ones: list  # other parameters specialised as the constant 1 (e.g. a unit stride)
    scalars: dict  # scalar (non-pointer, non-constexpr) parameter name -> its type in the signature

    def payload(self):  # what a worker process needs (the kernel by its registry name)
        return kernel_id(self.fn), self.signature, self.constexprs, self.attrs, self.options


_BINDERS = {}


# scalar types as Inductor passes them to a user-defined kernel (--wide-scalars, --i64-ints)
WIDE_FLOATS = {"fp16": "fp64", "bf16": "fp64", "fp32": "fp64"}
WIDE_INTS = {"i8": "i64", "i16": "i64", "i32": "i64", "u32": "u64"}


def bind(launch: Launch, backend, wide_scalars: bool = False, i64_ints: bool = False) -> Job:
    """Triton's runtime binding (JITFunction.run → binder → _pack_args), without a driver.
    ``wide_scalars``: float scalars typed fp64 (``WIDE_FLOATS``), as Inductor does; ``i64_ints``:
    integer scalars i64 (``WIDE_INTS``)."""
    fn, kwargs = launch.fn, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or triton.knobs.runtime.debug
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    if fn not in _BINDERS:
        _BINDERS[fn] = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = _BINDERS[fn](*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    wider = {**(WIDE_FLOATS if wide_scalars else {}), **(WIDE_INTS if i64_ints else {})}
    signature = {name: wider.get(ty, ty) for name, ty in signature.items()}  # pointers ("*fp32") stay
    wide = ("|wide" if wide_scalars else "") + ("|i64" if i64_ints else "")
    key = hashlib.sha1(f"{kernel_id(fn)}|{spec}|{sorted(opts.items())}{wide}".encode()).hexdigest()[:12]
    named = {p.name: bound[p.name] for p in fn.params if p.is_constexpr}
    ones = [p.name for p in fn.params if not p.is_constexpr and signature.get(p.name) == "constexpr"]
    scalars = {
        p.name: signature[p.name]
        for p in fn.params
        if not p.is_constexpr
        and signature.get(p.name, "constexpr") != "constexpr"
        and not signature[p.name].startswith("*")
    }
    return Job(key, fn, signature, constexprs, attrs, dict(options.__dict__), named, ones, scalars)


def _triton_hash(fn, signature, constexprs, attrs, options):
    """Triton's cache hash of this compilation (as triton.compile computes it), or None."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_key

        backend = make_backend(TARGET)
        key = get_cache_key(
            ASTSource(fn, signature, constexprs, attrs),
            backend,
            backend.parse_options(options),
            get_cache_invalidating_env_vars(),
        )
        return hashlib.sha256(key.encode()).hexdigest()
    except Exception:
        return None


def cached_result(job: Job):
    """The stored analysis of an unchanged kernel, or None."""
    from triton.runtime.cache import get_cache_manager

    h = _triton_hash(job.fn, job.signature, job.constexprs, job.attrs, job.options)
    path = get_cache_manager(h).get_file(RESULT_FILE) if h else None
    if path:
        with open(path) as f:
            return json.load(f)
    return None


def _compile(fn, signature, constexprs, attrs, options):
    """triton.compile for sm_90a (always compiled: the log of Triton's own ``ptxas -v`` run
    is needed) and that log."""
    out = io.StringIO()
    with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(out):
        triton.knobs.nvidia.dump_ptxas_log = True
        triton.knobs.compilation.always_compile = True
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
    return ck, out.getvalue()


_MMA = re.compile(r"\b(wgmma\.mma_async|mma\.sync)\.\S*?(m\d+n\d+k\d+)\.(?:row\.col\.)?\w+\.(\w+)\.")
_DOT_16BIT = re.compile(r"\btt\.dot\b.*:\s*tensor<[^>]*x(?:bf16|f16)>")


def analyse(ck, log) -> dict:
    """Resources (ptxas -v, metadata) and instruction mix (PTX, TTIR) of a compiled kernel."""

    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    mma = sorted(
        {
            f"{'wgmma' if op.startswith('wgmma') else 'mma'}.{shape}.{ty}"
            for op, shape, ty in _MMA.findall(ck.asm["ptx"])
        }
    )
    return dict(
        regs=num(r"Used (\d+) registers"),
        spill_st=num(r"(\d+) bytes spill stores"),
        spill_ld=num(r"(\d+) bytes spill loads"),
        stack=num(r"(\d+) bytes stack frame"),
        shared=ck.metadata.shared,
        num_warps=ck.metadata.num_warps,
        num_stages=ck.metadata.num_stages,
        mma=mma,
        tf32=any(k.endswith(".tf32") for k in mma),
        dot16=bool(_DOT_16BIT.search(ck.asm.get("ttir", ""))),
    )


def compile_kernel(fn, signature, constexprs, attrs, options) -> dict:
    """Compile and analyse one kernel, store the analysis in its Triton cache entry; a
    failure is returned as {"error": message} (and not cached)."""
    from triton.runtime.cache import get_cache_manager

    t0 = time.perf_counter()
    try:
        ck, log = _compile(fn, signature, constexprs, attrs, options)
        result = analyse(ck, log)
    except Exception as e:  # noqa: BLE001 - any compiler error is a finding
        return dict(error=f"{type(e).__name__}: {str(e).strip()[:1500]}")
    result["compile_s"] = round(time.perf_counter() - t0, 1)
    get_cache_manager(ck.hash).put(json.dumps(result), RESULT_FILE, binary=False)
    return result


def _compile_in_worker(payload):
    kid, signature, constexprs, attrs, options = payload
    from triton.runtime.jit import _triton_jit_function_registry

    importlib.import_module(kid.split(":")[0])  # defines (and registers) the kernel
    return compile_kernel(_triton_jit_function_registry[kid], signature, constexprs, attrs, options)


def _importable(fn) -> bool:
    """Can a fresh process find this kernel by importing its module?"""
    from triton.runtime.jit import _triton_jit_function_registry

    return "<locals>" not in kernel_id(fn) and _triton_jit_function_registry.get(kernel_id(fn)) is fn


def compile_all(jobs, n_proc, log=lambda msg: None):
    """{job key: analysis}: stored analyses of unchanged kernels, the rest compiled in n_proc
    processes (spawned: they import the kernel modules; no fork of a threaded torch process).
    ``log`` gets a line per compiled kernel (a cold run takes minutes: the progress shows)."""
    results = {job.key: cached_result(job) for job in jobs}
    todo = [job for job in jobs if results[job.key] is None]
    n_proc = min(n_proc, len(todo))
    t0 = time.perf_counter()

    def done(i, job):
        log(f"  compiled {i}/{len(todo)} {job.fn.__name__} ({time.perf_counter() - t0:.0f} s)")

    if n_proc > 1 and all(_importable(job.fn) for job in todo):
        with ProcessPoolExecutor(n_proc, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {job.key: pool.submit(_compile_in_worker, job.payload()) for job in todo}
            for i, (job, (key, fut)) in enumerate(zip(todo, futures.items()), 1):
                try:
                    results[key] = fut.result()
                except Exception as e:  # noqa: BLE001 - e.g. a compiler crash took the worker down
                    results[key] = dict(
                        error=f"compile process failed ({type(e).__name__}: {e}); "
                        "rerun with --jobs 1 to see which kernel crashes"
                    )
                done(i, job)
    else:
        for i, job in enumerate(todo, 1):
            results[job.key] = compile_kernel(job.fn, job.signature, job.constexprs, job.attrs, job.options)
            done(i, job)
    return results, len(todo)


# ------------------------------------------------------------------ 4. problems + report
def precisions(named: dict) -> set:
    """Values of the launch's input-precision constexprs (PREC, DOT_PREC, any *_PREC)."""
    return {str(v) for k, v in named.items() if k == "PREC" or k.endswith("_PREC")}


def problems_of(row: dict) -> list:
    """The problems of one compiled kernel (a row of the report); [] when it is fine."""
    if row.get("error"):
        return ["compile failed: " + row["error"].splitlines()[0][:300]]
    out = []
    if row.get("regs") is None:
        out.append("no ptxas -v register count")
    if row.get("spill_st") or row.get("spill_ld"):
        out.append(f"spills {row.get('spill_st')}/{row.get('spill_ld')} B (stores/loads)")
    if (row.get("shared") or 0) > SMEM_LIMIT:
        out.append(f"shared memory {row['shared']} B > {SMEM_LIMIT} B")
    precs = set(row.get("prec") or ())
    if row.get("tf32") and row["dtype"] == "fp32" and not ("tf32x3" in precs and "tf32" not in precs):
        out.append(f"tf32 MMA on float32 inputs (precision {'/'.join(sorted(precs)) or 'unspecified'})")
    if row.get("dot16") and row["dtype"] in ("bf16", "fp16") and not row.get("mma"):
        out.append("tl.dot on 16-bit operands but no MMA instruction")
    return out


def _table(rows):
    """One line per distinct compiled kernel."""
    cols = [
        "kernel",
        "cfg",
        "flags",
        "ints=1",
        "from",
        "dtype",
        "D",
        "gamma",
        "blocks",
        "prec",
        "w/s",
        "regs",
        "spill st/ld",
        "smem",
        "mma",
        "tf32",
        "status",
        "key",
    ]
    lines = []
    for r in rows:
        vals = [
            r["kernel"],
            r["cfg"] or "-",
            ",".join(r["flags"]) or "-",
            ",".join(r["ones"]) or "-",
            "+".join(r["from"]),
            r["dtype"],
            ",".join(map(str, r["D"])),
            ",".join(map(str, r["gamma"])),
            r["blocks"],
            "/".join(r["prec"]) or "-",
        ]
        if r.get("error"):
            vals += ["-"] * 6
        else:
            vals += [
                f"{r['num_warps']}/{r['num_stages']}",
                r["regs"],
                f"{r['spill_st']}/{r['spill_ld']}",
                r["shared"],
                ",".join(r["mma"]) or "-",
                "yes" if r["tf32"] else "no",
            ]
        status = "; ".join(r["problems"]) or "ok" + (f" (tf32 on {r['dtype']} inputs)" if r.get("tf32") else "")
        lines.append([str(v) for v in vals] + [status, r["key"]])
    widths = [max([len(c)] + [len(line[i]) for line in lines]) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(cols), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def markdown_table(report) -> str:
    """Registers per thread, spills and shared memory of each kernel by operand width (16-bit:
    bf16 and fp16 together) and autotune candidate, γ = 0 and γ > 0 (the margin) apart, over every
    variant driven (D, flags, specialisations); a line of the run's configuration above it. What
    ``--markdown`` prints and ``python -m tools.docs_tables`` writes into docs/triton.md."""

    def span(values):
        values = sorted(v for v in values if v is not None)
        if not values:
            return "-"
        return str(values[0]) if values[0] == values[-1] else f"{values[0]}–{values[-1]}"

    groups = {}
    for r in report["rows"]:
        dtypes = r.get("dtypes") or [r["dtype"]]  # every input dtype that launched this kernel
        widths = tuple(sorted({"32" if d == "fp32" else "16" for d in dtypes}))  # 16-bit, float32 or both
        key = (r["kernel"], widths, r["cfg"], r["blocks"], r.get("num_warps"), r.get("num_stages"))
        g = groups.setdefault(key, dict(dtypes=set(), plain=[], margin=[], st=[], ld=[], shared=[], errors=0))
        g["dtypes"].update(dtypes)
        for gamma in r["gamma"]:
            g["margin" if gamma else "plain"].append(r.get("regs"))
        g["st"].append(r.get("spill_st") or 0)
        g["ld"].append(r.get("spill_ld") or 0)
        g["shared"].append(r.get("shared") or 0)
        g["errors"] += bool(r.get("error"))
    gammas = sorted({gm for r in report["rows"] for gm in r["gamma"]})
    margins = ", ".join(f"{gm:g}" for gm in gammas if gm) or "-"
    lines = [
        "| kernel | features | candidate | tiles (BLOCK_*) | warps / stages | registers, γ = 0 | "
        f"registers, γ = {margins} | spill stores / loads (B) | shared memory (KiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(groups, key=lambda k: k[:4]):
        kernel, _, cfg, blocks, warps, stages = key
        g = groups[key]
        spills = f"{max(g['st'])} / {max(g['ld'])}" if max(g["st"] + g["ld"]) else "0"
        regs = [span(g["plain"]), span(g["margin"])]
        if g["errors"]:
            regs = [f"{x} ({g['errors']} failed)" for x in regs]
        features = ", ".join(d for d in DTYPES if d in g["dtypes"])
        lines.append(
            f"| `{kernel}` | {features} | {cfg or '-'} | {blocks} | {warps} / {stages} | {regs[0]} | "
            f"{regs[1]} | {spills} | {fmt_kib(max(g['shared']))} |"
        )
    c = report["config"]
    listed = lambda xs: ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)  # noqa: E731
    head = (
        f"triton {report['triton']}, {report['target']}; {listed(c['dtypes'])}; D = {listed(c['D'])}; "
        f"γ = {listed(c['gammas'])}; label smoothing {listed(c['smoothings'])}; false-negative threshold "
        f"{listed(c.get('thresholds') or [None])}; N = {c['n']}, a rank's M = {c['local_m']}: "
        f"{report['launches']} launches, {len(report['rows'])} distinct kernels, "
        f"{len(report['problems']) or 'no'} problem{'' if len(report['problems']) == 1 else 's'}."
    )
    return head + "\n\n" + "\n".join(lines)


def fmt_kib(b: int) -> str:
    return f"{b / 1024:.2f}".rstrip("0").rstrip(".")


SOURCES = (
    "single",
    "dir",
    "rank",
    "family",
    "family-text",
    "family-sym",
    "family-sym-it",
    "family-sym-noids",
    "sigmoid",
    "sigmoid-it",
    "sigmoid-rank",
)


def capture_all(dtypes, ds, gammas, smoothings, n, local_m, wide_scalars=False, i64_ints=False, thresholds=(None,),
                sources=SOURCES):  # fmt: skip
    """Drive every combination (of the drives named in ``sources``, :data:`SOURCES`); returns
    ({key: Job}, {key: where it was launched from}, problems, launches)."""
    backend = make_backend(TARGET)
    jobs, where, problems, n_launch = {}, {}, [], 0
    for dt, d, gm, eps, thr in itertools.product(dtypes, ds, gammas, smoothings, thresholds):
        dtype = DTYPES[dt]
        args = dict(gamma=gm, eps=eps, threshold=thr)
        for src, thunk in (
            ("single", lambda d=d, dtype=dtype, a=args: drive_single(n, d, dtype, **a)),
            ("dir", lambda d=d, dtype=dtype, a=args: drive_directional(local_m, n, d, dtype, offset=local_m, **a)),
            ("rank", lambda d=d, dtype=dtype, a=args: drive_rank(local_m, n, d, dtype, offset=local_m, **a)),
            ("family", lambda d=d, dtype=dtype, a=args: drive_family(n, d, dtype, **a)),
            ("family-text", lambda d=d, dtype=dtype, a=args: drive_family(n, d, dtype, margin="text", **a)),
            ("family-sym", lambda d=d, dtype=dtype, a=args: drive_family_sym(n, d, dtype, **a)),
            (
                "family-sym-it",
                lambda d=d, dtype=dtype, a=args: drive_family_sym(n, d, dtype, margin="image_text", **a),
            ),
            ("family-sym-noids", lambda d=d, dtype=dtype, a=args: drive_family_sym(n, d, dtype, ids=False, **a)),
            ("sigmoid", lambda d=d, dtype=dtype, a=args: drive_sigmoid(n, d, dtype, **a)),
            ("sigmoid-it", lambda d=d, dtype=dtype, a=args: drive_sigmoid(n, d, dtype, margin="image_text", **a)),
            ("sigmoid-rank", lambda d=d, dtype=dtype, a=args: drive_sigmoid(n, d, dtype, local_m=local_m, **a)),
        ):
            if src not in sources:
                continue
            case = f"{src} {dt} D={d} gamma={gm} label_smoothing={eps} false_negative_threshold={thr}"
            try:
                with capture_launches() as launches:
                    thunk()
            except Exception as e:  # noqa: BLE001 - the launcher failed on CPU tensors
                problems.append(f"{case}: driving the launcher failed: {type(e).__name__}: {e}")
                continue
            if not launches:
                problems.append(f"{case}: no Triton kernel was launched")
            for launch in launches:
                n_launch += 1
                job = bind(launch, backend, wide_scalars, i64_ints)
                jobs.setdefault(job.key, job)
                w = where.setdefault(
                    job.key, dict(cfg=launch.config, dtype=dt, src=set(), D=set(), gamma=set(), eps=set(), dtypes=set())
                )
                for k, v in (("src", src), ("D", d), ("gamma", gm), ("eps", eps), ("dtypes", dt)):
                    w[k].add(v)
    return jobs, where, problems, n_launch


def run_check(
    dtypes,
    ds,
    gammas,
    smoothings,
    n=4096,
    local_m=512,
    jobs=None,
    cache_dir=DEFAULT_CACHE,
    wide_scalars=False,
    i64_ints=False,
    log=lambda msg: print(msg, flush=True),
    thresholds=(None,),
    sources=SOURCES,
):
    """Capture, compile and analyse (the drives named in ``sources``). Returns a dict: "rows" (one per distinct compiled kernel,
    with its "problems"), "problems" (all, as strings) and run statistics."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: unset it, this compiles the real kernels")
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # read lazily by Triton, inherited by the workers
    t0, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # the launchers' torch code on CPU: small ops, faster without a thread pool
    try:
        by_key, where, problems, n_launch = capture_all(
            dtypes, ds, gammas, smoothings, n, local_m, wide_scalars, i64_ints, thresholds, sources
        )
    finally:
        torch.set_num_threads(threads)
    t_capture = time.perf_counter() - t0
    n_proc = jobs or len(os.sched_getaffinity(0))
    log(
        f"triton {triton.__version__}, sm_{TARGET.arch}a, {hnclip_kernels.__file__}: {n_launch} launches, "
        f"{len(by_key)} distinct kernels (captured in {t_capture:.1f} s); compiling in {n_proc} process(es), "
        f"cache {cache_dir}"
    )
    results, n_compiled = compile_all(list(by_key.values()), n_proc, log)
    rows = []
    for key, job in by_key.items():
        w = where[key]
        row = dict(
            key=key,
            kernel=job.fn.__name__,
            cfg=w["cfg"],
            flags=sorted(k for k, v in job.named.items() if v is True),
            ones=job.ones,
            dtype=w["dtype"],
            dtypes=[d for d in DTYPES if d in w["dtypes"]],
            D=sorted(w["D"]),
            gamma=sorted(w["gamma"]),
            eps=sorted(w["eps"]),
            blocks=" ".join(f"{k[len('BLOCK_') :]}{v}" for k, v in job.named.items() if k.startswith("BLOCK_")) or "-",
            prec=sorted(precisions(job.named)),
            constexprs=job.named,
            scalars=job.scalars,
            **{"from": sorted(w["src"])},
            **results[key],
        )
        row["problems"] = problems_of(row)
        rows.append(row)
        problems += [
            f"{row['kernel']} {row['cfg']} [{','.join(row['flags'])}] {row['dtype']} (from "
            f"{'+'.join(row['from'])}, D={row['D']}, gamma={row['gamma']}, key {key}): {p}"
            for p in row["problems"]
        ]
    order = {k: i for i, k in enumerate(DTYPES)}
    rows.sort(key=lambda r: (order.get(r["dtype"], 9), r["kernel"], r["flags"], r["blocks"], r["cfg"], r["D"]))
    return dict(
        rows=rows,
        problems=problems,
        launches=n_launch,
        compiled=n_compiled,
        capture_s=round(t_capture, 1),
        compile_s=round(time.perf_counter() - t0 - t_capture, 1),
        target=f"sm_{TARGET.arch}a",
        triton=triton.__version__,
        package=hnclip_kernels.__file__,
        config=dict(
            dtypes=dtypes,
            D=ds,
            gammas=gammas,
            smoothings=smoothings,
            n=n,
            local_m=local_m,
            wide_scalars=wide_scalars,
            i64_ints=i64_ints,
            thresholds=list(thresholds),
            sources=list(sources),
        ),
    )


def scalar_summary(rows, wide_scalars: bool, i64_ints: bool = False) -> str:
    """One line: the scalar arguments of the compiled kernels, by type, across all rows."""
    by_type = {}
    for r in rows:
        for name, ty in (r.get("scalars") or {}).items():
            by_type.setdefault(ty, set()).add(f"{r['kernel']}.{name}")
    kinds = (
        "; ".join(
            f"{ty}: {len(names)} ({', '.join(sorted(names)[:6])}{', ...' if len(names) > 6 else ''})"
            for ty, names in sorted(by_type.items())
        )
        or "none"
    )
    how = " + ".join(flag for flag, on in (("--wide-scalars", wide_scalars), ("--i64-ints", i64_ints)) if on)
    how = f"Inductor's typing ({how})" if how else "Triton's own typing"
    return f"scalar arguments under {how}: {kinds}"


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m tools.sm90", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--quick", action="store_true", help="D 64,768 and label smoothing 0 (unless given)")
    ap.add_argument("--dtypes", type=csv(str), default=list(DTYPES))
    ap.add_argument("--d", type=csv(int), default=None, help="feature dims D (default 64,512,768,1024)")
    ap.add_argument("--gammas", type=csv(float), default=[0.0, 0.5])
    ap.add_argument("--smoothings", type=csv(float), default=None, help="label smoothing (default 0,0.1)")
    ap.add_argument("--n", type=int, default=4096, help="global batch N")
    ap.add_argument("--local-m", type=int, default=512, help="local rows of the directional op (offset = local-m)")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPUs available)")
    ap.add_argument("--json", default=None, help="write the full report here")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE, help="persistent TRITON_CACHE_DIR")
    ap.add_argument(
        "--wide-scalars",
        action="store_true",
        help="type float scalars fp64, as Inductor does for user kernels under torch.compile",
    )
    ap.add_argument("--i64-ints", action="store_true", help="type integer scalars i64 (unbounded SymInts)")
    ap.add_argument(
        "--markdown",
        action="store_true",
        help="print only the markdown summary (markdown_table; the docs' table) on stdout, the rest on stderr",
    )
    ap.add_argument(
        "--thresholds",
        type=csv(str),
        default=["none"],
        help="false-negative thresholds to drive, 'none' for no masking (default none; e.g. none,0.9)",
    )
    ap.add_argument(
        "--sources",
        type=csv(str),
        default=list(SOURCES),
        help=f"which drives (default all: {','.join(SOURCES)})",
    )
    a = ap.parse_args(argv)
    if unknown := [x for x in a.sources if x not in SOURCES]:
        ap.error(f"unknown source(s) {unknown}; choose from {','.join(SOURCES)}")
    thresholds = [None if x == "none" else float(x) for x in a.thresholds]
    ds = a.d or ([64, 768] if a.quick else [64, 512, 768, 1024])
    smoothings = a.smoothings or ([0.0] if a.quick else [0.0, 0.1])
    if unknown := [d for d in a.dtypes if d not in DTYPES]:
        ap.error(f"unknown dtype(s) {unknown}; choose from {list(DTYPES)}")
    out = sys.stderr if a.markdown else sys.stdout  # --markdown: stdout holds the table only
    say = lambda *args: print(*args, file=out, flush=True)  # noqa: E731
    try:
        report = run_check(
            a.dtypes,
            ds,
            a.gammas,
            smoothings,
            a.n,
            a.local_m,
            a.jobs,
            a.cache_dir,
            a.wide_scalars,
            a.i64_ints,
            log=say,
            thresholds=thresholds,
            sources=a.sources,
        )
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    say(_table(report["rows"]))
    say(
        f"\n{report['launches']} launches, {len(report['rows'])} distinct kernels, {report['compiled']} compiled "
        f"(rest cached); capture {report['capture_s']} s, compile {report['compile_s']} s"
    )
    say(scalar_summary(report["rows"], a.wide_scalars, a.i64_ints))
    if a.markdown:
        print(markdown_table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if report["problems"]:
        say(f"\n{len(report['problems'])} problem(s):")
        for p in report["problems"]:
            say("  " + p)
        return 1
    say("\nall kernels compile for sm_90a: no spills, shared memory within 227 KiB, no tf32 on float32 inputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
