"""Test-session setup, loaded before any other conftest or test module.

* Make the in-repo packages (kv_canary, kv_canary_testing) importable without installing.
* Without a CUDA GPU, Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be
  set before anything imports triton (sglang modules imported by other conftests do), since
  triton reads it when kernels are decorated.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_PYTHON_DIR = str(Path(__file__).resolve().parent.parent / "python")
if _PYTHON_DIR not in sys.path:
    sys.path.insert(0, _PYTHON_DIR)


def pytest_ignore_collect(collection_path, config):
    from kv_canary_testing.line_suites import not_on_this_line

    here = Path(__file__).resolve().parent
    path = Path(collection_path).resolve()
    return True if path.is_relative_to(here) and path.relative_to(here).as_posix() in not_on_this_line() else None


def pytest_report_header(config):
    from kv_canary_testing.line_suites import installed_sglang, not_on_this_line

    skipped = not_on_this_line()
    return [f"sglang {installed_sglang()}: {len(skipped)} test file(s) not collected on this line"] + [
        f"  {f}: {why}" for f, why in sorted(skipped.items())]
