"""The house rules that keep the package small: module size and the import contracts.

The contracts live in pyproject.toml ([tool.importlinter]); .ci/run and pre-commit run
``lint-imports`` too, this test holds them for anyone running only pytest.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 400


def test_no_module_over_the_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "hnclip_kernels").rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by role): {over}"


def test_import_contracts():
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    out = subprocess.run(
        [str(lint)], cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": str(lint.parent)}
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
