"""The sglang 0.5.14/0.5.15 line (``adapter/lines/v0_5_15``), a diff of the 0.5.17 line, and the 0.5.13 line
(``v0_5_13``), a diff of it; no sglang needed.

Which releases it serves and what refuses them: ``test_release_fence``; its policies against the installed release's
fields: ``test_server_args_policy``.
"""

from __future__ import annotations

from types import SimpleNamespace

from kv_canary.adapter.lines import choose_line, v0_5_12, v0_5_13, v0_5_15, v0_5_17
from kv_canary.adapter.policy_0_5_15 import (_FROM_0_5_12, _NOT_YET, _NOT_YET_0_5_13, _NOT_YET_0_5_14, _RENAMED,
                                             POLICY_0_5_13, POLICY_0_5_14, POLICY_0_5_15)
from kv_canary.adapter.server_args import POLICY_0_5_12
from kv_canary.adapter.policy_0_5_17 import POLICY_0_5_17

CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes"


def test_the_line_serves_0_5_14_to_0_5_15_post1_with_a_policy_per_field_set():
    for version in ("0.5.14", "0.5.15", "0.5.15.post1"):
        line = choose_line(version, has_in_tree_canary=True, environ={}).line
        assert line is v0_5_15.LINE and line.in_tree_canary and line.flags_declared_by_sglang
        assert line.policy_for(version) is (POLICY_0_5_14 if version == "0.5.14" else POLICY_0_5_15)
    assert v0_5_17.LINE.policy_for("0.5.16") is POLICY_0_5_17  # a line without release policies: its own


def test_the_hook_table_is_0_5_17s_with_0_5_12s_kv_sizing_hook():
    ours, theirs = dict(v0_5_15.HOOKS), dict(v0_5_17.HOOKS)
    assert set(theirs) - set(ours) == {CONFIGURATOR}
    assert set(ours) - set(theirs) == {MIXIN}
    assert ours[MIXIN] == v0_5_12.HOOKS[MIXIN] == ("hooks.after_profile_available_bytes", "after")
    assert all(ours[t] == theirs[t] for t in set(ours) & set(theirs))


def test_unported_is_0_5_17s_naming_0_5_15_without_post_capture_kv_sizing(monkeypatch):
    monkeypatch.setenv(v0_5_17.POST_CAPTURE_KV_SIZING_ENV, "1")  # not read by sglang 0.5.14/0.5.15
    ok = SimpleNamespace(kv_canary="raise", tp_size=1, dp_size=1, disaggregation_mode="null",
                         speculative_algorithm=None)
    assert v0_5_15.unported(ok) == ""
    assert v0_5_17.unported(ok).startswith(v0_5_17.POST_CAPTURE_KV_SIZING_ENV)
    for field, value in [("kv_canary", "contain"), ("speculative_algorithm", "EAGLE"), ("tp_size", 2),
                         ("dp_size", 2), ("disaggregation_mode", "prefill")]:
        reason = v0_5_15.unported(SimpleNamespace(**{**vars(ok), field: value}))
        assert "sglang 0.5.15" in reason and "0.5.17" not in reason, reason


def test_the_policies_are_0_5_17s_on_0_5_15s_and_0_5_14s_fields():
    """Exhaustive against the installed release in test_server_args_policy; here: the diffs are consistent."""
    fields_17 = set().union(*POLICY_0_5_17.classified())
    fields_15 = set().union(*POLICY_0_5_15.classified())
    fields_14 = set().union(*POLICY_0_5_14.classified())
    assert _NOT_YET <= fields_17 and not set(_RENAMED) & fields_17 and set(_RENAMED.values()) <= _NOT_YET
    assert fields_15 == (fields_17 - _NOT_YET) | set(_RENAMED)
    assert fields_14 == fields_15 - _NOT_YET_0_5_14 and _NOT_YET_0_5_14 <= fields_15
    for policy in (POLICY_0_5_15, POLICY_0_5_14):
        rules, elsewhere, neutral = policy.classified()
        assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
        for field, rule in policy.rules.items():  # the same rule objects as 0.5.17's (a renamed field: its new name's)
            assert rule is POLICY_0_5_17.rules[_RENAMED.get(field, field)]


SHAPE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape"
BATCH_SIZE = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size"


def test_the_0_5_13_line_is_0_5_15s_with_0_5_12s_decode_capture_target():
    for version in ("0.5.13", "0.5.13.post1"):
        line = choose_line(version, has_in_tree_canary=True, environ={}).line
        assert line is v0_5_13.LINE and line.policy_for(version) is POLICY_0_5_13
    ours, theirs = dict(v0_5_13.HOOKS), dict(v0_5_15.HOOKS)
    assert set(theirs) - set(ours) == {SHAPE} and set(ours) - set(theirs) == {BATCH_SIZE}
    assert ours[BATCH_SIZE] == v0_5_12.HOOKS[BATCH_SIZE] == theirs[SHAPE]  # the same capture hook, 0.5.12's target
    assert all(ours[t] == theirs[t] for t in set(ours) & set(theirs))
    assert "sglang 0.5.13" in v0_5_13.unported(SimpleNamespace(kv_canary="contain"))


def test_the_0_5_13_policy_is_0_5_15s_less_the_phase_graph_fields_plus_0_5_12s_piecewise_ones():
    fields_15 = set().union(*POLICY_0_5_15.classified())
    rules, elsewhere, neutral = POLICY_0_5_13.classified()
    assert rules | elsewhere | neutral == (fields_15 - _NOT_YET_0_5_13) | _FROM_0_5_12
    assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
    assert "cuda_graph_config" in _NOT_YET_0_5_13 and not _FROM_0_5_12 & fields_15
    for field in _FROM_0_5_12:  # 0.5.12's class, the same rule objects
        assert (POLICY_0_5_13.rules.get(field) is POLICY_0_5_12.rules.get(field)
                and (field in elsewhere) == (field in POLICY_0_5_12.checked_elsewhere))
    assert POLICY_0_5_13.rules["enforce_piecewise_cuda_graph"] is POLICY_0_5_12.rules["enforce_piecewise_cuda_graph"]
