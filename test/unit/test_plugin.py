"""The sglang plugin layer: version gate, CLI flags and their startup errors, capacities.

CLI checks run sglang's own entry code in a forked child (load_plugins + prepare_server_args),
so the hooks are applied exactly as in a real server process.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from kv_canary import sglang_plugin
from kv_canary.views import CanaryCapacityError, ForwardView, LaunchCapacities

pytest.importorskip("sglang")


def test_inactive_plugin_on_an_unsupported_release_registers_only_the_refusal(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kv_canary.adapter import lines

    monkeypatch.setattr(lines, "_current", lines.choose_line("9.9", has_in_tree_canary=True, environ={}))
    monkeypatch.setattr(sglang_plugin, "_registered", False)
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    monkeypatch.setattr(HookRegistry, "_hooks", __import__("collections").defaultdict(list, before))
    with caplog.at_level("WARNING", logger="kv_canary"):
        sglang_plugin.register()
    added = {k for k, v in HookRegistry._hooks.items() if len(v) > len(before.get(k, []))}
    assert added == set(sglang_plugin.REFUSAL_HOOKS)
    lines_logged = [r.getMessage() for r in caplog.records if r.name == "kv_canary"]
    assert len(lines_logged) == 1 and "plugin inactive: sglang 9.9 is not supported" in lines_logged[0]


@pytest.fixture(scope="module")
def forker():
    """One process imports sglang once; each parse runs in a fork of it (kv_canary_testing.entry_fork), with the
    libcuda stand-in (sglang's scheduler module imports it)."""
    from kv_canary_testing.entry_fork import EntryForker
    from kv_canary_testing.server import SglangServer

    with EntryForker(SglangServer(device="cpu").environment()) as f:
        yield f


def _prepare(forker, args, env=None):
    """(exit code, output) of loading the plugins and parsing ``args`` as sglang's entry does, in a fresh fork."""
    from kv_canary_testing.model_dir import write_model_dir

    code = textwrap.dedent(f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        a = prepare_server_args(["--model-path", {str(write_model_dir())!r}, *{list(args)!r}])
        print("PARSED", a.kv_canary, a.kv_canary_sweep_interval, a.kv_canary_real_data, flush=True)
        raise SystemExit(0)
    """)
    return forker.run([], env or {}, prelude=code, timeout=120)


def test_flags_parse_and_reach_server_args(forker):
    code, out = _prepare(forker, ["--kv-canary", "log", "--kv-canary-sweep-interval", "5", "--kv-canary-real-data",
                                  "all", "--device", "cuda", "--disable-piecewise-cuda-graph"])
    assert code == 0 and "PARSED log 5 all" in out, out[-2000:]


@pytest.mark.parametrize(
    "args,env,want",
    [
        ([], {}, "all"),
        (["--kv-canary-real-data", "partial"], {}, "partial"),
        (["--enable-hierarchical-cache"], {}, "partial"),
        ([], {"SGLANG_KV_CANARY_KV_HASH_BYTES": "32"}, "partial"),
    ],
)
def test_real_data_defaults_to_every_byte_where_the_plugin_owns_the_flag(forker, args, env, want):
    """Unset, --kv-canary-real-data is all; partial where all is not verified (HiCache here, PD and the window env
    vars alike), with the reason logged at startup; a given value is kept."""
    from kv_canary.adapter.lines import current_line

    if current_line().flags_declared_by_sglang:
        pytest.skip("sglang declares --kv-canary-real-data on this line, with its own default (none)")
    code, out = _prepare(forker, ["--kv-canary", "log", "--device", "cuda", "--disable-piecewise-cuda-graph", *args],
                         env)
    assert code == 0 and f"PARSED log 0 {want}" in out, out[-2000:]
    assert (f"kv_canary_real_data_default={want}" in out) == (not args or args[0] != "--kv-canary-real-data"), out[-2000:]


def test_the_default_is_partial_only_where_all_is_not_verified():
    """default_real_data names the reason for each setting all is not verified with (PD, HiCache, the window)."""
    from types import SimpleNamespace

    from kv_canary.adapter.flags import default_real_data

    plain = SimpleNamespace(enable_hierarchical_cache=False, disaggregation_mode="null")
    assert default_real_data(plain, {})[0] == "all"
    assert default_real_data(plain, {"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "8"})[0] == "all"
    for mode in ("prefill", "decode"):
        value, why = default_real_data(SimpleNamespace(enable_hierarchical_cache=False, disaggregation_mode=mode), {})
        assert value == "partial" and "PD" in why
    value, why = default_real_data(SimpleNamespace(enable_hierarchical_cache=True, disaggregation_mode=None), {})
    assert value == "partial" and "--enable-hierarchical-cache" in why
    value, why = default_real_data(plain, {"SGLANG_KV_CANARY_KV_HASH_LAYERS": "0,1"})
    assert value == "partial" and "SGLANG_KV_CANARY_KV_HASH_LAYERS" in why


def test_eagle_spec_v1_defaults_to_all_and_takes_the_whole_row_hash():
    """Spec v1 (0.5.12's EAGLEWorker, --disable-overlap-schedule) stores K/V its TAILs do not record -- the draft decode
    steps' scratch slots, the tree verifies' nodes -- and HEAD forgets those slots' earlier records
    (``ForwardView.unrecorded_stores``), so the scrub no longer reads them as corrupt (12 kv_hash rows rid=scrub
    group=draft on a clean CPU server before): unset, the flag is all there as with spec v2, and all or the scrub is
    taken (both were refused, and the default partial, until the fix)."""
    from types import SimpleNamespace

    from kv_canary.adapter.flags import default_real_data
    from kv_canary.adapter.install import config_from_server_args

    def args(real_data, overlap_off=True, mode="log"):
        return SimpleNamespace(kv_canary=mode, kv_canary_sweep_interval=0, kv_canary_real_data=real_data,
                               speculative_algorithm="EAGLE", disable_overlap_schedule=overlap_off, device="cpu",
                               enable_hierarchical_cache=False, disaggregation_mode="null")

    for overlap_off in (True, False):  # spec v1 (on 0.5.12; 0.5.23 serves EAGLE with spec v2 only) and spec v2
        assert default_real_data(args(None, overlap_off), {}) == ("all", "every byte of every slot (the default)")
        for mode in ("log", "contain"):
            assert config_from_server_args(args("all", overlap_off, mode), environ={}).real_data.value == "all"
    config = config_from_server_args(args("partial"), environ={"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "64"})
    assert config.real_data.value == "partial" and config.scrub_slots_per_forward == 64


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
def test_bad_input_fails_at_startup_naming_it(forker, args, env, message):
    code, out = _prepare(forker, args, env)
    assert code != 0 and "PARSED" not in out
    assert message in out, out[-2000:]


def test_forward_over_capacity_names_the_capacity_and_the_flag():
    caps = LaunchCapacities(max_batch_size=4, max_context_len=64, verify_programs_target=1)
    z = torch.zeros(5, dtype=torch.int64)
    view = ForwardView(z, z, z, z, z, z, z, batch_size=5, max_new_len=1)
    with pytest.raises(CanaryCapacityError, match="max_batch_size=4.*--max-running-requests"):
        caps.check(view)

