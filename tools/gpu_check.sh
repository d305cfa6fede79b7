#!/usr/bin/env bash
# One-command GPU check of this checkout on a CUDA machine: the GPU tests, the torch.compile /
# torch.library checks, the benchmark sweep, the MMA-work count and the sigmoid loss's sweep, each step under its own
# timeout, so that the whole run ends within one wall-clock budget (GPU_CHECK_BUDGET_S, 570 s by
# default: it fits a 10-minute command):
#
#   bash tools/gpu_check.sh [OUTDIR]
#
# Needs: an NVIDIA GPU with nvidia-smi; a Python ($PYTHON, default python3) with torch and
# triton (pyproject.toml: torch >= 2.4, triton >= 3.0) and pytest (pytest-xdist used when
# present); bash, timeout, tar. No network: no step downloads anything. The package
# runs from this checkout (PYTHONPATH=<repo root>, HNCLIP_NO_CPP=1): csrc/ is not built, so the
# C++ backend is reported as not built.
#
# OUTDIR: the argument, else $OUT when set, else benchmarks/out/gpu_check.
#
# Wheels: optional packages the machine may lack travel in .whl/ (ignored through
# .git/info/exclude), copied along with the checkout. Build it on a machine with PyPI with
# `bash tools/gpu_wheels.sh` (open_clip_torch 3.3.0, ftfy, wcwidth, inf-cl 1.2.1, siglip-kernel
# 0.1.2; about 2.4 MiB). Without .whl/ the wheels step is skipped, and open_clip / inf-cl /
# siglip-kernel are benchmarked only if the machine has them.
#
# Steps, in order; each has its own timeout (cut so that the whole run ends within
# GPU_CHECK_BUDGET_S), its log under logs/, and a failed step does not stop the next:
#   wheels   pip install --no-index --no-deps --target $GPU_CHECK_SITE .whl/*.whl; prepend it to PYTHONPATH
#   info     nvidia-smi and versions (python, torch, triton, open_clip, inf_cl, ...) -> versions.txt
#   imports  every module of hnclip_kernels (backends/ included) from source without the built _C,
#            and which benchmark providers can run
#   tests    GPU_TEST_LEVEL=quick python -m pytest tests/backends/test_gpu.py tests/backends/test_gpu_flavours.py
#            -q -x -k "not test_library_" (test_gpu_flavours.py: TF32 allowed, reduced-precision reductions
#            allowed and autocast, each within the float32 / 16-bit bounds; about 20 s), with
#            HNCLIP_AUTOTUNE=0 (one launch configuration per shape instead of autotuning each) and
#            pytest-xdist (-n 4) when installed; 1.5 to 4 minutes measured on an H200, mostly Triton compiles
#   compile  the same for tests/backends/test_gpu.py -k test_library_: the hnclip::triton_* operators under
#            torch.compile with Inductor (fullgraph, a 12-step τ/γ schedule: at most 2 compiles,
#            values and gradients as eager; the kernels used to fail there on fp64 scalars),
#            "aot_eager" with autotuning and a chunked backward, opcheck, torch.func, torch.export
#            on CUDA (full level: dynamic shapes, the directional operator); 1 to 3 minutes
#   bench    python -m benchmarks.run --device cuda --out OUTDIR/bench --budget-s B, B = 210 s
#            (the default sweep's budget) or less when earlier steps ran long
#   work     python -m tools.work: the MMA-work counter; with what is left, because it
#            runs in Triton's interpreter on the CPU (no GPU needed); skipped without tools/work.py
#   sigbench python -m benchmarks.run --loss sigmoid --device cuda --dims 512 --modes fwd+bwd
#            --out OUTDIR/sigbench --budget-s B, B = 120 s or less: the sigmoid (SigLIP) loss's sweep
#            (hnclip-triton, open_clip's SigLipLoss, siglip-kernel, ...); its CSV and plots go in logs.tar.gz
# Outputs, at most 8 files at the top of OUTDIR (few files, so a remote runner can copy them back):
#   summary.txt (step statuses, test result line, bench status counts), versions.txt,
#   tests.log, bench.log, cuda_results.csv, cuda_time_vs_n.png, cuda_memory_vs_n.png,
#   logs.tar.gz (every step's log, the tests' JUnit XML, the bench folder, the sigbench folder with
#   cuda_sigmoid_results.csv and its plots).
# Exit status: 0 when no step failed or timed out (skipped steps do not count), else 1.
#
# Knobs (environment):
#   GPU_TEST_LEVEL=quick|full      tests/backends/test_gpu.py level (full: ~12 min, over the budget alone)
#   GPU_TEST_WORKERS=N             pytest-xdist workers (default 4 when xdist imports; 0: serial)
#   GPU_TEST_PYTEST_ARGS="-x"      extra pytest arguments (default -x: stop at the first failure)
#   HNCLIP_AUTOTUNE                passed through to the tests when set (default there: 0)
#   GPU_CHECK_BUDGET_S=570         wall-clock budget of the whole script, in seconds
#   GPU_CHECK_SKIP=a,b             steps to skip (wheels,info,imports,tests,compile,bench,work,sigbench)
#   GPU_CHECK_BENCH_ARGS, GPU_CHECK_WORK_ARGS, GPU_CHECK_SIGBENCH_ARGS   extra arguments of those commands
#   GPU_CHECK_SITE=/tmp/site       where the wheels are installed
#   PYTHON=python3                 the interpreter that has torch and triton
# shellcheck disable=SC2317  # finish, step_info and step_imports run through trap and bash -c
set -uo pipefail
export PYTHONUNBUFFERED=1

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
OUTDIR=${1:-${OUT:-$REPO/benchmarks/out/gpu_check}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2
LOGDIR=$OUTDIR/logs
BENCH_OUT=$OUTDIR/bench
SIGBENCH_OUT=$OUTDIR/sigbench
SUMMARY=$OUTDIR/summary.txt
TOP_FILES=(summary.txt versions.txt tests.log bench.log cuda_results.csv cuda_time_vs_n.png cuda_memory_vs_n.png
           logs.tar.gz)
rm -rf "$LOGDIR" "$BENCH_OUT" "$SIGBENCH_OUT"
for f in "${TOP_FILES[@]}"; do rm -f "${OUTDIR:?}/$f"; done
mkdir -p "$LOGDIR"

BUDGET=${GPU_CHECK_BUDGET_S:-570}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
SITE=${GPU_CHECK_SITE:-/tmp/site}
SKIP=",${GPU_CHECK_SKIP:-},"
export GPU_TEST_LEVEL=${GPU_TEST_LEVEL:-quick}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HNCLIP_NO_CPP=1
export REPO PY OUTDIR LOGDIR SITE

STEPS=(wheels info imports tests compile bench work sigbench)
# seconds: the most a step may take, and the least worth starting it with (also what the
# steps before it leave over for it)
declare -A MAX=([wheels]=90 [info]=60 [imports]=60 [tests]=300 [compile]=240 [bench]=300 [work]=120 [sigbench]=165)
declare -A MIN=([wheels]=15 [info]=15 [imports]=15 [tests]=60 [compile]=60 [bench]=90 [work]=30 [sigbench]=75)
[ "$GPU_TEST_LEVEL" = full ] && MAX[tests]=$BUDGET && MAX[compile]=$BUDGET
PACK_S=15  # kept for packing the outputs at the end
BENCH_BUDGET_MAX=210  # benchmarks/run.py's default GPU budget
BENCH_OVERHEAD_S=60   # imports, the matmul calibration, the cell running at the deadline, plots
SIGBENCH_BUDGET_MAX=120  # the sigmoid sweep's budget at most

STEP_NO=0
FAILED=0

{
    echo "gpu_check  $(date -u '+%Y-%m-%d %H:%M:%S UTC')  host $(hostname 2>/dev/null || echo '?')"
    echo "repo $REPO  commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "budget ${BUDGET}s  GPU_TEST_LEVEL=$GPU_TEST_LEVEL  skip=${GPU_CHECK_SKIP:-none}  python=$PY"
    echo
    printf '%-8s %-8s %6s  %s\n' step status time detail
} > "$SUMMARY"

record() {  # NAME STATUS SECONDS DETAIL
    case $2 in FAIL* | TIMEOUT*) FAILED=$((FAILED + 1)) ;; esac
    printf '%-8s %-8s %5ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$SUMMARY"
}

# plan NAME: 0 and LIMIT set when the step should run; 1 (SKIP recorded) otherwise
plan() {
    local name=$1 reserve=$PACK_S seen=0 s
    STEP_NO=$((STEP_NO + 1))
    LOG=$LOGDIR/$(printf '%02d' "$STEP_NO")-$name.log
    if [[ $SKIP == *",$name,"* ]]; then
        record "$name" SKIP 0 "GPU_CHECK_SKIP"
        return 1
    fi
    for s in "${STEPS[@]}"; do  # keep the minimum of every later step that will run
        if ((seen)) && [[ $SKIP != *",$s,"* ]]; then reserve=$((reserve + MIN[$s])); fi
        [ "$s" = "$name" ] && seen=1
    done
    local left=$((DEADLINE - $(date +%s) - reserve))
    LIMIT=${MAX[$name]}
    ((left < LIMIT)) && LIMIT=$left
    if ((LIMIT < MIN[$name])); then
        record "$name" SKIP 0 "no time left (${LIMIT}s < ${MIN[$name]}s; GPU_CHECK_BUDGET_S=$BUDGET)"
        return 1
    fi
    return 0
}

# run NAME CMD...: CMD under `timeout LIMIT`, its output on stdout and in LOG; sets RC, DUR
run() {
    local name=$1 t0=$SECONDS
    shift
    echo "=== [$name] $(date -u +%H:%M:%S) limit ${LIMIT}s: $*" | tee "$LOG"
    timeout -k 10 "$LIMIT" "$@" 2>&1 | tee -a "$LOG"
    RC=${PIPESTATUS[0]}
    DUR=$((SECONDS - t0))
    echo "=== [$name] exit $RC after ${DUR}s" | tee -a "$LOG"
}

verdict() {  # from RC
    case $RC in
        0) echo PASS ;;
        124 | 137) echo TIMEOUT ;;
        *) echo FAIL ;;
    esac
}

finish() {
    [ -n "${FINISHED:-}" ] && return
    FINISHED=1
    local f
    for f in cuda_results.csv cuda_time_vs_n.png cuda_memory_vs_n.png; do
        [ -f "$BENCH_OUT/$f" ] && cp "$BENCH_OUT/$f" "$OUTDIR/$f"
    done
    for f in "$LOGDIR"/*-tests.log; do [ -f "$f" ] && cp "$f" "$OUTDIR/tests.log"; done
    for f in "$LOGDIR"/*-bench.log; do [ -f "$f" ] && cp "$f" "$OUTDIR/bench.log"; done
    {
        echo
        echo "total $(($(date +%s) - START))s of ${BUDGET}s; failed or timed-out steps: $FAILED"
        echo "files: ${TOP_FILES[*]} (those present)"
    } | tee -a "$SUMMARY"
    local dirs=()
    [ -d "$LOGDIR" ] && dirs+=(logs)
    [ -d "$BENCH_OUT" ] && dirs+=(bench)
    [ -d "$SIGBENCH_OUT" ] && dirs+=(sigbench)
    if ((${#dirs[@]})) && tar -czf "$OUTDIR/logs.tar.gz" -C "$OUTDIR" "${dirs[@]}"; then
        rm -rf "$LOGDIR" "$BENCH_OUT" "$SIGBENCH_OUT"  # the device tool brings back at most 8 files
    fi
    echo
    cat "$SUMMARY"
}
trap finish EXIT
trap 'echo "gpu_check: interrupted"; exit 130' INT TERM

# ------------------------------------------------------------------ wheels
if [ ! -d .whl ] || ! compgen -G ".whl/*.whl" > /dev/null; then
    STEP_NO=$((STEP_NO + 1))
    record wheels SKIP 0 "no .whl/*.whl here (bash tools/gpu_wheels.sh builds it; carry .whl)"
elif plan wheels; then
    run wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl
    if ((RC == 0)); then
        export PYTHONPATH="$SITE:$PYTHONPATH"
        names=""
        for f in .whl/*.whl; do names+="$(basename "$f" | cut -d- -f1-2) "; done
        record wheels PASS "$DUR" "${names}-> $SITE"
    else
        record wheels "$(verdict)" "$DUR" "pip install into $SITE: exit $RC (see logs)"
    fi
fi

# ------------------------------------------------------------------ info
step_info() {
    echo "## nvidia-smi"
    nvidia-smi
    local smi=$?
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null
    echo
    echo "## versions"
    "$PY" - << 'EOF'
import importlib
import importlib.metadata as md
import os
import platform
import sys

print(f"python      {sys.version.split()[0]}  {sys.executable}")
print(f"platform    {platform.platform()}  cpus {os.cpu_count()}")
for key in ("PYTHONPATH", "HNCLIP_NO_CPP", "GPU_TEST_LEVEL", "HNCLIP_AUTOTUNE", "TRITON_CACHE_DIR"):
    print(f"env {key}={os.environ.get(key, '')}")
MODULES = [("torch", "torch"), ("triton", "triton"), ("open_clip", "open_clip_torch"), ("inf_cl", "inf-cl"),
           ("memeff", "memeff"), ("siglip_kernel", "siglip-kernel"), ("numpy", "numpy"), ("torchvision", "torchvision"), ("timm", "timm"),
           ("ftfy", "ftfy"), ("wcwidth", "wcwidth"), ("huggingface_hub", "huggingface_hub"),
           ("matplotlib", "matplotlib"), ("tqdm", "tqdm"), ("pytest", "pytest"), ("xdist", "pytest-xdist"),
           ("hypothesis", "hypothesis")]
for mod, dist in MODULES:
    try:
        m = importlib.import_module(mod)
    except Exception as exc:  # missing or broken: report, go on
        print(f"{mod:16s} -- {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        continue
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        version = getattr(m, "__version__", "?")
    print(f"{mod:16s} {version:14s} {os.path.dirname(getattr(m, '__file__', '') or '')}")
import torch

ok = torch.cuda.is_available()
print(f"torch.cuda  available={ok}  cuda={torch.version.cuda}")
if ok:
    p = torch.cuda.get_device_properties(0)
    print(f"device      {p.name}  cc {p.major}.{p.minor}  {p.multi_processor_count} SMs  "
          f"{p.total_memory / 2**30:.0f} GiB")
with open(os.path.join(os.environ["LOGDIR"], "cuda_available"), "w") as f:
    f.write("1" if ok else "0")
EOF
    local py=$?
    ((smi == 0 && py == 0)) && return 0
    echo "nvidia-smi exit $smi, python exit $py"
    return 1
}
export -f step_info
if plan info; then
    run info bash -c step_info
    cp "$LOG" "$OUTDIR/versions.txt"
    record info "$(verdict)" "$DUR" "$(grep -m1 '^device ' "$LOG" || grep -m1 '^torch.cuda ' "$LOG" || echo 'no torch')"
fi
HAVE_CUDA=$(cat "$LOGDIR/cuda_available" 2> /dev/null \
    || timeout 60 "$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2> /dev/null || echo 0)

# ------------------------------------------------------------------ imports
step_imports() {
    "$PY" - << 'EOF'
import importlib
import os
import pkgutil
import sys

repo = os.path.realpath(os.environ["REPO"])
import hnclip_kernels

src = os.path.realpath(os.path.dirname(hnclip_kernels.__file__))
print(f"hnclip_kernels {hnclip_kernels.__version__} from {src}")
bad = []
if not src.startswith(repo + os.sep):
    bad.append(f"hnclip_kernels imported from {src}, not from the checkout {repo}")
# every module file under the package, folders without __init__.py (namespace packages) included
names = []
for root, dirs, _ in os.walk(src):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    rel = os.path.relpath(root, src)
    prefix = "hnclip_kernels." + ("" if rel == "." else rel.replace(os.sep, ".") + ".")
    names += [prefix + info.name for info in pkgutil.iter_modules([root]) if prefix + info.name not in names]
for name in names:
    try:
        importlib.import_module(name)
        print(f"ok        {name}")
    except ImportError as exc:
        if name == "hnclip_kernels._C" or name.startswith("hnclip_kernels.backends.cpp"):  # csrc/ is not built here
            print(f"expected  {name}: ImportError: {str(exc).splitlines()[0][:200]}")
        else:
            bad.append(f"{name}: ImportError: {exc}")
    except Exception as exc:
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
from hnclip_kernels.backends import cpp_directional, triton_directional

print("C++ backend:", "not built (as expected with HNCLIP_NO_CPP=1)" if cpp_directional() is None
      else f"loaded ({sys.modules['hnclip_kernels._C'].__file__})")
try:
    triton_directional()
    print("Triton backend: importable")
except Exception as exc:
    bad.append(f"triton_directional(): {type(exc).__name__}: {exc}")
from benchmarks.providers import PROVIDERS, unavailable

for name in PROVIDERS:
    why = unavailable(name, "cuda")
    print(f"provider  {name:22s} {'ok' if why is None else why}")
from benchmarks import sigmoid

for name in sigmoid.PROVIDERS:  # --loss sigmoid (sigbench): its peers beyond the InfoNCE sweep's
    if name not in PROVIDERS:
        why = unavailable(name, "cuda", table=sigmoid.PROVIDERS)
        print(f"provider  {name:22s} {'ok' if why is None else why}")
for line in bad:
    print("BROKEN   ", line)
sys.exit(1 if bad else 0)
EOF
}
export -f step_imports
if plan imports; then
    run imports bash -c step_imports
    peers=$(grep -E '^provider  (open_clip|inf-cl|memeff|siglip-kernel) ' "$LOG" | awk '{ print $2 "=" ($3 == "ok" ? "ok" : "no") }' | tr '\n' ' ')
    broken=$(grep -c '^BROKEN' "$LOG")
    record imports "$(verdict)" "$DUR" "broken modules: $broken; peers: ${peers:-?}"
fi

# ------------------------------------------------------------------ tests, compile
workers=${GPU_TEST_WORKERS:-}
if [ -z "$workers" ]; then
    workers=0
    "$PY" -c 'import xdist' 2> /dev/null && ((HAVE_CUDA)) && workers=4
fi
xdist=()
((workers > 0)) && xdist=(-n "$workers")

# the GPU test files: the matrix and operators, and the GPU-only call flavours (global matmul flags, autocast)
GPU_TEST_FILES=(tests/backends/test_gpu.py tests/backends/test_gpu_flavours.py)

# gpu_pytest NAME SELECTION: GPU_TEST_FILES -k SELECTION as step NAME (its JUnit XML in logs/)
gpu_pytest() {
    local name=$1 selection=$2 result detail
    # shellcheck disable=SC2086  # GPU_TEST_PYTEST_ARGS is a list of words
    run "$name" env HNCLIP_AUTOTUNE="${HNCLIP_AUTOTUNE:-0}" "$PY" -m pytest "${GPU_TEST_FILES[@]}" -q -p no:cacheprovider \
        -k "$selection" --durations=15 --junitxml="$LOGDIR/$name-junit.xml" "${xdist[@]}" ${GPU_TEST_PYTEST_ARGS--x}
    result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|deselected)|no tests ran' "$LOG" | tail -n 1 | tr -d '=')
    detail="level $GPU_TEST_LEVEL, workers $workers: ${result:-no pytest summary line}"
    if ((RC == 0 && !HAVE_CUDA)); then
        record "$name" SKIP "$DUR" "no CUDA device ($detail)"
    else
        record "$name" "$(verdict)" "$DUR" "$detail"
    fi
}

if plan tests; then
    gpu_pytest tests "not test_library_"
fi

if ((!HAVE_CUDA)); then
    STEP_NO=$((STEP_NO + 1))
    record compile SKIP 0 "no CUDA device"
elif plan compile; then
    gpu_pytest compile "test_library_"
fi

# ------------------------------------------------------------------ bench
status_counts() {  # CSV: each provider's cells by status, one line
    "$PY" - "$1" << 'EOF' 2> /dev/null
import collections
import csv
import sys

by = collections.defaultdict(collections.Counter)
with open(sys.argv[1], newline="") as f:
    for row in csv.DictReader(f):
        by[row["provider"]][row["status"].split(":")[0]] += 1
print("; ".join(f"{p} " + ",".join(f"{s} {n}" for s, n in c.most_common()) for p, c in by.items()))
EOF
}

if ((!HAVE_CUDA)); then
    STEP_NO=$((STEP_NO + 1))
    record bench SKIP 0 "no CUDA device"
elif plan bench; then
    bench_budget=$((LIMIT - BENCH_OVERHEAD_S))
    ((bench_budget > BENCH_BUDGET_MAX)) && bench_budget=$BENCH_BUDGET_MAX
    ((bench_budget < 30)) && bench_budget=30
    # shellcheck disable=SC2086
    run bench "$PY" -m benchmarks.run --device cuda --out "$BENCH_OUT" --budget-s "$bench_budget" \
        ${GPU_CHECK_BENCH_ARGS:-}
    counts=$(status_counts "$BENCH_OUT/cuda_results.csv")
    record bench "$(verdict)" "$DUR" "budget ${bench_budget}s; ${counts:-no cuda_results.csv}"
fi

# ------------------------------------------------------------------ work
if [ ! -f tools/work.py ] && [ ! -d tools/work ]; then
    STEP_NO=$((STEP_NO + 1))
    record work SKIP 0 "tools.work is not in this checkout"
elif plan work; then
    # shellcheck disable=SC2086
    run work "$PY" -m tools.work ${GPU_CHECK_WORK_ARGS:-}
    record work "$(verdict)" "$DUR" "$(grep -cE '^(loss|directional) ' "$LOG") rows (table in logs)"
fi

# ------------------------------------------------------------------ sigbench
if ((!HAVE_CUDA)); then
    STEP_NO=$((STEP_NO + 1))
    record sigbench SKIP 0 "no CUDA device"
elif plan sigbench; then
    sig_budget=$((LIMIT - BENCH_OVERHEAD_S))
    ((sig_budget > SIGBENCH_BUDGET_MAX)) && sig_budget=$SIGBENCH_BUDGET_MAX
    ((sig_budget < 15)) && sig_budget=15
    # shellcheck disable=SC2086
    run sigbench "$PY" -m benchmarks.run --loss sigmoid --device cuda --dims 512 --modes fwd+bwd \
        --out "$SIGBENCH_OUT" --budget-s "$sig_budget" ${GPU_CHECK_SIGBENCH_ARGS:-}
    counts=$(status_counts "$SIGBENCH_OUT/cuda_sigmoid_results.csv")
    record sigbench "$(verdict)" "$DUR" "budget ${sig_budget}s; ${counts:-no cuda_sigmoid_results.csv}"
fi

exit $((FAILED > 0))
