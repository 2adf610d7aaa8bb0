"""The real-bug harness (issue 53, ``kv_canary_testing.real_bugs``): reversed fixes and fixes applied forward."""

from __future__ import annotations

import json

import pytest

from kv_canary_testing import real_bugs
from kv_canary_testing.real_bugs import APPLIES_ON, MARKER, REVERSES_ON, RealBugError

FORWARD = "swa_recover_locked_full_legacy_0512"


def _installed():
    try:
        return real_bugs.installed_sglang()[0]
    except RealBugError:
        pytest.skip("no sglang installed for this interpreter")


def test_every_listed_patch_exists_with_one_direction():
    stems = {p.stem for p in real_bugs.PATCH_DIR.glob("*.patch")}  # (plus other releases' forms, not listed)
    assert set(REVERSES_ON) | set(APPLIES_ON) <= stems
    assert not set(REVERSES_ON) & set(APPLIES_ON)


def test_a_forward_fix_builds_a_fixed_copy_and_the_bug_runs_on_the_venv(tmp_path):
    version = _installed()
    if version not in APPLIES_ON[FORWARD]:
        with pytest.raises(RealBugError, match="does not apply"):
            real_bugs.fixed_sglang(FORWARD, cache_dir=tmp_path)
        return
    root = real_bugs.fixed_sglang(FORWARD, cache_dir=tmp_path)
    marker = json.loads((root / MARKER).read_text())
    assert marker["bug"] == FORWARD and marker["fix_applied"] and marker["sglang"] == version
    assert "_recover_tombstone_keeping_locked_full" in (root / "sglang/srt/mem_cache/swa_radix_cache.py").read_text()
    assert real_bugs.fixed_sglang(FORWARD, cache_dir=tmp_path) == root  # cached
    with pytest.raises(RealBugError, match="applied forward"):
        real_bugs.buggy_sglang(FORWARD, cache_dir=tmp_path)
    assert real_bugs.run_env(FORWARD, bug_in=True) == {}  # the release as installed ships the bug


def test_a_reversed_fix_is_not_a_forward_one(tmp_path):
    with pytest.raises(RealBugError, match="not a forward fix"):
        real_bugs.fixed_sglang("swa_evict_boundary_pr22470", cache_dir=tmp_path)
    assert real_bugs.run_env("swa_evict_boundary_pr22470", bug_in=False) == {}  # the venv is the fixed run
