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


def test_three_runs_adds_run_args_to_one_run_and_runs_b2_as_a_second_b(monkeypatch, tmp_path):
    from kv_canary_testing import real_bug_runs

    class Log:
        text, violations = "", []

    seen = []

    def serve(mode, bug, factory, args, env, workload, pool, model_path, python=None, bug_in=True):
        seen.append((mode, bug_in, list(args)))
        return real_bug_runs.Run(None, Log(), True)

    monkeypatch.setattr(real_bug_runs, "serve", serve)
    out = real_bug_runs.three_runs("swa_evict_boundary_pr22470", ["--x"], {}, None, 64, None,
                                   runs=("b", "b2"), run_args={"b2": ["--y", "1"]})
    assert list(out) == ["b", "b2"]
    assert seen == [("log", True, ["--x"]), ("log", True, ["--x", "--y", "1"])]


@pytest.mark.parametrize("name", ["fa3_mla_embedding_skip_kv_pr24097", "fa3_mla_embedding_skip_kv_pr24097_v0.5.23form"])
def test_the_fa3_mla_embedding_bug_reverses_in_its_form_of_the_line(name, tmp_path):
    """test_e2e_real_bugs_gpu_more picks the form per line (0.5.12 the plain patch, 0.5.23 its _v0.5.23form)."""
    version = _installed()
    if version not in REVERSES_ON[name]:
        pytest.skip(f"{name} is {REVERSES_ON[name]}'s form; this is sglang {version}")
    root = real_bugs.buggy_sglang(name, cache_dir=tmp_path)
    text = (root / "sglang/srt/layers/attention/flashattention_backend.py").read_text()
    start = text.index("self.fa_skip_kv_cache = (")
    block = text[start:text.index("\n        )\n", start)]  # the condition, up to its closing parenthesis
    assert "disable_radix_cache" in block and "use_mla" not in block, block  # MLA takes the fast path too
