"""Speed and memory of HN-CLIP loss implementations at the batch sizes users train with.

    python -m benchmarks.run                  # the GPU sweep if CUDA is available, else the CPU one
    python -m benchmarks.run --device cpu --quick
    python -m benchmarks.run --loss sigmoid   # the sigmoid (SigLIP) loss's providers

Prints a table, and writes DEVICE_results.csv, DEVICE_time_vs_n.png and
DEVICE_memory_vs_n.png (DEVICE_sigmoid_* with --loss sigmoid) under --out (default
benchmarks/out). See benchmarks/__init__.py for what each number means.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from . import measure, report, sigmoid
from .providers import PROVIDERS, unavailable

# --loss -> (the providers, the CPU targets judged at the end, the output files' prefix suffix)
LOSSES = {
    "infonce": (PROVIDERS, report.CPU_TARGETS, ""),
    "sigmoid": (sigmoid.PROVIDERS, sigmoid.TARGETS, "_sigmoid"),
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (device, quick) -> defaults; every one can be overridden on the command line
DEFAULTS = {
    ("cuda", False): dict(
        sizes=[4096, 16384, 65536, 262144],
        dims=[512, 768],
        dtypes=["bfloat16", "float32"],
        modes=list(measure.MODES),
        rep_ms=50,
        budget_s=210,
        max_call_s=5,
    ),
    ("cuda", True): dict(
        sizes=[4096, 16384],
        dims=[512],
        dtypes=["bfloat16"],
        modes=list(measure.MODES),
        rep_ms=25,
        budget_s=90,
        max_call_s=1,
    ),
    ("cpu", False): dict(
        sizes=[1024, 4096, 16384],
        dims=[512],
        dtypes=["float32"],
        modes=["fwd+bwd"],
        reps=5,
        cell_s=20,
        budget_s=0,
        max_call_s=0,
    ),
    ("cpu", True): dict(
        sizes=[1024, 4096],
        dims=[512],
        dtypes=["float32"],
        modes=["fwd+bwd"],
        reps=3,
        cell_s=3,
        budget_s=0,
        max_call_s=0,
    ),
}
REFERENCE = {"cuda": ("hnclip-triton", "hnclip-torch"), "cpu": ("hnclip-cpp", "hnclip-torch")}
INPUT_SETS = {"cuda": 3, "cpu": 2}
SLOW_MS = 1000  # a call this slow was warmed up at a smaller N already: no separate warm-up call


def _csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    epilog = "defaults:\n" + "\n".join(
        f"  {dev}{' --quick' if quick else ''}: "
        + ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in d.items())
        for (dev, quick), d in DEFAULTS.items()
    )
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument(
        "--loss",
        choices=list(LOSSES),
        default="infonce",
        help="infonce: HN-CLIP's softmax loss (default); sigmoid: the SigLIP loss (benchmarks/sigmoid.py)",
    )
    ap.add_argument("--quick", action="store_true", help="a small sweep (fewer sizes, shorter timing)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"), help="output folder")
    ap.add_argument("--sizes", type=_csv_list(int), help="batch sizes N, e.g. 4096,16384")
    ap.add_argument("--dims", type=_csv_list(int), help="embedding dims D, e.g. 512,768")
    ap.add_argument("--dtypes", type=_csv_list(str), help=f"from {','.join(DTYPES)}")
    ap.add_argument("--modes", type=_csv_list(str), help=f"from {','.join(measure.MODES)}")
    ap.add_argument(
        "--providers",
        type=_csv_list(str),
        help=f"infonce: {','.join(PROVIDERS)}; sigmoid: {','.join(sigmoid.PROVIDERS)} (default: all of --loss's)",
    )
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--rep-ms", type=float, help="GPU: do_bench rep time per cell (ms)")
    ap.add_argument("--reps", type=int, help="CPU: timed calls per cell at most (at least min(3, reps))")
    ap.add_argument("--cell-s", type=float, help="CPU: timing budget per cell (s)")
    ap.add_argument(
        "--budget-s",
        type=float,
        help="skip cells predicted to end past this many seconds "
        "from the start (0: no limit; GPU default keeps the sweep under 4 minutes)",
    )
    ap.add_argument(
        "--max-call-s",
        type=float,
        help="skip cells whose single call is predicted (from the previous N, ∝ N²) to take longer (0: no limit)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one provider's CPU cells
    ap.add_argument("--deadline-epoch", type=float, help=argparse.SUPPRESS)  # internal: the parent's budget
    args = ap.parse_args(argv)
    args.table = LOSSES[args.loss][0]
    if args.providers is None:
        args.providers = list(args.table)
    for name, values, allowed in (
        ("--dtypes", args.dtypes, DTYPES),
        ("--modes", args.modes, measure.MODES),
        ("--providers", args.providers, args.table),
    ):
        bad = [v for v in values or () if v not in allowed]
        if bad:
            ap.error(f"{name}: unknown {bad}; choose from {','.join(allowed)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    for key, value in DEFAULTS[(args.device, args.quick)].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _cells(args, providers):
    """Sweep order: the smallest N of every dtype first (cheap, and it pays every compilation),
    then --dtypes order and growing N, so that a time budget drops the last dtype's largest N."""
    cells = [
        (p, dt, n, d, m)
        for dt in args.dtypes
        for n in args.sizes
        for d in args.dims
        for p in providers
        for m in args.modes
        if dt in (args.table[p].dtypes or (dt,))
    ]
    return sorted(cells, key=lambda c: (c[2] != min(args.sizes), args.dtypes.index(c[1]), c[2]))


def _is_oom(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg or "can't allocate memory" in msg


def _plan(key, n, d, last, args, deadline):
    """(skip reason or None, whether to warm up) for one cell, predicted from the last measured
    (N, D) of the same provider, dtype and mode: time ∝ N²·D."""
    pred_ms = None
    if key in last:
        n0, d0, ms0 = last[key]
        pred_ms = ms0 * (n / n0) ** 2 * d / d0
    if pred_ms and args.max_call_s and pred_ms > 1000 * args.max_call_s:
        return f"skipped: predicted {pred_ms / 1000:.1f} s per call > --max-call-s {args.max_call_s:g}", False
    warm = not (pred_ms and pred_ms > SLOW_MS)
    if deadline:
        calls = (3 + warm) * (1.5 if key[-1] == "bwd" else 1.0)  # a bwd call also runs its forward
        left = deadline - time.monotonic()
        if left <= 0 or (pred_ms and pred_ms * calls / 1000 > left):
            return f"skipped: past the --budget-s {args.budget_s:g} s time budget", False
    return None, warm


def _measure(args, loss_fn, n, d, dt, mode, warm) -> dict:
    step = measure.Step(loss_fn, measure.make_inputs(n, d, DTYPES[dt], args.device, INPUT_SETS[args.device]), mode)
    if args.device == "cuda":
        return measure.measure_cuda(step, warm=warm, rep_ms=args.rep_ms)
    return measure.measure_cpu(step, warm=warm, min_reps=min(3, args.reps), max_reps=args.reps, cell_s=args.cell_s)


def sweep(args, providers, deadline=None, emit=None):
    """Measure every cell of ``providers`` on ``args.device``; one row per cell."""
    loss_fns, last, rows = {}, {}, []
    cells = _cells(args, providers)
    for prov, dt, n, d, mode in tqdm(cells, desc=f"{args.device} {','.join(providers)}"[:40], file=sys.stderr):
        row = dict(provider=prov, dtype=dt, N=n, D=d, mode=mode)
        status, warm = _plan((prov, dt, mode), n, d, last, args, deadline)
        if status is None:
            try:
                if prov not in loss_fns:
                    loss_fns[prov] = args.table[prov].build(torch.device(args.device))
                row.update(_measure(args, loss_fns[prov], n, d, dt, mode, warm))
                status = "ok"
                last[(prov, dt, mode)] = (n, d, row["median_ms"])
            except Exception as exc:  # one failing cell must not end the sweep
                status = "OOM" if _is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:300]
            if status != "ok":
                gc.collect()  # the traceback is gone: free the tensors its frames held
            if args.device == "cuda":
                torch.cuda.empty_cache()  # give the next cell an unfragmented heap
        row["status"] = " ".join(status.split())
        rows.append(row)
        if emit:
            emit(row)
    return rows


def _skipped_rows(args, prov, reason):
    return [
        dict(provider=prov, dtype=dt, N=n, D=d, mode=m, status=f"skipped: {reason}")
        for _, dt, n, d, m in _cells(args, [prov])
    ]


def run_cpu(args, argv, providers, deadline=None):
    """One worker process per provider, so each one's peak RSS is its own."""
    rows = []
    if deadline:
        argv = [*argv, "--deadline-epoch", str(time.time() + deadline - time.monotonic())]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    for prov in providers:
        expected = _cells(args, [prov])
        print(f"[{prov}] {len(expected)} cells in a worker process", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.run", *argv, "--device", "cpu", "--worker", prov]
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        rows += got
        for i, (_, dt, n, d, m) in enumerate(expected[len(got) :]):  # cells a dead worker never reported
            died = (
                "OOM (worker killed)"
                if proc.returncode == -9 and i == 0
                else f"error: worker exited with code {proc.returncode}"
            )
            rows.append(dict(provider=prov, dtype=dt, N=n, D=d, mode=m, status=died))
    return rows


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.worker:  # CPU worker: rows as JSON lines on stdout, progress on stderr
        deadline = time.monotonic() + (args.deadline_epoch - time.time()) if args.deadline_epoch else None
        sweep(args, [args.worker], deadline, emit=lambda row: print("ROW " + json.dumps(row), flush=True))
        return 0
    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s else None
    runnable, rows = [], []
    for prov in args.providers:
        reason = unavailable(prov, args.device, deep=args.device == "cuda", table=args.table)
        if reason:
            print(f"skipping {prov}: {reason}", file=sys.stderr)
            rows += _skipped_rows(args, prov, reason)
        else:
            runnable.append(prov)
    if args.device == "cuda":
        matmul = measure.cuda_matmul_tflops()
    else:
        matmul = measure.cpu_matmul_tflops(1024 if args.quick else 2048)
    print(
        f"dense {'bf16' if args.device == 'cuda' else 'float32'} torch.matmul: {matmul:.2f} TFLOP/s "
        f"(the ceiling for frac_of_matmul)",
        file=sys.stderr,
    )
    if args.device == "cuda":
        rows += sweep(args, runnable, deadline)
    else:
        load_before = report.load_note("before the sweep")
        print(load_before, file=sys.stderr, flush=True)
        rows += run_cpu(args, argv, runnable, deadline)
    meta = dict(
        device=args.device,
        device_name=_device_name(args.device),
        matmul_tflops=matmul,
        threads=args.threads if args.device == "cpu" else torch.get_num_threads(),
        torch_version=torch.__version__,
        triton_version=_version("triton"),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    report.finalize(rows, meta)
    if args.loss == "sigmoid":  # workspace_bytes states the InfoNCE path's workspace, not the sigmoid one's
        for row in rows:
            row["workspace_mb"] = "n/a"
    _, targets, suffix = LOSSES[args.loss]
    order = list(args.table)
    rows.sort(
        key=lambda r: (
            args.dtypes.index(r["dtype"]),
            r["N"],
            r["D"],
            order.index(r["provider"]),
            args.modes.index(r["mode"]),
        )
    )
    print(report.format_table(rows, order, REFERENCE[args.device]))
    if args.device == "cpu":
        if targets:
            print(report.format_targets(rows, targets))
        print(load_before)  # beside the targets it qualifies (also on stderr before the sweep)
        print(report.load_note("after the sweep"))
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"{args.device}{suffix}_results.csv")
    report.write_csv(rows, csv_path)
    pngs = report.plot(rows, args.out, args.device + suffix, order)
    print(f"\nwrote {csv_path}, {', '.join(pngs)} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
