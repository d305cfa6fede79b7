"""The docs site builds: ``mkdocs build --strict`` (every page in the nav, no broken link
between pages, the API reference rendered from the docstrings). About 15 s."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_every_docs_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load(open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8"))["nav"]

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    listed = set(pages(nav))
    on_disk = {name for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")}
    assert on_disk == listed, (
        f"docs pages missing from mkdocs.yml's nav: {on_disk - listed}; listed but absent: {listed - on_disk}"
    )
