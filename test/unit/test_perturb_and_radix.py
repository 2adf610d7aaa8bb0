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


def _group(real_data="partial"):
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.config import CanaryConfig, RealData

    k = [torch.zeros(8, 2, 8) for _ in range(3)]
    v = [torch.zeros(8, 2, 8) for _ in range(3)]
    return build_group(PoolLayout("full", k, v), CanaryConfig(real_data=RealData(real_data)), torch.device("cpu"))


def test_kv_flips_land_anywhere_in_the_slot_by_default():
    from kv_canary.perturb.real_kv import flip_kv_byte

    g, rng = _group(), random.Random(1)
    flips = [flip_kv_byte(g, 3, rng) for _ in range(300)]
    assert {(f.layer, f.half) for f in flips} == {(layer, h) for layer in range(3) for h in "kv"}
    assert max(f.byte for f in flips) >= 48 and any(not f.hashed for f in flips)  # rows are 64 bytes
    # each flip changed exactly one byte of slot 3 (XOR 0xFF twice restores, so count odd flips)
    changed = sum(int((r.view[3] != 0).sum()) for r in g.rows)
    assert changed > 0 and all(int((r.view[s] != 0).sum()) == 0 for r in g.rows for s in (0, 1, 2, 4))


def test_kv_flip_specs_hashed_and_one_place():
    from kv_canary.config import CanaryConfigError
    from kv_canary.perturb.real_kv import check_flip_spec, flip_kv_byte

    g, rng = _group(), random.Random(2)
    assert all(f.hashed and f.layer == 0 and f.byte < 16 for f in (flip_kv_byte(g, 1, rng, "hashed") for _ in range(50)))
    f = flip_kv_byte(g, 1, rng, "-1:k:mid")
    assert (f.layer, f.half, f.byte, f.hashed) == (2, "k", 32, False)
    assert int(g.rows[4].view[1].view(torch.uint8)[32]) == 0xFF
    with pytest.raises(CanaryConfigError, match="no such row"):
        check_flip_spec(g, "5:k:0")
    with pytest.raises(CanaryConfigError, match="real-data none hashes no K/V bytes"):
        check_flip_spec(_group("none"), "hashed")
