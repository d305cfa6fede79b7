"""Every Triton kernel the launcher runs on a GPU compiles for sm_90a (H100/H200) cleanly.

``python -m tools.sm90 --quick`` (see its docstring) drives the single-process loss,
the distributed path's directional op and a rank's op (both directions), the hard-negative family's
directional op and its single-process loss (``hnclip::triton_symmetric_nll`` with negatives: the pair kernels with
group ids, the negatives' block), forward + backward, for bf16/fp16/fp32 inputs, D 64
and 768, γ 0 and 0.5, label smoothing 0, and compiles each distinct launch ahead of time for
sm_90a. No GPU is needed: only Triton's CUDA backend and the ptxas its wheel ships. The test
fails on any problem the check reports: a compile failure, a register spill, shared memory
above 227 KiB, a tf32 MMA on float32 inputs (other than a "tf32x3" split), a tl.dot on 16-bit
operands without an MMA instruction.

The second test compiles them with the scalar types Inductor gives a user kernel under
``torch.compile`` (``--wide-scalars``: float scalars fp64): with γ a float argument the forward
kernel fails to compile there ("Loop-carried variable run_max has initial type fp32 but is
re-assigned to fp64") and the dS kernel spills 1.3 KB. γ is read from device memory: no
kernel has a float scalar argument, so this compiles what the first test compiled (cached).

Cold, each compiles ~60 kernels (2 to 4 minutes on 2 cores); unchanged kernels are cached under
``<tempdir>/hnclip-sm90-cache``. Deselect with ``-m "not sm90"``.
"""

import json
import os
import subprocess
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _missing_toolchain():
    """Why the sm_90a compile cannot run here (None when it can): Triton's CUDA backend and
    its ptxas, looked up the way the backend itself does (TRITON_PTXAS_PATH, then the wheel's)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except Exception as e:  # noqa: BLE001
        return f"triton's CUDA backend cannot be imported ({type(e).__name__}: {e})"
    try:
        _ = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001 - RuntimeError("Cannot find ptxas")
        return f"no ptxas for sm_90 ({e}): set TRITON_PTXAS_PATH or install the triton wheel that ships it"
    return None


def _run_sm90(tmp_path, capsys, *args):
    """``python -m tools.sm90 --quick ARGS`` in a clean environment; its JSON report, checked clean.
    Its progress (the capture, then a line per compiled kernel) goes to the terminal as it comes,
    past pytest's capture: a cold run takes minutes."""
    reason = _missing_toolchain()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # conftest sets it for this process; the check compiles real kernels
    for knob in ("HNCLIP_AUTOTUNE", "HNCLIP_TRITON_LAUNCH"):  # every autotune candidate, GPU launch config
        env.pop(knob, None)
    out = tmp_path / "sm90.json"
    cmd = [sys.executable, "-m", "tools.sm90", "--quick", *args, "--json", str(out)]
    lines = []
    with capsys.disabled():
        print(f"\n[sm90] python -m tools.sm90 --quick {' '.join(args)}".rstrip(), flush=True)
        with subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(("triton ", "  compiled ")):  # the header and a line per kernel, not the table
                    print(f"[sm90] {line.strip()}", flush=True)
            proc.wait(timeout=1800)
    stdout = "".join(lines)  # stdout and stderr
    assert out.exists(), f"tools.sm90 exited {proc.returncode}:\n{stdout[-10000:]}"
    report = json.loads(out.read_text())
    assert report["rows"], stdout
    assert not report["problems"], (
        f"{len(report['problems'])} problem(s) at sm_90a:\n  " + "\n  ".join(report["problems"]) + "\n\n" + stdout
    )
    assert proc.returncode == 0, stdout[-10000:]
    return report


@pytest.mark.sm90
def test_kernels_compile_for_sm90_without_spills(tmp_path, capsys):
    _run_sm90(tmp_path, capsys)


@pytest.mark.sm90
def test_kernels_compile_for_sm90_with_inductor_scalar_types(tmp_path, capsys):
    report = _run_sm90(tmp_path, capsys, "--wide-scalars")
    assert report["config"]["wide_scalars"]
    types = {ty for row in report["rows"] for ty in row["scalars"].values()}
    # every scalar argument is an integer (γ and τ come through pointers)
    assert types == {"i32"}, types


# ------------------------------------------------------------------ the checker's own rules (fast)
def _row(**kw):
    """A clean bf16 kernel row, as tools.sm90.run_check reports it."""
    row = dict(
        dtype="bf16",
        prec=["ieee"],
        regs=168,
        spill_st=0,
        spill_ld=0,
        stack=0,
        shared=98304,
        num_warps=4,
        num_stages=3,
        mma=["wgmma.m64n64k16.bf16"],
        tf32=False,
        dot16=True,
    )
    row.update(kw)
    return row


def test_problem_rules_on_synthetic_rows():
    from tools.sm90 import SMEM_LIMIT, problems_of

    assert problems_of(_row()) == []
    # today's fp32 forward kernel (γ = 0.5): fails for its spills only, passes without them
    fwd_fp32 = _row(dtype="fp32", regs=255, spill_st=740, spill_ld=740, stack=520, shared=131072, mma=[], dot16=False)
    assert problems_of(fwd_fp32) == ["spills 740/740 B (stores/loads)"]
    assert problems_of({**fwd_fp32, "spill_st": 0, "spill_ld": 0}) == []
    assert problems_of(_row(spill_st=0, spill_ld=4)) == ["spills 0/4 B (stores/loads)"]
    assert problems_of(_row(shared=SMEM_LIMIT)) == []
    assert problems_of(_row(shared=SMEM_LIMIT + 1)) == [f"shared memory {SMEM_LIMIT + 1} B > {SMEM_LIMIT} B"]
    # tf32 MMAs: fine on float32 inputs only as the tf32x3 split; reported, not a problem, on 16-bit inputs
    tf32 = dict(mma=["wgmma.m64n64k8.tf32"], tf32=True, dot16=False)
    assert problems_of(_row(dtype="fp32", prec=["tf32x3"], **tf32)) == []
    for prec in (["tf32"], ["ieee"], [], ["tf32", "tf32x3"]):
        assert [p.split(" (")[0] for p in problems_of(_row(dtype="fp32", prec=prec, **tf32))] == [
            "tf32 MMA on float32 inputs"
        ], prec
    assert problems_of(_row(dtype="fp16", mma=["wgmma.m64n64k16.f16", "wgmma.m64n64k8.tf32"], tf32=True)) == []
    # a 16-bit tl.dot must become an MMA; a float32 "ieee" dot is FMA by design
    assert problems_of(_row(mma=[])) == ["tl.dot on 16-bit operands but no MMA instruction"]
    assert problems_of(_row(dtype="fp32", mma=[], dot16=False)) == []
    assert problems_of(_row(regs=None)) == ["no ptxas -v register count"]
    assert problems_of(_row(error="PTXASError: ptxas failed\n...")) == ["compile failed: PTXASError: ptxas failed"]


def test_ptx_and_ptxas_log_parsing():
    from tools.sm90 import analyse

    ptx = """
        wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 1;
        wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%r1}, %rd1, %rd2, p, 1, 1;
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};
    """
    ttir = "%acc = tt.dot %q, %k, %acc0 : tensor<64x64xbf16> * tensor<64x64xbf16> -> tensor<64x64xf32> loc(#loc1)"
    log = (
        "ptxas info    : Function properties for _fwd_kernel\n"
        "    520 bytes stack frame, 740 bytes spill stores, 736 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 520 bytes cumulative stack size\n"
    )
    ck = types.SimpleNamespace(
        asm={"ptx": ptx, "ttir": ttir}, metadata=types.SimpleNamespace(shared=131072, num_warps=4, num_stages=3)
    )
    r = analyse(ck, log)
    assert r == dict(
        regs=255,
        spill_st=740,
        spill_ld=736,
        stack=520,
        shared=131072,
        num_warps=4,
        num_stages=3,
        mma=["mma.m16n8k16.f16", "wgmma.m64n128k16.bf16", "wgmma.m64n64k8.tf32"],
        tf32=True,
        dot16=True,
    )
    fp32 = analyse(
        types.SimpleNamespace(
            asm={"ptx": "fma.rn.f32 %f1, %f2, %f3, %f4;", "ttir": ttir.replace("bf16", "f32")}, metadata=ck.metadata
        ),
        log.replace("740 bytes", "0 bytes"),
    )
    assert (fp32["mma"], fp32["tf32"], fp32["dot16"], fp32["spill_st"]) == ([], False, False, 0)
