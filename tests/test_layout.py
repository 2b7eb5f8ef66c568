"""The package's layout: no import cycle among cvl modules, no module over 600 lines.

Both are read from the source (ast), not by importing: a cycle hidden in a function-level
import (one that only exists to dodge the cycle at import time) counts as a cycle too, and so
does an import under ``if TYPE_CHECKING:`` - the dependency is real either way.
"""

from __future__ import annotations

import ast
from pathlib import Path

CVL = Path(__file__).resolve().parents[1] / "cvl"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(CVL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(CVL.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The cvl module that ``name`` names, or its nearest enclosing cvl module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every cvl module that ``module`` imports, at module level or inside a function."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package that holds this module
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from cvl.a import b` imports the module cvl.a.b when there is one, else cvl.a
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == "cvl" or target.startswith("cvl."):
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    found.add(resolved)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle inside a strongly connected component: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first from start until an edge comes back to it
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    nxt.append(succ)
        frontier = nxt
    return component  # unreachable for a strongly connected component


def test_finds_a_cycle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_reads_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "cvl" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from cvl.pkg.a import f\n")
    modules = {"cvl.pkg": pkg / "__init__.py", "cvl.pkg.a": pkg / "a.py", "cvl.pkg.b": pkg / "b.py"}
    assert _imports("cvl.pkg.a", pkg / "a.py", modules) == {"cvl.pkg.b"}
    assert _imports("cvl.pkg.b", pkg / "b.py", modules) == {"cvl.pkg.a"}


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    cycles = []
    for component in find_cycles(graph):
        cycle = _a_cycle(graph, component)
        line = " -> ".join(cycle)
        if len(component) > len(cycle) - 1:  # more modules are caught in it than this cycle
            line += f"  (all of: {', '.join(component)})"
        cycles.append(line)
    assert not cycles, "import cycles among cvl modules:\n  " + "\n  ".join(cycles)


def test_modules_under_600_lines():
    long = []
    for path in sorted(CVL.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long.append(f"{path.relative_to(CVL.parent)}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them by what they do):\n  " + (
        "\n  ".join(long)
    )
