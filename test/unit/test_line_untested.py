"""The lines of 0.5.18 (``v0_5_18``, a diff of 0.5.17) and 0.5.21 (``v0_5_21``, a diff of 0.5.23), mapped by the
fence alone (``SglangLine.untested_versions``) until their CPU smokes passed on their own pins (2026-11-29); no
sglang needed. Which releases they serve: ``test_release_fence``."""

from __future__ import annotations

from types import SimpleNamespace

from kv_canary.adapter.lines import v0_5_17, v0_5_18, v0_5_21, v0_5_23
from kv_canary.adapter.policy_0_5_17 import POLICY_0_5_17
from kv_canary.adapter.policy_0_5_18 import _FROM_0_5_23, _GONE, POLICY_0_5_18
from kv_canary.adapter.policy_0_5_21 import _FROM_0_5_17, _HOST_RECEIVE, _NOT_YET, POLICY_0_5_21
from kv_canary.adapter.policy_0_5_23 import POLICY_0_5_23


def test_the_0_5_18_line_is_0_5_17s_hooks_as_they_are_with_its_own_policy_and_serves_0_5_18():
    line = v0_5_18.LINE
    assert line.versions == ("0.5.18",) and line.untested_versions == ()
    assert line.all_hooks() == v0_5_17.LINE.all_hooks() and line.policy is POLICY_0_5_18
    assert "sglang 0.5.18" in line.unported(SimpleNamespace(kv_canary="contain"))
    assert (line.in_tree_canary, line.verified_pools) == (v0_5_17.LINE.in_tree_canary, v0_5_17.LINE.verified_pools)


def test_the_0_5_21_line_is_0_5_23s_with_its_own_policy_and_serves_0_5_21():
    line = v0_5_21.LINE
    assert line.versions == ("0.5.21",) and line.untested_versions == ()
    assert line.all_hooks() == v0_5_23.LINE.all_hooks() and line.policy is POLICY_0_5_21
    assert line.unported is v0_5_23.LINE.unported and line.containment is v0_5_23.LINE.containment


def test_their_policies_are_the_neighbour_lines_on_their_fields():
    for policy, base, gone, added, source in [(POLICY_0_5_18, POLICY_0_5_17, _GONE, _FROM_0_5_23, POLICY_0_5_23),
                                             (POLICY_0_5_21, POLICY_0_5_23, _NOT_YET, _FROM_0_5_17, POLICY_0_5_17)]:
        rules, elsewhere, neutral = policy.classified()
        assert rules | elsewhere | neutral == (set().union(*base.classified()) - gone) | added
        assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
        for field, rule in policy.rules.items():  # the neighbour's rule objects, but 0.5.21's host receive (off at 0)
            assert rule is (source if field in added else base).rules[field] or field == _HOST_RECEIVE
    host_receive = POLICY_0_5_21.rules[_HOST_RECEIVE]
    assert host_receive.allowed(0, None) and not host_receive.allowed(1, None)
    theirs = POLICY_0_5_23.rules[_HOST_RECEIVE]
    assert theirs.allowed(1, None) and not theirs.allowed(0, None)
