"""CI smoke test of the benchmark suite: the CPU sweep at tiny sizes, end to end."""

import csv
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.providers import PROVIDERS
from benchmarks.report import COLUMNS, MEASURED_COLUMNS


def test_cpu_sweep_writes_complete_csv_and_plots(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the benchmark must not depend on the test setup
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--device",
        "cpu",
        "--quick",
        "--sizes",
        "64,128",
        "--dims",
        "32",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hnclip-torch" in proc.stdout and "targets" in proc.stdout
    assert "load average before the sweep: " in proc.stdout and "load average after the sweep: " in proc.stdout

    for name in ("cpu_time_vs_n.png", "cpu_memory_vs_n.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    with open(tmp_path / "cpu_results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)

    assert len(rows) == len(PROVIDERS) * 2  # one row per provider and N, skipped ones included
    for row in rows:
        assert row["status"] == "ok" or row["status"] == "OOM" or row["status"].startswith("skipped: "), row
        measured = set(MEASURED_COLUMNS)
        for col in COLUMNS:
            if col not in measured or row["status"] == "ok":
                assert row[col] != "", f"{row['provider']} N={row['N']}: empty {col}"
        if row["status"] == "ok":
            assert all(math.isfinite(float(row[c])) for c in MEASURED_COLUMNS), row
            assert float(row["median_ms"]) > 0 and float(row["q20_ms"]) <= float(row["q80_ms"])
        else:
            assert all(row[c] == "" for c in MEASURED_COLUMNS), row
    ok = {r["provider"] for r in rows if r["status"] == "ok"}
    assert {"hnclip-torch", "hnclip-torch-compile", "open_clip"} <= ok
    from hnclip_kernels.backends import cpp_directional

    assert ("hnclip-cpp" in ok) == (cpp_directional() is not None)  # runs as soon as it is built


def test_load_average_above_the_cores_warns():
    from benchmarks.report import load_note

    idle = load_note("before the sweep", load=(0.5, 0.7, 0.9), n_cores=2)
    assert idle == "load average before the sweep: 0.50 0.70 0.90 on 2 cores"
    busy = load_note("after the sweep", load=(3.1, 1.0, 0.5), n_cores=2)
    assert busy.startswith("load average after the sweep: 3.10")
    assert "WARNING: the load average is above the 2 cores" in busy
    assert "WARNING" in load_note("x", load=(1.0, 4.0, 4.0), n_cores=2)  # loaded over the last 5 minutes


def test_memory_plot_has_no_negative_region(tmp_path):
    """The memory axis is symlog (a cell's RSS growth can be 0): its range starts at 0, not below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import report

    rows = [
        dict(
            provider=p,
            dtype="float32",
            D=32,
            mode="fwd+bwd",
            N=n,
            status="ok",
            median_ms=1.0 + n,
            peak_mem_mb=mem,
            device="cpu",
            device_name="test",
        )
        for p, n, mem in (("hnclip-torch", 64, 0.0), ("hnclip-torch", 128, 30.0), ("hnclip-cpp", 64, 2.0))
    ]
    created = []
    original = plt.subplots

    def subplots(*args, **kwargs):
        fig, axes = original(*args, **kwargs)
        created.append(axes)
        return fig, axes

    plt.subplots = subplots
    try:
        report.plot(rows, str(tmp_path), "cpu", ["hnclip-torch", "hnclip-cpp"])
    finally:
        plt.subplots = original
    memory_axes = created[1][0][0]
    assert memory_axes.get_yscale() == "symlog" and memory_axes.get_ylim()[0] == 0
