"""The fence (``adapter/lines/fence``) against every release's stored hook-target signatures; no sglang needed.

``release_targets.json`` is read from each release's wheel (``scripts/release_targets.py``). A release is served
by a line only when every hook target of that line has the signature the line expects there; otherwise it is
refused, naming the target. A release newer than the newest line runs only with the opt-in env var, and only when
its targets all match.
"""

from __future__ import annotations

import pytest

from kv_canary.adapter.lines import (ALLOW_UNTESTED_ENV, LINE_MODULES, UnsupportedSglang, choose_line, load_line,
                                     release_modules)
from kv_canary.adapter.lines.fence import (MISSING, UNCHECKED, differences, format_params, load_table,
                                           release_signatures)
from kv_canary.config import CanaryConfig

TABLE = load_table()
RELEASES = TABLE["releases"]
SERVED = {"0.5.12": "0.5.12", "0.5.12.post1": "0.5.12", "0.5.13": "0.5.13", "0.5.13.post1": "0.5.13",
          "0.5.14": "0.5.15", "0.5.15": "0.5.15", "0.5.15.post1": "0.5.15", "0.5.16": "0.5.17", "0.5.17": "0.5.17",
          "0.5.18": "0.5.18", "0.5.19": "0.5.19", "0.5.20": "0.5.20", "0.5.21": "0.5.21", "0.5.22": "0.5.22",
          "0.5.23": "0.5.23"}
# release -> the line whose targets all match it, statically, with no smoke run: served only with the opt-in env var
UNTESTED = {}  # none since the own-pin smokes of 0.5.18, 0.5.19 and 0.5.21 (2026-11-29); the mechanism stays
# release -> a target that keeps its closest line out (the first difference the fence names)
REFUSED = {}  # none since the 0.5.20 line (2026-11-30; 0.5.20 was refused before); the mechanism stays


def stored(version):
    return lambda targets: release_signatures(TABLE, version)


def choose(version, signatures_of=None, env=None, in_tree=None):
    in_tree = RELEASES[signatures_of or version]["in_tree_canary"] if in_tree is None else in_tree
    return choose_line(version, has_in_tree_canary=in_tree, environ=env or {}, observe=stored(signatures_of or version))


def test_every_release_from_0_5_12_to_0_5_23_is_in_the_table_with_its_wheel():
    assert set(RELEASES) == set(SERVED) | set(REFUSED) | set(UNTESTED)
    assert all(r["wheel"] for r in RELEASES.values())
    assert all(rows for rows in TABLE["targets"].values())


@pytest.mark.parametrize("version", sorted(SERVED))
def test_a_release_whose_targets_all_match_is_served_by_its_line(version):
    choice = choose(version)
    assert choice.line is not None and choice.line.name == SERVED[version] and not choice.refuse
    assert version in choice.line.versions and not choice.untested


@pytest.mark.parametrize("version", sorted(REFUSED))
def test_a_release_whose_targets_differ_is_refused_naming_the_target(version):
    choice = choose(version)
    assert choice.line is None and choice.refuse
    assert f"sglang {version} is not supported" in choice.reason
    assert REFUSED[version] in choice.reason


def test_each_line_covers_exactly_the_releases_whose_targets_all_match():
    """No release a line could serve is left out of its ``versions``, and none is in them without the facts."""
    for module in LINE_MODULES.values():
        line = load_line(module)
        matching = {v for v, r in RELEASES.items() if r["in_tree_canary"] == line.in_tree_canary
                    and not differences(line, release_signatures(TABLE, v), TABLE)}
        assert set(line.versions) | set(line.untested_versions) == matching, line.name
        assert not set(line.versions) & set(line.untested_versions), line.name
    assert set(release_modules()) == set(SERVED) | set(UNTESTED)


@pytest.mark.parametrize("version", sorted(UNTESTED))
def test_a_release_mapped_by_the_fence_alone_runs_only_when_allowed(version):
    choice = choose(version)
    assert choice.line is None and choice.refuse and ALLOW_UNTESTED_ENV in choice.reason
    assert f"sglang {version} has not been run with sglang-kv-canary" in choice.reason
    assert f"its hook targets all match the {UNTESTED[version]} line" in choice.reason
    assert version not in choice.reason.split("install one of ", 1)[1]  # not listed as supported
    choice = choose(version, env={ALLOW_UNTESTED_ENV: "1"})
    assert choice.line is not None and choice.line.name == UNTESTED[version] and choice.untested and not choice.refuse
    assert version in choice.line.untested_versions and "no smoke has run on it" in choice.reason
    # a differing target: refused even when allowed
    other = "0.5.17" if UNTESTED[version] in ("0.5.18", "0.5.19") else "0.5.23"
    choice = choose(version, env={ALLOW_UNTESTED_ENV: "1"}, signatures_of=other)
    assert choice.line is None and choice.refuse and "nothing of it is installed" in choice.reason


def test_a_release_no_line_maps_is_refused_naming_what_keeps_the_closest_line_out():
    """A release between the lines (no line lists it) whose targets are 0.5.20's but 0.5.19's store recorder: the
    closest lines (0.5.19, 0.5.20) differ by one target each; the newer is named, with the target that differs."""
    target = "sglang.srt.mem_cache.events.KVCacheEventRecorder.record_store"
    doctored = {**release_signatures(TABLE, "0.5.20"), target: release_signatures(TABLE, "0.5.19")[target]}
    choice = choose_line("0.5.20.post9", has_in_tree_canary=True, environ={}, observe=lambda targets: doctored)
    assert choice.line is None and choice.refuse and "sglang 0.5.20.post9 is not supported" in choice.reason
    assert (f"the 0.5.20 line's hook targets differ here: {target} is (self, node, medium=) (sglang 0.5.20: "
            "(self, node, medium=, *, session_id=))") in choice.reason, choice.reason


def test_the_refusal_hooks_exist_on_every_release():
    """A refused release still stops --kv-canary at startup: the refusal's own targets exist everywhere."""
    from kv_canary.sglang_plugin import REFUSAL_HOOKS

    for version in RELEASES:
        signatures = release_signatures(TABLE, version)
        assert all(signatures[target] is not MISSING for target in REFUSAL_HOOKS), version


def test_a_served_release_with_one_differing_target_installs_nothing_and_names_it():
    target = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"
    doctored = {**release_signatures(TABLE, "0.5.23"), target: "(self, recv_reqs, extra)"}
    choice = choose_line("0.5.23", has_in_tree_canary=True, environ={}, observe=lambda targets: doctored)
    assert choice.line is None and choice.refuse
    assert f"{target} is (self, recv_reqs, extra) (sglang 0.5.23: (self, recv_reqs))" in choice.reason
    assert "nothing of it is installed" in choice.reason
    gone = {**release_signatures(TABLE, "0.5.12"), target: MISSING}
    choice = choose_line("0.5.12", has_in_tree_canary=False, environ={}, observe=lambda targets: gone)
    assert choice.line is None and f"{target} is missing" in choice.reason


@pytest.mark.parametrize("version", ["0.5.14", "0.5.15", "0.5.15.post1"])
def test_the_0_5_15_line_refuses_its_releases_when_a_target_it_tells_apart_from_0_5_17_differs(version):
    """The two targets that tell the 0.5.15 line apart from 0.5.17's: with 0.5.17's shape on one of them, a
    release of the line is refused (nothing installed), naming the target."""
    mixin = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes"
    init_new = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
    ours, later = release_signatures(TABLE, version), release_signatures(TABLE, "0.5.17")
    assert choose(version).line.name == "0.5.15"
    for target, phrase in [(mixin, f"{mixin} is missing (sglang 0.5.15: (self, pre_model_load_memory))"),
                           (init_new, f"{init_new} is {later[init_new]} (sglang 0.5.15: (cls, batch, model_runner))")]:
        doctored = {**ours, target: later[target]}
        choice = choose_line(version, has_in_tree_canary=True, environ={}, observe=lambda targets: doctored)
        assert choice.line is None and choice.refuse and "nothing of it is installed" in choice.reason
        assert phrase in choice.reason, choice.reason


def test_a_target_whose_module_does_not_import_here_is_left_to_the_applied_hooks_check():
    target = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache"
    unchecked = {**release_signatures(TABLE, "0.5.12"), target: UNCHECKED}
    assert choose_line("0.5.12", has_in_tree_canary=False, environ={}, observe=lambda t: unchecked).line is not None


def test_an_in_tree_canary_that_differs_from_the_line_is_refused():
    choice = choose("0.5.12", in_tree=True)
    assert choice.line is None and "sglang.srt.kv_canary exists" in choice.reason


@pytest.mark.parametrize("version", ["0.5.24", "0.5.24.post1", "0.6.0"])
def test_a_newer_release_is_refused_by_default_and_runs_untested_only_when_allowed(version):
    choice = choose(version, "0.5.23")
    assert choice.line is None and choice.refuse and ALLOW_UNTESTED_ENV in choice.reason
    assert "its hook targets all match the 0.5.23 line" in choice.reason
    choice = choose(version, "0.5.23", env={ALLOW_UNTESTED_ENV: "1"})
    assert choice.line is not None and choice.line.name == "0.5.23" and choice.untested and not choice.refuse
    assert f"sglang {version} is newer than the newest tested release (0.5.23)" in choice.reason


def test_a_newer_release_whose_targets_differ_is_refused_even_when_allowed():
    for env in ({}, {ALLOW_UNTESTED_ENV: "1"}):
        # 0.5.21's ForwardBatch.init_new, PD sender and HiCache storage hit query (pp_rank=), as if a release
        # moved them
        choice = choose("0.5.24", "0.5.21", env=env)
        assert choice.line is None and choice.refuse
        assert "3 hook target(s) differ from the 0.5.23 line: sglang.srt.disaggregation.common.conn.CommonKVSender." \
               "send is" in choice.reason and "HybridCacheController._storage_hit_query is" in choice.reason and "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new is" \
               in choice.reason


def test_the_opt_in_env_var_is_validated_and_known_to_the_config():
    with pytest.raises(UnsupportedSglang, match=f"{ALLOW_UNTESTED_ENV}='maybe'"):
        choose("0.5.24", "0.5.23", env={ALLOW_UNTESTED_ENV: "maybe"})
    assert choose("0.5.24", "0.5.23", env={ALLOW_UNTESTED_ENV: "0"}).refuse
    config = CanaryConfig.build(mode="raise", environ={ALLOW_UNTESTED_ENV: "1", "SGLANG_KV_CANARY_IMPL": "plugin"})
    assert config.mode.value == "raise"


def test_signatures_are_written_in_one_form():
    assert format_params([("self", "POSITIONAL_OR_KEYWORD", False), ("a", "POSITIONAL_OR_KEYWORD", True),
                          ("b", "KEYWORD_ONLY", False), ("kw", "VAR_KEYWORD", False)]) == "(self, a=, *, b, **kw)"
    assert format_params([("x", "POSITIONAL_ONLY", False), ("args", "VAR_POSITIONAL", False),
                          ("k", "KEYWORD_ONLY", True)]) == "(x, /, *args, k=)"


FENCE_ON_THE_RUNNING_SGLANG = """
from sglang.version import __version__ as version
from kv_canary.adapter.lines import load_line, release_modules
from kv_canary.adapter.lines.fence import UNCHECKED, differences, observed_targets
line = load_line(release_modules()[version])
observed = observed_targets(line.all_hooks())
print("UNCHECKED", sorted(t for t, s in observed.items() if s == UNCHECKED), flush=True)
print("DIFFS", differences(line, observed), flush=True)
"""


def test_the_fence_lets_the_installed_release_in():
    """On the installed sglang (``inspect.signature``, in a CPU server's environment) every hook target of its line
    has the signature stored from its wheel: the fence does not refuse the real line; only optional backends
    (PD transfer engines) may not import here."""
    import ast
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    from kv_canary_testing.server import SglangServer

    proc = subprocess.run([sys.executable, "-c", FENCE_ON_THE_RUNNING_SGLANG], capture_output=True, text=True,
                          env=SglangServer(device="cpu").environment(), timeout=300)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "DIFFS []" in proc.stdout, out
    unchecked = proc.stdout.split("UNCHECKED ", 1)[1].splitlines()[0]
    assert all(".disaggregation." in target for target in ast.literal_eval(unchecked)), unchecked
