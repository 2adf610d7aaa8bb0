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


def kernel_bench(name):
    """A kernel benchmark as a module, with ``benchmarks/`` on ``sys.path`` (it imports its helpers by name)."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return sys.modules.get(name) or _load(name)


def on_cpu_kernels(step: str):
    """Skip unless the Triton interpreter was on from the start: a benchmark's CPU smoke runs its kernels on CPU
    tensors, and Triton picks the interpreter when the kernels' modules are imported (a GPU host runs the
    benchmark itself: ``gpu_host.sh STEP``)."""
    import os

    import pytest

    return pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                              reason=f"the CPU smoke needs TRITON_INTERPRET=1 from the start (a GPU host runs the "
                                     f"bench itself: gpu_host.sh {step})")
