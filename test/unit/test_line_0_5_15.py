"""The sglang 0.5.14/0.5.15 line (``adapter/lines/v0_5_15``): a diff of the 0.5.17 line; no sglang needed.

Which releases it serves and what refuses them: ``test_release_fence``; its policies against the installed release's
fields: ``test_server_args_policy``.
"""

from __future__ import annotations

from types import SimpleNamespace

from kv_canary.adapter.lines import choose_line, v0_5_12, v0_5_15, v0_5_17
from kv_canary.adapter.policy_0_5_15 import _NOT_YET, _NOT_YET_0_5_14, _RENAMED, POLICY_0_5_14, POLICY_0_5_15
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
