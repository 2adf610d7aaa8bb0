"""The sglang plugin layer: version gate, CLI flags and their startup errors, capacities.

CLI checks run sglang's own entry code in a subprocess (load_plugins + prepare_server_args),
so the hooks are applied exactly as in a real server process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kv_canary import sglang_plugin
from kv_canary.views import CanaryCapacityError, ForwardView, LaunchCapacities

pytest.importorskip("sglang")


def test_version_gate_accepts_only_stock_0_5_12(monkeypatch):
    assert sglang_plugin.version_gate() == ""
    import sglang.version

    monkeypatch.setattr(sglang.version, "__version__", "0.5.13")
    assert "0.5.13 is not 0.5.12" in sglang_plugin.version_gate()


def test_in_tree_canary_disables_the_plugin(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "sglang.srt.kv_canary" else real(name, *a))
    assert "in-tree kv_canary" in sglang_plugin.version_gate()


def test_inactive_plugin_logs_one_line_and_registers_nothing(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(sglang_plugin, "version_gate", lambda: "sglang 9.9 is not 0.5.12")
    monkeypatch.setattr(sglang_plugin, "_registered", False)
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    with caplog.at_level("WARNING", logger="kv_canary"):
        sglang_plugin.register()
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    lines = [r for r in caplog.records if r.name == "kv_canary"]
    assert len(lines) == 1 and "plugin inactive" in lines[0].getMessage()


def _prepare(args, env=None):
    from kv_canary_testing.model_dir import write_model_dir

    code = textwrap.dedent(f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        a = prepare_server_args(["--model-path", {str(write_model_dir())!r}, *{list(args)!r}])
        print("PARSED", a.kv_canary, a.kv_canary_sweep_interval, a.kv_canary_real_data)
    """)
    from kv_canary_testing.server import SglangServer

    full_env = SglangServer(device="cpu").environment()  # the libcuda stand-in: sglang's scheduler module imports
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


def test_flags_parse_and_reach_server_args():
    r = _prepare(["--kv-canary", "log", "--kv-canary-sweep-interval", "5", "--kv-canary-real-data", "all",
                  "--device", "cuda", "--disable-piecewise-cuda-graph"])
    assert "PARSED log 5 all" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--kv-canary", "loud"], {}, "argument --kv-canary: invalid choice: 'loud'"),
        (["--kv-canary", "raise", "--device", "cuda"], {}, "pass --disable-piecewise-cuda-graph"),
        (["--kv-canary-sweep-interval", "3", "--device", "cuda", "--disable-piecewise-cuda-graph"], {},
         "--kv-canary-sweep-interval 3 needs the canary on"),
        (["--kv-canary", "log", "--device", "cuda", "--disable-piecewise-cuda-graph"],
         {"SGLANG_KV_CANARY_KV_HASH_BYTES": "7"}, "SGLANG_KV_CANARY_KV_HASH_BYTES='7'"),
        (["--kv-canary", "log", "--kv-canary-real-data", "every"], {},
         "argument --kv-canary-real-data: invalid choice: 'every'"),
        (["--kv-canary", "log", "--kv-canary-real-data", "all", "--device", "cuda", "--disable-piecewise-cuda-graph"],
         {"SGLANG_KV_CANARY_KV_HASH_LAYERS": "1"}, "tunes the hashed window of --kv-canary-real-data partial"),
    ],
)
def test_bad_input_fails_at_startup_naming_it(args, env, message):
    r = _prepare(args, env)
    assert r.returncode != 0 and "PARSED" not in r.stdout
    assert message in r.stderr, r.stderr[-2000:]


def test_forward_over_capacity_names_the_capacity_and_the_flag():
    caps = LaunchCapacities(max_batch_size=4, max_context_len=64, verify_programs_target=1)
    z = torch.zeros(5, dtype=torch.int64)
    view = ForwardView(z, z, z, z, z, z, z, batch_size=5, max_new_len=1)
    with pytest.raises(CanaryCapacityError, match="max_batch_size=4.*--max-running-requests"):
        caps.check(view)
