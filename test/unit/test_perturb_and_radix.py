"""Slot picker, warmup gate and the radix-cache walk (on a real sglang RadixCache)."""

from __future__ import annotations

import random

import pytest
import torch

from kv_canary.adapter.radix import RadixCacheView
from kv_canary.perturb.manager import WarmupGate
from kv_canary.perturb.slot_picker import pick_read_slot
from kv_canary.views import HostBatch

radix_cache = pytest.importorskip("sglang.srt.mem_cache.radix_cache")
base_prefix_cache = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")


def test_warmup_gate_opens_after_the_warmup_forwards():
    gate = WarmupGate(3)
    assert [gate.is_open(i) for i in range(5)] == [False, False, False, True, True]
    assert WarmupGate(0).is_open(0)


def test_slot_picker_only_picks_slots_the_forward_reads():
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    r2t[1, :6] = torch.arange(10, 16)  # request 0: 5 read positions + 1 new
    r2t[2, :3] = torch.arange(20, 23)  # request 1: decode of position 2 -> reads 0..1
    batch = HostBatch(rows=[1, 2, 3], seq_lens=[6, 3, 1], new_lens=[1, 1, 1], rids=["a", "b", "c"])
    rng = random.Random(0)
    seen = set()
    for _ in range(400):
        e = pick_read_slot(batch, r2t, rng)
        assert e.position < batch.seq_lens[e.batch_index] - batch.new_lens[e.batch_index]
        assert e.slot == int(r2t[e.row, e.position]) and e.rid == batch.rids[e.batch_index]
        seen.add((e.rid, e.position))
    assert seen == {("a", p) for p in range(5)} | {("b", 0), ("b", 1)}  # never a slot being written
    nothing = HostBatch(rows=[1], seq_lens=[4], new_lens=[4], rids=["a"])  # a fresh prefill reads nothing
    assert pick_read_slot(nothing, r2t, rng) is None


def _insert(cache, tokens, slots):
    cache.insert(base_prefix_cache.InsertParams(key=radix_cache.RadixKey(tokens), value=torch.tensor(slots)))


def _tree():
    cache = radix_cache.RadixCache.create_simulated()
    a = [100 + i for i in range(10)]
    b = a[:5] + [200, 201, 202]
    _insert(cache, a, list(range(1, 11)))
    _insert(cache, b, list(range(1, 6)) + [11, 12, 13])
    return cache, a, b


def test_radix_walk_flattens_cached_sequences_with_predecessors():
    cache, a, b = _tree()
    assert RadixCacheView.supports(cache)
    e = RadixCacheView(cache).sweep_entries(torch.device("cpu"))
    got = {s: (p, pos, t) for s, p, pos, t in zip(*(x.tolist() for x in (e.slots, e.preds, e.positions, e.tokens)))}
    want = {}
    for seq, slots in ((a, list(range(1, 11))), (b, list(range(1, 6)) + [11, 12, 13])):
        for pos, (tok, slot) in enumerate(zip(seq, slots)):
            want[slot] = (slots[pos - 1] if pos else 0, pos, tok)
    assert got == want and e.size == 13  # the shared prefix appears once


def test_unused_slot_is_never_held_by_a_running_request():
    cache, a, b = _tree()
    match = cache.match_prefix(base_prefix_cache.MatchPrefixParams(key=radix_cache.RadixKey(b)))
    cache.inc_lock_ref(match.last_device_node)  # a running request holds b (and the shared prefix)
    view = RadixCacheView(cache)
    rng = random.Random(1)
    picks = {view.pick_unused_slot(rng) for _ in range(200)}
    assert picks == {(slot, slot - 1) for slot in range(6, 11)}  # only a's own tail, with its positions
    cache.inc_lock_ref(cache.match_prefix(base_prefix_cache.MatchPrefixParams(
        key=radix_cache.RadixKey(a))).last_device_node)
    assert view.pick_unused_slot(rng) is None
