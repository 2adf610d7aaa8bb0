"""Which adapter serves which sglang release (``adapter/lines``): the pick, the switch, the refusal."""

from __future__ import annotations

import pytest

from kv_canary.adapter.lines import (ALLOW_UNTESTED_ENV, IMPL_ENV, LINE_MODULES, UnsupportedSglang, choose_line,
                                     load_line, supported_versions)
from kv_canary.adapter.refusal import _refuse
from kv_canary.config import CanaryConfigError


@pytest.mark.parametrize("version", LINE_MODULES)
def test_each_line_serves_its_own_release(version):
    untested = version in load_line(LINE_MODULES[version]).untested_versions  # a line no smoke ran on: the opt-in
    choice = choose_line(version, has_in_tree_canary=version != "0.5.12",
                         environ={ALLOW_UNTESTED_ENV: "1"} if untested else {})
    assert choice.line is not None and choice.line.name == version and choice.untested is untested
    assert version in (choice.line.untested_versions if untested else choice.line.versions)
    assert choice.line.in_tree_canary is (version != "0.5.12")
    hooks = choice.line.all_hooks()
    assert hooks and all(kind in ("before", "after", "around", "replace") for _, kind in hooks.values())
    assert choice.line.policy is not None


def test_the_newest_line_replaces_the_in_tree_install_and_declares_no_flags_of_its_own():
    line = choose_line("0.5.23", has_in_tree_canary=True, environ={}).line
    assert line.hooks["sglang.srt.model_executor.model_runner.install_canary"][1] == "replace"
    assert line.flags_declared_by_sglang
    assert "sglang.srt.model_executor.model_runner.ModelRunner.forward" not in line.hooks  # sglang brackets it


@pytest.mark.parametrize("version,in_tree", [("0.5.24", True), ("0.5.11", False), ("0.6.0", True)])
def test_an_unsupported_release_installs_nothing_and_refuses_naming_versions(version, in_tree):
    choice = choose_line(version, has_in_tree_canary=in_tree, environ={})
    assert choice.line is None and choice.refuse
    assert f"sglang {version} is not supported" in choice.reason
    assert all(v in choice.reason for v in supported_versions())
    assert (f"{IMPL_ENV}=in-tree" in choice.reason) is in_tree


def test_the_in_tree_switch_keeps_sglangs_own_canary():
    for version in ("0.5.23", "0.5.21"):
        choice = choose_line(version, has_in_tree_canary=True, environ={IMPL_ENV: "in-tree"})
        assert choice.line is None and not choice.refuse and "sglang" in choice.reason
    with pytest.raises(UnsupportedSglang, match="ships no in-tree kv_canary"):
        choose_line("0.5.12", has_in_tree_canary=False, environ={IMPL_ENV: "in-tree"})
    with pytest.raises(UnsupportedSglang, match=f"{IMPL_ENV}='both'"):
        choose_line("0.5.23", has_in_tree_canary=True, environ={IMPL_ENV: "both"})


def test_the_refusal_hook_passes_none_and_refuses_any_other_mode(monkeypatch):
    from types import SimpleNamespace

    from kv_canary.adapter import lines

    monkeypatch.setattr(lines, "_current", choose_line("0.5.11", has_in_tree_canary=False, environ={}))
    _refuse(SimpleNamespace(kv_canary="none"))
    _refuse(SimpleNamespace())
    with pytest.raises(CanaryConfigError, match="--kv-canary log: sglang 0.5.11 is not supported"):
        _refuse(SimpleNamespace(kv_canary="log"))


@pytest.mark.parametrize("version", LINE_MODULES)
def test_pd_is_verified_only_on_the_lines_it_ran_on(version):
    """The line record says whether PD ran on its releases (``pd_verified``); only a line with PD hooks can say so.
    0.5.21 and 0.5.22 carry 0.5.23's PD hooks, which never ran there."""
    line = load_line(LINE_MODULES[version])
    assert line.pd_verified is (version in ("0.5.12", "0.5.23"))
    assert not line.pd_verified or line.pd_hooks


def test_the_pd_gate_refuses_a_line_whose_pd_path_never_ran_and_passes_a_verified_one(monkeypatch):
    from types import SimpleNamespace

    from kv_canary.adapter import lines
    from kv_canary.adapter.disagg import check_disaggregation
    from kv_canary.config import CanaryConfig

    config = CanaryConfig.build(mode="log", environ={})
    args = SimpleNamespace(disaggregation_mode="prefill", page_size=1, tp_size=1)
    for version in ("0.5.21", "0.5.22"):
        monkeypatch.setattr(lines, "_current", choose_line(version, has_in_tree_canary=True, environ={}))
        with pytest.raises(CanaryConfigError, match=f"--disaggregation-mode prefill is verified on sglang 0.5.12, "
                                                    f"0.5.12.post1, 0.5.23, not on sglang {version} "):
            check_disaggregation(args, config, environ={})
    monkeypatch.setattr(lines, "_current", choose_line("0.5.23", has_in_tree_canary=True, environ={}))
    check_disaggregation(args, config, environ={})  # the same settings pass on the line PD ran on
