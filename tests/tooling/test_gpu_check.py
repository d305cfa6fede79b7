"""CPU checks of the GPU check: tools/gpu_check.sh parses and runs its shell logic to the
end without a GPU, and tests/backends/test_gpu.py's quick level keeps the coverage it promises."""

import collections
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

from cases import DTYPES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import test_gpu

SCRIPTS = [os.path.join(REPO, "tools", name) for name in ("gpu_check.sh", "gpu_wheels.sh")]
STEPS = ("wheels", "info", "imports", "tests", "compile", "bench", "work", "sigbench")
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's no-GPU path")
@pytest.mark.skipif(shutil.which("timeout") is None, reason="gpu_check.sh needs coreutils' timeout")
def test_gpu_check_runs_without_gpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_SKIP="wheels,info,tests,work", GPU_CHECK_BUDGET_S="300")
    env.pop("TRITON_INTERPRET", None)  # the script must not depend on the test setup
    env.pop("OUT", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", SCRIPTS[0], str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    status = {
        line.split()[0]: line.split()[1] for line in summary.splitlines() if line.split() and line.split()[0] in STEPS
    }
    assert status == {
        "wheels": "SKIP",
        "info": "SKIP",
        "imports": "PASS",
        "tests": "SKIP",
        "compile": "SKIP",
        "bench": "SKIP",
        "work": "SKIP",
        "sigbench": "SKIP",
    }, summary
    assert "no CUDA device" in summary and "failed or timed-out steps: 0" in summary
    # what the device tool brings back: at most 8 files, no folders left over
    top = sorted(p.name for p in out.iterdir())
    assert len(top) <= 8 and all((out / name).is_file() for name in top), top
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    imports_log = [n for n in names if n.endswith("-imports.log")]
    assert imports_log, names
    with tarfile.open(out / "logs.tar.gz") as tar:
        text = tar.extractfile(imports_log[0]).read().decode()
    assert "ok        hnclip_kernels.backends.triton.ops" in text and "BROKEN" not in text, text
    assert "provider  siglip-kernel" in text, text  # the sigmoid sweep's peer is reported too


def test_sigbench_step_runs_the_sigmoid_sweep_last():
    with open(SCRIPTS[0]) as f:
        script = f.read()
    assert "STEPS=(" + " ".join(STEPS) + ")" in script
    assert "-m benchmarks.run --loss sigmoid --device cuda" in script
    assert "cuda_sigmoid_results.csv" in script
    with open(SCRIPTS[1]) as f:
        assert "siglip-kernel==0.1.2" in f.read()


def test_quick_level_coverage():
    cases = test_gpu.matrix_cases("quick")
    assert {c[0] for c in cases} == {1, 17, 130, 4097} and {c[1] for c in cases} == {3, 64, 768}
    for dtype in DTYPES:
        mine = [c for c in cases if c[2] == dtype]
        n, d, _, gamma, tau, eps, red = zip(*mine)
        assert set(n) == {1, 17, 130, 4097} and set(d) == {3, 64, 768}, dtype
        # the kernels specialise on γ ≠ 0 and ε ≠ 0: every combination, for every dtype
        assert {(g != 0, e != 0) for g, e in zip(gamma, eps)} == {
            (False, False),
            (False, True),
            (True, False),
            (True, True),
        }, dtype
        assert set(tau) == set(test_gpu.TAUS) and set(red) == set(test_gpu.REDUCTIONS), dtype
    options = test_gpu.option_cases("quick")
    for dtype in DTYPES:
        mine = [c for c in options if c[0] == dtype]
        for i, values in enumerate((test_gpu.GAMMAS, test_gpu.TAUS, test_gpu.SMOOTHINGS, test_gpu.REDUCTIONS)):
            assert {c[1 + i] for c in mine} == set(values), (dtype, values)
    assert len(set(cases)) == len(cases) and len(set(options)) == len(options)


def test_full_level_is_the_whole_matrix():
    cases = test_gpu.matrix_cases("full")
    assert collections.Counter((c[0], c[1], c[2]) for c in cases) == collections.Counter(
        (n, d, dt) for n in test_gpu.GPU_N["full"] for d in test_gpu.GPU_D["full"] for dt in DTYPES
    )
    assert sorted(test_gpu.option_cases("full"), key=str) == sorted(
        ((dt, *opt) for dt in DTYPES for opt in test_gpu.OPTIONS), key=str
    )


def test_compile_step_selects_the_library_tests():
    # gpu_check.sh runs tests/backends/test_gpu.py twice: -k "not test_library_" (tests) and -k test_library_
    # (compile, the torch.library / torch.compile checks): every test is in exactly one of them
    names = [name for name in dir(test_gpu) if name.startswith("test_")]
    library = [name for name in names if "test_library_" in name]
    assert {
        "test_library_inductor_fullgraph_schedule",
        "test_library_aot_eager_chunked_backward_autotuned",
        "test_library_opcheck_cuda",
        "test_library_func_grad_and_vmap_cuda",
        "test_library_export_cuda",
    } <= set(library)
    assert all(name.startswith("test_library_") for name in library)
    with open(SCRIPTS[0]) as f:
        script = f.read()
    assert 'gpu_pytest tests "not test_library_"' in script and 'gpu_pytest compile "test_library_"' in script
