"""The sweep's cached-slot index follows sglang's real ``MambaRadixCache`` (adapter/mamba_radix).

sglang 0.5.12's own tree, KV pool + allocator (``MHATokenToKVPool``, ``TokenToKVPoolAllocator``) and
``HybridReqToTokenPool`` with its ``MambaPool`` on CPU, the plugin's hooks applied the way sglang's HookRegistry
applies AFTER hooks. Requests run as the scheduler runs them (match the prefix, compute the rest into new slots
and one new mamba state, insert, free the mamba state if the tree already had one); "computing" writes random K/V
and the record TAIL would write (token, position, chain, kv_hash). After every tree operation -- inserts with
splits (a split node has no mamba state: a tombstone from birth), a request recomputing a tombstoned prefix (its
duplicate slots freed, the tree's kept), mamba eviction (internal nodes tombstoned, leaves evicted with the
tombstones behind them), full eviction, slot reuse, reset -- the index must equal a brute-force walk of the tree,
and a sweep (the Triton kernel and its torch twin) over it must check exactly those slots and find nothing. A
corrupted held slot (a tombstoned node's, whose KV the tree still holds) is reported; a corrupted freed slot
never is. The plugin's scheduler hook attaches this view to a MambaRadixCache and refuses the sweep with any
other tree class.
"""

from __future__ import annotations

import os
import random
import types

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# sglang's tree, pools and the canary's index live on the CPU here; the Triton sweep runs on them only under the
# interpreter (on a GPU host, compiled Triton needs CUDA tensors: the torch twin alone checks there)
SWEEPS = ("triton", "torch") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang.srt import server_args as sglang_server_args  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.mem_cache import base_prefix_cache  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from kv_canary import fingerprint as fp  # noqa: E402
from kv_canary.adapter import mamba_radix  # noqa: E402
from kv_canary.buffer_groups import PoolLayout, build_group  # noqa: E402
from kv_canary.cache_index import CachedSlotIndex  # noqa: E402
from kv_canary.config import CanaryConfig  # noqa: E402
from kv_canary.kernels import index_sweep  # noqa: E402
from kv_canary.kernels import reference as ref  # noqa: E402

CPU = torch.device("cpu")
SLOTS = 96  # KV pool size (slot 0 is sglang's padding slot)
MAMBA_STATES = 12


@pytest.fixture
def hooked(monkeypatch):
    """The plugin's MambaRadixCache hooks, applied as HookRegistry applies AFTER hooks; sglang's global args."""
    from kv_canary import sglang_plugin as plugin
    from kv_canary.adapter import hooks
    from kv_canary.adapter.lines.v0_5_12 import LINE as V0_5_12

    applied, calls = 0, {}
    for target, (name, kind) in V0_5_12.hooks.items():
        if ".MambaRadixCache." not in target:
            continue
        assert kind == "after"
        attr = target.rsplit(".", 1)[1]
        original, hook = getattr(MambaRadixCache, attr), plugin.resolve_hook(name)

        def wrapped(*args, _original=original, _hook=hook, _attr=attr, **kwargs):
            result = _original(*args, **kwargs)
            _hook(result, *args, **kwargs)
            calls[_attr] = calls.get(_attr, 0) + 1
            return result
        monkeypatch.setattr(MambaRadixCache, attr, wrapped)
        applied += 1
    assert applied == 4
    # match_prefix reads mamba_cache_chunk_size from sglang's global server args (set by the scheduler)
    monkeypatch.setattr(sglang_server_args, "_global_server_args", types.SimpleNamespace(mamba_cache_chunk_size=4))
    return calls


class Engine:
    """sglang's pools and MambaRadixCache, driven as the scheduler drives them; the canary's records and sweep."""

    def __init__(self, seed=0):
        self.pool = MHATokenToKVPool(size=SLOTS, page_size=1, dtype=torch.float32, head_num=1, head_dim=4,
                                     layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        self.alloc = TokenToKVPoolAllocator(size=SLOTS, dtype=torch.float32, device="cpu", kvcache=self.pool,
                                            need_sort=False)
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4,
                                        state_size=4, conv_kernel=2)
        self.req_pool = HybridReqToTokenPool(size=4, mamba_size=MAMBA_STATES, mamba_spec_state_size=MAMBA_STATES,
                                             max_context_len=64, device="cpu", enable_memory_saver=False,
                                             cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                                             mamba_layer_ids=[0], enable_mamba_extra_buffer=False)
        self.cache = MambaRadixCache(CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                                     token_to_kv_pool_allocator=self.alloc, page_size=1))
        self.group = build_group(PoolLayout("full", [self.pool.k_buffer[0]], [self.pool.v_buffer[0]]),
                                 CanaryConfig(), CPU)
        self.index = CachedSlotIndex(self.group.num_slots, CPU)
        self.rng = torch.Generator().manual_seed(seed)
        self.counters = {b: _counters() for b in SWEEPS}
        self.ring = {b: torch.zeros(64, fp.RING_WIDTH, dtype=torch.int64) for b in SWEEPS}
        self.swept = 0

    def request(self, tokens):
        """Match, compute the unmatched tokens (K/V + the record TAIL writes), insert; the slots it used."""
        match = self.cache.match_prefix(base_prefix_cache.MatchPrefixParams(key=RadixKey(tokens)))
        prefix = match.device_indices.to(torch.int64)
        new = self.alloc.alloc(len(tokens) - len(prefix))
        if new is None:
            self.cache.evict(base_prefix_cache.EvictParams(num_tokens=len(tokens) - len(prefix)))
            new = self.alloc.alloc(len(tokens) - len(prefix))
        self._compute(new.to(torch.int64), tokens, len(prefix), prefix[-1:])
        mamba = self.req_pool.mamba_pool.alloc(1)
        if mamba is None:
            self.cache.evict(base_prefix_cache.EvictParams(num_tokens=0, mamba_num=1))
            mamba = self.req_pool.mamba_pool.alloc(1)
        value = torch.cat([prefix, new.to(torch.int64)])
        result = self.cache.insert(base_prefix_cache.InsertParams(key=RadixKey(tokens), value=value.clone(),
                                                                  mamba_value=mamba, prev_prefix_len=len(prefix)))
        if result.mamba_exist:
            self.req_pool.mamba_pool.free(mamba)
        return value

    def _compute(self, slots, tokens, start, pred):
        n = len(slots)
        k, v = self.pool.k_buffer[0], self.pool.v_buffer[0]
        k[slots] = torch.randn(n, *k.shape[1:], generator=self.rng)
        v[slots] = torch.randn(n, *v.shape[1:], generator=self.rng)
        toks = torch.tensor(tokens[start:], dtype=torch.int64)
        pos = torch.arange(start, start + n, dtype=torch.int64)
        base = self.group.records[int(pred[0]), fp.F_CHAIN] if start > 0 else torch.tensor(fp.CHAIN_ANCHOR)
        rec = self.group.records
        rec[slots, fp.F_TOKEN], rec[slots, fp.F_POSITION] = toks, pos
        rec[slots, fp.F_CHAIN] = base + torch.cumsum(fp.chain_term(toks, pos), 0)
        rec[slots, fp.F_KV_HASH] = fp.kv_hash_from_words(self.group.hashed_words(slots))

    def sweep(self):
        """Both sweep backends over the index; the violation rows each appended."""
        found = {}
        launches = {"triton": index_sweep.launch_index_sweep, "torch": ref.launch_index_sweep}
        for backend in SWEEPS:
            launch, c, ring = launches[backend], self.counters[backend], self.ring[backend]
            before = int(c[fp.C_VIOLATIONS])
            launch(self.group, self.index, c, ring)
            found[backend] = sorted(tuple(ring[(before + i) % ring.shape[0]].tolist())
                                    for i in range(int(c[fp.C_VIOLATIONS]) - before))
        assert all(rows == found["torch"] for rows in found.values())
        return found["torch"]

    def check(self):
        """Index == the tree; the sweep checks exactly the tree's slots and finds nothing. The tree's slots."""
        self.index.apply_pending()
        held = self.index.held.nonzero().flatten().tolist()
        state = {s: (int(self.index.pred[s]), int(self.index.position[s]), int(self.index.token[s])) for s in held}
        want = tree_truth(self.cache)
        assert state == want
        assert self.sweep() == []
        self.swept += len(want)
        assert all(int(c[fp.C_SLOTS_SWEPT]) == self.swept for c in self.counters.values())
        return want


def _counters():
    c = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64)
    c[fp.C_REPORT_ENABLED] = 1
    return c


def tree_truth(cache):
    """{slot: (pred slot, position, token)} of every node that holds KV (tombstoned ones included)."""
    held = {}
    stack = [(c, 0, None) for c in cache.root_node.children.values()]
    while stack:
        node, start, parent_last = stack.pop()
        slots = node.value.tolist()
        for k, (slot, tok) in enumerate(zip(slots, node.key.token_ids)):
            assert slot not in held, "a slot held twice"
            held[slot] = (slots[k - 1] if k else (parent_last if start else 0), start + k, tok)
        stack.extend((c, start + len(slots), slots[-1]) for c in node.children.values())
    return held


def _nodes(cache):
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _path_to(node):
    toks = []
    while node.parent is not None:
        toks = list(node.key.token_ids) + toks
        node = node.parent
    return toks


def test_index_follows_mamba_radix_cache_through_tombstones_evictions_and_reuse(hooked):
    eng = Engine()
    cache, rng = eng.cache, random.Random(0)
    words = lambda n: [rng.randrange(1, 1000) for _ in range(n)]  # noqa: E731
    a = words(12)
    eng.request(a)  # before the index is attached: picked up by attach_index's walk
    view = mamba_radix.MambaRadixCacheView(cache)
    assert view.supports(cache) and not mamba_radix.MambaRadixCacheView.supports(object())
    view.attach_index(eng.index)
    eng.check()
    # b shares a's first 6 tokens: the match splits a (the split node has no mamba state, so the match
    # returns nothing and b recomputes all 12: insert frees b's 6 duplicates and keeps the tree's)
    b = a[:6] + words(6)
    used = eng.request(b)
    held = eng.check()
    assert not set(used[:6].tolist()) & set(held)  # the duplicates are not the tree's
    c = b + words(5)  # extends b's leaf (mamba state there): prefix hit of 12
    eng.request(c)
    eng.request(a[:9] + words(4))  # another split of a
    eng.check()
    tombstones = [n for n in _nodes(cache) if n.mamba_value is None]
    assert tombstones, "no split node"
    # mamba eviction: internal nodes lose their mamba state (KV kept), leaves go with the tombstones behind them
    eng.request(c)  # c's path most recent (b's node older than c's); evict every other mamba state
    with_state = [n for n in _nodes(cache) if n.mamba_value is not None]
    cache.evict(base_prefix_cache.EvictParams(num_tokens=0, mamba_num=len(with_state) - 1))
    eng.check()
    tombstoned = [n for n in _nodes(cache) if n.mamba_value is None and n.children and len(n.value) == 6
                  and n.parent is not cache.root_node]
    assert tombstoned, "b's node was not tombstoned"
    # a corrupted slot of the tombstoned node (its KV still held) is found by the sweep
    slot = int(tombstoned[0].value[-1])
    clean = eng.pool.k_buffer[0][slot].clone()
    eng.pool.k_buffer[0][slot].view(-1)[0] += 1.0
    rows = eng.sweep()
    eng.swept += len(tree_truth(cache))
    assert [(r[fp.V_REASON] & 0xFF, r[fp.V_SLOT], r[fp.V_POSITION]) for r in rows] == [(fp.R_KV_HASH, slot, 11)]
    eng.pool.k_buffer[0][slot] = clean
    # a request through a tombstoned node: recomputed past the last mamba state, then the node gets its state
    # back ("add for mamba tombstone") without a KV change; and one extending it
    target = tombstoned[0]
    path, kept = _path_to(target), target.value.clone()
    eng.request(path)
    eng.check()
    assert target.mamba_value is not None and torch.equal(target.value, kept)
    eng.request(path + words(4))
    eng.check()
    for _ in range(3):  # more mamba evictions: a tombstoned node whose last child goes is deleted with it
        eng.request(words(3) + words(5))
        cache.evict(base_prefix_cache.EvictParams(num_tokens=0, mamba_num=1))
        eng.check()
    # full eviction: LRU leaves and the tombstone leaves behind them; their slots freed (a corrupted freed
    # slot is never swept) and then reused
    for _ in range(4):
        eng.request(words(10))
    before = set(eng.check())
    cache.evict(base_prefix_cache.EvictParams(num_tokens=10))
    after = set(eng.check())
    freed = before - after
    assert freed
    for s in freed:  # corrupt every freed slot: never swept
        eng.pool.k_buffer[0][s].view(-1)[0] += 1.0
    eng.check()
    for _ in range(6):  # refill the pool: freed slots are reallocated with new content and cached again
        eng.request(words(14))
        eng.check()
    assert freed & set(tree_truth(cache)), "no freed slot was cached again"
    cache.evict(base_prefix_cache.EvictParams(num_tokens=10_000))
    assert eng.check() == {}
    eng.request(words(7))
    eng.check()
    cache.reset()
    assert eng.check() == {}
    eng.request(words(5))
    assert len(eng.check()) == 5
    assert all(hooked.get(h, 0) > 0 for h in ("_record_store_event", "_delete_leaf", "_delete_tombstone_leaf",
                                               "reset")), hooked  # every path the tree can take was taken


def test_unused_slot_pick_skips_locked_nodes_and_includes_tombstones(hooked):
    eng = Engine()
    cache = eng.cache
    a = list(range(100, 110))
    eng.request(a)
    b = a[:5] + [7, 8, 9]
    eng.request(b)  # splits a at 5: the shared node has no mamba state
    match = cache.match_prefix(base_prefix_cache.MatchPrefixParams(key=RadixKey(b)))
    cache.inc_lock_ref(match.last_device_node)  # a running request holds b and the shared prefix
    view = mamba_radix.MambaRadixCacheView(cache)
    rng = random.Random(1)
    held = tree_truth(cache)
    a_tail = {s for s, (_, pos, tok) in held.items() if pos >= 5 and tok >= 100}
    picks = {view.pick_unused_slot(rng) for _ in range(200)}
    assert {s for s, _ in picks} == a_tail and all(held[s][1] == p for s, p in picks)
    cache.dec_lock_ref(match.last_device_node)
    shared = {s for s, (_, pos, _) in held.items() if pos < 5}
    picks = {view.pick_unused_slot(rng)[0] for _ in range(400)}
    assert shared <= picks  # the tombstone (split node, no mamba state) holds KV: a target too


class _Manager:
    """The two things ``_after_scheduler_init`` reads of the canary's manager: its config, attach_prefix_cache."""

    def __init__(self, config):
        self.config, self.attached = config, None

    def attach_prefix_cache(self, view):
        self.attached = view


def _scheduler(tree, manager):
    runner = types.SimpleNamespace(canary_manager=manager)
    return types.SimpleNamespace(tp_worker=types.SimpleNamespace(model_runner=runner), tree_cache=tree,
                                 server_args=types.SimpleNamespace(kv_canary="log"))


def test_plugin_attaches_the_mamba_view_and_refuses_other_mamba_trees(hooked):
    from kv_canary import sglang_plugin as plugin
    from kv_canary.adapter import hooks
    from kv_canary.adapter.lines.v0_5_12 import LINE as V0_5_12
    from kv_canary.config import CanaryConfigError

    eng = Engine()
    manager = _Manager(CanaryConfig(sweep_interval=4))
    hooks.after_scheduler_init(None, _scheduler(eng.cache, manager))
    assert isinstance(manager.attached, mamba_radix.MambaRadixCacheView)

    class HiMambaRadixCache(MambaRadixCache):  # another tree over the same nodes (host offload): not followed
        pass

    other = HiMambaRadixCache(CacheInitParams(disable=False, req_to_token_pool=eng.req_pool,
                                              token_to_kv_pool_allocator=eng.alloc, page_size=1))
    with pytest.raises(CanaryConfigError, match="--kv-canary-sweep-interval 4 .* HiMambaRadixCache: the sweep "
                       "follows RadixCache, SWARadixCache and MambaRadixCache only"):
        hooks.after_scheduler_init(None, _scheduler(other, _Manager(CanaryConfig(sweep_interval=4))))
