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


# Test files that drive what only one sglang line's adapter verifies (python/kv_canary/adapter/lines): on another
# line they are not collected (their sglang imports may not even exist there), and the run's header says so.
ONLY_ON_LINE = {
    "0.5.12": {
        "why": "sglang 0.5.23's adapter refuses these at startup (docs/compatibility.md): speculative decoding, PD, "
               "SWA / MLA / hybrid-linear pools, contain, TP; or the test drives 0.5.12's own classes",
        "files": (
            "unit/test_mamba_radix_index.py", "unit/test_pools.py", "unit/test_speculative.py",
            "unit/test_speculative_draft.py", "unit/test_speculative_v1.py", "unit/test_speculative_v1_draft.py",
            "unit/test_swa_radix_index.py", "unit/test_perturb_and_radix.py", "unit/test_plugin.py", "unit/test_pd.py",
            "unit/test_speculative_eagle3.py",
            "registered/kv_canary/test_e2e_contain.py", "registered/kv_canary/test_e2e_hybrid_linear.py",
            "registered/kv_canary/test_e2e_mla_fp8.py", "registered/kv_canary/test_e2e_pd.py",
            "registered/kv_canary/test_e2e_speculative.py", "registered/kv_canary/test_e2e_speculative_eagle3.py",
            "registered/kv_canary/test_e2e_speculative_mtp.py", "registered/kv_canary/test_e2e_speculative_perturb.py",
            "registered/kv_canary/test_e2e_speculative_v1.py", "registered/kv_canary/test_e2e_swa.py",
            "registered/kv_canary/test_e2e_tp.py", "registered/kv_canary/test_refused_configs.py",
        ),
    },
    "0.5.23": {
        "why": "drives sglang 0.5.23's own code (the in-tree canary's call sites, its flags, UnifiedRadixCache)",
        "files": ("registered/kv_canary/test_e2e_newest_line.py",),
    },
}


def _installed_sglang():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _not_on_this_line():
    """{test file relative to test/: why it is not collected on the installed sglang line}."""
    line = _installed_sglang()
    return {f: f"only on sglang {only}: {spec['why']}" for only, spec in ONLY_ON_LINE.items() if only != line
            for f in spec["files"]}


def pytest_ignore_collect(collection_path, config):
    rel = Path(collection_path).resolve().relative_to(Path(__file__).resolve().parent).as_posix() \
        if Path(collection_path).resolve().is_relative_to(Path(__file__).resolve().parent) else None
    return True if rel in _not_on_this_line() else None


def pytest_report_header(config):
    skipped = _not_on_this_line()
    return [f"sglang {_installed_sglang()}: {len(skipped)} test file(s) not collected on this line"] + [
        f"  {f}: {why}" for f, why in sorted(skipped.items())]
