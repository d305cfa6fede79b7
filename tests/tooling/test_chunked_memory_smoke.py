"""CI smoke test of ``python -m benchmarks.chunked_memory``: a tiny ``local-dir:`` model, one N, end to end."""

import csv
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("open_clip")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_chunked_memory_writes_csv_png_and_table(tmp_path):
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "head_width": 16, "layers": 1},
        "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.chunked_memory",
        "--model",
        f"local-dir:{tmp_path / 'model'}",
        "--sizes",
        "6",
        "--chunk",
        "4",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| N | unchunked: peak RSS (step) | chunk 4: peak RSS (step) |" in proc.stdout
    with open(tmp_path / "out" / "cpu_chunked_memory.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["N"], r["chunk"], r["status"]) for r in rows] == [("6", "0", "ok"), ("6", "4", "ok")]
    assert all(float(r["peak_mb"]) > float(r["step_mb"]) > 0 for r in rows)
    assert (tmp_path / "out" / "cpu_chunked_memory.png").stat().st_size > 1000
