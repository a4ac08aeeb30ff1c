"""The package's layout: no import cycles, and the decoding package never imports a stage.

Every import statement of every module of src/dflashpipe counts, at any depth (function-level,
`if TYPE_CHECKING:`), relative or absolute: a cycle that only closes inside a function still
ties the two modules together for a reader, and breaks the day the import moves to the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dflashpipe"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE
STAGES = ("prompts", "regenerate", "extract", "train", "export", "evaluate", "report", "retrieve")


def module_name(path: Path, root: Path) -> str:
    """dflashpipe.decoding.engine for root/decoding/engine.py; a package is its __init__."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute names an import statement of `module` brings in: for `from x import y`,
    both x and x.y (y may be a submodule; names that are not modules drop out later)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, from every .py file under root."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        names = {
            name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for name in imported(node, module, is_package)
        }
        graph[module] = {n for n in names if n in files and n != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first, iterative)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        todo = [iter(sorted(graph[start]))]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                todo.pop()
                continue
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                todo.append(iter(sorted(graph[nxt])))
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(SRC))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_decoding_never_imports_a_stage():
    stages = {f"{PACKAGE}.{s}" for s in STAGES}
    graph = import_graph(SRC)
    decoding = [
        m for m in graph if m == f"{PACKAGE}.decoding" or m.startswith(f"{PACKAGE}.decoding.")
    ]
    assert decoding, f"no {PACKAGE}.decoding modules under {SRC}"
    bad = {m: sorted(graph[m] & stages) for m in decoding if graph[m] & stages}
    assert not bad, f"decoding modules import stage modules: {bad}"


# The three engines are schedulers over one layer set (decoding/layers.py): none runs another's
# code. The concurrent engine names the c = 1 Engine as a type only (its rows run that engine's
# models), under TYPE_CHECKING; the batched engine's token step is its own.
ENGINES = {"engine": set(), "concurrent": {"engine"}, "batched": {"batched_step"}}


def test_no_engine_imports_a_sibling_engine():
    graph = import_graph(SRC)
    siblings = {f"{PACKAGE}.decoding.{m}" for m in [*ENGINES, "batched_step", "ddtree"]}
    for name, allowed in ENGINES.items():
        module = f"{PACKAGE}.decoding.{name}"
        ok = {f"{PACKAGE}.decoding.{m}" for m in allowed}
        assert graph[module] & siblings <= ok, (module, sorted(graph[module] & siblings - ok))
    concurrent = (SRC / "decoding" / "concurrent.py").read_text()
    assert "if TYPE_CHECKING:" in concurrent.split("from dflashpipe.decoding.engine import")[0]


def test_the_checks_see_every_kind_of_import(tmp_path):
    """The graph and the cycle search on a package written here: relative and absolute imports,
    in functions and under TYPE_CHECKING, all count, and a cycle is found and named."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from . import c\n",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
        "d.py": "import pkg.sub.c\nimport os\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    graph = import_graph(root)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.sub", "pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.sub", "pkg.sub.c"},
        "pkg.sub.c": {"pkg.a"},
        "pkg.d": {"pkg.sub.c"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (root / "sub" / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(root)) is None


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_module_exists(stage):
    """The stage list the decoding check uses names real modules (a rename would blind it)."""
    assert (SRC / f"{stage}.py").is_file()
