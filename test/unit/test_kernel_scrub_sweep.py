"""The scrub (every byte of a round-robin window) and the index sweep (the radix cache's slots against their
records), Triton against the torch reference (``kv_canary_testing.kernel_sim``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_canary_testing.kernel_sim import DEVICE, NUM_SLOTS, Sim, scenario as _scenario

from kv_canary import fingerprint as fp
from kv_canary.config import RealData
from kv_canary.kernels import reference as ref
from kv_canary.kernels import triton_kernels as tk




def test_scrub_checks_every_byte_of_a_round_robin_window():
    """partial HEAD misses a flip in the last layer; the scrub (FULL_HASH) finds it within the stated bound."""
    sims = [Sim(tk, full_hash=True), Sim(ref, full_hash=True)]
    lengths = [_scenario(s) for s in sims][0]
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    per_forward, span = 64, NUM_SLOTS - 1
    bound = -(-span // per_forward)
    for s in sims:
        for _ in range(bound):  # a clean pass over the whole pool
            s.backend.launch_scrub(s.group, s.counters, s.ring, per_forward)
            s.counters[fp.C_FORWARD_INDEX] += 1
        assert int(s.counters[fp.C_VIOLATIONS]) == 0
        assert int(s.counters[fp.C_SLOTS_SCRUBBED]) == s.next_slot - 1  # every written slot, once
        last_k = [r for r in s.group.rows if r.half == "k"][-1]
        last_k.view[int(s.r2t[2, 10]), last_k.row_words // 2] ^= 1 << 7
        assert s.verify_all(list(lengths.items())) == []  # HEAD (partial window) cannot see it
        found = []
        for _ in range(bound):
            before = int(s.counters[fp.C_VIOLATIONS])
            s.backend.launch_scrub(s.group, s.counters, s.ring, per_forward)
            s.counters[fp.C_FORWARD_INDEX] += 1
            found += s.new_violations(before)
        assert [(r[fp.V_SLOT], r[fp.V_POSITION], r[fp.V_REASON], r[fp.V_BATCH_INDEX]) for r in found] == [
            (int(s.r2t[2, 10]), 10, fp.R_KV_HASH, -2)]


def test_a_scrub_after_its_forwards_bump_checks_its_own_forwards_window():
    """``after_write`` (a load-back forward's scrub runs after the TAIL's write bumped the forward counter): at
    counter F + 1 it checks forward F's window, as a HEAD scrub at F does, and its ring rows name F; without it the
    next forward's window would be checked twice and F's never."""
    sims = [Sim(tk, full_hash=True), Sim(ref, full_hash=True)]
    [_scenario(s) for s in sims]
    for s in sims:
        f = int(s.counters[fp.C_FORWARD_INDEX])
        start = f * 16 % (NUM_SLOTS - 1)
        flipped = 1 + (start + 5) % (NUM_SLOTS - 1)  # in forward f's window
        assert int(s.group.records[flipped, fp.F_CHAIN]) != 0, "a written slot"
        s.group.rows[-1].view[flipped, 1] ^= 1 << 2
        s.backend.launch_scrub(s.group, s.counters, s.ring, 16)  # HEAD at f
        head = int(s.counters[fp.C_SLOTS_SCRUBBED])
        assert [(int(r[fp.V_SLOT]), int(r[fp.V_FORWARD])) for r in s.new_violations(0)] == [(flipped, f)]
        s.counters[fp.C_FORWARD_INDEX] = f + 1  # the write's bump
        s.backend.launch_scrub(s.group, s.counters, s.ring, 16, after_write=True)
        assert int(s.counters[fp.C_SLOTS_SCRUBBED]) == 2 * head > 0
        assert [(int(r[fp.V_SLOT]), int(r[fp.V_FORWARD])) for r in s.new_violations(1)] == [(flipped, f)]


def test_forgotten_slots_are_skipped_by_the_scrub_and_the_rest_still_checked():
    """``CanaryBufferGroup.forget``: K/V stored without a TAIL (spec v1's draft scratch slots, a tree verify's nodes)
    into recorded slots; their records forgotten (zeros, first-read tags too) the scrub skips them, a flip in a slot
    still recorded is found; forgetting the padding slot 0 (a padding lane) changes nothing; an int32 index or a
    group with a slot map is refused (``ValueError``), never a silent partial forget."""
    sims = [Sim(tk, full_hash=True, real_data=RealData.ALL), Sim(ref, full_hash=True, real_data=RealData.ALL)]
    lengths = [_scenario(s) for s in sims][0]
    span = NUM_SLOTS - 1
    for s in sims:
        scratch = s.r2t[2, 5:9].to(torch.int64)  # row 2 finished: its slots are free, their records stay
        s.group.full_row.tags[scratch] = s.group.records[scratch, fp.F_FULL_HASH]  # first-read verified
        for r in s.group.rows:  # another owner's K/V stored there, no TAIL (every row, layer 0's window too)
            r.view[scratch] ^= 1 << 3
        others = s.group.records.clone()
        padding = torch.zeros(3, dtype=torch.int64, device=scratch.device)  # padding lanes (slot 0)
        s.group.forget(torch.cat([scratch, padding]))
        assert s.group.records[scratch].eq(0).all() and s.group.full_row.tags[scratch].eq(0).all()
        keep = torch.ones(NUM_SLOTS, dtype=torch.bool)
        keep[scratch] = False
        assert torch.equal(s.group.records[keep], others[keep]) and s.group.records[0].eq(0).all()
        s.backend.launch_scrub(s.group, s.counters, s.ring, span)  # the whole pool in one window
        assert int(s.counters[fp.C_VIOLATIONS]) == 0
        assert int(s.counters[fp.C_SLOTS_SCRUBBED]) == s.next_slot - 1 - len(scratch)
        flipped = int(s.r2t[3, 10])
        s.group.rows[-1].view[flipped, 0] ^= 1 << 5
        s.backend.launch_scrub(s.group, s.counters, s.ring, span)
        assert [(int(r[fp.V_SLOT]), int(r[fp.V_REASON])) for r in s.new_violations(0)] == [(flipped, fp.R_KV_HASH)]
        with pytest.raises(ValueError, match="int64"):
            s.group.forget(scratch.to(torch.int32))
    assert lengths[2] > 9
    mapped = dataclasses.replace(sims[1].group, slot_map=torch.arange(NUM_SLOTS))
    with pytest.raises(ValueError, match="slot map"):
        mapped.forget(torch.tensor([1]))


def _index_of(sim, rows_lengths):
    """A CachedSlotIndex holding whole cached sequences, as the radix hooks would fill it."""
    from kv_canary.cache_index import CachedSlotIndex

    index = CachedSlotIndex(NUM_SLOTS, DEVICE)
    for row, n in rows_lengths:
        seq = sim.r2t[row, :n].to(torch.int64)
        index.add(seq, sim.own[row][:n], 0, None)
    index.apply_pending()
    return index


def test_index_sweep_matches_reference_and_finds_unused_corruption():
    from kv_canary.kernels import index_sweep

    sims = [Sim(tk), Sim(ref)]
    launch = {id(tk): index_sweep.launch_index_sweep, id(ref): ref.launch_index_sweep}
    for s in sims:
        _scenario(s)
    cached = [(3, 33), (1, 93)]
    for s in sims:
        sweep = launch[id(s.backend)]
        index = _index_of(s, cached)
        sweep(s.group, index, s.counters, s.ring)
        assert int(s.counters[fp.C_VIOLATIONS]) == 0
        assert int(s.counters[fp.C_SLOTS_SWEPT]) == 33 + 93
        s.group.sources[1].view[int(s.r2t[3, 20]), 1] ^= 1 << 9  # a slot only the cache holds (V, layer 0)
        sweep(s.group, index, s.counters, s.ring)
        # a slot the cache no longer holds is not checked, even when corrupt
        index.remove(s.r2t[3, :33].to(torch.int64))
        index.apply_pending()
        sweep(s.group, index, s.counters, s.ring)
        assert int(s.counters[fp.C_SLOTS_SWEPT]) == 2 * (33 + 93) + 93
    rows = [[s.ring[i].tolist() for i in range(int(s.counters[fp.C_VIOLATIONS]))] for s in sims]
    assert rows[0] == rows[1] and len(rows[0]) == 1
    r = rows[0][0]
    assert (r[fp.V_REASON], r[fp.V_POSITION], r[fp.V_BATCH_INDEX], r[fp.V_ROW]) == (fp.R_KV_HASH, 20, -1, -1)


def test_index_sweep_catches_a_cached_slot_rewritten_by_another_sequence():
    """The cache claims token t at position p; the slot's record now says another token (a reused slot)."""
    from kv_canary.kernels import index_sweep

    s = Sim(tk)
    _scenario(s)
    index = _index_of(s, [(3, 33)])
    slot = int(s.r2t[3, 10])
    index.token[slot] += 1  # the claim no longer matches the record's token
    index_sweep.launch_index_sweep(s.group, index, s.counters, s.ring)
    assert int(s.counters[fp.C_VIOLATIONS]) == 1
    assert s.ring[0, fp.V_REASON].item() & fp.R_TOKEN and s.ring[0, fp.V_SLOT].item() == slot
