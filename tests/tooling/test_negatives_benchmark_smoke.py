"""CI smoke test of ``python -m benchmarks.negatives``: the CPU sweep at tiny sizes, end to end."""

import csv
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.negatives import COLUMNS, MEASURED, PROVIDERS


def test_quick_cpu_sweep_writes_csv_plot_and_table(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the benchmark must not depend on the test setup
    cmd = [sys.executable, "-m", "benchmarks.negatives", "--device", "cpu", "--quick", "--out", str(tmp_path)]
    cmd += ["--sizes", "32,64", "--reps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "load average before the sweep: " in proc.stdout and "load average after the sweep: " in proc.stdout
    assert (tmp_path / "cpu_negatives.png").stat().st_size > 1000
    with open(tmp_path / "cpu_negatives.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)

    # one row per provider, N and M/N in {0, 1, 4}, skipped ones included
    cells = {(r["provider"], int(r["N"]), int(r["M"])) for r in rows}
    assert len(rows) == len(cells) == len(PROVIDERS) * 2 * 3
    assert {(n, m) for _, n, m in cells} == {(n, r * n) for n in (32, 64) for r in (0, 1, 4)}
    ok = {r["provider"] for r in rows if r["status"] == "ok"}
    assert {"hnclip-torch", "negclip", "negclip-margin"} <= ok
    from hnclip_kernels.backends import cpp_directional

    assert ("hnclip-cpp" in ok) == (cpp_directional() is not None)
    for row in rows:
        if row["provider"] == "hnclip-triton":  # CUDA only: skipped with the reason, never run here
            assert row["status"].startswith("skipped: CUDA only"), row
        if row["status"] == "ok":
            assert all(math.isfinite(float(row[c])) for c in MEASURED), row
            assert float(row["median_ms"]) > 0 and float(row["q20_ms"]) <= float(row["q80_ms"])
        else:
            assert all(row[c] == "" for c in MEASURED), row
        n, m = int(row["N"]), int(row["M"])
        assert math.isclose(float(row["logits_mb"]), n * (n + m) * 4 / 2**20, rel_tol=1e-5)  # float32, 6 digits

    # the table: a line per measured cell, the CUDA-only provider in one line
    lines = [line.split() for line in proc.stdout.splitlines()]
    for prov in ok:
        assert sum(w[:1] != ["all"] and prov in w[2:3] for w in lines) == 6, prov
    assert ["all", "hnclip-triton", "skipped:", "CUDA", "only"] in [w[:5] for w in lines]


def test_negclip_margin_is_the_hnclip_loss():
    """negclip-margin materialises the same loss as ours (the plain way): equal values."""
    import torch

    from benchmarks.negatives import PROVIDERS as P

    gen = torch.Generator().manual_seed(0)
    img, txt, neg = (torch.randn(r, 16, generator=gen, dtype=torch.float64) for r in (8, 8, 20))
    ours = P["hnclip-torch"][0](img, txt, neg)
    plain = P["negclip-margin"][0](img, txt, neg)
    torch.testing.assert_close(plain, ours, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(P["negclip"][0](img, txt, neg), ours)  # no margin: another loss
