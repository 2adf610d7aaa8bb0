"""The translated/windowed kernel paths (hybrid sliding-window pools) against the torch reference.

A two-group pool as sglang 0.5.12's ``SWAKVPool`` lays it out: a ``full`` group
indexed by the engine's slots and a smaller ``swa`` group reached through a
full -> swa mapping (the allocator's ``full_to_swa_index_mapping``), with the SWA
slots of positions that left the window released (mapping 0) and handed to
another request. HEAD must verify the swa group only inside the window, never
the released slots, and both backends must agree on records and violations.
"""

from __future__ import annotations

import pytest
import torch

# kernel_sim first: it sets TRITON_INTERPRET on CPU before Triton is imported
from kv_canary_testing.kernel_sim import DEVICE, decode_read_view, extend_view, violations_since

from kv_canary import fingerprint as fp
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig
from kv_canary.kernels import reference as ref
from kv_canary.kernels import triton_kernels as tk

FULL_SLOTS, SWA_SLOTS, CTX, WINDOW = 400, 160, 120, 12


class SwaSim:
    """full + swa groups, req_to_token in full slots, the mapping, two allocators, SWA release."""

    def __init__(self, backend, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.backend = backend
        self.kf = [torch.randn(FULL_SLOTS, 2, 8, generator=g).to(DEVICE) for _ in range(2)]
        self.vf = [torch.randn(FULL_SLOTS, 2, 8, generator=g).to(DEVICE) for _ in range(2)]
        self.ks = [torch.randn(SWA_SLOTS, 2, 8, generator=g).to(DEVICE)]
        self.vs = [torch.randn(SWA_SLOTS, 2, 8, generator=g).to(DEVICE)]
        self.mapping = torch.zeros(FULL_SLOTS + 2, dtype=torch.int64, device=DEVICE)
        self.mapping[-1] = -1
        config = CanaryConfig(kv_hash_layers=(0,), kv_hash_bytes=16)
        self.groups = [build_group(PoolLayout("full", self.kf, self.vf), config, DEVICE),
                       build_group(PoolLayout("swa", self.ks, self.vs, slot_translation=self.mapping, window=WINDOW),
                                   config, DEVICE)]
        self.r2t = torch.zeros(8, CTX, dtype=torch.int32, device=DEVICE)
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
        self.counters[fp.C_REPORT_ENABLED] = 1
        self.ring = torch.zeros(512, fp.RING_WIDTH, dtype=torch.int64, device=DEVICE)
        self.next_full = 1
        # the SWA allocator hands slots out in a scrambled order (so swa != full slot numbers)
        self.swa_free = torch.randperm(SWA_SLOTS - 1, generator=torch.Generator().manual_seed(seed + 5)).add(1).tolist()
        self.evicted = {}  # row -> positions below this had their SWA slot released
        self.rng = torch.Generator().manual_seed(seed + 1)

    def forward(self, reqs):
        entries = []
        for row, prefix, toks in reqs:
            full = torch.arange(self.next_full, self.next_full + len(toks), dtype=torch.int64)
            self.next_full += len(toks)
            swa = torch.tensor([self.swa_free.pop(0) for _ in toks], dtype=torch.int64)
            self.mapping[full.to(DEVICE)] = swa.to(DEVICE)
            entries.append((row, prefix, toks, full))
        view = extend_view(self.r2t, entries)
        for gi, group in enumerate(self.groups):
            self.backend.launch_verify(group, view, self.r2t, self.counters, self.ring, 2, 16, group_index=gi)
        loc = view.out_cache_loc
        for layer in range(2):  # "attention" writes K/V: full layers at full slots, the swa layer translated
            self.kf[layer][loc] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
            self.vf[layer][loc] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
        self.ks[0][self.mapping[loc]] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
        self.vs[0][self.mapping[loc]] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
        for gi, group in enumerate(self.groups):
            self.backend.launch_write(group, view, self.r2t, self.counters, self.ring, gi == 1, block=16,
                                      group_index=gi, check_fed=gi == 0)  # the token oracle: test_kernels

    def release_outside_window(self, row, seq_len):
        """sglang's _evict_swa: free the SWA slots of positions < seq_len - window - 1 (mapping -> 0)."""
        lo, hi = self.evicted.get(row, 0), max(0, seq_len - WINDOW - 1)
        for p in range(lo, hi):
            full = int(self.r2t[row, p])
            self.swa_free.append(int(self.mapping[full]))
            self.mapping[full] = 0
        self.evicted[row] = max(lo, hi)

    def verify(self, reqs):
        """HEAD of a decode forward reading positions [0, n) of each (row, n); new violations, sorted."""
        view = decode_read_view(reqs)
        before = int(self.counters[fp.C_VIOLATIONS])
        for gi, group in enumerate(self.groups):
            self.backend.launch_verify(group, view, self.r2t, self.counters, self.ring, 3, 16, group_index=gi)
        return violations_since(self.counters, self.ring, before)


def _scenario(sim):
    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(1, 500, (n,), generator=g).tolist()  # noqa: E731
    sim.forward([(1, 0, tok(30)), (2, 0, tok(20))])  # prefill, longer than the window
    sim.forward([(1, 30, tok(25))])  # a second chunk: reads 30 prefix positions, the swa group only 12
    lengths = {1: 55, 2: 20}
    for step in range(30):  # decode, releasing SWA slots that left the window (reused by the next tokens)
        for row in (1, 2):
            sim.release_outside_window(row, lengths[row])
        sim.forward([(row, lengths[row], tok(1)) for row in (1, 2)])
        lengths = {r: n + 1 for r, n in lengths.items()}
    sim.forward([(3, 0, tok(40))])  # a new request reuses released SWA slots
    lengths[3] = 40
    return lengths


def _by_key(found):
    out = {}
    for row in found:
        key = (row[fp.V_REASON] >> fp.GROUP_SHIFT, row[fp.V_ROW], row[fp.V_POSITION])
        out[key] = out.get(key, 0) | (row[fp.V_REASON] & ((1 << fp.GROUP_SHIFT) - 1))
    return out


def test_swa_group_clean_run_matches_reference_and_verifies_only_the_window():
    sims = [SwaSim(tk), SwaSim(ref)]
    lengths = [_scenario(s) for s in sims][0]
    for gi in range(2):
        assert torch.equal(sims[0].groups[gi].records, sims[1].groups[gi].records)
    assert [int(s.counters[fp.C_VIOLATIONS]) for s in sims] == [0, 0]
    before = [int(s.counters[fp.C_SLOTS_VERIFIED]) for s in sims]
    assert before[0] == before[1] > 0
    everyone = list(lengths.items())
    assert [s.verify(everyone) for s in sims] == [[], []]
    verified = int(sims[0].counters[fp.C_SLOTS_VERIFIED]) - before[0]
    # full group: every prefix position; swa group: the last WINDOW of each
    assert verified == sum(lengths.values()) + sum(min(WINDOW, n) for n in lengths.values())
    assert int(sims[1].counters[fp.C_SLOTS_VERIFIED]) - before[1] == verified
    # the mapping really diverged and released slots (not the identity)
    full = sims[0].r2t[1, 70:85].to(torch.int64)
    assert not torch.equal(sims[0].mapping[full], full)
    assert int((sims[0].mapping[sims[0].r2t[1, :40].to(torch.int64)] == 0).sum()) > 0


def test_swa_corruptions_inside_the_window_are_detected_released_slots_never():
    sims = [SwaSim(tk), SwaSim(ref)]
    lengths = [_scenario(s) for s in sims][0]
    n1 = lengths[1]
    for s in sims:
        swa = s.groups[1]
        # swa kv byte of row 1 inside the window (position n1 - 3)
        s.ks[0][int(s.mapping[int(s.r2t[1, n1 - 3])])].view(-1)[0] += 1.0
        # full kv byte of row 2 outside the swa window (position 2): only the full group sees it
        s.kf[0][int(s.r2t[2, 2])].view(-1)[0] += 1.0
        # a released SWA slot's old record: nothing verifies it any more (row 1 position 5's mapping is 0)
        assert int(s.mapping[int(s.r2t[1, 5])]) == 0
        # the mapping of row 3 position 35 (inside its window) lost: a slot violation in the swa group
        s.mapping[int(s.r2t[3, 35])] = 0
        del swa
    found = [s.verify(list(lengths.items())) for s in sims]
    assert found[0] == found[1]
    keys = _by_key(found[0])
    assert keys[(1, 1, n1 - 3)] == fp.R_KV_HASH
    assert keys[(0, 2, 2)] == fp.R_KV_HASH
    assert keys[(1, 3, 35)] == fp.R_SLOT
    assert (1, 3, 36) not in keys  # predecessor unknown: the chain link is not checked, nothing else fails
    assert set(keys) == {(1, 1, n1 - 3), (0, 2, 2), (1, 3, 35)}, keys
    # the swa ring rows carry the swa slot (the group's own index), not the full slot
    row = next(r for r in found[0] if r[fp.V_REASON] >> fp.GROUP_SHIFT == 1 and r[fp.V_POSITION] == n1 - 3)
    assert row[fp.V_SLOT] == int(sims[0].mapping[int(sims[0].r2t[1, n1 - 3])])


@pytest.mark.parametrize("backend", [tk, ref], ids=["triton", "torch"])
def test_swa_chain_catches_a_foreign_slot_inside_the_window(backend):
    sim = SwaSim(backend)
    lengths = _scenario(sim)
    n2 = lengths[2]
    # row 2's swa mapping for position n2 - 4 now points at row 1's swa slot of another position
    full = int(sim.r2t[2, n2 - 4])
    sim.mapping[full] = sim.mapping[int(sim.r2t[1, lengths[1] - 2])]
    keys = _by_key(sim.verify(list(lengths.items())))
    assert keys[(1, 2, n2 - 4)] & (fp.R_POSITION | fp.R_CHAIN)
    assert keys[(1, 2, n2 - 3)] == fp.R_CHAIN  # the successor's link
    assert not any(g == 0 for g, _, _ in keys)  # the full group is untouched


def _cache_index_of(sim, rows_lengths):
    """The sweep's index over engine slots for whole cached sequences (as the radix hooks fill it)."""
    from kv_canary.cache_index import CachedSlotIndex

    index = CachedSlotIndex(FULL_SLOTS, DEVICE)
    for row, n in rows_lengths:
        toks = sim.groups[0].records[sim.r2t[row, :n].to(torch.int64), fp.F_TOKEN].tolist()
        index.add(sim.r2t[row, :n].to(torch.int64), toks, 0, None)
    index.apply_pending()
    return index


def test_swa_index_sweep_translates_and_skips_released_slots():
    """Both groups swept from one engine-slot index: the swa group through the mapping, released slots never."""
    from kv_canary.kernels import index_sweep

    sims = [SwaSim(tk), SwaSim(ref)]
    lengths = [_scenario(s) for s in sims][0]
    launch = {id(tk): index_sweep.launch_index_sweep, id(ref): ref.launch_index_sweep}
    cached = list(lengths.items())
    found = []
    for s in sims:
        sweep = launch[id(s.backend)]
        index = _cache_index_of(s, cached)
        live_swa = sum(int((s.mapping[s.r2t[r, :n].to(torch.int64)] > 0).sum()) for r, n in cached)
        assert 0 < live_swa < sum(lengths.values())  # some swa slots were released (tombstone-like)
        before = int(s.counters[fp.C_VIOLATIONS])
        for gi, group in enumerate(s.groups):
            sweep(group, index, s.counters, s.ring, group_index=gi)
        assert int(s.counters[fp.C_VIOLATIONS]) == before  # clean: no false alarm in either group
        assert int(s.counters[fp.C_SLOTS_SWEPT]) == sum(lengths.values()) + live_swa
        # a flipped byte in a live swa slot of a cached position; a released slot's row flipped too
        n1 = lengths[1]
        s.ks[0][int(s.mapping[int(s.r2t[1, n1 - 5])])].view(-1)[0] += 1.0
        released = int(s.r2t[1, 3])
        assert int(s.mapping[released]) == 0
        s.kf[0][released].view(-1)[0] += 1.0  # the full group still holds it: caught there
        for gi, group in enumerate(s.groups):
            sweep(group, index, s.counters, s.ring, group_index=gi)
        n = int(s.counters[fp.C_VIOLATIONS]) - before
        found.append(sorted(tuple(s.ring[(before + i) % s.ring.shape[0]].tolist()) for i in range(n)))
    assert found[0] == found[1]
    keys = {(r[fp.V_REASON] >> fp.GROUP_SHIFT, r[fp.V_SLOT], r[fp.V_POSITION]): r[fp.V_REASON] & 0xFF
            for r in found[0]}
    s = sims[0]
    assert keys == {(1, int(s.mapping[int(s.r2t[1, lengths[1] - 5])]), lengths[1] - 5): fp.R_KV_HASH,
                    (0, int(s.r2t[1, 3]), 3): fp.R_KV_HASH}, keys
