"""EAGLE (spec v2, topk 1): the draft model's own KV pool in eager draft forwards, no false alarm, corruption caught.

The draft prefill, sglang's own ``EagleDraftWorker.draft_forward`` loop and the draft extends after verifies,
run eagerly through the plugin's hooks on the shared draft harness (``speculative_draft_harness``: real sglang
0.5.12 batches and row layout). Page size 1 and 16; the token convention (draft slot p holds the KV of token
p + 1) is checked in the records the TAIL wrote. Replayed draft graphs: ``test_speculative_draft_graphs``.
"""

from __future__ import annotations

import os

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.batch_adapter import SglangBatchAdapter
from kv_canary.adapter.draft import around_draft_forward
from kv_canary.draft_pool import DRAFT_GROUP, DRAFT_STATS_PREFIX
from kv_canary.violations import CanaryViolationError
from speculative_draft_harness import DraftHarness, EagleDraftWorker, ForwardMode, _rounds  # test/unit: on the path

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter (CPU CI); on a GPU "
           "host test_e2e_speculative*.py cover EAGLE with real CUDA graphs")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_rounds_raise_nothing_and_keep_the_token_offset(page_size, kernels):
    """Also the Triton kernels: draft_forward's per-step out_cache_loc is a strided view (a flat read of it
    wrote other requests' slots: the view copies it into a contiguous buffer)."""
    h = DraftHarness(steps=3, page_size=page_size, kernels=kernels)
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11]}, sampled={1: 12, 2: 13})
    _rounds(h, [1, 2], [[4, 1], [2, 3], [1, 1], [4, 4]])
    c = h.counters()
    assert int(c[fp.C_VIOLATIONS]) == 0
    # one prefill, four draft extends, and per round steps - 1 = 2 decode steps (managers 0 and 1)
    assert h.manager.forwards == 1 + 4 * (2 + 1) and h.manager.outer_steps == 1 + 4 * 2
    assert h.sfm_log == [0] + [0, 1, 0] * 4
    assert int(c[fp.C_FORWARD_INDEX]) == h.manager.forwards == int(c[fp.C_VERIFY_LAUNCHES])
    rec = h.manager.groups[0].records
    for row in (1, 2):
        for p in sorted(h.convention_positions[row]):
            slot = int(h.r2t[row, p])
            assert int(rec[slot, fp.F_POSITION]) == p
            assert int(rec[slot, fp.F_TOKEN]) == h.own[row][p + 1], (row, p)  # slot p: the KV of token p + 1


def test_a_draft_step_reads_the_committed_prefix_plus_the_earlier_steps():
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8]}, sampled={1: 9})
    fb = h.draft_batch([1])
    adapter = h.manager._adapter
    views = []
    for step in range(2):
        fb.kv_canary_draft_step = step
        views.append(adapter.view(fb))
    c = h.committed[1]
    assert [int(v.seq_lens[0]) for v in views] == [c + 1, c + 2]  # reads [0, c + i], writes position c + i
    assert all(int(v.new_lens[0]) == 1 and not v.staged for v in views)
    assert views[0].seq_lens.data_ptr() != views[1].seq_lens.data_ptr()  # a buffer per step (graph-safe)
    before = int(h.counters()[fp.C_SLOTS_VERIFIED])
    around_draft_forward(EagleDraftWorker.draft_forward, h.worker, fb)
    assert int(h.counters()[fp.C_SLOTS_VERIFIED]) - before == c + (c + 1)


def test_a_draft_extend_is_viewed_with_int64_ids_like_every_precompiled_variant():
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, sampled={1: 11, 2: 12})
    h.draft_phase([1, 2])
    fb = h._extend_batch({1: [13, 14, 15, 16], 2: [17, 18, 19, 20]}, {1: 4, 2: 2}, ForwardMode.DRAFT_EXTEND_V2)
    view = h.manager._adapter.view(fb)
    assert fb.input_ids.dtype == torch.int32 and view.input_ids.dtype == torch.int64
    assert view.input_ids.tolist() == fb.input_ids.tolist() and view.staged  # an extend view
    assert view.seq_lens.tolist() == [8, 6] and view.new_lens.tolist() == [4, 4]  # reads [0, c), writes [c, c + n)


def test_the_targets_decode_view_on_a_draft_step_would_be_a_false_alarm():
    """Without the step view (the target's adapter), step 0's TAIL sees position c fed at sequence index c - 1."""
    h = DraftHarness(steps=3, adapter=SglangBatchAdapter)
    h.prefill({1: [5, 6, 7, 8]}, sampled={1: 9})
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.draft_phase([1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_prefix_and_chunk_boundaries_are_not_reported(page_size):
    """The draft slots sglang leaves with another token's KV (a cached prefix's last slot, an unfinished chunk's
    last slot) chain and hash correctly: no token check in the draft pool, so no false alarm."""
    h = DraftHarness(steps=2, page_size=page_size)
    h.prefill({1: list(range(3, 3 + 32))}, sampled={1: 50})
    _rounds(h, [1], [[2], [3]])
    # row 2 shares row 1's first 16 positions (the radix match) and continues with its own tokens in two chunks
    h.prefill({2: [60, 61, 62]}, sampled={2: 40}, shared={2: (1, 16)}, chunk_end={2: True})
    h.prefill({2: [63, 1, 2]}, sampled={2: 41})
    assert h.own[1][16] != h.own[2][16] and int(h.r2t[2, 15]) == int(h.r2t[1, 15])
    _rounds(h, [1, 2], [[1, 3], [3, 2]])
    assert int(h.counters()[fp.C_VIOLATIONS]) == 0
    rec = h.manager.groups[0].records
    # what sglang left: row 1's token at the shared slot 15, the thrown-away sample at the chunk's last slot
    assert int(rec[int(h.r2t[2, 15]), fp.F_TOKEN]) == h.own[1][16]
    assert int(rec[int(h.r2t[2, 18]), fp.F_TOKEN]) == 40


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupt_draft_slot_is_caught_by_the_next_draft_forward(page_size):
    h = DraftHarness(steps=3, page_size=page_size)
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    _rounds(h, [1], [[2]])
    slot = int(h.r2t[1, 3])
    h.k[slot, 0, 1] += 1.0  # a flipped K value of a committed draft slot
    with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*slot={slot}"):
        h.draft_phase([1])


def test_a_redirected_req_to_token_entry_is_caught_in_a_draft_step():
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    h.r2t[1, 2] = h.r2t[1, 4]  # the row points position 2 at position 4's draft slot
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.draft_phase([1])


def test_stats_lines_are_the_draft_pools_own(caplog):
    h = DraftHarness(steps=2)
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    h.counters()
    line = h.manager.stats_line()
    assert line.startswith(DRAFT_STATS_PREFIX + "=") and "slots_written=3" in line


def test_a_draft_loop_with_more_forwards_than_steps_is_an_error():
    from kv_canary.runner import CanaryBracketError

    h = DraftHarness(steps=2)  # one draft decode forward per phase
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    fb = h.draft_batch([1])
    h.runner.kv_canary_draft_steps = iter(range(1))
    h.runner.forward(fb)
    with pytest.raises(CanaryBracketError, match="more draft forwards"):
        h.runner.forward(fb)
