"""sglang 0.5.23's speculative wiring (``adapter/spec_0_5_23``): what it refuses, and how sglang's own draft call sites
route a draft decode phase through ``DraftInTreeSlot`` to the draft pool's manager.

The routing runs on a real ``DraftCanaryManager`` (torch reference kernels) in the order 0.5.23's
``EagleDraftWorker.draft`` / ``draft_forward`` enter it: the phase's outer bracket, then each step's
``with_active_single_forward_manager(i)``. No sglang object is needed: this runs on both lines.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_canary.adapter.draft import DraftBatchAdapter
from kv_canary.adapter.spec_0_5_23 import DraftInTreeSlot, spec_unported
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig, CanaryMode
from kv_canary.draft_pool import DRAFT_GROUP, DraftCanaryManager, draft_config
from kv_canary.kernels import CanaryKernels
from kv_canary.kernels import reference as ref
from kv_canary.runner import CanaryBracketError
from kv_canary.speculative import build_accepted_drafts, record_accepted
from kv_canary.views import LaunchCapacities

CPU_EAGLE = dict(speculative_algorithm="EAGLE", device="cpu", disable_overlap_schedule=True,
                 speculative_eagle_topk=1)


def test_eagle_with_topk_1_is_what_is_verified():
    """CPU (synchronous spec v2) and the GPU, with the overlap scheduler (0.5.23's default there) or without it."""
    assert spec_unported(SimpleNamespace(**CPU_EAGLE)) == ""
    assert spec_unported(SimpleNamespace(**dict(CPU_EAGLE, speculative_algorithm="EAGLE3"))) == ""
    for overlap_off in (False, True):
        gpu = dict(CPU_EAGLE, device="cuda", disable_overlap_schedule=overlap_off)
        assert spec_unported(SimpleNamespace(**gpu)) == ""
    assert spec_unported(SimpleNamespace(speculative_algorithm=None, device="cuda")) == ""  # no speculative decoding


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_topk_above_1_is_refused_naming_the_flag(device):
    reason = spec_unported(SimpleNamespace(**dict(CPU_EAGLE, device=device, speculative_eagle_topk=2)))
    assert "--speculative-eagle-topk 2" in reason and "0.5.23" in reason


def _draft_manager(steps: int = 3) -> DraftCanaryManager:
    config = draft_config(CanaryConfig(mode=CanaryMode.RAISE, d2h_delay_steps=0, stats_print_every_n_steps=0))
    k, v = torch.zeros(64, 1, 4), torch.zeros(64, 1, 4)
    group = build_group(PoolLayout(DRAFT_GROUP, [k], [v]), config, torch.device("cpu"))
    return DraftCanaryManager(
        config=config, groups=[group],
        kernels=CanaryKernels("torch", ref.launch_verify, ref.launch_write, ref.launch_scrub, ref.launch_index_sweep,
                              record_accepted, build_accepted_drafts, ref.launch_witness_stamp,
                              ref.launch_witness_check, ref.launch_first_read, graph_safe=False),
        req_to_token=torch.zeros(4, 32, dtype=torch.int32),
        capacities=LaunchCapacities(max_batch_size=5, max_context_len=32, verify_programs_target=1),
        batch_adapter=DraftBatchAdapter(max_batch_size=5, device=torch.device("cpu"), draft_tokens_per_request=steps + 1,
                                        decode_steps=steps - 1),
        device=torch.device("cpu"), num_single_forward_managers=steps - 1)


def test_a_draft_phase_routes_step_i_to_manager_i_and_the_adapter_views_step_i():
    """0.5.23's ``ModelRunner.forward`` hands the model a batch of its own, so the step cannot ride on the phase's
    batch: the slot tells the adapter (``active_step``), and the post-ops see step 0 again."""
    manager = _draft_manager(steps=3)
    slot = DraftInTreeSlot(manager)
    adapter = manager._adapter
    phase_batch = SimpleNamespace()
    seen = []
    with slot.with_ops_outside_graph(single_forward_indices=[0, 1], maybe_inaccurate_forward_batch=phase_batch):
        for i in range(2):
            with slot.with_active_single_forward_manager(i):
                model_batch = SimpleNamespace()  # what the model gets: not the phase's object
                seen.append((manager._active[-1], adapter.draft_step(model_batch)))
        assert adapter.draft_step(phase_batch) == 0  # outside a step: the phase's first
    assert seen == [(0, 0), (1, 1)]
    assert adapter.draft_step(SimpleNamespace()) == 0 and manager._active == []
    # a batch the 0.5.12 hooks marked keeps its own step
    assert adapter.draft_step(SimpleNamespace(kv_canary_draft_step=1)) == 1


def test_the_extends_run_on_manager_0_and_a_step_past_the_managers_is_an_error():
    manager = _draft_manager(steps=3)
    slot = DraftInTreeSlot(manager)
    with slot.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=SimpleNamespace()):
        with slot.with_active_single_forward_manager(0):
            assert manager._active == [0] and manager._adapter.draft_step(SimpleNamespace()) == 0
    with pytest.raises(CanaryBracketError):
        slot.with_active_single_forward_manager(2)  # num_steps - 1 = 2 managers: 0 and 1


def test_a_draft_phase_batch_before_its_first_step_has_a_host_layout():
    """0.5.23's ``draft()`` opens the phase's outer step before ``draft_forward`` sets ``input_ids``: the pre-forward
    perturbations read the host layout of that batch (one token per request per step at topk 1)."""
    adapter = DraftBatchAdapter(max_batch_size=5, device=torch.device("cpu"), draft_tokens_per_request=4,
                                decode_steps=2)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE", is_idle=lambda: False), batch_size=2,
                         input_ids=None, req_pool_indices=torch.tensor([3, 1]), seq_lens=torch.tensor([7, 9]),
                         seq_lens_cpu=None, extend_seq_lens=None, extend_seq_lens_cpu=None)
    batch = adapter.host_batch(fb)
    assert batch.rows == [3, 1] and batch.new_lens == [1, 1] and batch.seq_lens == [8, 10]  # step 0 writes c

