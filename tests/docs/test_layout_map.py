"""docs/layout.md, the module map, stays true: it names every module and C++ source, and
everything it cites exists.

How the page is read (the rules its text follows):

* It is cut into blocks: a paragraph, or one bullet with its continuation lines.
* A citation is a code span. A path (it has a ``/`` or a file suffix) is relative to a
  directory the same block cited before it, else to the section's directory (the last
  directory a paragraph ending in ``:`` cites: "The package, ``hnclip_kernels/``:"), else to
  the repository root; the first of these where it exists is what it names. ``python -m X`` names
  module X, ``bash P`` the file P.
* A dotted name (``hnclip_kernels.workspace_bytes``, ``launch.interpreting()``,
  ``torch.mm``) is absolute, or relative to the package of a module the block cites (or to
  ``hnclip_kernels``); its module must be found by ``importlib.util.find_spec`` and the rest
  by ``getattr``. ``tl`` is ``triton.language``.
* A bare Python name (``hn_clip_loss``, ``bind``, ``_fwd_pair_kernel``) in a block that cites a
  module of the package must be defined in one of the modules the block cites (at their top
  level or in a class there), read from their source.
* An operator (``hnclip::triton_rank_nll``) must be registered once the backends' operator
  modules are imported (skipped for a backend that cannot load here: no triton, no built C++).

Every ``.py`` under ``hnclip_kernels/`` (an ``__init__.py`` counted as its package, so the
package's directory or dotted name cites it too) and every file under ``csrc/`` must be what
some path or dotted module name of the page resolves to: a name inside a longer word, or a
path that resolves elsewhere (``tests/backends/``), does not count.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "layout.md"
PACKAGE = "hnclip_kernels"
ALIASES = {"tl": "triton.language"}
OPTIONAL = {"triton", "transformers"}  # a citation into these is skipped where they are not installed
ROOTS = {PACKAGE, "torch", "triton"}  # what an absolute dotted name may start with (nothing else is imported)

PATH = re.compile(r"^[\w.\-/]+$")
NAME = re.compile(r"^[A-Za-z_]\w*(?:\(\))?$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?$")
OPERATOR = re.compile(r"^hnclip::(\w+)$")
SUFFIX = re.compile(r"\.(py|h|cpp|toml|md|sh|txt|cfg|yml|yaml)$")


def blocks(text: str):
    """The page's paragraphs and bullets, each a string."""
    out, cur = [], []
    for line in text.splitlines():
        starts = line.startswith("- ") or line.startswith("#")
        if not line.strip() or starts:
            if cur:
                out.append("\n".join(cur))
            cur = [line] if line.strip() else []
        else:
            cur.append(line)
    if cur:
        out.append("\n".join(cur))
    return out


def spans(block: str):
    return re.findall(r"`([^`\n]+)`", block)


def is_path(span: str) -> bool:
    return bool(PATH.match(span)) and ("/" in span or bool(SUFFIX.search(span)))


def module_of(path: pathlib.Path):
    """The dotted module a file or directory of the package is, or None outside it."""
    try:
        rel = path.relative_to(ROOT)
    except ValueError:
        return None
    if not rel.parts or rel.parts[0] != PACKAGE:
        return None
    if path.is_dir():
        return ".".join(rel.parts) if (path / "__init__.py").exists() else None
    if path.suffix != ".py":
        return None
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(module: str):
    """The file of a module of this checkout (``a.b``: a/b.py or a/b/__init__.py), or None."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


def find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent is missing
        return None


@functools.lru_cache(maxsize=None)
def defined_names(path: pathlib.Path) -> frozenset:
    """Names a module's source defines at its top level or in its classes' bodies."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()

    def collect(body, into):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                into.add(node.name)
                if isinstance(node, ast.ClassDef):
                    collect(node.body, into)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    into.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                into.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                collect(node.body, into)
                collect(getattr(node, "orelse", []), into)
                for handler in getattr(node, "handlers", []):
                    collect(handler.body, into)

    collect(tree.body, names)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def operators_loaded() -> bool:
    """Import the modules that register the ``hnclip::`` operators; whether all of them loaded."""
    loaded = True
    # the sigmoid operators register when their backend's sigmoid entry is first imported
    for module in (
        f"{PACKAGE}.backends.cpp.ops",
        f"{PACKAGE}.backends.cpp.sigmoid_pairs",
        f"{PACKAGE}.backends.triton.ops",
        f"{PACKAGE}.backends.triton.sigmoid_pairs",
    ):
        try:
            importlib.import_module(module)
        except ImportError:  # triton not installed, or the C++ extension not built
            loaded = False
    return loaded


def operator_exists(name: str):
    """True/False, or None where a backend's operators could not be loaded to tell."""
    import torch

    loaded = operators_loaded()
    return True if hasattr(torch.ops.hnclip, name) else (False if loaded else None)


def resolve_dotted(name: str, packages):
    """(True, None) when ``name`` resolves; (None, why) when it needs a package that is not
    installed; (False, why) otherwise."""
    name = name.removesuffix("()")
    first, _, rest = name.partition(".")
    if first in ALIASES:
        name = f"{ALIASES[first]}.{rest}"
    candidates = [f"{p}.{name}" for p in packages] + [f"{PACKAGE}.{name}"]
    candidates += [name] if name.split(".")[0] in ROOTS else []
    whys = []
    for full in candidates:
        parts = full.split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
            module = ".".join(parts[:i])
            if find_spec(module) is None:
                continue
            try:
                obj = importlib.import_module(module)
            except ImportError as exc:
                if (exc.name or "").split(".")[0] in OPTIONAL:
                    return None, f"{exc.name} is not installed"
                raise
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError as exc:
                whys.append(f"{full}: {exc}")
                break
            return True, None
    return False, "; ".join(whys) or f"no module found for it (tried {', '.join(candidates)})"


def read_page(page: pathlib.Path = PAGE):
    """(cited files and directories, problems) of the module map ``page``."""
    cited, problems = set(), []
    base = ROOT
    for block in blocks(page.read_text(encoding="utf-8")):
        dirs, modules, names = [], [], []
        for span in spans(block):
            command = re.match(r"^(?:python -m (\S+)|bash (\S+))$", span)
            if command and command.group(1):
                module = command.group(1)
                path = module_file(module)
                if path is None:
                    problems.append(f"`{span}`: no module {module} in this checkout")
                else:
                    cited.add(path)
                continue
            if command:
                span = command.group(2)
            if is_path(span):
                for where in [*reversed(dirs), base, ROOT]:
                    path = (where / span).resolve()
                    if path.exists():
                        break
                else:
                    problems.append(f"`{span}`: no such file or directory (relative to {base.relative_to(ROOT)}/)")
                    continue
                cited.add(path)
                if path.is_dir():
                    dirs.append(path)
                if module_of(path):
                    modules.append(module_of(path))
            elif OPERATOR.match(span):
                if operator_exists(OPERATOR.match(span).group(1)) is False:
                    problems.append(f"`{span}`: no operator of that name is registered")
            elif DOTTED.match(span):
                names.append(("dotted", span))
            elif NAME.match(span):
                names.append(("name", span))
        for kind, span in names:
            if kind == "dotted":
                full = span.removesuffix("()")
                if full.split(".")[0] == PACKAGE and module_file(full) is not None:
                    cited.add(module_file(full))  # a module cited by its dotted name
                packages = [m if (ROOT / m.replace(".", "/")).is_dir() else m.rpartition(".")[0] for m in modules]
                ok, why = resolve_dotted(span, packages)
                if ok is False:
                    problems.append(f"`{span}`: {why}")
            elif modules:
                files = {module_file(m) for m in modules}
                if not any(span.removesuffix("()") in defined_names(f) for f in files if f):
                    problems.append(
                        f"`{span}`: not defined in {', '.join(sorted(modules))}, the modules its block cites"
                    )
        if not block.startswith("- ") and block.rstrip().endswith(":"):  # a section's heading line
            base = dirs[-1] if dirs else ROOT
    return cited, problems


def expected():
    files = sorted((ROOT / PACKAGE).rglob("*.py")) + sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    return [p.resolve() for p in files if "__pycache__" not in p.parts]


def test_every_module_and_cpp_source_is_on_the_map():
    cited, _ = read_page()
    missing = [
        str(p.relative_to(ROOT))
        for p in expected()
        if p not in cited and not (p.name == "__init__.py" and p.parent in cited)
    ]
    assert not missing, f"docs/layout.md does not name these (add a line for each): {missing}"


def test_everything_the_map_cites_exists():
    _, problems = read_page()
    assert not problems, "docs/layout.md cites what does not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "text, fails",
    [
        ("The package, `hnclip_kernels/`:\n\n- `chunk.py`: no such module.", "no such file"),
        ("The package, `hnclip_kernels/`:\n\n- `loss.py`: `hn_clip_losses`.", "not defined"),
        ("- `hnclip_kernels.loss.hn_clip_losses`.", "hn_clip_losses"),
        ("- `hnclip::cpp_no_such_nll`.", "no operator"),
    ],
)
def test_the_reader_catches_a_wrong_citation(tmp_path, text, fails):
    if fails == "no operator" and not operators_loaded():
        pytest.skip("the C++ extension or triton does not load here: an unknown operator cannot be told")
    page = tmp_path / "layout.md"
    page.write_text(text, encoding="utf-8")
    _, problems = read_page(page)
    assert any(fails in p for p in problems), problems


def test_a_name_inside_a_word_does_not_count(tmp_path):
    page = tmp_path / "layout.md"
    page.write_text(
        "The package, `hnclip_kernels/`:\n\n- `loss.py`: `hn_clip_loss`, unlike reports.py or `reports_py`.\n"
        "- `tests/`: `backends/`, `distributed/`.\n",
        encoding="utf-8",
    )
    cited, _ = read_page(page)
    assert (ROOT / PACKAGE / "loss.py").resolve() in cited
    assert (ROOT / PACKAGE / "reports.py").resolve() not in cited
    assert (ROOT / "tests" / "backends").resolve() in cited  # relative to tests/, cited before it
    assert (ROOT / PACKAGE / "backends").resolve() not in cited
    assert (ROOT / PACKAGE / "distributed").resolve() not in cited
