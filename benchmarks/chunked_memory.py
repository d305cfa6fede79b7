"""Peak memory of one training step against the contrastive batch, chunked and unchunked.

    python -m benchmarks.chunked_memory                       # CPU: peak RSS of a fresh process per cell
    python -m benchmarks.chunked_memory --device cuda         # GPU: torch.cuda.max_memory_allocated
    python -m benchmarks.chunked_memory --sizes 32,64 --chunk 16 --model ViT-B-32

Each cell (batch N, chunk C or none) runs in a fresh interpreter: an open_clip model with random
weights (``pretrained=None``, train mode), N random images and captions, one forward through
both towers (:func:`hnclip_kernels.chunked_features` in chunks of C, or ``model(images, texts)``),
one ``HNClipLoss`` (γ = 0.5) and one backward. Reported: on CPU the process's peak RSS
(``ru_maxrss``: the high-water mark, insensitive to CPU contention, unlike time) and its growth
over the RSS after the model and inputs were built (the step's own memory: activations, features,
gradients); on CUDA ``max_memory_allocated`` and its growth over the allocation before the step.
A cell whose unchunked peak, extrapolated linearly from the smaller cells, exceeds ``--max-gb``
is skipped (so a shared machine is not pushed into swap or the OOM killer).

Writes DEVICE_chunked_memory.csv and DEVICE_chunked_memory.png under --out (default benchmarks/out).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

COLUMNS = [
    "model",
    "device",
    "N",
    "chunk",
    "peak_mb",
    "step_mb",
    "seconds",
    "threads",
    "torch_version",
    "date",
    "status",
]


def _child(model_name: str, device: str, n: int, chunk: int) -> dict:
    import open_clip
    import torch

    from hnclip_kernels import HNClipLoss, chunked_features

    torch.manual_seed(0)
    model = open_clip.create_model(model_name, pretrained=None).to(device).train()
    tokenizer_len = model.context_length
    images = torch.randn(n, 3, *model.visual.image_size, device=device)
    texts = torch.randint(1, 49407, (n, tokenizer_len), device=device)
    texts[:, -1] = 49407
    loss_fn = HNClipLoss(gamma=0.5)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kb() * 1024
    t0 = time.perf_counter()
    img, txt, scale = chunked_features(model, images, texts, chunk) if chunk else model(images, texts)
    loss_fn(img, txt, scale).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    seconds = time.perf_counter() - t0
    return dict(
        peak_mb=peak / 2**20,
        step_mb=(peak - base) / 2**20,
        seconds=seconds,
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
    )


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _run_cell(args, n: int, chunk: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.chunked_memory",
        "--child",
        "--model",
        args.model,
        "--device",
        args.device,
        "--sizes",
        str(n),
        "--chunk",
        str(chunk),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed (out of memory?)"])[-1]
        return dict(status=f"failed: {tail[:120]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), status="ok")


def _estimate(rows: list, chunk: int, n: int):
    """Linear extrapolation of the peak from the two largest measured cells of this chunk setting
    (from one: proportional to N, an overestimate)."""
    done = sorted((r["N"], r["peak_mb"]) for r in rows if r["chunk"] == chunk and r["status"] == "ok")
    if not done:
        return None
    if len(done) == 1:
        return done[0][1] * n / done[0][0]
    (n0, p0), (n1, p1) = done[-2:]
    return p1 + (p1 - p0) / (n1 - n0) * (n - n1)


def format_table(rows: list, device: str) -> str:
    what = "peak RSS" if device == "cpu" else "max_memory_allocated"
    sizes = sorted({r["N"] for r in rows})
    chunks = sorted({r["chunk"] for r in rows})
    head = "| N | " + " | ".join(f"{'unchunked' if c == 0 else f'chunk {c}'}: {what} (step)" for c in chunks) + " |"
    lines = [head, "|" + "---|" * (len(chunks) + 1)]
    for n in sizes:
        cells = []
        for c in chunks:
            r = next((r for r in rows if r["N"] == n and r["chunk"] == c), None)
            cells.append(
                f"{r['peak_mb']:,.0f} MiB ({r['step_mb']:,.0f})"
                if r and r["status"] == "ok"
                else (r["status"] if r else "-")
            )
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list, path: str, device: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in sorted({r["chunk"] for r in rows}):
        pts = sorted((r["N"], r["step_mb"]) for r in rows if r["chunk"] == c and r["status"] == "ok")
        if pts:
            ax.plot(*zip(*pts), marker="o", label="unchunked" if c == 0 else f"chunk {c}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("contrastive batch N")
    ax.set_ylabel(("peak RSS" if device == "cpu" else "max allocated") + " growth of one step (MiB)")
    ax.set_title(f"{model} (random init), one training step, {device}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.chunked_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--sizes", default="32,64,128,256", help="contrastive batch sizes N")
    ap.add_argument("--chunk", type=int, default=16, help="chunk size of the chunked cells")
    ap.add_argument("--max-gb", type=float, default=12.0, help="skip a cell whose extrapolated peak is larger")
    ap.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds per cell")
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"))
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="CSV",
        help="measure nothing: merge these CSVs (runs at other sizes) into one CSV, PNG and table",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.child:
        print(json.dumps(_child(args.model, args.device, sizes[0], args.chunk)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        return _write(args, sorted(_read(args.merge), key=lambda r: (r["N"], r["chunk"])))
    rows, date = [], datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for n in sizes:
        for chunk in (0, args.chunk):
            est = _estimate(rows, chunk, n)
            row = dict(model=args.model, device=args.device, N=n, chunk=chunk, date=date)
            if est is not None and est > args.max_gb * 1024:
                row.update(status=f"skipped: ~{est / 1024:.1f} GB > --max-gb {args.max_gb:g}")
            else:
                row.update(_run_cell(args, n, chunk))
            rows.append(row)
            print(
                f"N={n} chunk={chunk or '-'}: {row.get('peak_mb', float('nan')):.0f} MiB peak, "
                f"{row.get('step_mb', float('nan')):.0f} MiB step, {row.get('seconds', float('nan')):.1f} s, "
                f"{row['status']}",
                flush=True,
            )
    return _write(args, rows)


def _read(paths: list) -> list:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                r["N"], r["chunk"] = int(r["N"]), int(r["chunk"])
                for k in ("peak_mb", "step_mb", "seconds"):
                    r[k] = float(r[k]) if r[k] else None
                rows.append(r)
    return rows


def _write(args, rows: list) -> int:
    csv_path = os.path.join(args.out, f"{args.device}_chunked_memory.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.join(args.out, f"{args.device}_chunked_memory.png"), rows[0]["device"], rows[0]["model"])
    model, device = rows[0]["model"], rows[0]["device"]
    print(f"\n{model}, random init, one forward+backward, {platform.processor() or platform.machine()}")
    print(format_table(rows, device))
    print(f"\nwrote {csv_path} and the PNG next to it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
