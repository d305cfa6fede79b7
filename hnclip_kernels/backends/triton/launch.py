"""The launch switch of the Triton kernels: how they are wrapped for ``torch.library`` and
launched (autotuned, or with ``config.heuristic``'s fixed configuration).

How the operators are registered (see ``ops``): ``torch.library.triton_op`` for compiled
kernels, ``custom_op`` under the interpreter (and on a torch without ``triton_op``).
``triton_op`` must find every kernel of its operators in their source (torch hashes the
kernels' code into its compile-cache keys): it reads the operator's code and follows the
functions it calls *by name*, down to ``wrap_triton(<kernel>)``. So each kernel has one named
launcher beside it (``forward_kernels.launch_fwd`` … ``dscore_launch.launch_dscore_rank``) that hands
:func:`launch` a ``lambda tuned: wrap_triton(<twin>) if tuned else wrap_triton(<kernel>)``,
and the host walks call the launchers by name (``tests/backends/test_triton_ops_kernels.py``
holds that each operator finds exactly its kernels).
"""

from __future__ import annotations

import os

import torch

from . import config as cfg
from .precision import INTERPRET

USE_TRITON_OP = not INTERPRET and hasattr(torch.library, "triton_op")
if USE_TRITON_OP:
    from torch.library import wrap_triton
else:

    def wrap_triton(kernel):
        """Under the interpreter the kernels are launched as they are."""
        return kernel


def interpreting() -> bool:
    """Do the kernels run in Triton's interpreter? ``precision.INTERPRET`` (they were created
    interpreted: TRITON_INTERPRET=1 when ``triton.jit`` ran), checked against triton's own
    library (``tl.sum`` & co., made when triton is imported).

    Raises ``ValueError`` when the two disagree, or TRITON_INTERPRET=1 is set now but the
    kernels are compiled: it was set after ``import triton`` (directly or by ``torch._dynamo``),
    and the kernels would fail inside with an InterpreterError."""
    import triton.language.standard as standard

    library = "Interpreted" in type(standard.sum).__name__
    if INTERPRET and library:
        return True
    if bool(INTERPRET) != library or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ValueError(
            "backend='triton' on CPU tensors: TRITON_INTERPRET=1 was set after triton was imported "
            "(by `import triton`, or by torch._dynamo / torch.compile), so Triton is only partly "
            "interpreting; set TRITON_INTERPRET=1 before importing triton (in the environment, or "
            "first thing in the program), or use backend='cpp' / 'torch'"
        )
    return False


def launch(kernel, name: str, width: int, grid, args, **constexprs):
    """Launch ``kernel(tuned)`` (a launcher's switch: the kernel through ``wrap_triton``, its
    autotuned twin when ``tuned``) in mode "autotune", else the kernel with ``cfg.heuristic(name,
    width)``; ``grid(tiles)`` maps the chosen constexprs to the launch grid. ``args``: the
    kernel's other arguments by name (each launcher's ``*_args`` builds them; None for a pointer
    it does not read: its flag derives from that, see :func:`derived`).
    By keyword throughout: ``wrap_triton`` binds launch kwargs to the kernel's parameters, and
    the autotuner keys and prunes on them (``cfg.pruner`` reads the kwargs)."""
    constexprs = {**constexprs, **derived_flags(name, args)}
    if cfg.launch_mode() == "autotune":
        kernel(True)[lambda meta: grid(meta)](**args, **constexprs)
        return
    fixed = cfg.heuristic(name, width)
    tiles = {**constexprs, **fixed.constexprs}
    kernel(False)[grid(tiles)](**args, **tiles, num_warps=fixed.num_warps, num_stages=fixed.num_stages)


# the kernels' flags that follow from a pointer being None (not read), as cut-cross-entropy
# derives HAS_BIAS. They need no autotune key: the autotuner's key holds the dtypes of the
# tensor arguments in order, so a None pointer already keys apart (HAS_MARGIN, whose γ pointer
# is None without it too, stays explicit: γ and the threshold are both float32 and would not).
_DERIVED = {
    # false-negative masking: the threshold block, or (the directional kernels) the family's group ids
    "MASK": lambda args: args["thr_ptr"] is not None or args.get("gk_ptr") is not None,
    "COSINE": lambda args: args["thr_ptr"] is not None,  # masking by the captions' cosine (the threshold)
    "CAPTIONS": lambda args: args["cq_ptr"] is not None,  # the family's masking captions (margin="image_text")
    "GROUPS": lambda args: args["gk_ptr"] is not None,  # the family's group ids
    "SHIFT": lambda args: args["s_ptr"] is not None,  # masking with label smoothing: each row's ε/n_i
    "ROUND16": lambda args: args["res_r_ptr"] is not None,  # 16-bit W: staged in float32, its slice maxima
    "TAIL": lambda args: args["lo_ptr"] is not None,  # fp16: the rounded W's float16 tail (round16)
}


_FLAGS: dict[str, tuple[str, ...]] = {}  # launch name -> the flags :func:`launch` derives for its kernel


def derived_flags(name: str, args: dict) -> dict[str, bool]:
    """The constexpr flags of the kernel launched as ``name``, derived from which of ``args``'
    pointers are None; for a caller that launches a kernel itself (the tests' staged kernels)."""
    return {flag: _DERIVED[flag](args) for flag in _FLAGS[name]}


def derived(name: str, *flags: str):
    """Mark the kernel launched as ``name`` (``cfg.heuristic``'s name) as taking ``flags`` (MASK,
    COSINE, CAPTIONS, GROUPS, SHIFT, ROUND16, TAIL), which :func:`launch` derives from their
    pointers and passes as constexprs. Not ``triton.heuristics``: ``torch.library.wrap_triton``
    takes only a ``triton.jit`` or ``triton.autotune`` object, so a heuristics-wrapped kernel
    failed every fixed-configuration launch on a GPU (first GPU run, torch 2.11)."""

    def mark(kernel):
        _FLAGS[name] = flags
        return kernel

    return mark
