"""What the CPU-side studies share (``tools.work``, ``tools.precision``): Triton's
interpreter, the GPU's launch configuration inside it, and their CSV rows.

``enter_interpreter`` must run before anything imports triton: TRITON_INTERPRET is read
when triton is first imported.
"""

from __future__ import annotations

import contextlib
import csv
import os
import sys

LAUNCH_ENV = "HNCLIP_TRITON_LAUNCH"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enter_interpreter(program: str, why: str) -> None:
    """Set TRITON_INTERPRET=1, or refuse if triton was already imported without it."""
    if "triton" in sys.modules and not interpreting():
        raise RuntimeError(
            f"{program} {why}, but triton was imported without TRITON_INTERPRET=1, so its kernels would be "
            f"compiled ones; run `python -m {program}` in a fresh process, or set TRITON_INTERPRET=1 before "
            "anything imports triton"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def gpu_launch():
    """The GPU's launch configuration (tiles, warps, column splits) inside the block only, so
    nothing leaks to code (or tests) that runs after it."""
    from hnclip_kernels.backends.triton import config as triton_config

    previous = os.environ.get(LAUNCH_ENV)
    os.environ[LAUNCH_ENV] = "gpu"
    try:
        if triton_config.launch_mode() != "gpu":
            raise RuntimeError(
                f"{LAUNCH_ENV}=gpu did not give the GPU launch mode (got {triton_config.launch_mode()!r})"
            )
        yield
    finally:
        if previous is None:
            os.environ.pop(LAUNCH_ENV, None)
        else:
            os.environ[LAUNCH_ENV] = previous


def write_rows(rows: list, path: str, columns: list) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
