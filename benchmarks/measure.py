"""Timing and peak memory of one benchmark cell, on a GPU (CUDA events, do_bench) or a CPU.

Peak memory is measured over one call of the timed region, above what is live just before
it: the inputs for fwd and fwd+bwd, the inputs plus the saved forward graph for bwd.
"""

from __future__ import annotations

import ctypes
import gc
import time
import warnings

import torch

QUANTILES = (0.5, 0.2, 0.8)  # median, q20, q80
MODES = ("fwd", "bwd", "fwd+bwd")


def make_inputs(n: int, d: int, dtype: torch.dtype, device: str, n_sets: int, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        tuple(torch.randn(n, d, generator=gen, device=device, dtype=dtype).requires_grad_(True) for _ in range(2))
        for _ in range(n_sets)
    ]


class Step:
    """The timed region of one mode, rotating over input sets so caches see fresh data.

    ``prepare()`` is untimed: it picks the next input set, drops old gradients and, for
    "bwd", runs the forward whose backward ``run()`` then times. Calling the step does both
    (what do_bench times for fwd and fwd+bwd, where prepare is host bookkeeping only).
    """

    def __init__(self, loss_fn, sets, mode: str):
        assert mode in MODES, mode
        self.loss_fn, self.sets, self.mode = loss_fn, sets, mode
        self.leaves = [x for pair in sets for x in pair]
        self._i, self._loss = -1, None

    def prepare(self) -> None:
        self._i = (self._i + 1) % len(self.sets)
        for x in self.sets[self._i]:
            x.grad = None
        if self.mode == "bwd":
            self._loss = self.loss_fn(*self.sets[self._i])

    def run(self) -> None:
        if self.mode == "fwd":
            self.loss_fn(*self.sets[self._i])  # dropped at once, and its graph with it
        elif self.mode == "fwd+bwd":
            self.loss_fn(*self.sets[self._i]).backward()
        else:  # a fresh graph per call: retain_graph would break torch.compile's donated buffers
            loss, self._loss = self._loss, None
            loss.backward()

    def __call__(self) -> None:
        self.prepare()
        self.run()


def summarize(times_ms) -> dict:
    t = torch.tensor(times_ms, dtype=torch.float64)
    med, q20, q80 = torch.quantile(t, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return dict(median_ms=med, q20_ms=q20, q80_ms=q80, reps=len(times_ms))


# ---------------------------------------------------------------- GPU


def _l2_flusher():
    from triton import runtime  # the same L2 flush do_bench does between its runs

    cache = runtime.driver.active.get_empty_cache_for_benchmark()
    return lambda: runtime.driver.active.clear_cache(cache)


def _event_times(step: Step, n: int, flush) -> list:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for start, end in zip(starts, ends):
        step.prepare()  # enqueued before `start`: a bwd's forward is not timed
        flush()
        start.record()
        step.run()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def measure_cuda(step: Step, *, warm: bool, rep_ms: float, warmup_ms: float = 25.0) -> dict:
    """Median and 20/80% quantiles of ``step`` on the current GPU, and its peak memory.

    Fast fwd / fwd+bwd cells go through ``triton.testing.do_bench``. bwd cells (do_bench
    cannot keep their forward out of the timed region) and slow cells (do_bench would run
    them at least 8 times) use the same CUDA-event loop with the same L2 flush; a slow cell
    gets 3 timed calls in all.
    """
    import triton.testing

    flush = _l2_flusher()
    if warm:  # compilation, autotuning, allocator growth
        step()
    prep_start, prep_end, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    prep_start.record()
    step.prepare()
    prep_end.record()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # inputs (and for bwd the saved graph)
    torch.cuda.reset_peak_memory_stats()
    flush()
    start.record()
    step.run()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    per_call = first + prep_start.elapsed_time(prep_end)  # a bwd call also pays for its forward

    if step.mode != "bwd" and first * 10 <= rep_ms:
        # return_mode="all": the same quantiles as quantiles=QUANTILES, plus the number of runs
        times = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, grad_to_none=step.leaves, return_mode="all")
    elif per_call * 3 <= rep_ms:
        _event_times(step, min(100, max(1, int(warmup_ms / per_call))), flush)
        times = _event_times(step, min(1000, int(rep_ms / per_call)), flush)
    else:
        times = [first] + _event_times(step, 2, flush)
    return dict(summarize(times), peak_mem_mb=peak_mb)


def cuda_matmul_tflops(n: int = 8192) -> float:
    """Dense bf16 ``torch.matmul`` rate on this GPU: the ceiling the kernels are judged by."""
    import triton.testing

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- CPU

_libc = None
_warned_rss = False


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak_rss() -> int:
    """Start a fresh resident-set high-water mark; return the current RSS in KiB.

    torch's CPU tensors come from malloc and count in RSS once written; malloc_trim returns
    freed heap pages so that reusing them shows up as growth again.
    """
    global _libc, _warned_rss
    gc.collect()
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM (and ru_maxrss) to the current RSS
    except OSError:
        if not _warned_rss:
            _warned_rss = True
            warnings.warn(
                "cannot reset the peak RSS (/proc/self/clear_refs): peak memory is only "
                "right for cells that set a new high-water mark in this process",
                stacklevel=2,
            )
    return _proc_status_kb("VmRSS")


def measure_cpu(step: Step, *, warm: bool, min_reps: int, max_reps: int, cell_s: float) -> dict:
    """Median and quantiles of wall time over repeated calls, and the peak RSS growth of one call.

    ``max_reps`` calls when they fit in ``cell_s`` seconds, never fewer than ``min_reps``,
    except that a single call longer than ``cell_s`` gets at most 2.
    """
    if warm:
        step()
    step.prepare()
    base_kb = _reset_peak_rss()
    t0 = time.perf_counter()
    step.run()
    first = time.perf_counter() - t0
    peak_mb = (_proc_status_kb("VmHWM") - base_kb) / 1024
    reps = min(max_reps, max(min_reps, int(cell_s / first)))
    if first > cell_s:
        reps = min(reps, 2)
    times = [first * 1e3]
    for _ in range(reps - 1):
        step.prepare()
        t0 = time.perf_counter()
        step.run()
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(summarize(times), peak_mem_mb=peak_mb)


def cpu_matmul_tflops(n: int = 2048, reps: int = 5) -> float:
    """Dense float32 ``torch.matmul`` rate with the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e12  # the best call: a shared CPU's noise only slows calls down
