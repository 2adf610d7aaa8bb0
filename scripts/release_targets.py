"""Write python/kv_canary/adapter/lines/release_targets.json: every line's hook targets, read from each release's wheel.

For each sglang release (0.5.12 .. 0.5.23, post releases included) the wheel is downloaded without installing it
(``pip download sglang==X --no-deps -d WHEELS/X``; reused when already there) and read statically: for every hook
target of every line (``adapter/lines``), the module's AST gives the class and the function (following imports
and base classes the way ``inspect.getattr_static`` does at runtime) and its parameters, written in the fence's
form (``adapter/lines/fence.format_params``). Also recorded: whether the release ships sglang's in-tree kv_canary.
The fence's unit test (``test/unit/test_release_fence.py``) reads the table with no sglang installed.

    python scripts/release_targets.py [--wheels /tmp/sgl-wheels] [--out python/kv_canary/adapter/lines/...json]
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import zipfile
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from kv_canary.adapter.lines import LINE_MODULES, load_line  # noqa: E402
from kv_canary.adapter.lines.fence import GENERATED, MISSING, TARGETS_FILE, format_params  # noqa: E402

RELEASES = ("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16",
            "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
DATACLASS_METHODS = ("__init__", "__repr__", "__eq__")


def fetch_wheel(version: str, wheels: str) -> Optional[str]:
    found = glob.glob(os.path.join(wheels, version, "sglang-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "-q", "-d",
                        os.path.join(wheels, version)], check=False)
        found = glob.glob(os.path.join(wheels, version, "sglang-*.whl"))
    return found[0] if found else None


class Wheel:
    """The wheel's Python sources, parsed on demand."""

    def __init__(self, path: str):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: Dict[str, Optional[ast.Module]] = {}

    def module(self, name: str) -> Optional[ast.Module]:
        if name not in self._trees:
            base = name.replace(".", "/")
            tree = None
            for path in (base + ".py", base + "/__init__.py"):
                if path in self.names:
                    tree = ast.parse(self.zip.read(path))
                    break
            self._trees[name] = tree
        return self._trees[name]

    def is_package(self, name: str) -> bool:
        return name.replace(".", "/") + "/__init__.py" in self.names


def _body(nodes):
    """Statements of a module or class body, with those under ``if``/``try`` (conditional definitions)."""
    for node in nodes:
        yield node
        if isinstance(node, ast.If):
            yield from _body(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _body(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _imported(wheel: Wheel, module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if wheel.is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def find(wheel: Wheel, module: str, name: str, depth: int = 0):
    """``(module, node)`` that ``module.name`` resolves to (a def or a class), following ``from x import name``."""
    tree = wheel.module(module)
    if tree is None or depth > 8:
        return None
    found = None
    for node in _body(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = (module, node)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    found = find(wheel, _imported(wheel, module, node), alias.name, depth + 1) or found
        elif (isinstance(node, ast.Assign) and found is None
              and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            found = (module, node)  # a rebinding of a def or class (0.5.23: ServerArgs = msgspec.defstruct(...,
            # namespace of the class)) keeps the def's signature
    return found


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
                isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def method(wheel: Wheel, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
    """The def of ``cls.name``, or one of its bases' (in method resolution order, depth-first as single bases go)."""
    for node in _body(cls.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    if name in DATACLASS_METHODS and _is_dataclass(cls):
        return GENERATED
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 8:
            hit = find(wheel, module, base.id)
            if hit and isinstance(hit[1], ast.ClassDef):
                found = method(wheel, hit[0], hit[1], name, depth + 1)
                if found is not None:
                    return found
    return None


def params_of(fn) -> str:
    a = fn.args
    positional = [(x.arg, "POSITIONAL_ONLY") for x in a.posonlyargs] + [(x.arg, "POSITIONAL_OR_KEYWORD")
                                                                         for x in a.args]
    first_default = len(positional) - len(a.defaults)
    params = [(n, k, i >= first_default) for i, (n, k) in enumerate(positional)]
    if a.vararg:
        params.append((a.vararg.arg, "VAR_POSITIONAL", False))
    params += [(x.arg, "KEYWORD_ONLY", d is not None) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, "VAR_KEYWORD", False))
    return format_params(params)


def signature(wheel: Wheel, target: str) -> Optional[str]:
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if wheel.module(module) is None:
            continue
        hit = find(wheel, module, parts[cut])
        if hit is None:
            return MISSING
        where, node = hit
        for name in parts[cut + 1:]:
            if not isinstance(node, ast.ClassDef):
                return MISSING
            node = method(wheel, where, node, name)
            if node is None:
                return MISSING
        if node == GENERATED:
            return GENERATED
        return params_of(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else MISSING
    return MISSING


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default="/tmp/sgl-wheels")
    parser.add_argument("--out", default=TARGETS_FILE)
    args = parser.parse_args()
    targets = sorted({t for m in LINE_MODULES.values() for t in load_line(m).all_hooks()})
    releases: Dict[str, dict] = {}
    table: Dict[str, List[list]] = {t: [] for t in targets}
    for version in RELEASES:
        path = fetch_wheel(version, args.wheels)
        if path is None:
            releases[version] = {"wheel": None, "note": "pip download failed"}
            continue
        wheel = Wheel(path)
        releases[version] = {"wheel": os.path.basename(path),
                             "in_tree_canary": wheel.module("sglang.srt.kv_canary") is not None}
        for target in targets:
            sig = signature(wheel, target)
            row = next((r for r in table[target] if r[0] == sig), None)
            if row is None:
                table[target].append([sig, [version]])
            else:
                row[1].append(version)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write('{\n "about": "written by scripts/release_targets.py from each release\'s wheel (static AST); '
                'targets: [signature or null (missing), [releases]]",\n "releases": {\n')
        f.write(",\n".join(f"  {json.dumps(v)}: {json.dumps(r)}" for v, r in releases.items()))
        f.write('\n },\n "targets": {\n')
        f.write(",\n".join(f"  {json.dumps(t)}: {json.dumps(rows)}" for t, rows in table.items()))
        f.write("\n }\n}\n")
    print(f"wrote {args.out}: {len(targets)} targets x {len(releases)} releases")


if __name__ == "__main__":
    main()
