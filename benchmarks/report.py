"""Benchmark output: the CSV, the table on stdout and the PNG plots."""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict

# One row per (provider, dtype, N, D, mode) cell. The metadata columns are filled in every
# row; the measured columns only where status == "ok" (empty for "OOM", "skipped: ...",
# "error: ...").
META_COLUMNS = [
    "provider",
    "device",
    "device_name",
    "dtype",
    "N",
    "D",
    "mode",
    "threads",
    "matmul_tflops",
    "torch_version",
    "triton_version",
    "date",
    "status",
]
MEASURED_COLUMNS = ["median_ms", "q20_ms", "q80_ms", "peak_mem_mb", "tflops", "frac_of_matmul", "reps"]
# workspace_mb: what ``hnclip_kernels.workspace_bytes`` states the fused Triton path allocates
# beyond inputs and outputs (GPU launch configuration), beside the measured peak; "n/a" for the
# other providers. Filled in every row, measured or not.
COLUMNS = META_COLUMNS[:7] + MEASURED_COLUMNS[:4] + ["workspace_mb"] + MEASURED_COLUMNS[4:] + META_COLUMNS[7:]

# Useful FLOPs per N²·D: the logits (2), and dL/dimg plus dL/dtxt (2 + 2). Margins,
# recomputation and both directions' extra work are the implementation's cost, not counted.
USEFUL_FLOPS = {"fwd": 2, "bwd": 4, "fwd+bwd": 6}

# Issue 3's CPU targets: (what, slower provider, faster provider, N, metric, factor)
CPU_TARGETS = [
    ("cpp >= 1.5x faster than hnclip-torch at N=4096", "hnclip-torch", "hnclip-cpp", 4096, "median_ms", 1.5),
    ("cpp >= 1.2x faster than torch.compile at N=4096", "hnclip-torch-compile", "hnclip-cpp", 4096, "median_ms", 1.2),
    ("cpp peak memory < 1/10 of hnclip-torch at N=16384", "hnclip-torch", "hnclip-cpp", 16384, "peak_mem_mb", 10.0),
]


def finalize(rows: list, meta: dict) -> list:
    """Add the run's metadata and the achieved rates to every row."""
    for row in rows:
        row.update(meta)
        row["workspace_mb"] = workspace_mb(row)
        if row["status"] == "ok":
            flops = USEFUL_FLOPS[row["mode"]] * row["N"] ** 2 * row["D"]
            row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
            row["frac_of_matmul"] = row["tflops"] / meta["matmul_tflops"]
    return rows


def workspace_mb(row: dict):
    """MiB the fused Triton path allocates beyond inputs and outputs for this cell (its forward's
    statistics and backward's dS chunks, ``hnclip_kernels.workspace_bytes``), or "n/a"."""
    if not row["provider"].startswith("hnclip-triton"):
        return "n/a"
    try:
        import torch

        from hnclip_kernels import workspace_bytes

        return workspace_bytes(int(row["N"]), int(row["D"]), getattr(torch, row["dtype"])) / 2**20
    except ImportError:  # no Triton
        return "n/a"


def write_csv(rows: list, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in COLUMNS})


def _csv_value(v):
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else v


def _reference(group_rows: list, preferred: tuple):
    ok = {r["provider"] for r in group_rows if r["status"] == "ok"}
    return next((p for p in preferred if p in ok), None)


def format_table(rows: list, provider_order: list, preferred_ref: tuple) -> str:
    """One block per (dtype, D, mode); a line per (N, provider) with time, memory, rate, ratio."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["dtype"], r["D"], r["mode"])].append(r)
    out = []
    for (dtype, d, mode), grp in groups.items():
        ref = _reference(grp, preferred_ref)
        ref_ms = {r["N"]: r["median_ms"] for r in grp if r["provider"] == ref and r["status"] == "ok"}
        out.append(
            f"\n== {grp[0]['device']} ({grp[0]['device_name']}) · {dtype} · D={d} · {mode}"
            + (f" · ratio = time / time of {ref}" if ref else "")
        )
        out.append(
            f"{'N':>7}  {'provider':<21} {'median ms':>10} {'q20-q80 ms':>19} {'peak MiB':>9} {'ws MiB':>8} "
            f"{'TFLOP/s':>8} {'%matmul':>8} {'ratio':>7}"
        )
        # a provider with the same non-ok status at every N (e.g. not importable) gets one line
        statuses = defaultdict(set)
        for r in grp:
            statuses[r["provider"]].add(r["status"])
        uniform = {
            p: s.pop()
            for p, s in sorted(statuses.items(), key=lambda kv: provider_order.index(kv[0]))
            if len(s) == 1 and "ok" not in s
        }
        for r in sorted(grp, key=lambda r: (r["N"], provider_order.index(r["provider"]))):
            if r["provider"] in uniform:
                continue
            if r["status"] != "ok":
                out.append(f"{r['N']:>7}  {r['provider']:<21} {r['status']}")
                continue
            ratio = f"{r['median_ms'] / ref_ms[r['N']]:.2f}x" if r["N"] in ref_ms else "-"
            out.append(
                f"{r['N']:>7}  {r['provider']:<21} {r['median_ms']:>10.3f} "
                f"{r['q20_ms']:>9.3f}-{r['q80_ms']:<9.3f} {r['peak_mem_mb']:>9.1f} {_mib(r.get('workspace_mb')):>8} "
                f"{r['tflops']:>8.3f} {100 * r['frac_of_matmul']:>7.1f}% {ratio:>7}"
            )
        out += [f"{'all N':>7}  {p:<21} {status}" for p, status in uniform.items()]
    return "\n".join(out)


def _mib(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else (v or "-")


def format_targets(rows: list, targets=CPU_TARGETS, dtype="float32", d=512, mode="fwd+bwd") -> str:
    """Issue 3's acceptance targets, judged on this run's rows (n/a where a cell is missing)."""
    cell = {
        (r["provider"], r["N"]): r
        for r in rows
        if r["status"] == "ok" and r["dtype"] == dtype and r["D"] == d and r["mode"] == mode
    }
    lines = [f"\ntargets ({dtype}, D={d}, {mode}):"]
    for what, slow, fast, n, metric, factor in targets:
        a, b = cell.get((slow, n)), cell.get((fast, n))
        if a is None or b is None:
            lines.append(f"  n/a   {what} (no measurement of both)")
            continue
        got = a[metric] / b[metric] if b[metric] > 0 else math.inf
        lines.append(f"  {'PASS' if got >= factor else 'FAIL'}  {what}: {got:.2f}x")
    return "\n".join(lines)


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_note(when: str, load=None, n_cores=None) -> str:
    """The 1/5/15-minute load averages ``when`` the sweep runs, with a warning above the core count
    (other processes then take CPU time from the timed ones: slower cells, spurious FAILs)."""
    if load is None:
        if not hasattr(os, "getloadavg"):
            return f"load average {when}: unknown on this platform"
        load = os.getloadavg()
    n_cores = cores() if n_cores is None else n_cores
    line = f"load average {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {n_cores} cores"
    if max(load[0], load[1]) > n_cores:
        line += (
            f"\nWARNING: the load average is above the {n_cores} cores: other processes share the CPU, so "
            "the times (and the PASS/FAIL targets) are not those of an idle machine; rerun when it is idle"
        )
    return line


def plot(rows: list, out_dir: str, prefix: str, provider_order: list) -> list:
    """time_vs_n and memory_vs_n PNGs: a panel per (dtype, D) and mode, a line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = sorted({(r["dtype"], r["D"]) for r in rows})
    sizes = sorted({r["N"] for r in rows})
    modes = [m for m in USEFUL_FLOPS if any(r["mode"] == m for r in rows)]
    paths = []
    for metric, label, name in (
        ("median_ms", "median time (ms)", "time_vs_n"),
        ("peak_mem_mb", "peak memory above inputs (MiB)", "memory_vs_n"),
    ):
        fig, axes = plt.subplots(len(panels), len(modes), squeeze=False, figsize=(4.5 * len(modes), 3.6 * len(panels)))
        for (i, (dtype, d)), (j, mode) in ((a, b) for a in enumerate(panels) for b in enumerate(modes)):
            ax = axes[i][j]
            for prov in provider_order:
                pts = sorted(
                    (r["N"], r[metric])
                    for r in rows
                    if r["provider"] == prov
                    and r["dtype"] == dtype
                    and r["D"] == d
                    and r["mode"] == mode
                    and r["status"] == "ok"
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=prov)
            ax.set_xscale("log", base=2)
            if metric == "peak_mem_mb":
                ax.set_yscale("symlog", linthresh=1.0)  # RSS growth of a tiny cell can be 0
                ax.set_ylim(bottom=0)  # memory is never negative: no empty lower half
            else:
                ax.set_yscale("log")
            ax.set(title=f"{dtype}, D={d}, {mode}", xlabel="N (batch)", ylabel=label)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.suptitle(f"{rows[0]['device_name']} ({rows[0]['device']})")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{prefix}_{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
