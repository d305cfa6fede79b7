"""``python -m benchmarks.run --loss sigmoid``: its providers agree with each other in value and
gradient at tiny N, a sweep of them writes a complete CSV and both plots, and the CUDA-only
peers are skipped with their reason. The end-to-end CLI run (a worker process per provider) is
in the slow tier."""

import csv
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import report, run, sigmoid
from benchmarks.providers import unavailable
from hnclip_kernels.backends import cpp_directional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = [name for name in sigmoid.PROVIDERS if unavailable(name, "cpu", deep=False, table=sigmoid.PROVIDERS) is None]


def _inputs(n=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float32).requires_grad_(True) for _ in range(2)]


def _value_and_grads(name):
    img, txt = _inputs()
    loss = sigmoid.PROVIDERS[name].build(torch.device("cpu"))(img, txt)
    loss.backward()
    return float(loss.detach()), img.grad, txt.grad


def test_the_cpu_providers_are_the_expected_ones():
    expected = {"hnclip-torch", "open_clip"} | ({"hnclip-cpp", "hnclip-cpp-g0"} if cpp_directional() else set())
    assert set(CPU) == expected


@pytest.mark.parametrize("gamma, names", [(0.0, ("hnclip-cpp-g0", "open_clip")), (0.5, ("hnclip-torch", "hnclip-cpp"))])
def test_providers_agree_with_the_reference_in_value_and_gradient(gamma, names):
    """γ = 0: ours and open_clip's SigLipLoss compute SigLIP; γ = 0.5: both our backends the margin's loss."""
    from hnclip_kernels import hn_siglip_loss

    img, txt = _inputs()
    ref = hn_siglip_loss(img, txt, sigmoid.LOGIT_SCALE, sigmoid.LOGIT_BIAS, gamma=gamma, backend="torch")
    ref.backward()
    ran = 0
    for name in names:
        if name not in CPU:
            continue
        value, g_img, g_txt = _value_and_grads(name)
        assert value == pytest.approx(float(ref), rel=1e-5), name
        torch.testing.assert_close(g_img, img.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(g_txt, txt.grad, rtol=1e-4, atol=1e-6, msg=name)
        ran += 1
    assert ran >= 1


def test_cuda_peers_are_skipped_with_their_reason():
    table = sigmoid.PROVIDERS
    assert unavailable("siglip-kernel", "cpu", table=table) == "CUDA only (Triton)"
    assert unavailable("hnclip-triton", "cpu", table=table).startswith("CUDA only")
    if "siglip_kernel" not in sys.modules and not _importable("siglip_kernel"):  # this machine's case
        assert unavailable("siglip-kernel", "cuda", deep=False, table=table) == (
            "siglip_kernel is not importable (pip install siglip-kernel==0.1.2)"
        )


def _importable(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_loss_option_picks_the_sigmoid_table():
    args = run.parse_args(["--device", "cpu", "--loss", "sigmoid"])
    assert args.providers == list(sigmoid.PROVIDERS) and args.table is sigmoid.PROVIDERS
    assert run.parse_args(["--device", "cpu"]).providers == list(run.PROVIDERS)
    with pytest.raises(SystemExit):
        run.parse_args(["--device", "cpu", "--loss", "sigmoid", "--providers", "hnclip-torch-compile"])


def test_a_tiny_sweep_writes_a_complete_csv_and_both_plots(tmp_path):
    args = run.parse_args(
        ["--device", "cpu", "--loss", "sigmoid", "--sizes", "16,32", "--dims", "8", "--reps", "1", "--cell-s", "0"]
    )
    rows = run.sweep(args, CPU) + run._skipped_rows(args, "siglip-kernel", "CUDA only (Triton)")
    report.finalize(rows, dict(device="cpu", device_name="test", matmul_tflops=1.0, threads=1, torch_version="t",
                               triton_version="t", date="d"))  # fmt: skip
    path = tmp_path / "cpu_sigmoid_results.csv"
    report.write_csv(rows, str(path))
    pngs = report.plot(rows, str(tmp_path), "cpu_sigmoid", list(sigmoid.PROVIDERS))
    assert [os.path.basename(p) for p in pngs] == ["cpu_sigmoid_time_vs_n.png", "cpu_sigmoid_memory_vs_n.png"]
    assert all(os.path.getsize(p) > 1000 for p in pngs)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        written = list(reader)
    assert len(written) == 2 * (len(CPU) + 1)
    for row in written:
        if row["provider"] == "siglip-kernel":
            assert row["status"] == "skipped: CUDA only (Triton)" and row["median_ms"] == ""
            continue
        assert row["status"] == "ok", row
        assert all(math.isfinite(float(row[c])) for c in report.MEASURED_COLUMNS), row
    table = report.format_table(rows, list(sigmoid.PROVIDERS), run.REFERENCE["cpu"])
    assert "open_clip" in table and "siglip-kernel" in table


@pytest.mark.slow
def test_the_cli_run_writes_the_sigmoid_files(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.run", "--device", "cpu", "--loss", "sigmoid", "--sizes", "32,64",
           "--dims", "16", "--reps", "1", "--cell-s", "0", "--out", str(tmp_path)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\ntargets (" not in proc.stdout and "load average after the sweep" in proc.stdout
    for name in ("cpu_sigmoid_results.csv", "cpu_sigmoid_time_vs_n.png", "cpu_sigmoid_memory_vs_n.png"):
        assert (tmp_path / name).stat().st_size > 500, name
    with open(tmp_path / "cpu_sigmoid_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["provider"] for r in rows if r["status"] == "ok"} == set(CPU)
    assert {r["workspace_mb"] for r in rows} == {"n/a"}  # workspace_bytes is the InfoNCE path's


def test_the_committed_csv_states_no_infonce_workspace():
    with open(os.path.join(REPO, "benchmarks", "results", "cpu_sigmoid_results.csv"), newline="") as f:
        assert {r["workspace_mb"] for r in csv.DictReader(f)} == {"n/a"}
