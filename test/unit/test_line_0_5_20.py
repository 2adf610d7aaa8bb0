"""The 0.5.20 line (``v0_5_20``, a diff of 0.5.19): 0.5.19's hooks, the launching-process check after
``ServerArgs.resolve_once`` in place of ``__post_init__`` (a msgspec Struct on 0.5.20), and its own policy. Which
releases it serves (0.5.20 only): ``test_release_fence``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_canary.adapter.lines import v0_5_19, v0_5_20, v0_5_23
from kv_canary.adapter.policy_0_5_19 import POLICY_0_5_19
from kv_canary.adapter.policy_0_5_20 import _FROM_0_5_23, _GONE, POLICY_0_5_20
from kv_canary.adapter.policy_0_5_23 import POLICY_0_5_23

_POST_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"
_RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"


def test_the_line_is_0_5_19s_with_the_launch_check_after_resolve_once():
    line, base = v0_5_20.LINE, v0_5_19.LINE
    assert line.versions == ("0.5.20",) and line.untested_versions == ()
    assert set(line.hooks) ^ set(base.hooks) == {_POST_INIT, _RESOLVE_ONCE}
    assert all(line.hooks[t] == hook for t, hook in base.hooks.items() if t in line.hooks)
    assert line.hooks[_RESOLVE_ONCE] == v0_5_23.HOOKS[_RESOLVE_ONCE] == base.hooks[_POST_INIT]  # the same check
    assert line.req_row is v0_5_23.req_row and line.policy is POLICY_0_5_20
    assert line.prefix_cache_view is base.prefix_cache_view and line.verified_pools == base.verified_pools
    for flag in (dict(kv_canary="contain"), dict(speculative_algorithm="EAGLE"), dict(tp_size=2), dict(dp_size=2),
                 dict(disaggregation_mode="prefill")):
        assert "sglang 0.5.20" in line.unported(SimpleNamespace(**flag)), flag
    assert line.unported(SimpleNamespace(kv_canary="log")) == ""


def test_its_policy_is_0_5_19s_less_4_fields_plus_15_classified_as_on_0_5_23():
    rules, elsewhere, neutral = POLICY_0_5_20.classified()
    assert len(_GONE) == 4 and len(_FROM_0_5_23) == 15
    assert rules | elsewhere | neutral == (set().union(*POLICY_0_5_19.classified()) - _GONE) | _FROM_0_5_23
    assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
    for field, rule in POLICY_0_5_20.rules.items():
        assert rule is (POLICY_0_5_23 if field in _FROM_0_5_23 else POLICY_0_5_19).rules[field]


def test_the_installed_server_args_runs_the_launch_check_hook_of_its_line(monkeypatch):
    """A line that hooks ``ServerArgs.__post_init__`` needs sglang to call the class attribute as it is when a
    record is built: a dataclass does (0.5.17-0.5.19), a msgspec Struct (0.5.20) bound it when the class was
    built, so a hook set later never runs: the 0.5.20 line hooks ``resolve_once`` instead."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    from kv_canary.adapter.lines import current_choice

    line = current_choice().line
    if line is None:
        pytest.skip(f"no line serves the installed sglang: {current_choice().reason}")
    calls = []
    monkeypatch.setattr(server_args.ServerArgs, "__post_init__", lambda self: calls.append(self))
    server_args.ServerArgs(model_path="dummy")
    assert calls or _POST_INIT not in line.hooks, f"the {line.name} line's {_POST_INIT} hook would never run"
    if line.name == "0.5.20":
        assert not calls and _RESOLVE_ONCE in line.hooks
