"""Test and demo infrastructure for kv-canary: a real sglang server (0.5.12 or 0.5.23) on CPU.

Modules:
  tiny_model    external sglang model package (``KvcTinyForCausalLM``)
  model_dir     writes a model folder (config + tokenizer) for the tiny model
  libcuda_stub  builds a stand-in ``libcuda.so.1`` so ``sgl_kernel`` imports on CPU
  server        ``SglangServer``: launches ``python -m sglang.launch_server`` (on CPU through ``fast_launch``)
  fast_launch   sglang's entry with its children forked from the launcher (CPU test servers)
  launcher_zygote  one pre-imported process per environment that CPU test servers' launchers are forked from
  workload      ``run_mixed_workload``: concurrent /generate traffic
"""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Return the cache folder for generated files ($KVC_CACHE_DIR or ~/.cache/kv-canary-testing)."""
    root = os.environ.get("KVC_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kv-canary-testing"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
