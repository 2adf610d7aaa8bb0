"""The 0.5.23 sweep walks sglang's UnifiedRadixCache again only when the tree may have changed (``TreeChanges``).

Drives sglang's own Rust tree core through random inserts, matches, locks, unlocks, evictions and resets: after
every step the sweep's index must hold exactly the rows a fresh walk gives, whether the view walked or reused
its last walk (less the slots evicted since); a run of reads and locks must not walk at all, nor evictions.
"""

import random

import pytest
import torch

from test_contain_unified import KV_SIZE, Cache, _seq  # sglang 0.5.23's tree, allocator and the canary's records

pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache", reason="sglang 0.5.23's UnifiedRadixCache")


def _rows(tree):
    walk = tree.tree_core.walk_for_kv_canary(False, False)
    return {s: (p, max(q, 0)) for s, p, q in zip(walk.slot_indices.tolist(), walk.positions.tolist(),
                                                 walk.prev_slot_indices.tolist())}


def _indexed(index):
    index.apply_pending()
    held = index.held.nonzero().flatten().tolist()
    return {s: (int(index.position[s]), int(index.pred[s])) for s in held}


def _view(cache):
    from kv_canary.adapter.unified_radix import UnifiedRadixCacheView
    from kv_canary.cache_index import CachedSlotIndex

    view = UnifiedRadixCacheView(cache.tree, cache.records)
    index = CachedSlotIndex(KV_SIZE + 1, torch.device("cpu"))
    view.attach_index(index)
    return view, index


def test_the_rust_core_is_followed_and_the_python_core_walked_every_sweep():
    assert _view(Cache("rust"))[0].changes is not None
    view, _ = _view(Cache("python"))
    assert view.changes is None
    view.before_sweep()
    view.before_sweep()
    assert view.walks == 3 and view.walks_skipped == 0  # attach + two sweeps


def test_the_index_is_the_trees_after_every_step_whether_walked_or_not():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

    cache = Cache("rust")
    view, index = _view(cache)
    rng = random.Random(5)
    seqs = [_seq(rng.randrange(4, 40), start=rng.randrange(0, 300)) for _ in range(12)]
    locks = []
    for step in range(300):
        op = rng.choice(["insert", "match", "lock", "unlock", "evict", "read", "read", "read"]
                        + (["reset"] if step % 97 == 96 else []))
        if op == "insert" and cache.alloc.available_size() > 48:
            base = rng.choice(seqs)
            cache.insert(base[:rng.randrange(1, len(base) + 1)] + ([rng.randrange(1000)] if rng.random() < .5 else []))
        elif op == "match":
            cache.hit(rng.choice(seqs))
        elif op == "lock":
            node = cache.tree.match_prefix(MatchPrefixParams(key=cache.key(rng.choice(seqs)))).last_device_node
            locks.append(cache.tree.lock(node))
        elif op == "unlock" and locks:
            cache.tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op == "evict":
            cache.tree.evict(EvictParams(num_tokens=rng.randrange(1, 32)))
        elif op == "reset" and not locks:
            cache.tree.reset()
        walks = view.walks
        view.before_sweep()
        assert _indexed(index) == _rows(cache.tree), (step, op, view.walks > walks)
    assert view.walks_skipped > 50 and view.walks > 20 and view.slots_evicted > 0, (view.walks, view.walks_skipped,
                                                                                   view.slots_evicted)


def test_reads_and_locks_do_not_walk_and_a_change_walks_once():
    cache = Cache("rust")
    a = _seq(20)
    cache.insert(a)
    view, index = _view(cache)
    core = cache.tree.tree_core
    for _ in range(5):
        core.walk_for_kv_canary(True, False)
        core.evictable_size(), core.protected_size(), core.total_size()
        view.before_sweep()
    assert view.walks == 1 and view.walks_skipped == 5
    cache.insert(_seq(6, start=400))
    view.before_sweep()
    view.before_sweep()
    assert view.walks == 2 and view.walks_skipped == 6
    assert _indexed(index) == _rows(cache.tree)


def test_evictions_drop_their_slots_without_a_walk():
    """A full pool evicting leaf after leaf (a decode under memory pressure, issue 57): no walk, and the index
    less the freed slots is the tree's after each sweep."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = Cache("rust")
    for i in range(20):  # 20 leaves of 24 slots under one shared 4-token node: 484 of the 512 slots
        cache.insert(_seq(4, start=900) + _seq(20, start=i * 20))
    view, index = _view(cache)
    held = len(_indexed(index))
    for _ in range(6):
        cache.tree.evict(EvictParams(num_tokens=30))  # two leaves each time
        view.before_sweep()
        assert _indexed(index) == _rows(cache.tree)
    assert view.walks == 1 and view.walks_skipped == 6
    assert view.slots_evicted == held - len(_rows(cache.tree)) >= 6 * 30


def test_remove_all_drops_each_tensors_slots():
    """``CachedSlotIndex.remove_all``: several engine tensors (one empty) dropped as one queued remove."""
    from kv_canary.cache_index import CachedSlotIndex

    index = CachedSlotIndex(16, torch.device("cpu"))
    index.add(torch.arange(10), list(range(10)), 0, None)
    index.remove_all([torch.tensor([1, 2], dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                      torch.tensor([7])])
    assert index.pending == 2
    index.apply_pending()
    assert index.held.nonzero().flatten().tolist() == [0, 3, 4, 5, 6, 8, 9]


def test_an_eviction_step_result_is_read_by_what_it_freed():
    """``TreeChanges.note_eviction``: the walk's brackets (None) change nothing; a step's FULL frees are kept, other
    components' frees (SWA, mamba state) are not rows of the walk; a result of another shape walks again."""
    from types import SimpleNamespace

    from kv_canary.adapter.unified_radix import TreeChanges
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    changes = TreeChanges(Cache("rust").tree.tree_core)
    assert changes.take() == (True, [])  # the first call walks
    changes.note_eviction(None)
    changes.note_eviction(SimpleNamespace(device_frees={}))
    changes.note_eviction(SimpleNamespace(device_frees={ComponentType.SWA: [torch.arange(3)]}))
    assert changes.take() == (False, [])
    freed = torch.arange(5, 9)
    changes.note_eviction(SimpleNamespace(device_frees={ComponentType.FULL: [freed, torch.zeros(0)],
                                                        ComponentType.SWA: [torch.arange(3)]}))
    must_walk, evicted = changes.take()
    assert not must_walk and len(evicted) == 1 and evicted[0] is freed
    changes.note_eviction(SimpleNamespace(tracker={}))
    assert changes.take() == (True, [])
