"""The code's shape, checked: no import cycle between transom's subpackages, no file over 500 lines,
no two modules with one name, and the bottom layer (transom.common) imports nothing else of
transom."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "transom"
MAX_LINES = 500


def _unit(module: str) -> str:
    """transom.control.agent -> control; transom.cli -> cli (a top-level module is its own unit)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        source = _unit(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("transom.") and _unit(name) != source:
                    edges.setdefault(source, set()).add(_unit(name))
    return edges


def test_no_import_cycle_between_subpackages():
    edges = _imports()
    state: dict[str, str] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = "open"
        for nxt in sorted(edges.get(unit, ())):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join([*path, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[unit] = "done"

    for unit in sorted(edges):
        if unit not in state:
            visit(unit, [unit])


def test_the_bottom_layer_imports_nothing_else_of_transom():
    assert _imports().get("common", set()) == set()


def test_no_file_is_longer_than_500_lines():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_two_modules_share_a_name():
    """Each module's name says its job where it stands: no two modules of transom/ and
    benchmarks/ have one file name (but a package's __init__.py and __main__.py)."""
    by_name: dict[str, list[str]] = {}
    for top in (ROOT, ROOT.parent / "benchmarks"):
        for p in top.rglob("*.py"):
            if p.name not in ("__init__.py", "__main__.py"):
                by_name.setdefault(p.name, []).append(str(p.relative_to(ROOT.parent)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
