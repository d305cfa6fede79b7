"""The loss implementations under test.

Each provider builds ``loss_fn(img, txt) -> scalar loss`` (mean over the batch, both
directions) at τ = 0.07. Ours runs HN-CLIP with γ = 0.5; the others are plain symmetric
InfoNCE (γ = 0), the floor a user gives up the margins for. Optional third-party
providers are imported only when asked for and reported as skipped when they cannot run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch

TAU = 0.07
GAMMA = 0.5


@dataclass(frozen=True)
class Provider:
    name: str
    devices: tuple  # device types it runs on
    module: str  # what must be importable
    pip: str  # what provides it
    build: Callable[[torch.device], Callable]
    note: str = ""  # why it is limited to ``devices``
    dtypes: tuple = ()  # the feature dtypes it is meant for (empty: all)


def _hnclip(backend: str, device: torch.device, **options) -> Callable:
    from hnclip_kernels import hn_clip_loss

    return functools.partial(hn_clip_loss, tau=TAU, **{"gamma": GAMMA, "backend": backend, **options})


def _triton_precision(precision: str) -> Provider:
    """Ours on float32 features in another tensor-core input precision (hnclip-triton: tf32x3)."""
    return Provider(
        f"hnclip-triton-{precision}",
        ("cuda",),
        "triton",
        "triton",
        functools.partial(_hnclip, "triton", precision=precision),
        "CUDA only",
        ("float32",),
    )


def _hnclip_compiled(device: torch.device) -> Callable:
    # dynamic=True: one compilation per dtype for the whole sweep instead of one per shape
    return torch.compile(_hnclip("torch", device), dynamic=True)


def _open_clip(device: torch.device) -> Callable:
    from open_clip.loss import ClipLoss

    loss = ClipLoss()
    return lambda img, txt: loss(img, txt, 1.0 / TAU)


def _inf_cl(device: torch.device) -> Callable:
    from inf_cl import cal_inf_loss

    scale = torch.tensor(1.0 / TAU, device=device)  # no grad: inf-cl all-reduces a scale's grad
    return lambda img, txt: 0.5 * (cal_inf_loss(img, txt, scale=scale) + cal_inf_loss(txt, img, scale=scale))


def _memeff(device: torch.device) -> Callable:
    from memeff import MemoryEfficientCLIPLoss

    # stable=False: the textbook 1/τ gradient scale, the same gradient the others compute
    return MemoryEfficientCLIPLoss(temperature=TAU, stable=False)


PROVIDERS = {
    p.name: p
    for p in (
        Provider(
            "hnclip-triton",
            ("cuda",),
            "triton",
            "triton",
            functools.partial(_hnclip, "triton"),
            "CUDA only (the Triton interpreter on CPU is far too slow to benchmark)",
        ),
        # γ = 0: plain InfoNCE through our kernels, like for like with open_clip and Inf-CL
        Provider(
            "hnclip-triton-g0",
            ("cuda",),
            "triton",
            "triton",
            functools.partial(_hnclip, "triton", gamma=0.0),
            "CUDA only",
        ),
        *(_triton_precision(p) for p in ("ieee", "bf16x3", "bf16x6")),
        Provider(
            "hnclip-torch", ("cuda", "cpu"), "hnclip_kernels", "hnclip-kernels", functools.partial(_hnclip, "torch")
        ),
        Provider("hnclip-torch-compile", ("cuda", "cpu"), "hnclip_kernels", "hnclip-kernels", _hnclip_compiled),
        Provider(
            "hnclip-cpp",
            ("cpu",),
            "hnclip_kernels",
            "hnclip-kernels",
            functools.partial(_hnclip, "cpp"),
            "CPU only (the C++ kernel takes CPU tensors)",
        ),
        Provider("open_clip", ("cuda", "cpu"), "open_clip", "open_clip_torch", _open_clip),
        Provider("inf-cl", ("cuda",), "inf_cl", "inf-cl", _inf_cl, "CUDA only (Triton kernels)"),
        Provider("memeff", ("cuda",), "memeff", "memeff", _memeff, "CUDA only (Triton kernels)"),
    )
}
OURS = tuple(name for name in PROVIDERS if name.startswith("hnclip-"))


def unavailable(name: str, device: str, deep: bool = True, table: Optional[dict] = None) -> Optional[str]:
    """Why provider ``name`` of ``table`` (default: the InfoNCE ``PROVIDERS``) cannot run on
    ``device`` here, or None.

    ``deep`` imports the module (catches broken installs); without it only its presence is
    checked, so a parent process need not pay for imports its workers will do anyway.
    """
    p = (PROVIDERS if table is None else table)[name]
    if device not in p.devices:
        return p.note
    if importlib.util.find_spec(p.module) is None:
        return f"{p.module} is not importable (pip install {p.pip})"
    if name.startswith("hnclip-cpp"):
        from hnclip_kernels.backends import cpp_directional

        if cpp_directional() is None:
            return "hnclip_kernels._C is not built (reinstall with the README's command to compile csrc/)"
    if deep:
        try:
            importlib.import_module(p.module)
        except Exception as exc:  # a present but broken install: report it, keep benchmarking the rest
            return f"importing {p.module} failed: {type(exc).__name__}: {exc}"
    return None
