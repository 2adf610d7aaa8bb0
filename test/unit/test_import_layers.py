"""python/kv_canary's import graph has no circle, and its layers point one way (issue 59).

Edges: every ``import`` / ``from ... import`` statement anywhere in a module -- module level, inside functions and
under ``if TYPE_CHECKING:`` alike (a type-only import still ties the two files together); relative imports are
resolved; ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``. Lookups by
dotted string (``importlib.import_module``: the line registry, the hook tables) are not edges.

Layers, low to high: core (every module not named below) < runner (``runner/``, ``draft_pool``) < adapter
(``adapter/``, ``sglang_plugin``, ``_autoload``) < entry points (``api``, ``ops/``). A module imports its own
layer or a lower one.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2] / "python"
PACKAGE = "kv_canary"
LAYERS = (  # (layer, its modules: a name covers the module and everything under it); core is the rest
    ("runner", ("kv_canary.runner", "kv_canary.draft_pool")),
    ("adapter", ("kv_canary.adapter", "kv_canary.sglang_plugin", "kv_canary._autoload")),
    ("entry point", ("kv_canary.api", "kv_canary.ops")),
)
ORDER = ("core",) + tuple(name for name, _ in LAYERS)

Edges = Dict[str, Dict[str, int]]  # module -> {imported module: line of its first import}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> Edges:
    """Every module of the package -> the package's modules it imports (see the module docstring)."""
    modules = _modules()
    graph: Edges = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: List[Tuple[str, int]] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, node.lineno)
                          for a in node.names]
        edges: Dict[str, int] = {}
        for target, line in sorted(found, key=lambda f: f[1]):
            if target in modules and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def layer_of(module: str) -> str:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return "core"


def _shortest_cycle(graph: Edges, start: str) -> List[str]:
    """The shortest import path from ``start`` back to itself ([] if none)."""
    came: Dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return path[::-1] + [start]
            if nxt not in came:
                came[nxt] = node
                queue.append(nxt)
    return []


def _describe(graph: Edges, path: List[str]) -> str:
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def test_the_graph_is_read():
    graph = import_graph()
    assert len(graph) > 50
    assert "kv_canary.runner.brackets" in graph["kv_canary.runner.manager"]  # a module-level relative import
    assert "kv_canary.adapter.lines" in graph["kv_canary.sglang_plugin"]  # one inside a function


def test_no_import_cycles():
    graph = import_graph()
    seen: Set[frozenset] = set()
    cycles = []
    for module in sorted(graph):
        path = _shortest_cycle(graph, module)
        if path and frozenset(path) not in seen:
            seen.add(frozenset(path))
            cycles.append(_describe(graph, path))
    assert not cycles, "import cycles (module:line of the import):\n  " + "\n  ".join(cycles)


def test_layers_point_one_way():
    graph = import_graph()
    upward = [f"{a}:{line} -> {b} ({layer_of(a)} imports {layer_of(b)})"
              for a, edges in sorted(graph.items()) for b, line in edges.items()
              if ORDER.index(layer_of(b)) > ORDER.index(layer_of(a))]
    assert not upward, f"imports against the layers {' < '.join(ORDER)}:\n  " + "\n  ".join(upward)
