"""Speculative decoding over a hybrid sliding-window target (``SWAKVPool``): verified on sglang 0.5.23 with EAGLE
and a draft model of its own (test_e2e_speculative_swa), refused everywhere else at startup, naming
``--speculative-algorithm`` (``adapter/speculative.spec_pool_refusal``; the line's ``spec_target_pools``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_canary.adapter.facts import SpecFacts
from kv_canary.adapter.speculative import SPEC_POOL_CLASSES, spec_pool_refusal


def pool(cls):
    return cls.__new__(cls)


def swa_pool():
    return pool(pytest.importorskip("sglang.srt.mem_cache.swa_memory_pool").SWAKVPool)


LINE_0_5_23 = ("MHATokenToKVPool", "SWAKVPool")  # lines.v0_5_23.SPEC_TARGET_POOLS


def test_swa_target_with_eagle_and_its_own_draft_is_verified_where_the_line_says_so():
    assert spec_pool_refusal("EAGLE", swa_pool(), draft=False, target_pools=LINE_0_5_23) == ""


def test_swa_target_is_refused_on_lines_that_did_not_run_it():
    """The default (every line but 0.5.23): MHATokenToKVPool targets only, as before."""
    why = spec_pool_refusal("EAGLE", swa_pool(), draft=False)
    assert why.startswith("--speculative-algorithm EAGLE with the target model's KV pool SWAKVPool:"), why
    assert SPEC_POOL_CLASSES == ("MHATokenToKVPool",)


def test_swa_target_refusals_that_stay_on_0_5_23():
    """EAGLE3, MTP drafts (the target's own checkpoint), a skipped draft pool (PD, contain) and an SWA draft pool."""
    for kwargs, algo, needle in (
        ({}, "EAGLE3", "a SWAKVPool target is verified with --speculative-algorithm EAGLE and a draft model of its own"),
        ({}, "NEXTN", "MTP drafts"),
        ({"draft_from_target": True}, "EAGLE", "MTP drafts (the target's own checkpoint) are not"),
        ({"draft_skip": "--disaggregation-mode decode"}, "EAGLE", "not with --disaggregation-mode decode"),
    ):
        why = spec_pool_refusal(algo, swa_pool(), draft=False, target_pools=LINE_0_5_23, **kwargs)
        assert why.startswith(f"--speculative-algorithm {algo} with the target model's KV pool SWAKVPool:"), why
        assert needle in why, why
    why = spec_pool_refusal("EAGLE", swa_pool(), draft=True, target_pools=LINE_0_5_23)
    assert why.startswith("--speculative-algorithm EAGLE with the draft model's KV pool SWAKVPool:"), why


def test_the_lines_spec_target_pools():
    """0.5.23 lifts SWAKVPool; 0.5.21 and 0.5.22 (0.5.23's hooks, never run with it) and 0.5.12 keep MHA only."""
    from kv_canary.adapter.lines import v0_5_12, v0_5_21, v0_5_22, v0_5_23

    assert v0_5_23.LINE.spec_target_pools == LINE_0_5_23
    for line in (v0_5_12.LINE, v0_5_21.LINE, v0_5_22.LINE):
        assert line.spec_target_pools == ("MHATokenToKVPool",), line.name


def test_draft_from_target_reads_the_draft_model_path(tmp_path):
    pytest.importorskip("sglang")  # SpecFacts.read asks the installed line
    def facts(**args):
        return SpecFacts.read(SimpleNamespace(speculative_algorithm="EAGLE", **args), "raise")

    target, draft = tmp_path / "target", tmp_path / "draft"
    assert facts(model_path=str(target), speculative_draft_model_path=str(draft)).draft_from_target is False
    assert facts(model_path=str(target), speculative_draft_model_path=str(target) + "/").draft_from_target is True
    assert facts(model_path=str(target), speculative_draft_model_path=None).draft_from_target is True
