"""The commands the suite runs that write files (examples/dense_caption_demo.py, the benchmark sweep, the
GPU check script), run from the repository root with the arguments the tests give them, write only where their
output argument points: the checkout shows no new or changed file afterwards, ignored folders included
(demo_out/, benchmarks/out/, logs/), caches such as __pycache__/ aside."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# ignored paths that running Python, pytest, ruff or the build touch by design
CACHES = ("__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".venv", ".venv-ci", "build", ".whl")
DEMO_TINY = [
    "--train-groups",
    "6",
    "--eval-groups",
    "3",
    "--epochs",
    "1",
    "--batch-groups",
    "3",
    "--probe-batches",
    "1",
    "--no-progress",
]  # tests/integrations/test_demo.py


def _git(*args):
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def _in_git_checkout():
    if shutil.which("git") is None:
        return False
    top = _git("rev-parse", "--show-toplevel")
    return top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(REPO)


pytestmark = pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout of the repository")


def _is_cache(path):
    parts = path.rstrip("/").split("/")
    return any(p in CACHES or p.endswith(".egg-info") for p in parts) or path.endswith((".so", ".pyd"))


def _tree_state():
    """(git status lines, {ignored file: (size, mtime)}) of the checkout, caches left out."""
    status = set(_git("status", "--porcelain", "--untracked-files=all").stdout.splitlines())
    files = {}
    for line in _git("status", "--porcelain", "--ignored", "--untracked-files=normal").stdout.splitlines():
        if not line.startswith("!! ") or _is_cache(line[3:]):
            continue
        top = os.path.join(REPO, line[3:])
        walk = os.walk(top) if os.path.isdir(top) else [(os.path.dirname(top), [], [os.path.basename(top)])]
        for root, dirs, names in walk:
            dirs[:] = [d for d in dirs if not _is_cache(d)]
            for name in names:
                path = os.path.join(root, name)
                st = os.stat(path)
                files[os.path.relpath(path, REPO)] = (st.st_size, st.st_mtime_ns)
    return status, files


def _needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def _demo(out):
    return [sys.executable, "examples/dense_caption_demo.py", *DEMO_TINY, "--out", str(out / "demo")], {}


def _bench(out):  # tests/tooling/test_benchmarks_smoke.py's sweep, one provider: the same CSV and plot writers
    return [
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
        "--providers",
        "hnclip-torch",
        "--out",
        str(out / "bench"),
    ], {"TRITON_INTERPRET": None}


def _gpu_check(out):  # tests/tooling/test_gpu_check.py
    return ["bash", "tools/gpu_check.sh", str(out / "gpu_check")], {
        "PYTHON": sys.executable,
        "GPU_CHECK_SKIP": "wheels,info,tests,work",
        "GPU_CHECK_BUDGET_S": "300",
        "TRITON_INTERPRET": None,
        "OUT": None,
        "GPU_CHECK_SITE": str(out / "site"),
    }


COMMANDS = [
    pytest.param(_demo, id="dense_caption_demo", marks=_needs("open_clip", "matplotlib", "tqdm")),
    pytest.param(_bench, id="benchmarks.run", marks=_needs("matplotlib")),
    pytest.param(
        _gpu_check,
        id="gpu_check.sh",
        marks=[
            pytest.mark.skipif(
                shutil.which("bash") is None or shutil.which("timeout") is None,
                reason="needs bash and coreutils' timeout",
            ),
            pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path only (minutes on a GPU)"),
        ],
    ),
]


@pytest.mark.parametrize("command", COMMANDS)
def test_command_leaves_the_checkout_unchanged(command, tmp_path):
    cmd, env_changes = command(tmp_path)
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    before_status, before_files = _tree_state()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    after_status, after_files = _tree_state()
    assert sorted(after_status - before_status) == [], "git status shows new entries"
    changed = sorted(p for p, v in after_files.items() if before_files.get(p) != v)
    assert changed == [], "ignored files written in the checkout"
