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


@pytest.fixture
def hooked_radix(monkeypatch):
    """RadixCache with the plugin's tree-change hooks applied as sglang's HookRegistry applies AFTER hooks."""
    from kv_canary import sglang_plugin as plugin
    from kv_canary.adapter import hooks
    from kv_canary.adapter.lines.v0_5_12 import LINE as V0_5_12

    cls = radix_cache.RadixCache
    hooks = [(target.rsplit(".", 1)[1], plugin.resolve_hook(hook_name))
             for target, (hook_name, kind) in V0_5_12.hooks.items() if ".radix_cache.RadixCache." in target]
    assert sorted(name for name, _ in hooks) == ["_delete_leaf", "_record_store_event", "reset"]
    for name, hook in hooks:
        original = getattr(cls, name)

        def wrapped(*args, _original=original, _hook=hook, **kwargs):
            result = _original(*args, **kwargs)
            _hook(result, *args, **kwargs)
            return result

        monkeypatch.setattr(cls, name, wrapped)
    return cls


def _index_state(index):
    index.apply_pending()
    held = index.held.nonzero().flatten().tolist()
    return {s: (int(index.pred[s]), int(index.position[s]), int(index.token[s])) for s in held}


def _want(*seqs):
    want = {}
    for seq, slots in seqs:
        for pos, (tok, slot) in enumerate(zip(seq, slots)):
            want[slot] = (slots[pos - 1] if pos else 0, pos, tok)
    return want


def test_cache_index_follows_inserts_splits_evictions_and_reset(hooked_radix):
    from kv_canary.cache_index import CachedSlotIndex

    class Allocator:  # the tree frees evicted slots here
        device = torch.device("cpu")
        freed = []

        def free(self, slots):
            self.freed += slots.tolist()

    allocator = Allocator()
    cache = radix_cache.RadixCache.create_simulated(mock_allocator=allocator)
    a = [100 + i for i in range(10)]
    _insert(cache, a, list(range(1, 11)))  # before the index is attached: picked up by attach_index's walk
    index = CachedSlotIndex(32, torch.device("cpu"))
    RadixCacheView(cache).attach_index(index)
    assert _index_state(index) == _want((a, list(range(1, 11))))
    b = a[:5] + [200, 201, 202]
    _insert(cache, b, list(range(1, 6)) + [11, 12, 13])  # splits a's node at 5; the shared prefix is held once
    c = b + [300, 301]
    _insert(cache, c, list(range(1, 6)) + [11, 12, 13, 14, 15])  # extends b: a child node at position 8
    state = _index_state(index)
    assert state == _want((a, list(range(1, 11))), (c, list(range(1, 6)) + [11, 12, 13, 14, 15]))
    assert len(state) == 15 and index.pending == 0
    # a running request holds c: evicting everything evictable frees only a's own tail (slots 6..10)
    match = cache.match_prefix(base_prefix_cache.MatchPrefixParams(key=radix_cache.RadixKey(c)))
    cache.inc_lock_ref(match.last_device_node)
    cache.evict(base_prefix_cache.EvictParams(num_tokens=100))
    assert sorted(allocator.freed) == list(range(6, 11))
    assert _index_state(index) == _want((c, list(range(1, 6)) + [11, 12, 13, 14, 15]))
    cache.reset()
    assert _index_state(index) == {}


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


def test_a_flip_never_undoes_an_earlier_flip_of_the_same_byte():
    """Flips of one place (a real_kv_used flip of the byte a real_kv_post_forward flip left wrong, seen in CI as a
    'missed' injection) leave the byte changed after each of them, whatever their count."""
    from kv_canary.perturb.real_kv import flip_kv_byte

    g, rng, standing = _group(), random.Random(3), {}
    byte = lambda: int(g.rows[4].view[1].view(torch.uint8)[32])  # noqa: E731
    seen = []
    for _ in range(6):
        flip_kv_byte(g, 1, rng, "-1:k:mid", standing=standing)
        seen.append(byte())
    assert 0 not in seen and seen[:2] == [0xFF, 0xF0]  # 0xFF, then 0x0F in place of the 0xFF that would undo it
    flip_kv_byte(g, 2, rng, "-1:k:mid", standing=standing)  # another slot: its own place
    assert int(g.rows[4].view[2].view(torch.uint8)[32]) == 0xFF
    flip_kv_byte(g, 3, rng, "-1:k:mid")  # no record: two flips with one mask still cancel
    flip_kv_byte(g, 3, rng, "-1:k:mid")
    assert int(g.rows[4].view[3].view(torch.uint8)[32]) == 0


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
