"""Every server setting the canary cannot verify is refused at startup, through sglang's real entry.

Each case runs ``python -m sglang.launch_server`` (module code as ``__main__``, real
argv) in a child forked from one process that imported sglang once
(``kv_canary_testing.entry_fork``): load_plugins, argument parsing and the canary's
hooks run in the child exactly as in a fresh process, in about a second instead of
15. Two cases also run fully fresh processes (``python -m sglang.launch_server`` and
``sglang serve``) to show the forked runs behave the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_canary_testing.canary_e2e import register_cpu_ci
from kv_canary_testing.entry_fork import EntryForker
from kv_canary_testing.model_dir import write_model_dir
from kv_canary_testing.server import DEVICE_ARGS, SglangServer

register_cpu_ci(est_time=180, suite="kv-canary-cpu")

MODEL = str(write_model_dir())
REFUSED = "CanaryConfigError"

_EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", MODEL, "--speculative-num-steps", "2",
          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]

# (case id, extra server args, text the refusal must contain)
CASES = [
    # EAGLE/EAGLE3 with any topk, spec v1 and v2, are verified (test_e2e_speculative*); these variants are not
    ("speculative-adaptive", [*_EAGLE, "--speculative-adaptive"],
     "cannot verify --speculative-algorithm EAGLE with --speculative-adaptive"),
    ("speculative-multi-layer-eagle", [*_EAGLE, "--enable-multi-layer-eagle"],
     "cannot verify --speculative-algorithm EAGLE with --enable-multi-layer-eagle"),
    ("speculative-dflash", ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", MODEL],
     "cannot verify --speculative-algorithm DFLASH"),
    ("speculative-standalone", ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", MODEL],
     "cannot verify --speculative-algorithm STANDALONE"),
    ("speculative-ngram", ["--speculative-algorithm", "NGRAM"], "cannot verify --speculative-algorithm NGRAM"),
    # HiCache is verified (CPU shim, GPU) with pages 1 and 16, layer_first or page_first, no storage or file storage
    # (test_e2e_hicache, test_e2e_hicache_storage); not these
    ("hicache-storage-mooncake", ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"],
     "cannot verify --enable-hierarchical-cache with --hicache-storage-backend mooncake"),
    ("hicache-storage-alone", ["--hicache-storage-backend", "file"], "cannot verify --hicache-storage-backend file"),
    ("hicache-page-64", ["--enable-hierarchical-cache", "--page-size", "64"],
     "cannot verify --enable-hierarchical-cache with --page-size 64"),
    ("hicache-page-first-direct", ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct"],
     "cannot verify --enable-hierarchical-cache with --hicache-mem-layout page_first_direct"),
    ("hicache-sweep", ["--enable-hierarchical-cache", "--kv-canary-sweep-interval", "8"],
     "cannot verify --enable-hierarchical-cache with --kv-canary-sweep-interval 8"),
    ("lmcache", ["--enable-lmcache"], "cannot verify --enable-lmcache"),
    ("dp-attention", ["--enable-dp-attention", "--tp-size", "2", "--dp-size", "2"], "cannot verify --"),
    # --dp-size 2 is verified (test_e2e_dp); DP with PD is not
    ("dp2-pd", ["--dp-size", "2", "--disaggregation-mode", "decode"], "--dp-size 1 only, not 2"),
    ("torch-compile", ["--enable-torch-compile"], "cannot verify --enable-torch-compile"),
    ("enforce-piecewise", ["--enforce-piecewise-cuda-graph"], "cannot verify --enforce-piecewise-cuda-graph"),
    ("disagg-nixl", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"],
     "--disaggregation-transfer-backend mooncake only, not nixl"),
    ("disagg-real-data-all", ["--disaggregation-mode", "prefill", "--kv-canary-real-data", "all"],
     "--kv-canary-real-data partial only, not all"),
    ("tp2-pd", ["--tp-size", "2", "--disaggregation-mode", "decode"], "--tp-size 1 only, not 2"),
    ("pp2", ["--pp-size", "2"], "cannot verify --pp-size 2"),
    ("kv-fp4", ["--kv-cache-dtype", "fp4_e2m1"], "cannot verify --kv-cache-dtype fp4_e2m1"),
    ("two-batch-overlap", ["--enable-two-batch-overlap"], "cannot verify --enable-two-batch-overlap"),
    ("memory-saver", ["--enable-memory-saver"], "cannot verify --enable-memory-saver"),
    ("mixed-chunk", ["--enable-mixed-chunk"], "cannot verify --enable-mixed-chunk"),
    ("streaming-session", ["--enable-streaming-session"], "cannot verify --enable-streaming-session"),
    ("pdmux", ["--enable-pdmux"], "cannot verify --enable-pdmux"),
    ("device-xpu", ["--device", "xpu"], "cannot verify --device xpu"),
]


def _argv(extra, mode="log"):
    return ["--model-path", MODEL, *DEVICE_ARGS["cpu"], "--host", "127.0.0.1", "--port", "29999",
            "--kv-canary", mode, *extra]


@pytest.fixture(scope="module")
def forker():
    with EntryForker(SglangServer(device="cpu").environment()) as f:
        yield f


@pytest.mark.parametrize("case,extra,message", CASES, ids=[c[0] for c in CASES])
def test_refused_at_startup_naming_flag_and_value(forker, case, extra, message):
    code, out = forker.run(_argv(extra), timeout=120)
    assert code != 0, out[-3000:]
    assert REFUSED in out and message in out, out[-3000:]
    assert "--kv-canary none" in out or "--disable-piecewise-cuda-graph" in out  # says what to do
    assert "Uvicorn running" not in out and "kv_canary_installed" not in out  # refused before any process


def test_contain_mode_is_refused_the_same_way(forker):
    code, out = forker.run(_argv(["--enable-torch-compile"], mode="raise"))
    assert code != 0 and "--kv-canary raise cannot verify --enable-torch-compile" in out, out[-3000:]


def test_a_hook_sglang_failed_to_apply_refuses_startup(forker):
    """sglang's HookRegistry only logs a hook it could not apply; the canary refuses to run half-wired."""
    prelude = (
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "_orig = HookRegistry._apply_target.__func__\n"
        "def _failing(cls, target, hooks):\n"
        "    if target.endswith('ModelRunner.init_memory_pool'):\n"
        "        raise AttributeError('simulated: no such method in this sglang')\n"
        "    return _orig(cls, target, hooks)\n"
        "HookRegistry._apply_target = classmethod(_failing)\n"
    )
    code, out = forker.run(_argv([]), prelude=prelude)
    assert code != 0, out[-3000:]
    assert "did not apply the canary's hook(s) on sglang.srt.model_executor.model_runner.ModelRunner." \
           "init_memory_pool" in out, out[-3000:]


def _fresh(cmd, extra):
    env = SglangServer(device="cpu").environment()
    return subprocess.run([*cmd, *_argv(extra)], env=env, capture_output=True, text=True, timeout=300)


def test_fresh_launch_server_process_refuses_the_same_way():
    r = _fresh([sys.executable, "-m", "sglang.launch_server"], CASES[0][1])
    assert r.returncode != 0 and CASES[0][2] in r.stderr, r.stderr[-3000:]


def test_fresh_sglang_serve_process_refuses_the_same_way():
    sglang_cli = Path(sys.executable).with_name("sglang")
    if not sglang_cli.exists():
        pytest.skip(f"no sglang console script next to {sys.executable}")
    r = _fresh([str(sglang_cli), "serve"], ["--enable-hierarchical-cache", "--page-size", "64"])
    assert r.returncode != 0 and "cannot verify --enable-hierarchical-cache with --page-size 64" in r.stderr, \
        r.stderr[-3000:]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
