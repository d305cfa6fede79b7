"""``torch.library.triton_op`` finds exactly the kernels each Triton operator launches.

torch reads an operator's source and follows the functions it calls by name down to
``wrap_triton(<kernel>)`` (``torch._library.triton.get_inner_triton_kernels``), and hashes
those kernels into its compile-cache keys: a kernel it misses is a stale cache entry after an
edit, one too many a needless recompile. Each kernel has one named launcher beside it
(``backends/triton/launch.py``), so every operator must find its own kernels and no other.
Compiled kernels are needed (the interpreter's are not ``JITFunction``s): the check runs in a
fresh process without TRITON_INTERPRET; it inspects source only and launches nothing.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_PROBE = r"""
import json
from torch._library.triton import get_inner_triton_kernels
from hnclip_kernels.backends.triton import directional, rank, symmetric

def name(k):
    while not hasattr(k, "__name__") or type(k).__name__ != "JITFunction":
        if not hasattr(k, "fn"):
            break
        k = k.fn
    return getattr(k, "__name__", repr(k))

bodies = ("_symmetric_nll", "_symmetric_nll_backward", "_directional_nll", "_directional_nll_backward",
          "_rank_nll", "_rank_nll_backward")
mod = lambda b: {"_symmetric": symmetric, "_directional": directional, "_rank": rank}[b[: b.index("_nll")]]
print(json.dumps({b: sorted({name(k) for k in get_inner_triton_kernels(getattr(mod(b), b))}) for b in bodies}))
"""

EXPECTED = {
    # the family's negatives add the directional kernels' walk over their block
    "_symmetric_nll": ["_fold_kernel", "_fwd_kernel", "_fwd_pair_kernel", "_merge_kernel"],
    "_symmetric_nll_backward": ["_dscore_kernel", "_dscore_pair_kernel", "_round16_kernel"],
    "_directional_nll": ["_fwd_kernel", "_merge_kernel"],
    "_directional_nll_backward": ["_dscore_kernel", "_round16_kernel"],
    "_rank_nll": ["_fwd_rank_kernel", "_merge_kernel"],
    "_rank_nll_backward": ["_dscore_rank_kernel", "_round16_kernel"],
}


def test_each_operator_finds_exactly_its_kernels():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == EXPECTED
