"""EAGLE (spec v2, topk 1): the draft model's own KV pool under CUDA graphs, no false alarm, corruption caught.

sglang's own ``EAGLEDraftCudaGraphRunner`` / ``EAGLEDraftExtendCudaGraphRunner`` capture and replay code (padding
included) through the plugin's hooks, with the graph object emulated on CPU (``speculative_draft_harness``:
``CpuDraftGraphRunner``, ``CpuDraftExtendGraphRunner``). Eager draft forwards: ``test_speculative_draft_eager``.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.draft import DraftBatchAdapter, around_draft_graph_replay
from kv_canary.draft_pool import DRAFT_GROUP
from kv_canary.violations import CanaryViolationError
from speculative_draft_harness import (  # test/unit: on the path
    CpuDraftGraphRunner, DraftHarness, EAGLEDraftCudaGraphRunner, ForwardMode, _rounds,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter (CPU CI); on a GPU "
           "host test_e2e_speculative*.py cover EAGLE with real CUDA graphs")


def _stale_padding_row(h):
    """Row 0 is sglang's padding row (the draft graph runner pads with req_pool_indices 0): make it point at live
    slots of row 1 at other positions, so a padding lane that read it would be reported."""
    h.r2t[0, :4] = h.r2t[1, 2:6]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_graph_replays_raise_nothing_are_counted_and_keep_the_token_offset(page_size, kernels):
    """Three requests replay from the batch-size-4 graphs (one padding lane on a stale row 0), one from the
    batch-size-1 graphs, the draft prefill runs eagerly; every replayed HEAD/TAIL is counted on the host."""
    h = DraftHarness(steps=3, page_size=page_size, kernels=kernels, graph_bs=(1, 2, 4))
    assert h.manager.init_finished and h.manager.counters.tolist()[fp.C_FORWARD_INDEX] == 0  # capture forgotten
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14]}, sampled={1: 15, 2: 16, 3: 17})
    _stale_padding_row(h)
    h.sfm_log.clear()
    _rounds(h, [1, 2, 3], [[4, 1, 2], [2, 3, 1], [1, 1, 4]])
    _rounds(h, [2], [[3], [4]])
    c = h.counters()
    assert int(c[fp.C_VIOLATIONS]) == 0 and h.manager.health_violations == 0
    # each round: one replayed draft phase (steps - 1 = 2 forwards, managers 0 and 1) and one replayed draft extend
    assert h.manager.graph_forwards == 5 * (2 + 1) and h.manager.forwards == 1 + 5 * (2 + 1)
    assert h.manager.outer_steps == 1 + 5 * 2
    assert h.sfm_log == [0, 1, 0] * 5  # the replays ran the captured HEADs: step i on manager i, the extend on 0
    assert int(c[fp.C_FORWARD_INDEX]) == h.manager.forwards == int(c[fp.C_VERIFY_LAUNCHES])
    assert int(c[fp.C_WRITE_LAUNCHES]) == h.manager.forwards
    written = 10 + 3 * 3 * (2 + 4) + 2 * (2 + 4)  # prefill; per round: 2 step slots + n extend slots per request
    assert int(c[fp.C_SLOTS_WRITTEN]) == written  # the padding lanes wrote nothing
    rec = h.manager.groups[0].records
    for row in (1, 2, 3):
        for p in sorted(h.convention_positions[row]):
            slot = int(h.r2t[row, p])
            assert int(rec[slot, fp.F_POSITION]) == p
            assert int(rec[slot, fp.F_TOKEN]) == h.own[row][p + 1], (row, p)


def test_a_graph_too_small_for_the_batch_runs_the_draft_eagerly():
    h = DraftHarness(steps=3, graph_bs=(1, 2))
    h.prefill({1: [5, 6, 7], 2: [8, 9], 3: [10, 11]}, sampled={1: 12, 2: 13, 3: 14})
    _rounds(h, [1, 2, 3], [[2, 3, 1]])  # bs 3 > the largest graph: draft_forward and ModelRunner.forward
    assert h.manager.graph_forwards == 0
    _rounds(h, [1, 2], [[1, 4]])
    assert h.manager.graph_forwards == 3 and int(h.counters()[fp.C_VIOLATIONS]) == 0
    assert h.manager.health_violations == 0 and int(h.counters()[fp.C_FORWARD_INDEX]) == h.manager.forwards


class UnmaskedDraftAdapter(DraftBatchAdapter):
    """The draft step view without the padding mask (a padding lane reads [0, fill + i + 1) of row 0)."""

    def view(self, fb):
        view = super().view(fb)
        if fb.forward_mode.name != "DECODE":
            return view
        step = int(getattr(fb, "kv_canary_draft_step", 0))
        return dataclasses.replace(view, seq_lens=fb.seq_lens[: view.batch_size].to(torch.int64) + step + 1)


def test_padding_lanes_of_a_replayed_draft_graph_read_and_write_nothing():
    h = DraftHarness(steps=3, graph_bs=(4,))
    h.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12]}, sampled={1: 13, 2: 14})
    _stale_padding_row(h)
    fb = h.draft_batch([1, 2])
    verified = int(h.counters()[fp.C_SLOTS_VERIFIED])
    around_draft_graph_replay(EAGLEDraftCudaGraphRunner.replay, h.graph_runner, fb)
    c1, c2 = h.committed[1], h.committed[2]
    # the real lanes read [0, c + i) at steps 0 and 1; the two padding lanes nothing
    assert int(h.counters()[fp.C_SLOTS_VERIFIED]) - verified == (c1 + c1 + 1) + (c2 + c2 + 1)
    buffers = h.graph_runner.buffers  # sglang's replay padded lanes 2, 3: row 0, out_cache_loc 0, seq_len 1
    assert buffers.out_cache_loc[2 * 3:].eq(0).all() and buffers.req_pool_indices[2:4].eq(0).all()
    assert buffers.seq_lens[2:4].tolist() == [1, 1] and int(h.counters()[fp.C_VIOLATIONS]) == 0
    # without the mask the same replay reads the stale row 0 through its padding lanes: a false alarm
    bad = DraftHarness(steps=3, graph_bs=(4,), adapter=UnmaskedDraftAdapter)
    bad.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12]}, sampled={1: 13, 2: 14})
    _stale_padding_row(bad)
    with pytest.raises(CanaryViolationError, match="row=0"):
        bad.draft_phase([1, 2])


def test_the_padded_draft_extend_graph_batch_is_viewed_with_its_padding_lanes_empty():
    h = DraftHarness(steps=3, graph_bs=(4,))
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, sampled={1: 11, 2: 12})
    h.draft_phase([1, 2])
    h.draft_extend([1, 2], [2, 3])  # replayed: 2 real requests, 2 padding lanes
    runner = h.extend_graph_runner
    fb = SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=4,
                         input_ids=runner.buffers.input_ids[:16], positions=runner.buffers.positions[:16],
                         out_cache_loc=runner.buffers.out_cache_loc[:16],
                         req_pool_indices=runner.buffers.req_pool_indices[:4], seq_lens=runner.buffers.seq_lens[:4])
    fb.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    view = h.manager._adapter.view(fb)
    assert view.seq_lens.tolist() == [h.committed[1] - 2 + 4, h.committed[2] - 3 + 4, 0, 0]
    assert view.new_lens.tolist() == [4] * 4 and view.new_starts.tolist() == [0, 4, 8, 12]
    assert view.input_ids.dtype == torch.int64 and int(h.counters()[fp.C_VIOLATIONS]) == 0
    assert h.manager.graph_forwards == 3


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupt_draft_slot_is_caught_inside_a_replayed_draft_graph(page_size):
    h = DraftHarness(steps=3, page_size=page_size, graph_bs=(1, 2, 4))
    h.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12, 13]}, sampled={1: 14, 2: 15})
    _rounds(h, [1, 2], [[2, 1]])
    slot = int(h.r2t[1, 3])
    h.k[slot, 0, 1] += 1.0  # a flipped K value of a committed draft slot
    with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*slot={slot}"):
        h.draft_phase([1, 2])


def test_a_redirected_req_to_token_entry_is_caught_inside_a_replayed_draft_extend():
    h = DraftHarness(steps=3, graph_bs=(2,))
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    h.draft_phase([1])
    h.r2t[1, 2] = h.r2t[1, 4]  # the row points position 2 at position 4's draft slot
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.draft_extend([1], [2])


def test_capture_is_silent_and_routes_each_step_to_its_manager():
    """While the draft's graphs capture (warmups included) nothing is reported or counted; a recapture after init
    leaves the device counters as they were (the health check sees no forward the host never counted)."""
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    before = h.manager.counters.tolist()
    h.sfm_log.clear()
    runner = CpuDraftGraphRunner(h, (1, 2))  # a recapture after init (sglang's adaptive path), reporting on
    assert h.sfm_log == [0, 1] * 3 * 2  # two warmups + the capture per batch size, step i on manager i
    assert h.manager.outer_steps == 1 and h.manager.forwards == 1  # no outer bracket ran while capturing
    assert h.manager.counters.tolist() == before
    assert runner.graphs[1] is not None and not h.manager.is_capturing


def test_the_draft_views_under_graphs_use_only_variants_precompiled_at_install():
    """No JIT after startup: with the draft pool's install-time precompile (``api._precompile``: every write block,
    every verify-grid class, the speculative variants), the replayed and eager draft forwards add no variant."""
    from kv_canary.kernels import VERIFY_BLOCK
    from kv_canary.kernels import triton_kernels as tk
    from kv_canary.kernels.variants import VariantTracker, programs_classes, track, write_block_lengths

    h = DraftHarness(steps=3, kernels="triton", graph_bs=(1, 2, 4))
    tracker = VariantTracker()
    tracked = track(h.manager.kernels, tracker, tk.tail_variant)
    h.manager.kernels = tracked
    for sfm in h.manager.single_forward_managers:
        sfm._kernels = tracked
    caps = h.manager.capacities
    h.manager.precompile(sorted(write_block_lengths(tk.tail_variant, caps.max_context_len).values()),
                         sorted(programs_classes(lambda bs: caps.verify_programs_per_request(bs, VERIFY_BLOCK),
                                                 caps.max_batch_size).values()), verify_staged=True)
    tracker.seal()
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14]}, sampled={1: 15, 2: 16, 3: 17})
    _rounds(h, [1, 2, 3], [[4, 1, 2], [2, 3, 1]])  # replayed (batch size 4)
    h.graph_runner.capture_bs, h.extend_graph_runner.capture_bs = [1], [1]
    h.graph_runner.max_bs = h.extend_graph_runner.max_bs = 1
    _rounds(h, [1, 2], [[1, 4]])  # eager: draft_forward and ModelRunner.forward
    assert h.manager.graph_forwards == 2 * 3 and int(h.counters()[fp.C_VIOLATIONS]) == 0
    assert tracker.after_startup == {}, tracker.after_startup
