"""The sweep's cached-slot index follows sglang's real ``SWARadixCache`` (adapter/swa_radix).

sglang 0.5.12's own tree, allocator (``SWATokenToKVPoolAllocator``, its live full -> swa
mapping) and pool on CPU, with the plugin's hooks applied the way sglang's
HookRegistry applies AROUND/AFTER hooks. After every tree operation -- inserts with
splits, SWA eviction (tombstones), a tombstoned node revived by an insert (its full
slots replaced without a store event), full eviction (tombstone leaves deleted),
reset -- the index must equal a brute-force walk of the tree, and the slots the swa
group's sweep reaches (held, mapping > 0) must be exactly the non-tombstoned nodes'.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.mem_cache import base_prefix_cache  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool, SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache  # noqa: E402

from kv_canary.adapter import swa_radix  # noqa: E402
from kv_canary.cache_index import CachedSlotIndex  # noqa: E402

CPU = torch.device("cpu")
WINDOW = 4


@pytest.fixture
def hooked(monkeypatch):
    """The plugin's SWARadixCache / allocator hooks, applied as HookRegistry applies them."""
    from kv_canary import sglang_plugin as plugin
    from kv_canary.adapter import hooks
    from kv_canary.adapter.lines.v0_5_12 import LINE as V0_5_12

    for target, (name, kind) in V0_5_12.hooks.items():
        if ".SWARadixCache." not in target and ".SWATokenToKVPoolAllocator." not in target:
            continue
        cls = SWARadixCache if ".SWARadixCache." in target else SWATokenToKVPoolAllocator
        attr = target.rsplit(".", 1)[1]
        original, hook = getattr(cls, attr), plugin.resolve_hook(name)
        if kind == "around":
            def wrapped(*args, _original=original, _hook=hook, **kwargs):
                return _hook(_original, *args, **kwargs)
        else:
            assert kind == "after"

            def wrapped(*args, _original=original, _hook=hook, **kwargs):
                result = _original(*args, **kwargs)
                _hook(result, *args, **kwargs)
                return result
        monkeypatch.setattr(cls, attr, wrapped)


def _cache():
    pool = SWAKVPool(size=96, size_swa=48, page_size=1, dtype=torch.float32, head_num=1, head_dim=4,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], enable_kvcache_transpose=False,
                     device="cpu", enable_alt_stream=False)
    alloc = SWATokenToKVPoolAllocator(size=96, size_swa=48, page_size=1, dtype=torch.float32, device="cpu",
                                      kvcache=pool, need_sort=False)
    cache = SWARadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                          page_size=1, sliding_window_size=WINDOW))
    return cache, alloc


def _request(cache, alloc, tokens):
    """A request: match its prefix, compute the rest into new slots, insert the whole sequence (as sglang)."""
    match = cache.match_prefix(base_prefix_cache.MatchPrefixParams(key=RadixKey(tokens)))
    prefix = match.device_indices
    new = alloc.alloc(len(tokens) - len(prefix))
    value = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
    cache.insert(base_prefix_cache.InsertParams(key=RadixKey(tokens), value=value, prev_prefix_len=len(prefix)))
    return value


def _tree_truth(cache):
    """{slot: (pred, position, token)} of every node, and the slots of the non-tombstoned nodes."""
    held, live = {}, set()
    stack = [(c, 0, None) for c in cache.root_node.children.values()]
    while stack:
        node, start, parent_last = stack.pop()
        slots = node.value.tolist()
        for k, (slot, tok) in enumerate(zip(slots, node.key.token_ids)):
            held[slot] = (slots[k - 1] if k else (parent_last if start else 0), start + k, tok)
        if not node.swa_tombstone:
            live.update(slots)
        stack.extend((c, start + len(slots), slots[-1]) for c in node.children.values())
    return held, live


def _tombstoned_path(cache):
    """The tokens from the root to the end of the first tombstoned node."""
    stack = [(c, []) for c in cache.root_node.children.values()]
    while stack:
        node, toks = stack.pop()
        toks = toks + list(node.key.token_ids)
        if node.swa_tombstone:
            return toks
        stack.extend((c, toks) for c in node.children.values())
    raise AssertionError("no tombstoned node")


def _check(index, cache, alloc):
    index.apply_pending()
    held = index.held.nonzero().flatten().tolist()
    state = {s: (int(index.pred[s]), int(index.position[s]), int(index.token[s])) for s in held}
    want, live = _tree_truth(cache)
    assert state == want
    mapping = alloc.full_to_swa_index_mapping
    assert {s for s in held if int(mapping[s]) > 0} == live  # what the swa group's sweep reaches
    return want, live


def test_index_follows_swa_radix_cache_through_tombstones_and_revival(hooked):
    cache, alloc = _cache()
    rng = random.Random(0)
    words = lambda n: [rng.randrange(1, 1000) for _ in range(n)]  # noqa: E731
    a = words(12)
    _request(cache, alloc, a)  # before the index is attached: picked up by attach_index's walk
    index = CachedSlotIndex(97, CPU)
    view = swa_radix.SWARadixCacheView(cache)
    assert view.supports(cache)
    view.attach_index(index)
    _check(index, cache, alloc)
    b = a[:6] + words(6)
    c = b + words(5)
    for seq in (b, c, a[:9] + words(4)):  # splits, a child extending b, another split
        _request(cache, alloc, seq)
        _check(index, cache, alloc)
    # SWA eviction: internal nodes (root first) lose their swa KV -> tombstones, mapping 0
    tombstoned = set()
    for _ in range(6):  # LRU leaves go whole; internal nodes closer to the root are tombstoned
        cache.evict(base_prefix_cache.EvictParams(swa_num_tokens=3))
        held, live = _check(index, cache, alloc)
        tombstoned = set(held) - live
        if tombstoned:
            break
    assert tombstoned, "no node was tombstoned"
    # a request recomputes a tombstoned prefix: insert revives the node with its new slots (old ones freed)
    before = dict(held)
    path = _tombstoned_path(cache)
    value = _request(cache, alloc, path + words(3))
    held, live = _check(index, cache, alloc)
    assert set(value[:len(path)].tolist()) <= live  # the recomputed prefix is cached with live swa KV
    replaced = set(before) - set(held)
    assert replaced and replaced <= tombstoned  # only tombstoned slots were replaced (freed, dropped)
    # every unlocked node evictable: full eviction deletes leaves and the tombstone leaves behind them
    cache.evict(base_prefix_cache.EvictParams(num_tokens=8))
    _check(index, cache, alloc)
    cache.evict(base_prefix_cache.EvictParams(num_tokens=1000))
    held, _ = _check(index, cache, alloc)
    assert held == {}
    _request(cache, alloc, words(7))
    _check(index, cache, alloc)
    cache.reset()
    assert _check(index, cache, alloc) == ({}, set())


def test_unused_slot_pick_skips_locked_nodes(hooked):
    cache, alloc = _cache()
    a = list(range(100, 110))
    _request(cache, alloc, a)
    b = a[:5] + [7, 8, 9]
    _request(cache, alloc, b)
    match = cache.match_prefix(base_prefix_cache.MatchPrefixParams(key=RadixKey(b)))
    cache.inc_lock_ref(match.last_device_node)  # a running request holds b and the shared prefix
    view = swa_radix.SWARadixCacheView(cache)
    rng = random.Random(1)
    held, _ = _tree_truth(cache)
    a_tail = {s for s, (_, pos, tok) in held.items() if pos >= 5 and tok >= 100}
    picks = {view.pick_unused_slot(rng) for _ in range(200)}
    assert {s for s, _ in picks} == a_tail and all(held[s][1] == p for s, p in picks)
