"""The tree's shape, checked from its imports (issue: a house that shows its design).

- No import cycles among `flare` modules: every import counts, at module level, inside a
  function or under `TYPE_CHECKING`, since each is an arrow a reader has to follow.
- The runtime package is the boundary between the two halves: the serving side
  (`flare.runtime`, `flare.state`, `flare.server`, `flare.package`) never imports
  `flare.prepare`, which writes packages and measures.

The graph is read with `ast` from the source files, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flare

ROOT = Path(flare.__file__).parent
SERVING_SIDE = ("flare.runtime", "flare.state", "flare.server", "flare.package")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the `flare` modules it imports (a `from a import b` names `a.b` when that
    is a module, else `a`)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_is_read():
    """The walk sees real arrows (so the checks below can fail)."""
    graph = import_graph()
    assert "flare.package.reader" in graph["flare.runtime.boot"]
    assert "flare.state.layout" in graph["flare.state.pools"]


def test_cycle_detector_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_serving_side_never_imports_prepare():
    graph = import_graph()
    bad = sorted((m, t) for m, targets in graph.items() if m.startswith(SERVING_SIDE)
                 for t in targets if t == "flare.prepare" or t.startswith("flare.prepare."))
    assert not bad, f"serving-side modules importing flare.prepare: {bad}"
