"""CI smoke test of the benchmark suite: the CPU sweep at tiny sizes, end to end."""
import csv
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # benchmarks/ is a folder of the repository, not an installed package

from benchmarks.providers import PROVIDERS  # noqa: E402
from benchmarks.report import COLUMNS, MEASURED_COLUMNS  # noqa: E402


def test_cpu_sweep_writes_complete_csv_and_plots(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the benchmark must not depend on the test setup
    cmd = [sys.executable, "-m", "benchmarks.run", "--device", "cpu", "--quick", "--sizes", "64,128",
           "--dims", "32", "--reps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hnclip-torch" in proc.stdout and "targets" in proc.stdout

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
