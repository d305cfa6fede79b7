"""Speed and memory of the hard-negative loss against the number of negative captions M.

    python -m benchmarks.negatives                  # the GPU sweep if CUDA is available, else the CPU one
    python -m benchmarks.negatives --device cpu --quick

Per cell (provider, N, M = r·N for r in --ratios, default 0, 1, 4): one forward+backward of the
loss on random (N, D) images and captions and (M, D) negative captions, all requiring grad, τ =
0.07. Providers:

  * hnclip-torch: ``hn_clip_loss(..., negatives=n, backend="torch")``, γ = 0.5 (our reference
    backend: it materialises the N × (N + M) logits and the margin's matrix);
  * hnclip-cpp: the same on the fused C++ kernels (CPU; no N × (N + M) matrix);
  * hnclip-triton: the same on the Triton kernels (CUDA only);
  * negclip: plain PyTorch as NegCLIP computes it: the N × (N + M) logits
    ``logit_scale · img @ cat(txt, neg)ᵀ`` and ``logit_scale · txt @ imgᵀ``, each through
    ``F.cross_entropy``, averaged. No margin (γ = 0): the time and memory floor of materialising
    the logits, not the same loss as ours;
  * negclip-margin: negclip with HN-CLIP's margin materialised, γ·sg(t_i·x) added off the
    positive (the text→image margin t tᵀ is the first N columns of the same matrix): the same
    loss as ours, computed the plain way.
Every provider L2-normalises the features (ours inside the loss; negclip as NegCLIP's model does
before its loss), so all do the same O((N + M)·D) normalisation work.

Timing and memory as ``python -m benchmarks.run`` (``benchmarks/measure.py``): on a GPU
``triton.testing.do_bench`` (or CUDA events for slow calls) and ``torch.cuda.max_memory_allocated``
above the inputs; on a CPU ``time.perf_counter`` over repeated calls and the resident-set growth
of one call, each provider in its own worker process. ``logits_mb`` is the size of one N × (N + M)
matrix in the features' dtype, the unit of what the plain providers materialise.

Writes DEVICE_negatives.csv and DEVICE_negatives.png (time and peak memory against M/N, a panel
per N) under --out (default benchmarks/out) and prints the table (ratio = time / time of
hnclip-cpp on a CPU, hnclip-triton on a GPU, falling back to hnclip-torch).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from . import measure, report
from .providers import GAMMA, TAU

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULTS = {  # (device, quick) -> defaults, each overridable on the command line
    ("cuda", False): dict(sizes=[4096, 16384, 32768], dim=512, dtype="bfloat16", rep_ms=50, reps=0, cell_s=0),
    ("cuda", True): dict(sizes=[4096], dim=512, dtype="bfloat16", rep_ms=25, reps=0, cell_s=0),
    ("cpu", False): dict(sizes=[256, 1024, 2048], dim=512, dtype="float32", rep_ms=0, reps=5, cell_s=4),
    ("cpu", True): dict(sizes=[64, 128], dim=32, dtype="float32", rep_ms=0, reps=2, cell_s=1),
}
RATIOS = [0, 1, 4]
REFERENCE = {"cuda": ("hnclip-triton", "hnclip-torch"), "cpu": ("hnclip-cpp", "hnclip-torch")}
SLOW_MS = 1000  # after a cell this slow the next (larger) one skips its warm-up call
COLUMNS = [
    "provider",
    "device",
    "device_name",
    "dtype",
    "N",
    "M",
    "M_over_N",
    "D",
    "median_ms",
    "q20_ms",
    "q80_ms",
    "peak_mem_mb",
    "logits_mb",
    "reps",
    "threads",
    "torch_version",
    "triton_version",
    "date",
    "status",
]
MEASURED = ["median_ms", "q20_ms", "q80_ms", "peak_mem_mb", "reps"]


def _hnclip(backend, img, txt, neg=None):
    from hnclip_kernels import hn_clip_loss

    return hn_clip_loss(img, txt, TAU, gamma=GAMMA, backend=backend, negatives=neg)


def _negclip(margin, img, txt, neg=None):
    img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
    keys = txt if neg is None else torch.cat([txt, F.normalize(neg, dim=-1)])
    labels = torch.arange(img.shape[0], device=img.device)
    logits_i2t, logits_t2i = img @ keys.T, txt @ img.T  # N × (N + M) and N × N
    if margin:
        with torch.no_grad():
            h = txt @ keys.T
            h.fill_diagonal_(0.0)  # no margin on the positive (i, i)
        logits_i2t = logits_i2t + GAMMA * h
        logits_t2i = logits_t2i + GAMMA * h[:, : img.shape[0]]  # t tᵀ is symmetric
    scale = 1.0 / TAU  # logit_scale
    return 0.5 * (F.cross_entropy(scale * logits_i2t, labels) + F.cross_entropy(scale * logits_t2i, labels))


# name -> (loss_fn(img, txt, neg=None), devices, why not elsewhere)
PROVIDERS = {
    "hnclip-torch": (functools.partial(_hnclip, "torch"), ("cpu", "cuda"), ""),
    "hnclip-cpp": (functools.partial(_hnclip, "cpp"), ("cpu",), "CPU only (the C++ kernel takes CPU tensors)"),
    "hnclip-triton": (
        functools.partial(_hnclip, "triton"),
        ("cuda",),
        "CUDA only (the Triton interpreter on CPU is far too slow to benchmark)",
    ),
    "negclip": (functools.partial(_negclip, False), ("cpu", "cuda"), ""),
    "negclip-margin": (functools.partial(_negclip, True), ("cpu", "cuda"), ""),
}


def unavailable(name: str, device: str):
    """Why provider ``name`` cannot run on ``device`` here, or None."""
    _, devices, note = PROVIDERS[name]
    if device not in devices:
        return note
    if name == "hnclip-cpp":
        from hnclip_kernels.backends import cpp_directional

        if cpp_directional() is None:
            return "hnclip_kernels._C is not built (reinstall with the README's command to compile csrc/)"
    return None


def _csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.negatives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and short timing (the smoke test)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"), help="output folder")
    ap.add_argument("--sizes", type=_csv_list(int), help="batch sizes N (CPU default 256,1024,2048)")
    ap.add_argument("--ratios", type=_csv_list(int), default=RATIOS, help="M / N values (default 0,1,4)")
    ap.add_argument("--dim", type=int, help="embedding dim D (default 512)")
    ap.add_argument("--dtype", choices=list(DTYPES), help="feature dtype (CPU float32, GPU bfloat16)")
    ap.add_argument("--providers", type=_csv_list(str), default=list(PROVIDERS), help=",".join(PROVIDERS))
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads; default 1)")
    ap.add_argument("--rep-ms", type=float, help="GPU: do_bench rep time per cell (ms)")
    ap.add_argument("--reps", type=int, help="CPU: timed calls per cell at most (at least min(3, reps))")
    ap.add_argument("--cell-s", type=float, help="CPU: timing budget per cell (s)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one provider's CPU cells
    args = ap.parse_args(argv)
    bad = [p for p in args.providers if p not in PROVIDERS]
    if bad:
        ap.error(f"--providers: unknown {bad}; choose from {','.join(PROVIDERS)}")
    if any(r < 0 for r in args.ratios):
        ap.error("--ratios: M / N must be >= 0")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    for key, value in DEFAULTS[(args.device, args.quick)].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _cells(args):
    return [(n, r * n) for n in sorted(args.sizes) for r in args.ratios]


def _inputs(n, m, d, dtype, device, n_sets):
    gen = torch.Generator(device=device).manual_seed(0)

    def leaf(rows):
        return torch.randn(rows, d, generator=gen, device=device, dtype=dtype).requires_grad_(True)

    return [(leaf(n), leaf(n), leaf(m)) if m else (leaf(n), leaf(n)) for _ in range(n_sets)]


def _is_oom(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg or "can't allocate memory" in msg


def sweep(args, providers, emit=None):
    """Measure every (provider, N, M) cell on ``args.device``; one row per cell."""
    rows, dtype = [], DTYPES[args.dtype]
    for prov in providers:
        loss_fn, last_ms = PROVIDERS[prov][0], 0.0
        for n, m in _cells(args):
            row = dict(provider=prov, dtype=args.dtype, N=n, M=m, M_over_N=m // n, D=args.dim)
            try:
                sets = _inputs(n, m, args.dim, dtype, args.device, 3 if args.device == "cuda" else 2)
                step = measure.Step(loss_fn, sets, "fwd+bwd")
                warm = last_ms < SLOW_MS
                if args.device == "cuda":
                    row.update(measure.measure_cuda(step, warm=warm, rep_ms=args.rep_ms))
                else:
                    row.update(
                        measure.measure_cpu(
                            step, warm=warm, min_reps=min(3, args.reps), max_reps=args.reps, cell_s=args.cell_s
                        )
                    )
                row["status"], last_ms = "ok", row["median_ms"]
            except Exception as exc:  # one failing cell must not end the sweep
                row["status"] = "OOM" if _is_oom(exc) else f"error: {type(exc).__name__}: {exc}"[:300]
            step = sets = None
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            row["status"] = " ".join(row["status"].split())
            rows.append(row)
            if emit:
                emit(row)
    return rows


def run_cpu(args, argv, providers):
    """One worker process per provider, so each one's peak resident set is its own."""
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for prov in providers:
        print(f"[{prov}] {len(_cells(args))} cells in a worker process", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.negatives", *argv, "--device", "cpu", "--worker", prov]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        rows += got
        for i, (n, m) in enumerate(_cells(args)[len(got) :]):  # cells a dead worker never reported
            died = (
                "OOM (worker killed)" if proc.returncode == -9 and i == 0 else f"error: worker exited {proc.returncode}"
            )
            rows.append(dict(provider=prov, dtype=args.dtype, N=n, M=m, M_over_N=m // n, D=args.dim, status=died))
    return rows


def format_table(rows, preferred_ref) -> str:
    head = f"\n== {rows[0]['device']} ({rows[0]['device_name']}) · {rows[0]['dtype']} · D={rows[0]['D']} · fwd+bwd"
    lines = [
        head + f" · ratio = time / time of {' (else '.join(preferred_ref)})",
        f"{'N':>6} {'M':>6}  {'provider':<15} {'median ms':>10} {'q20-q80 ms':>19} {'peak MiB':>9} "
        f"{'logits MiB':>10} {'ratio':>7}",
    ]
    order = list(PROVIDERS)
    statuses = {p: {r["status"] for r in rows if r["provider"] == p} for p in order}
    # a provider with the same non-ok status in every cell (not on this device) gets one line
    uniform = {p: s.pop() for p, s in statuses.items() if len(s) == 1 and "ok" not in s}
    for n, m in sorted({(r["N"], r["M"]) for r in rows}):
        cell = sorted(
            (r for r in rows if r["N"] == n and r["M"] == m and r["provider"] not in uniform),
            key=lambda r: order.index(r["provider"]),
        )
        ok = {r["provider"]: r for r in cell if r["status"] == "ok"}
        ref = next((ok[p]["median_ms"] for p in preferred_ref if p in ok), None)
        for r in cell:
            if r["status"] != "ok":
                lines.append(f"{n:>6} {m:>6}  {r['provider']:<15} {r['status']}")
                continue
            ratio = f"{r['median_ms'] / ref:.2f}x" if ref else "-"
            lines.append(
                f"{n:>6} {m:>6}  {r['provider']:<15} {r['median_ms']:>10.2f} "
                f"{r['q20_ms']:>9.2f}-{r['q80_ms']:<9.2f} {r['peak_mem_mb']:>9.1f} {r['logits_mb']:>10.1f} {ratio:>7}"
            )
    lines += [f"{'all':>6} {'':>6}  {p:<15} {status}" for p, status in uniform.items()]
    return "\n".join(lines)


def write_csv(rows, path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: report._csv_value(row.get(k)) for k in COLUMNS})


def plot(rows, path) -> None:
    """Time (top) and peak memory (bottom) against M/N, a panel per N, a line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), squeeze=False, figsize=(4.2 * len(sizes), 7))
    for j, n in enumerate(sizes):
        for i, (metric, label) in enumerate(
            (("median_ms", "median time (ms)"), ("peak_mem_mb", "peak MiB above inputs"))
        ):
            ax = axes[i][j]
            for prov in PROVIDERS:
                pts = sorted(
                    (r["M_over_N"], r[metric])
                    for r in rows
                    if r["provider"] == prov and r["N"] == n and r["status"] == "ok"
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=prov)
            ax.set_yscale(
                "log" if metric == "median_ms" else "symlog", **({} if metric == "median_ms" else {"linthresh": 1.0})
            )
            if metric == "peak_mem_mb":
                ax.set_ylim(bottom=0)
            ax.set(title=f"N={n}, D={rows[0]['D']}, {rows[0]['dtype']}, fwd+bwd", xlabel="M / N", ylabel=label)
            ax.set_xticks(sorted({r["M_over_N"] for r in rows}))
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"hard negatives: {rows[0]['device_name']} ({rows[0]['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from .run import _device_name, _version

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.worker:  # CPU worker: rows as JSON lines on stdout
        sweep(args, [args.worker], emit=lambda row: print("ROW " + json.dumps(row), flush=True))
        return 0
    start = time.monotonic()
    runnable, rows = [], []
    for prov in args.providers:
        reason = unavailable(prov, args.device)
        if reason:
            print(f"skipping {prov}: {reason}", file=sys.stderr)
            rows += [
                dict(
                    provider=prov, dtype=args.dtype, N=n, M=m, M_over_N=m // n, D=args.dim, status=f"skipped: {reason}"
                )
                for n, m in _cells(args)
            ]
        else:
            runnable.append(prov)
    load_before = report.load_note("before the sweep")
    rows += sweep(args, runnable) if args.device == "cuda" else run_cpu(args, argv, runnable)
    load_after = report.load_note("after the sweep")
    meta = dict(
        device=args.device,
        device_name=_device_name(args.device),
        threads=args.threads if args.device == "cpu" else torch.get_num_threads(),
        torch_version=torch.__version__,
        triton_version=_version("triton"),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    itemsize = DTYPES[args.dtype].itemsize
    for row in rows:
        row.update(meta, logits_mb=row["N"] * (row["N"] + row["M"]) * itemsize / 2**20)
    order = list(PROVIDERS)
    rows.sort(key=lambda r: (r["N"], r["M"], order.index(r["provider"])))
    print(format_table(rows, REFERENCE[args.device]))
    print(load_before)
    print(load_after)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"{args.device}_negatives.csv")
    png_path = os.path.join(args.out, f"{args.device}_negatives.png")
    write_csv(rows, csv_path)
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {png_path} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
