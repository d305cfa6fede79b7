"""examples/long_clip_loss.py as a user runs it: 2 gloo processes on CPU, ranks of 6 and 4 pairs.

Bound: one run of 2 steps, two spawned interpreters importing torch and open_clip, about 20 s
on 2 loaded cores (killed after 240 s). γ = 0, so Long-CLIP's own formula is comparable.
"""

import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("open_clip")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_process_long_clip_loss_equals_the_global_batch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "examples/long_clip_loss.py", "--gamma", "0", "--steps", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "2 ranks, local pairs [6, 4]" in out
    # the mean of the two ranks' losses is one process's loss on the 10 gathered pairs, both pairs
    check = re.search(r"check: .* global batch of 10 pairs .* max relative difference (\S+) \(ok\)", out)
    assert check and float(check.group(1)) <= 1e-5, out
    # Long-CLIP's targets rank * bs + arange(bs) put rank 1's positives at the wrong columns
    theirs = re.search(r"long-clip: .* relative difference (\S+)", out)
    assert theirs and float(theirs.group(1)) > 1e-2, out
    steps = [tuple(map(float, m)) for m in re.findall(r"step \d+: long (\S+)\s+short (\S+)\s+total (\S+)", out)]
    assert len(steps) == 2 and all(math.isfinite(v) for row in steps for v in row)
    assert all(abs(long + short - total) <= 1e-4 for long, short, total in steps)
