"""The sigmoid (SigLIP) loss's providers for ``python -m benchmarks.run --loss sigmoid``.

Each builds ``loss_fn(img, txt) -> scalar loss`` on random (N, D) features at SigLIP's
initialisation, s = ``logit_scale`` = 10 (already exponentiated) and b = ``logit_bias`` = −10,
both one-element tensors that require grad (dL/ds and dL/db are computed, as in training).
Every provider L2-normalises the features (ours inside the loss, the others through
``F.normalize`` before it), so all compute the same loss: SigLIP's (1/N)·Σ_ij softplus(−y_ij·z_ij).

* ``hnclip-cpp`` (CPU), ``hnclip-triton`` (CUDA): ``hn_siglip_loss`` on our fused operators
  (``hnclip::cpp_sigmoid_nll``, ``hnclip::triton_sigmoid_nll``), γ = 0.5 (the margin's work);
  ``hnclip-cpp-g0`` / ``hnclip-triton-g0``: the same at γ = 0, plain SigLIP, like for like
  with the peers below.
* ``hnclip-torch``: ``hn_siglip_loss(backend="torch")``, the materialising reference, γ = 0.5.
* ``open_clip``: open_clip's ``SigLipLoss`` (eager: the N×N logits and labels materialised).
* ``siglip-kernel``: PyPI ``siglip-kernel``'s ``fused_siglip_loss`` (Triton, CUDA only; it
  takes log s).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from .providers import Provider

LOGIT_SCALE = 10.0
LOGIT_BIAS = -10.0
GAMMA = 0.5


def _scalars(device: torch.device):
    return (
        torch.tensor(LOGIT_SCALE, device=device, requires_grad=True),
        torch.tensor(LOGIT_BIAS, device=device, requires_grad=True),
    )


def _hnclip(backend: str, device: torch.device, gamma: float = GAMMA) -> Callable:
    from hnclip_kernels import hn_siglip_loss

    s, b = _scalars(device)
    return lambda img, txt: hn_siglip_loss(img, txt, s, b, gamma=gamma, backend=backend)


def _open_clip(device: torch.device) -> Callable:
    from open_clip.loss import SigLipLoss

    loss = SigLipLoss()
    s, b = _scalars(device)
    return lambda img, txt: loss(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), s, b)


def _siglip_kernel(device: torch.device) -> Callable:
    from siglip_kernel import fused_siglip_loss

    log_s = torch.tensor(math.log(LOGIT_SCALE), device=device, requires_grad=True)
    b = torch.tensor(LOGIT_BIAS, device=device, requires_grad=True)
    return lambda img, txt: fused_siglip_loss(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), log_s, b)


_TRITON_NOTE = "CUDA only (the Triton interpreter on CPU is far too slow to benchmark)"
_CPP_NOTE = "CPU only (the C++ kernel takes CPU tensors)"
PROVIDERS = {
    p.name: p
    for p in (
        Provider("hnclip-triton", ("cuda",), "triton", "triton", functools.partial(_hnclip, "triton"), _TRITON_NOTE),
        Provider(
            "hnclip-triton-g0",
            ("cuda",),
            "triton",
            "triton",
            functools.partial(_hnclip, "triton", gamma=0.0),
            _TRITON_NOTE,
        ),
        Provider(
            "hnclip-torch", ("cuda", "cpu"), "hnclip_kernels", "hnclip-kernels", functools.partial(_hnclip, "torch")
        ),
        Provider(
            "hnclip-cpp", ("cpu",), "hnclip_kernels", "hnclip-kernels", functools.partial(_hnclip, "cpp"), _CPP_NOTE
        ),
        Provider(
            "hnclip-cpp-g0",
            ("cpu",),
            "hnclip_kernels",
            "hnclip-kernels",
            functools.partial(_hnclip, "cpp", gamma=0.0),
            _CPP_NOTE,
        ),
        Provider("open_clip", ("cuda", "cpu"), "open_clip", "open_clip_torch", _open_clip),
        Provider(
            "siglip-kernel", ("cuda",), "siglip_kernel", "siglip-kernel==0.1.2", _siglip_kernel, "CUDA only (Triton)"
        ),
    )
}

# What a sigmoid run reads (no acceptance targets: the table and docs/benchmarks.md give the ratios)
TARGETS: list = []


def _cell(row: dict) -> str:
    if row is None:
        return "—"
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    ms, mib = float(row["median_ms"]), float(row["peak_mem_mb"])
    time = f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"
    return f"{time}, {mib:.0f} MiB"


def markdown_table(rows: list) -> str:
    """The docs' table of a sweep's CSV rows: median fwd+bwd time and peak MiB per N and provider
    (the providers that ran at some N; a cell that did not run shows its status)."""
    ran = [p for p in PROVIDERS if any(r["provider"] == p and r["status"] == "ok" for r in rows)]
    cell = {(r["provider"], int(r["N"])): r for r in rows if r["mode"] == "fwd+bwd"}
    sizes = sorted({int(r["N"]) for r in rows})
    lines = ["| N | " + " | ".join(ran) + " |", "|---:|" + "---:|" * len(ran)]
    for n in sizes:
        lines.append(f"| {n} | " + " | ".join(_cell(cell.get((p, n))) for p in ran) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m benchmarks.sigmoid --markdown [CSV]``: print :func:`markdown_table` of a sweep's
    CSV (default: the committed ``benchmarks/results/cpu_sigmoid_results.csv``)."""
    import argparse
    import csv
    import os

    ap = argparse.ArgumentParser(prog="python -m benchmarks.sigmoid", description=main.__doc__)
    ap.add_argument("--markdown", action="store_true", required=True, help="print the docs' table")
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_sigmoid_results.csv")
    ap.add_argument("csv", nargs="?", default=default)
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        print(markdown_table(list(csv.DictReader(f))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
