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


def _layer_modules(layer: str) -> set[str]:
    """The module names of one layer entry ("a | b", "a : b"), without import-linter's optional parentheses."""
    return {part.strip().strip("()") for part in layer.replace(":", "|").split("|") if part.strip()}


def _uncovered_modules(contracts: list[dict], modules: list[str]) -> list[str]:
    """The modules that no `layers` contract places in a layer.

    A module inside a contract's container must be named (itself, or the child of the container it
    sits in) in that contract's layers, since the container contract is the one that orders it; a
    module in no container must be named, or have an ancestor named, in a container-less contract.
    """
    layered = [c for c in contracts if c.get("type") == "layers"]
    uncovered = []
    for module in modules:
        inside = [
            (c, container)
            for c in layered
            for container in c.get("containers", [])
            if module.startswith(container + ".")
        ]
        if inside:
            covered = any(
                module[len(container) + 1 :].split(".")[0] in set().union(*map(_layer_modules, c["layers"]))
                for c, container in inside
            )
        else:
            names = set().union(
                *(_layer_modules(layer) for c in layered if not c.get("containers") for layer in c["layers"])
            )
            parts = module.split(".")
            covered = any(".".join(parts[:k]) in names for k in range(2, len(parts) + 1))
        if not covered:
            uncovered.append(module)
    return uncovered


def test_every_module_is_in_a_layer():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; CI runs 3.11
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    package = ROOT / "hnclip_kernels"
    modules = sorted(
        ".".join(
            p.relative_to(ROOT).with_suffix("").parts[:-1]
            if p.name == "__init__.py"
            else p.relative_to(ROOT).with_suffix("").parts
        )
        for p in package.rglob("*.py")
    )
    modules = [m for m in modules if m != "hnclip_kernels"]  # the root package is the API, above every layer
    assert len(modules) > 40
    uncovered = _uncovered_modules(contracts, modules)
    assert not uncovered, (
        f"modules in no import-linter layer (add each to [tool.importlinter] in pyproject.toml): {uncovered}"
    )


def test_layer_coverage_rule():
    contracts = [
        {"type": "layers", "layers": ["p.api", "p.core | p.sub"]},
        {"type": "layers", "containers": ["p.sub"], "layers": ["ops", "kernels"]},
    ]
    modules = ["p.api", "p.core", "p.core.inner", "p.sub.ops", "p.sub.kernels", "p.sub.stray", "p.loose"]
    assert _uncovered_modules(contracts, modules) == ["p.sub.stray", "p.loose"]
