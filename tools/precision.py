"""Float32 accuracy of the fused Triton loss in each tensor-core input precision.

    python -m tools.precision [--n 130] [--d 128] [--seeds 4] [--csv PATH]

What runs: one forward+backward of the single-process Triton loss,
``hn_clip_pairs_triton(img, txt, tau=tau, gamma=gamma, label_smoothing=0.0, normalize=True,
precision=mode).mean()`` with τ a float32 tensor that requires grad, for each mode in :data:`MODES` (float32 features use the
mode for the score products and for the backward GEMMs alike) and each regime:

  * ``random``: ``make_pair`` float32 features (tests/cases.py), τ = 0.07, γ = 0.5;
  * ``saturated``: ``saturated_pair`` (tests/cases.py: well-separated pairs), τ = 0.01,
    γ = 0.5; every batch's true loss must be < 1e-20 (checked: the study refuses otherwise).

How: on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1), under the GPU launch
configuration (HNCLIP_TRITON_LAUNCH=gpu: the GPU's tiles, warps and column splits). There
the kernels round ``tl.dot`` operands as the tensor cores do in each mode (``_dot`` in
hnclip_kernels/backends/triton/precision.py), so the errors are what an H100/H200 computes.

Error: relative error in norm against the float64 truth, ``hn_clip_loss_f64`` of
tests/helpers.py, evaluated on the same float32 inputs (τ is the float32 τ, upcast). For each
mode and regime the worst over the seeds of the loss (mean reduction) and of the gradients
(max over d img, d txt, d τ), judged against the project's float32 guarantees
(tests/cases.py, README "Numerical guarantees"): loss ≤ 1e-5 (saturated: 3e-5), gradients ≤ 1e-4.

Cost: MMA passes per N×N×D product, and the same in bf16-MMA-pass equivalents at H100/H200
dense rates (tf32 MMA at half the bf16 rate; ieee is FMA on the CUDA cores, 66.9 against
989.4 dense bf16 TFLOPS on an H100 SXM, the H200 has the same compute). The recommended
default is the cheapest mode that keeps every guarantee in both regimes.
"""

from __future__ import annotations

import os
import sys

from .interpreted import LAUNCH_ENV, enter_interpreter, gpu_launch, write_rows  # before anything imports triton

enter_interpreter("tools.precision", "measures the tensor cores' operand rounding as emulated in Triton's interpreter")

if __name__ == "__main__":
    # run as a program: the whole process uses the GPU's launch configuration. Imported (by a
    # test), the study sets it only while it runs (gpu_launch), so nothing leaks to other code.
    os.environ[LAUNCH_ENV] = "gpu"

import argparse  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from hnclip_kernels.backends.triton import config as cfg  # noqa: E402
from hnclip_kernels.backends.triton import ops as ht  # noqa: E402
from hnclip_kernels.backends.triton.precision import INTERPRET  # noqa: E402

# The float64 truth and the test inputs live with the tests; tests/ is a folder of plain
# modules (cases.py itself imports `helpers`), put on sys.path as pytest does.
_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from cases import TOL_F32_GRAD, TOL_F32_LOSS, TOL_F32_LOSS_SATURATED, make_pair, saturated_pair  # noqa: E402
from helpers import hn_clip_loss_f64, rel_err  # noqa: E402

H100_TFLOPS_DENSE = {"fma": 66.9, "tf32": 494.7, "bf16": 989.4}  # H100 SXM datasheet (H200: same compute)


@dataclass(frozen=True)
class Mode:
    name: str
    passes: int  # MMA passes per product (0: no tensor cores)
    unit: str  # "fma", "tf32" or "bf16"

    @property
    def bf16_equiv(self) -> float:
        """Cost per product in bf16-MMA passes at H100/H200 dense rates (tf32 = 2, FMA ≈ 14.8)."""
        if self.unit == "fma":
            return H100_TFLOPS_DENSE["bf16"] / H100_TFLOPS_DENSE["fma"]
        return self.passes * H100_TFLOPS_DENSE["bf16"] / H100_TFLOPS_DENSE[self.unit]

    @property
    def passes_text(self) -> str:
        return "0 (FMA)" if self.unit == "fma" else f"{self.passes} {self.unit}"


MODES = {
    m.name: m
    for m in (
        Mode("ieee", 0, "fma"),
        Mode("tf32x3", 3, "tf32"),
        Mode("bf16x6", 6, "bf16"),
        Mode("bf16x3", 3, "bf16"),
        Mode("tf32", 1, "tf32"),
    )
}


@dataclass(frozen=True)
class Regime:
    name: str
    tau: float
    gamma: float
    inputs: Callable[[int, int, int], tuple]  # (seed, n, d) -> float32 (img, txt)
    loss_tol: float
    grad_tol: float
    max_true_loss: float | None = None  # the regime's definition, checked on every batch


REGIMES = {
    "random": Regime(
        "random", 0.07, 0.5, lambda seed, n, d: make_pair(n, d, torch.float32, seed=seed), TOL_F32_LOSS, TOL_F32_GRAD
    ),
    "saturated": Regime(
        "saturated",
        0.01,
        0.5,
        lambda seed, n, d: saturated_pair(seed, n, d),
        TOL_F32_LOSS_SATURATED,
        TOL_F32_GRAD,
        max_true_loss=1e-20,
    ),
}
GRADS = ("d_img", "d_txt", "d_tau")
COLUMNS = [
    "precision",
    "regime",
    "n",
    "d",
    "tau",
    "gamma",
    "seeds",
    "mma_passes",
    "pass_unit",
    "bf16_pass_equiv",
    "loss_err",
    "grad_err",
    "d_img_err",
    "d_txt_err",
    "d_tau_err",
    "loss_tol",
    "grad_tol",
    "ok",
    "max_true_loss",
]


def _require_interpreted_kernels() -> None:
    if not INTERPRET:
        raise RuntimeError(
            "tools.precision needs the Triton kernels interpreted (their tensor-core rounding "
            "is emulated there), but hnclip_kernels was imported without TRITON_INTERPRET=1; "
            "run `python -m tools.precision` in a fresh process"
        )


def truth(img, txt, tau32, gamma):
    """Float64 loss (mean) and gradients (d img, d txt, d τ) on the same float32 inputs."""
    leaves = [x.detach().double().requires_grad_(True) for x in (img, txt)]
    tau64 = tau32.detach().double().requires_grad_(True)
    loss = hn_clip_loss_f64(leaves[0], leaves[1], tau64, gamma, 0.0, "mean", True)
    loss.backward()
    return loss.detach(), (leaves[0].grad, leaves[1].grad, tau64.grad)


def errors(mode: str, img, txt, tau32, gamma, ref) -> dict:
    """Relative errors of one Triton forward+backward in ``mode`` against ``ref`` (from :func:`truth`)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (img, txt)]
    tau = tau32.detach().clone().requires_grad_(True)
    loss = ht.hn_clip_pairs_triton(
        leaves[0], leaves[1], tau=tau, gamma=gamma, label_smoothing=0.0, normalize=True, precision=mode
    ).mean()
    loss.backward()
    ref_loss, ref_grads = ref
    out = {"loss_err": rel_err(loss, ref_loss)}
    for name, got, want in zip(GRADS, (leaves[0].grad, leaves[1].grad, tau.grad), ref_grads):
        out[f"{name}_err"] = rel_err(got, want)
    return out


def study(modes=tuple(MODES), regimes=tuple(REGIMES), n: int = 130, d: int = 128, seeds=range(4)) -> list:
    """One row per (mode, regime): the worst errors over ``seeds`` (keys: :data:`COLUMNS`)."""
    _require_interpreted_kernels()
    seeds = list(seeds)
    rows = []
    with gpu_launch():
        for rname in regimes:
            reg = REGIMES[rname]
            worst = {m: {} for m in modes}
            max_true = 0.0
            for seed in seeds:
                img, txt = reg.inputs(seed, n, d)
                tau32 = torch.tensor(reg.tau, dtype=torch.float32)
                ref = truth(img, txt, tau32, reg.gamma)
                max_true = max(max_true, ref[0].item())
                if reg.max_true_loss is not None and not ref[0].item() < reg.max_true_loss:
                    raise ValueError(
                        f"regime {rname!r}, seed {seed}, N={n}, D={d}: true loss {ref[0].item():.3e} "
                        f"is not < {reg.max_true_loss:g}, so the batch is not saturated; choose a "
                        "larger D (the default 128 is)"
                    )
                for m in modes:
                    for key, err in errors(m, img, txt, tau32, reg.gamma, ref).items():
                        worst[m][key] = max(worst[m].get(key, 0.0), err)
            for m in modes:
                w, mode = worst[m], MODES[m]
                grad_err = max(w[f"{g}_err"] for g in GRADS)
                rows.append(
                    dict(
                        precision=m,
                        regime=rname,
                        n=n,
                        d=d,
                        tau=reg.tau,
                        gamma=reg.gamma,
                        seeds=" ".join(map(str, seeds)),
                        mma_passes=mode.passes,
                        pass_unit=mode.unit,
                        bf16_pass_equiv=round(mode.bf16_equiv, 2),
                        loss_err=w["loss_err"],
                        grad_err=grad_err,
                        **{f"{g}_err": w[f"{g}_err"] for g in GRADS},
                        loss_tol=reg.loss_tol,
                        grad_tol=reg.grad_tol,
                        ok=w["loss_err"] <= reg.loss_tol and grad_err <= reg.grad_tol,
                        max_true_loss=max_true,
                    )
                )
    return rows


def recommend(rows) -> tuple[list, list]:
    """(modes keeping every guarantee in every regime measured, cheapest first;
    the cheapest of them: one mode, or several tied on bf16-pass equivalents)."""
    modes = list(dict.fromkeys(r["precision"] for r in rows))
    keep = [m for m in modes if all(r["ok"] for r in rows if r["precision"] == m)]
    keep.sort(key=lambda m: MODES[m].bf16_equiv)
    if not keep:
        return [], []
    best = MODES[keep[0]].bf16_equiv
    return keep, [m for m in keep if abs(MODES[m].bf16_equiv - best) < 1e-9]


def headroom(rows, mode: str) -> float:
    """Smallest tolerance / error over the mode's checks (how far inside the guarantees it stays)."""
    ratios = [
        r[tol] / max(r[err], 1e-300)
        for r in rows
        if r["precision"] == mode
        for err, tol in (("loss_err", "loss_tol"), ("grad_err", "grad_tol"))
    ]
    return min(ratios)


def format_table(rows) -> str:
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    by = {(r["precision"], r["regime"]): r for r in rows}
    head = f"{'precision':<10}{'MMA passes':>12}{'bf16-eq':>9}"
    sub = " " * len(head)
    for rg in regimes:
        r0 = next(r for r in rows if r["regime"] == rg)
        title = f"{rg} τ={r0['tau']:g}"
        head += f"   {title:^19}"
        sub += f"   {'loss':>9}{'grads':>10}"
    head += "   guarantees"
    lines = [head, sub, "-" * len(head)]
    for m in dict.fromkeys(r["precision"] for r in rows):
        mode = MODES[m]
        eq = f"~{mode.bf16_equiv:.1f}" if mode.unit == "fma" else f"{mode.bf16_equiv:g}"
        line = f"{m:<10}{mode.passes_text:>12}{eq:>9}"
        ok = True
        for rg in regimes:
            r = by[(m, rg)]
            flag = lambda e, t: "*" if e > t else " "  # noqa: E731
            line += (
                f"   {r['loss_err']:>8.1e}{flag(r['loss_err'], r['loss_tol'])}"
                f"{r['grad_err']:>9.1e}{flag(r['grad_err'], r['grad_tol'])}"
            )
            ok &= r["ok"]
        lines.append(line + f"   {'kept' if ok else 'BROKEN'}")
    tols = "; ".join(
        f"{rg}: loss ≤ {by[(rows[0]['precision'], rg)]['loss_tol']:g}, "
        f"grads ≤ {by[(rows[0]['precision'], rg)]['grad_tol']:g}"
        for rg in regimes
    )
    lines.append(f"(* over the guarantee; {tols})")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m tools.precision", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=130, help="batch size N")
    ap.add_argument("--d", type=int, default=128, help="embedding dim D")
    ap.add_argument("--seeds", type=int, default=4, help="seeds 0..S-1 per regime (worst reported)")
    ap.add_argument("--modes", default=",".join(MODES), help=",".join(MODES))
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    if args.n < 2 or args.d < 1 or args.seeds < 1:
        ap.error("need --n ≥ 2, --d ≥ 1, --seeds ≥ 1")
    return args


def main(argv=None) -> list:
    args = parse_args(argv)
    start = time.perf_counter()
    rows = study(args.modes, tuple(REGIMES), args.n, args.d, range(args.seeds))
    elapsed = time.perf_counter() - start
    print(
        f"float32 accuracy of the Triton loss per input precision: N={args.n}, D={args.d}, γ=0.5, seeds "
        f"0..{args.seeds - 1} (worst), relative error in norm vs float64; grads = max(d img, d txt, d τ); "
        f"Triton interpreter with emulated tensor-core rounding, {LAUNCH_ENV}=gpu; bf16-eq = cost per product "
        "in bf16 MMA passes at H100/H200 dense rates"
    )
    print(format_table(rows))
    sat = [r["max_true_loss"] for r in rows if r["regime"] == "saturated"]
    if sat:
        print(f"saturated regime: largest true loss over the seeds {max(sat):.2e}")
    keep, best = recommend(rows)
    if not best:
        print("no mode keeps every guarantee")
    else:
        ranked = ", ".join(f"{m} ({MODES[m].bf16_equiv:.3g})" for m in keep)
        print(f"modes keeping every guarantee, cheapest first (bf16-eq): {ranked}")
        if len(best) == 1:
            print(f"recommended default: {best[0]}")
        else:
            room = ", ".join(f"{m} {headroom(rows, m):.1f}x" for m in best)
            print(
                f"cheapest tied at {MODES[best[0]].bf16_equiv:g} bf16-pass equivalents: {', '.join(best)} "
                f"(headroom, min tolerance/error: {room}); only GPU timing can separate them"
            )
    print(
        f"current default (validation.DEFAULT_FP32_PRECISION): {cfg.DEFAULT_FP32_PRECISION}; study took {elapsed:.1f} s"
    )
    if args.csv:
        write_rows(rows, args.csv, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
