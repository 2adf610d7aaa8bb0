"""--kv-canary contain on sglang 0.5.23 (adapter/contain_unified) against a real ``UnifiedRadixCache`` on CPU,
with both of its tree cores (Rust, the default, and Python): the node holding a bad slot and its subtree are
dropped through the tree-core interface, freed once through the allocator, an identical prompt then misses,
nothing else is touched (other branches, another namespace with the same tokens), locked nodes wait; and the
abort side speaks 0.5.23's scheduler (``collect_inflight_reqs``, ``_release_aborted_request``,
``send_abort_output``).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from kv_canary.adapter.contain_unified import UnifiedSchedulerContainment, UnifiedTreeEvictor
from kv_canary.containment import ContainOrder
from kv_canary.fingerprint import F_TOKEN, RECORD_WIDTH

KV_SIZE = 512


def _build(backend: str, page_size: int):
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    req_to_token = ReqToTokenPool(size=8, max_context_len=1024, device="cpu", enable_memory_saver=False)
    pool = MHATokenToKVPool(size=KV_SIZE, page_size=page_size, dtype=torch.bfloat16, head_num=1, head_dim=8,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=KV_SIZE, dtype=torch.bfloat16, device="cpu", kvcache=pool,
                                       need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size=KV_SIZE, page_size=page_size, dtype=torch.bfloat16, device="cpu",
                                            kvcache=pool, need_sort=False)
    params = CacheInitParams(req_to_token_pool=req_to_token, token_to_kv_pool_allocator=alloc, page_size=page_size,
                             disable=False, tree_components=(ComponentType.FULL,),
                             kv_event_lora_names=KvEventLoraNames())
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(backend):
        tree = UnifiedRadixCache(params=params)
    return tree, alloc


class Cache:
    """A UnifiedRadixCache, its allocator, and the canary's records (F_TOKEN per slot, as TAIL writes them)."""

    def __init__(self, backend: str, page_size: int = 1):
        self.tree, self.alloc = _build(backend, page_size)
        self.page = page_size
        self.records = torch.zeros((KV_SIZE + page_size, RECORD_WIDTH), dtype=torch.int64)
        self.slots = {}  # (namespace, tuple(tokens)) -> slots of that sequence

    def key(self, tokens, extra_key=None):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens), extra_key=extra_key)

    def insert(self, tokens, extra_key=None):
        """Cache ``tokens`` the way a finished request does: its prefix from the tree, the rest new slots."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

        m = self.tree.match_prefix(MatchPrefixParams(key=self.key(tokens, extra_key)))
        core = self.tree.tree_core
        prefix = core.collect_full_device_indices(m.last_device_node, core.root_node_handle())[:m.device_prefix_len]
        new = self.alloc.alloc(len(tokens) - len(prefix)).to(torch.int64)
        value = torch.cat([prefix.to(torch.int64), new])
        self.records[value, F_TOKEN] = torch.tensor(tokens, dtype=torch.int64)
        self.tree.insert(InsertParams(key=self.key(tokens, extra_key), value=value, prev_prefix_len=len(prefix)))
        self.slots[(extra_key, tuple(tokens))] = value.tolist()
        return value.tolist()

    def hit(self, tokens, extra_key=None) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.tree.match_prefix(MatchPrefixParams(key=self.key(tokens, extra_key))).device_prefix_len

    def cached(self):
        return set(self.tree.tree_core.walk_for_kv_canary(False, False).slot_indices.tolist())

    def containment(self, **scheduler):
        sched = SimpleNamespace(**{"tp_size": 1, "tree_cache": self.tree, "waiting_queue": [], "chunked_req": None,
                                   "collect_inflight_reqs": lambda: set(), **scheduler})
        manager = SimpleNamespace(groups=[SimpleNamespace(records=self.records)])
        return UnifiedSchedulerContainment(sched, manager)


BACKENDS = ["rust", "python"]


@pytest.fixture(params=BACKENDS)
def cache(request):
    return Cache(request.param)


def _seq(n, start=100):
    return list(range(start, start + n))


def test_supports_the_full_attention_tree(cache):
    assert UnifiedTreeEvictor.supports(cache.tree)
    assert not UnifiedTreeEvictor.supports(None) and not UnifiedTreeEvictor.supports(SimpleNamespace())


def test_the_node_holding_a_bad_slot_and_its_subtree_are_freed_once_and_missed(cache):
    a = _seq(12)  # root -> [0, 8) -> {[8, 12), [8, 10)+x, ...}
    b = a[:8] + [7, 7, 7]
    c = a + [1, 2, 3, 4]
    other = _seq(9, start=500)
    sa, sb, sc, so = cache.insert(a), cache.insert(b), cache.insert(c), cache.insert(other)
    lora = cache.insert(a[:8], extra_key="lora-1")  # the same tokens in another namespace: other slots
    before_avail, before_cached = cache.alloc.available_size(), cache.cached()
    bad = sa[5]  # in the shared node [0, 8): it and every branch below it go
    c_ = cache.containment()
    c_.submit(ContainOrder(aborts={}, slots=(bad, sc[13])))  # the second slot lies below the first one's node
    c_.apply()
    gone = set(sa) | set(sb) | set(sc)
    assert cache.cached() == before_cached - gone
    assert cache.alloc.available_size() - before_avail == len(gone)  # each slot freed once
    assert c_.evicted_tokens == len(gone) and c_.evicted_nodes == 4 and not c_._slots
    assert cache.hit(a) == 0 and cache.hit(c) == 0 and cache.hit(b) == 0  # a retry is computed fresh
    assert cache.hit(other) == len(other) and cache.hit(a[:8], extra_key="lora-1") == 8
    assert set(so) | set(lora) <= cache.cached()


def test_a_bad_slot_in_a_leaf_takes_only_that_leaf(cache):
    a, b = _seq(10), _seq(6) + [1, 1, 1, 1]
    sa, sb = cache.insert(a), cache.insert(b)
    c_ = cache.containment()
    c_.submit(ContainOrder(aborts={}, slots=(sa[8],)))
    c_.apply()
    assert c_.evicted_nodes == 1 and c_.evicted_tokens == 4  # the [6, 10) leaf of a
    assert cache.hit(a) == 6 and cache.hit(b) == 10


def test_a_locked_node_waits_for_its_request(cache):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    a = _seq(10)
    sa = cache.insert(a)
    lock = cache.tree.lock(cache.tree.match_prefix(MatchPrefixParams(key=cache.key(a))).last_device_node)
    c_ = cache.containment()
    c_.submit(ContainOrder(aborts={}, slots=(sa[3],)))
    c_.apply()
    c_.apply()
    assert c_.evicted_nodes == 0 and ("slot", sa[3]) in c_._slots and cache.hit(a) == 10
    cache.tree.unlock(lock)  # the request finished
    c_.apply()
    assert c_.evicted_tokens == 10 and not c_._slots and cache.hit(a) == 0


def test_another_namespace_is_found_through_the_requests_seen(cache):
    a = _seq(8)
    sd, sl = cache.insert(a), cache.insert(a, extra_key="lora-1")
    c_ = cache.containment()
    c_.submit(ContainOrder(aborts={}, slots=(sl[2],)))
    c_.apply()  # no request of that namespace seen yet: not resolved, nothing dropped
    assert c_.evicted_nodes == 0 and ("slot", sl[2]) in c_._slots and cache.hit(a, "lora-1") == 8
    c_._note_namespace(SimpleNamespace(extra_key="lora-1", cache_salt=None))
    c_.apply()
    assert c_.evicted_tokens == 8 and cache.hit(a, "lora-1") == 0 and cache.hit(a) == 8


def test_a_slot_no_node_holds_stays_pending_then_expires(cache, monkeypatch):
    import kv_canary.adapter.contain as contain

    monkeypatch.setattr(contain, "PENDING_TTL", 2)
    cache.insert(_seq(4))
    c_ = cache.containment()
    c_.submit(ContainOrder(aborts={}, slots=(KV_SIZE - 1,)))
    c_.apply()
    assert c_._slots == {("slot", KV_SIZE - 1): 1}
    c_.apply()
    assert not c_._slots and c_.evicted_nodes == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pages_of_16(backend):
    cache = Cache(backend, page_size=16)
    a, b = _seq(48), _seq(32) + _seq(16, start=900)
    sa, sb = cache.insert(a), cache.insert(b)
    before = cache.alloc.available_size()
    c_ = cache.containment()
    c_.submit(ContainOrder(aborts={}, slots=(sa[40],)))
    c_.apply()
    assert c_.evicted_tokens == 16 and cache.alloc.available_size() - before == 16
    assert cache.hit(a) == 32 and cache.hit(b) == 48


def test_aborts_speak_0_5_23s_scheduler():
    from sglang.srt.managers.io_struct import AbortReq

    def req(rid, finished=False):
        return SimpleNamespace(rid=rid, finished=lambda: finished, to_finish=None, skip_radix_cache_insert=False,
                               extra_key=None, cache_salt=None)

    running, done, queued, other = req("run"), req("done", finished=True), req("queued"), req("other")
    released, sent = [], []
    cache = Cache("python")
    c_ = cache.containment(collect_inflight_reqs=lambda: [running, done],
                           _release_aborted_request=released.append,
                           send_abort_output=lambda abort, r: sent.append((abort, r)))
    c_._scheduler.waiting_queue = [other, queued]
    c_.submit(ContainOrder(aborts={"run": "m-run", "done": "m-done", "queued": "m-queued", "gone": "m"}, slots=()))
    c_.apply()
    assert running.to_finish.message == "m-run" and running.skip_radix_cache_insert
    assert done.to_finish is None and done.skip_radix_cache_insert
    assert c_._scheduler.waiting_queue == [other] and released == [queued] and queued.skip_radix_cache_insert
    (abort, r), = sent
    assert isinstance(abort, AbortReq) and r is queued and abort.rid == "queued" and abort.abort_message == "m-queued"
    assert abort.finished_reason["type"] == "abort" and abort.finished_reason["message"] == "m-queued"
    assert c_.aborted == 2


def _violation(rid, slot, position, group="full"):
    from kv_canary.violations import Violation

    return Violation(seq=0, kind="kv_hash", group=group, slot=slot, position=position, rid=rid, row=-1,
                     batch_index=-1, stored=1, expected=2, forward=40, cuda_graph=None)


def test_a_slot_found_at_rest_names_no_request_and_goes_to_its_holders():
    """Scrub and sweep rows abort no pseudo-request: their slot and position go to the engine, which aborts the
    requests holding it. A reader's row aborts the reader and goes to the holders too (HEAD checks a slot read by
    several requests of a batch once, so the row names one of them); another group's rows and unnamed rows do not."""
    from kv_canary.containment import build_order

    order = build_order([_violation("scrub", 5, 3), _violation("cache", 9, 0), _violation("r1", 7, 2),
                         _violation("scrub", 6, 1, group="swa"), _violation("?", 8, 4)], num_slots=64,
                        engine_group="full")
    assert order.aborts.keys() == {"r1"} and order.slots == (5, 6, 7, 8, 9)
    assert [(s, p) for s, p, _ in order.held_slots] == [(5, 3), (7, 2), (9, 0)]
    messages = [m for _, _, m in order.held_slots]
    assert "found by the scrub" in messages[0] and "found by a read by request r1" in messages[1]
    assert "found by the sweep" in messages[2]
    assert all("kind=kv_hash" in m and "slot=" in m for _, _, m in order.held_slots)


def test_the_holders_of_a_bad_slot_are_aborted_and_counted():
    """0.5.23's requests (``Req.kv``): a running request whose row holds the slot at the reported position is
    aborted; one holding it elsewhere (a reused slot), one past its allocated length, and a finished one are not."""
    def req(rid, row, allocated, finished=False):
        return SimpleNamespace(rid=rid, finished=lambda: finished, to_finish=None, skip_radix_cache_insert=False,
                               extra_key=None, cache_salt=None, kv=SimpleNamespace(req_pool_idx=row,
                                                                                   kv_allocated_len=allocated))

    table = torch.zeros((4, 16), dtype=torch.int32)
    table[0, :6] = torch.tensor([11, 12, 13, 5, 14, 15])  # holds slot 5 at position 3
    table[1, :6] = torch.tensor([11, 12, 13, 5, 16, 17])  # a sharer of the same prefix
    table[2, :6] = torch.tensor([5, 18, 19, 20, 21, 22])  # slot 5 at position 0: not the bad copy
    table[3, :3] = torch.tensor([11, 12, 13])
    table[3, 3] = 5  # a stale entry past its allocated length
    reqs = [req("a", 0, 6), req("b", 1, 6), req("c", 2, 6), req("d", 3, 3), req("e", 1, 6, finished=True)]
    counted = []
    c_ = Cache("python").containment(collect_inflight_reqs=lambda: reqs,
                                     req_to_token_pool=SimpleNamespace(req_to_token=table))
    c_.on_holders_aborted(counted.extend)
    from kv_canary.containment import build_order

    c_.submit(build_order([_violation("scrub", 5, 3)], num_slots=64, engine_group="full"))
    c_.apply()
    assert reqs[0].to_finish is not None and reqs[1].to_finish is not None
    assert "found by the scrub" in reqs[0].to_finish.message and "slot=5" in reqs[0].to_finish.message
    assert all(r.to_finish is None for r in reqs[2:])
    assert sorted(counted) == ["a", "b"] and c_.aborted == 2
    # a later row for the same slot (a late reader, or the scrub again) while a and b run their last forward:
    # they are not aborted, logged or counted again
    reqs[0].to_finish = reqs[1].to_finish = None  # a second abort would set them again
    c_.submit(build_order([_violation("scrub", 5, 3)], num_slots=64, engine_group="full"))
    c_.apply()
    assert reqs[0].to_finish is None and reqs[1].to_finish is None
    assert sorted(counted) == ["a", "b"] and c_.aborted == 2
