"""The launch switch of the Triton kernels: how they are wrapped for ``torch.library`` and
launched (autotuned, or with ``config.heuristic``'s fixed configuration).

How the operators are registered (see ``ops``): ``torch.library.triton_op`` for compiled
kernels, ``custom_op`` under the interpreter (and on a torch without ``triton_op``).
``triton_op`` must find every kernel of its operators in their source (torch hashes the
kernels' code into its compile-cache keys): it reads the operator's code and follows the
functions it calls *by name*, down to ``wrap_triton(<kernel>)``. So each layer (``forward``,
``backward``) spells out its kernels in its own ``_kernel(name, tuned)`` switch and hands
:func:`launch` a ``lambda tuned: _kernel(name, tuned)``: a call by name that torch follows.
"""
from __future__ import annotations

import torch
import triton

from . import config as cfg
from .precision import INTERPRET

USE_TRITON_OP = not INTERPRET and hasattr(torch.library, "triton_op")
if USE_TRITON_OP:
    from torch.library import wrap_triton
else:
    def wrap_triton(kernel):
        """Under the interpreter the kernels are launched as they are."""
        return kernel


def _is_interpreting() -> bool:
    """Were the kernels created interpreted (TRITON_INTERPRET=1 when triton.jit ran)?"""
    return bool(INTERPRET)


def _library_interpreting() -> bool:
    """Were triton's own library functions (``tl.sum`` & co., jitted when triton is imported)
    created interpreted? Not when TRITON_INTERPRET=1 was set only after ``import triton``."""
    import triton.language.standard as standard

    return "Interpreted" in type(standard.sum).__name__


def traced(kernel) -> bool:
    """Is ``kernel`` (from a ``wrap_triton`` switch) a traceable wrapper, i.e. is an operator being traced?"""
    return USE_TRITON_OP and not isinstance(kernel, (triton.runtime.JITFunction, triton.runtime.Autotuner))


def strides(*xs):
    """The strides of ``xs``, flattened, in order."""
    return [s for x in xs for s in x.stride()]


def launch(kernel, name: str, width: int, grid, args, **constexprs):
    """Launch ``kernel(tuned)`` (a layer's switch: the kernel through ``wrap_triton``, its
    autotuned twin when ``tuned``) in mode "autotune", else the kernel with ``cfg.heuristic(name,
    width)``; ``grid(tiles)`` maps the chosen constexprs to the launch grid.

    Traced, an accumulating GEMM (ACCUMULATE) takes the fixed configuration: torch re-wraps a
    traced autotuner without its ``restore_value``, so benchmarking the candidates outside
    Inductor (``backend="aot_eager"``) would add the product into the output once per candidate."""
    if cfg.launch_mode() == "autotune":
        tuned = kernel(True)
        if not (constexprs.get("ACCUMULATE") and traced(tuned)):
            tuned[lambda meta: grid(meta)](*args, **constexprs)
            return
    fixed = cfg.heuristic(name, width)
    tiles = {**constexprs, **fixed.constexprs}
    kernel(False)[grid(tiles)](*args, **tiles, num_warps=fixed.num_warps, num_stages=fixed.num_stages)
