"""--kv-canary contain with HiCache on sglang 0.5.23 (adapter/contain_hicache_0_5_23) against a real
``UnifiedRadixCache`` on CPU with its Python tree core, HiCache on and every node backed up to host slots
(``tree_core.commit_backup``; the host pool's frees are recorded instead of freed): a bad device slot's or host
slot's node and its subtree leave the device (freed once through the allocator) and the host (each host slot once),
an identical prompt then misses, the other branch stays; a locked node waits; the Rust core (no per-node host drop)
is refused.
"""

from __future__ import annotations

import pytest
import torch

from kv_canary.adapter import contain_hicache_0_5_23 as hc
from kv_canary.config import CanaryConfigError
from kv_canary.containment import ContainOrder

from test_contain_unified import Cache, _seq

HOST = 1000  # host slot = HOST + device slot


class HiCache(Cache):
    def __init__(self, backend: str = "python"):
        super().__init__(backend)
        self.tree.tree_core.set_hicache_enabled()
        self.host_freed = []

        def drain(frees):  # UnifiedRadixCache._drain_host_frees, into a list (no host pool here)
            for ct in list(frees):
                self.host_freed.extend(torch.cat(frees.pop(ct)).tolist() if frees[ct] else [])

        self.tree._drain_host_frees = drain

    def back_up_all(self):
        core = self.tree.tree_core
        stack = list(core.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if hc._full(n).host_value is None:
                core.commit_backup(n.id, hc._full(n).value + HOST, {})


@pytest.fixture
def cache():
    return HiCache()


def test_supports_the_python_core_with_hicache_only(cache):
    assert hc.supports(cache.tree)
    assert not hc.supports(Cache("python").tree)  # no HiCache: contain_unified's own evictor
    rust = Cache("rust")
    rust.tree.tree_core.set_hicache_enabled()
    assert not hc.supports(rust.tree)
    with pytest.raises(CanaryConfigError, match="SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python"):
        rust.containment()


def test_a_bad_device_slot_leaves_the_device_and_the_host(cache):
    a = _seq(12)
    b = a[:8] + [7, 7, 7]  # root -> [0, 8) -> {[8, 12), [8, 11)'}
    sa, sb = cache.insert(a), cache.insert(b)
    cache.back_up_all()
    avail = cache.alloc.available_size()
    contain = cache.containment()
    contain.submit(ContainOrder(aborts={}, slots=(sa[9],)))
    contain.apply()
    assert sorted(cache.host_freed) == [HOST + s for s in sa[8:]]  # the leaf's host copy, each slot once
    assert cache.alloc.available_size() - avail == 4 and contain.evicted_nodes == 1 and contain.evicted_tokens == 4
    assert cache.hit(a) == 8 and cache.hit(b) == 11  # the other branch and the shared prefix stay
    assert not contain._slots


def test_a_bad_host_slot_takes_its_node_and_subtree_from_both_tiers(cache):
    a = _seq(12)
    b = a[:8] + [7, 7, 7]
    other = _seq(5, start=500)
    sa, sb, so = cache.insert(a), cache.insert(b), cache.insert(other)
    cache.back_up_all()
    avail = cache.alloc.available_size()
    contain = cache.containment()
    contain.submit(ContainOrder(aborts={}, host_slots=(HOST + sa[2],), slots=(sb[9],)))  # sb[9]: in the subtree
    contain.apply()
    assert sorted(cache.host_freed) == sorted(HOST + s for s in set(sa) | set(sb))
    assert cache.alloc.available_size() - avail == 15 and contain.evicted_nodes == 3
    assert cache.hit(a) == 0 and cache.hit(b) == 0 and cache.hit(other) == 5
    assert not contain._slots  # the device slot went with its ancestor's subtree: nothing freed twice


def test_a_device_only_node_is_dropped_and_a_locked_node_waits(cache):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    a = _seq(10)
    sa = cache.insert(a)  # not backed up: sglang's drop_subtree_no_host takes it
    lock = cache.tree.lock(cache.tree.match_prefix(MatchPrefixParams(key=cache.key(a))).last_device_node)
    contain = cache.containment()
    contain.submit(ContainOrder(aborts={}, slots=(sa[3],)))
    contain.apply()
    assert cache.hit(a) == 10 and contain.evicted_nodes == 0 and contain._slots  # held by a request: retried
    cache.tree.unlock(lock)  # the request finished
    contain.apply()
    assert cache.hit(a) == 0 and contain.evicted_nodes == 1 and cache.host_freed == [] and not contain._slots
