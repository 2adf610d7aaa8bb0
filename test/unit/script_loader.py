"""The repository's scripts as modules, for the unit tests of the benchmarks and their tools (scripts/ is not a
package): ``_load("bench_overhead")`` imports ``benchmarks/bench_overhead.py`` (and registers it in ``sys.modules``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
