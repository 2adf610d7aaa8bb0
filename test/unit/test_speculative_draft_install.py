"""EAGLE's draft pool at install: its config and the target's, where it is skipped, the bytes held back for it, and
an unsupported draft pool (the target stays verified). No draft forwards: ``test_speculative_draft_eager`` /
``test_speculative_draft_graphs`` drive those.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.draft import draft_skip_reason
from kv_canary.config import CanaryConfig, CanaryConfigError, CanaryMode
from kv_canary.draft_pool import DRAFT_GROUP, draft_config, target_config

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter (CPU CI); on a GPU "
           "host test_e2e_speculative*.py cover EAGLE with real CUDA graphs")


def test_draft_and_target_configs():
    base = CanaryConfig(mode=CanaryMode.RAISE, sweep_interval=4, perturb_real_kv_used_prob=0.2)
    d = draft_config(base)
    assert not d.uses_token_oracle and d.write_input_assert and d.sweep_interval == 0
    assert not d.any_perturbation  # perturbations stay in the target's pool by default
    assert target_config(base, "") is base
    to_draft = dataclasses.replace(base, perturb_target_group=DRAFT_GROUP)
    assert draft_config(to_draft).perturb_real_kv_used_prob == 0.2
    assert draft_config(to_draft).perturb_target_group == ""
    assert not target_config(to_draft, "").any_perturbation
    with pytest.raises(CanaryConfigError, match="SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=draft"):
        target_config(to_draft, "no --speculative-algorithm")


def test_the_draft_pool_is_verified_with_or_without_cuda_graphs_and_skipped_where_said():
    """CUDA graphs no longer skip the draft pool (its graph runners are bracketed: the tests below); sglang 0.5.12's
    EagleDraftWorker.__init__ flipping server_args.disable_cuda_graph for its draft runner changes nothing."""
    args = dict(speculative_algorithm="EAGLE", device="cuda", disaggregation_mode="null")
    for graphs_off in (False, True):
        assert draft_skip_reason(SimpleNamespace(**args, disable_cuda_graph=graphs_off), "raise") == ""
    assert draft_skip_reason(SimpleNamespace(**{**args, "device": "cpu"}), "log") == ""
    assert "contain" in draft_skip_reason(SimpleNamespace(**args), "contain")
    assert "--disaggregation-mode decode" in draft_skip_reason(
        SimpleNamespace(**{**args, "disaggregation_mode": "decode"}), "log")
    assert draft_skip_reason(SimpleNamespace(speculative_algorithm=None), "raise")


def test_the_draft_pools_bytes_are_held_back_with_the_targets():
    from kv_canary.api import canary_reserved_bytes

    def runner(**args):
        server_args = SimpleNamespace(kv_canary="raise", kv_canary_sweep_interval=0, kv_canary_real_data="partial",
                                      device="cpu", disable_cuda_graph=True, max_running_requests=8,
                                      disaggregation_mode="null", **args)
        return SimpleNamespace(server_args=server_args, is_draft_worker=False,
                               model_config=SimpleNamespace(context_len=256, is_hybrid_swa=False))

    budget = 1 << 24
    plain = canary_reserved_bytes(runner(speculative_algorithm=None), budget)
    eagle = canary_reserved_bytes(runner(speculative_algorithm="EAGLE"), budget)
    slots = budget // 1024  # at most the slots the budget buys at the fallback cell size
    assert eagle - plain >= 4096 * fp.RING_WIDTH * 8 + slots // 2 * fp.RECORD_WIDTH * 8


def test_an_unsupported_draft_pool_is_skipped_and_said(caplog):
    """The target stays verified (as before the draft pool was); a draft-targeted perturbation is refused."""
    from kv_canary.api import install_draft_canary
    from kv_canary.draft_pool import DRAFT_NOT_VERIFIED

    class SomeOtherPool:
        pass

    import dataclasses

    from kv_canary.adapter.facts import SglangFacts, SpecFacts

    spec = SpecFacts(algorithm="EAGLE", tree_verify=False, num_steps=3, draft_tokens_per_request=4, draft_skip="")
    values = dict(line="0.5.12", device=torch.device("cpu"), tp_rank=0, is_draft_worker=True, model=None,
                  pool=SomeOtherPool(), pool_name="SomeOtherPool", pool_context=None,
                  req_to_token=torch.zeros(2, 8, dtype=torch.int32), req_pool_size=2, cuda_graph_max_bs=0,
                  max_prefill_tokens=64, cuda_graphs=False, pd_mode=None, spec=spec, mrope=False, reserved_bytes=None,
                  tail_anchor=None)
    facts = SglangFacts(**{f.name: values[f.name] for f in dataclasses.fields(SglangFacts)})
    with caplog.at_level("WARNING", logger="kv_canary"):
        assert install_draft_canary(facts, CanaryConfig(mode=CanaryMode.RAISE)) is None
    assert DRAFT_NOT_VERIFIED in caplog.text and "SomeOtherPool" in caplog.text
    to_draft = CanaryConfig(mode=CanaryMode.LOG, perturb_target_group=DRAFT_GROUP, perturb_real_kv_used_prob=0.1)
    with pytest.raises(CanaryConfigError, match="SomeOtherPool"):
        install_draft_canary(facts, to_draft)


def test_a_draft_pool_that_cannot_be_verified_is_refused_over_an_swa_target():
    """An SWAKVPool target is verified with its draft pool verified only (docs/speculative.md): where the draft's
    install fails, it is refused, naming the draft's pool; over an MHA target the same failure only skips it."""
    from kv_canary.api import install_draft_canary
    from kv_canary.adapter.facts import SglangFacts, SpecFacts

    class SomeOtherPool:
        pass

    def facts(target_pool_name):
        spec = SpecFacts(algorithm="EAGLE", tree_verify=False, num_steps=3, draft_tokens_per_request=4,
                         draft_skip="", target_pool_name=target_pool_name)
        values = dict(line="0.5.23", device=torch.device("cpu"), tp_rank=0, is_draft_worker=True, model=None,
                      pool=SomeOtherPool(), pool_name="SomeOtherPool", pool_context=None,
                      req_to_token=torch.zeros(2, 8, dtype=torch.int32), req_pool_size=2, cuda_graph_max_bs=0,
                      max_prefill_tokens=64, cuda_graphs=False, pd_mode=None, spec=spec, mrope=False,
                      reserved_bytes=None, tail_anchor=None)
        return SglangFacts(**{f.name: values[f.name] for f in dataclasses.fields(SglangFacts)})

    with pytest.raises(CanaryConfigError, match="SomeOtherPool"):
        install_draft_canary(facts("SWAKVPool"), CanaryConfig(mode=CanaryMode.RAISE))
    assert install_draft_canary(facts("MHATokenToKVPool"), CanaryConfig(mode=CanaryMode.RAISE)) is None


def test_the_draft_reads_the_target_pool_through_the_shared_allocator():
    """sglang hands the EAGLE draft runner the target's token allocator; its ``get_kvcache()`` is the target's pool."""
    from kv_canary.adapter.facts import SpecFacts

    class SWAKVPool:
        pass

    allocator = SimpleNamespace(get_kvcache=lambda: SWAKVPool())
    args = SimpleNamespace(speculative_algorithm="EAGLE", device="cpu", disaggregation_mode="null",
                           speculative_num_steps=3, speculative_num_draft_tokens=4,
                           speculative_draft_model_path="/d", model_path="/t")
    draft_runner = SimpleNamespace(is_draft_worker=True, token_to_kv_pool_allocator=allocator)
    target_runner = SimpleNamespace(is_draft_worker=False, token_to_kv_pool_allocator=allocator)
    assert SpecFacts.read(args, "raise", draft_runner).target_pool_name == "SWAKVPool"
    assert SpecFacts.read(args, "raise", target_runner).target_pool_name == ""
