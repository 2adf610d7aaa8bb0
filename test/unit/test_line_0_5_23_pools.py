"""The sglang 0.5.23 line's tensor-parallel and pool readers (``adapter/lines/v0_5_23``).

The table checks run anywhere; the readers of sglang's own objects need sglang 0.5.23 installed and skip
elsewhere.
"""

from __future__ import annotations

import importlib
from array import array
from types import SimpleNamespace

import pytest

from kv_canary.adapter.lines import v0_5_12, v0_5_17, v0_5_23


def installed_sglang():
    try:
        return importlib.import_module("sglang.version").__version__
    except ImportError:
        return None


on_0_5_23 = pytest.mark.skipif(installed_sglang() != "0.5.23", reason="needs sglang 0.5.23 installed")


def test_tensor_parallel_is_no_longer_refused_on_0_5_23_but_still_on_0_5_17():
    args = SimpleNamespace(device="cpu", disable_cuda_graph=True, kv_canary="raise", tp_size=2,
                           disaggregation_mode="null", speculative_algorithm=None)
    assert v0_5_23.unported(args) == ""
    assert "--tp-size" in v0_5_17.unported(args)
    spec = SimpleNamespace(**{**vars(args), "speculative_algorithm": "EAGLE", "disable_overlap_schedule": True,
                              "speculative_eagle_topk": 1})
    assert "--tp-size" in v0_5_23.unported(spec)  # TP with speculative decoding: not run together on 0.5.23


def test_each_line_names_the_pools_it_verifies():
    assert v0_5_12.LINE.verified_pools is None  # every class adapter/pools registers
    assert set(v0_5_23.LINE.verified_pools) >= {"MHATokenToKVPool", "MLATokenToKVPool"}
    assert v0_5_17.LINE.verified_pools == ("MHATokenToKVPool", "MLATokenToKVPool")  # 0.5.23's ports not run there


def test_the_0_5_12_tp_rank_reader_reads_the_model_runner():
    assert v0_5_12.LINE.tp_rank(SimpleNamespace(tp_rank=1)) == 1
    assert v0_5_12.LINE.tp_rank(SimpleNamespace()) == 0


@on_0_5_23
def test_the_0_5_23_tp_rank_reader_reads_sglangs_parallel_context(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(tp_rank=1))
    assert v0_5_23.LINE.tp_rank(SimpleNamespace(tp_rank=0)) == 1  # 0.5.23's ModelRunner has no tp_rank of its own


def test_the_dp_rank_reader_reads_the_model_runner_and_0_5_17_refuses_data_parallel():
    assert v0_5_12.LINE.dp_rank(SimpleNamespace(dp_rank=1)) == 1
    assert v0_5_12.LINE.dp_rank(SimpleNamespace(dp_rank=None)) is None and v0_5_12.LINE.dp_rank(SimpleNamespace()) is None
    args = SimpleNamespace(device="cpu", disable_cuda_graph=True, kv_canary="raise", tp_size=1, dp_size=2,
                           disaggregation_mode="null", speculative_algorithm=None)
    assert v0_5_23.unported(args) == ""
    assert "--dp-size" in v0_5_17.unported(args)


@on_0_5_23
def test_the_0_5_23_dp_rank_reader_falls_back_to_sglangs_parallel_context(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(tp_rank=0, dp_rank=1))
    assert v0_5_23.LINE.dp_rank(SimpleNamespace()) == 1
    assert v0_5_23.LINE.dp_rank(SimpleNamespace(dp_rank=0)) == 0


# ---------------------------------------------------------------- the sweep over a hybrid-SWA UnifiedRadixCache

WINDOW, FULL_SLOTS, SWA_SLOTS = 4, 96, 64


class SwaTree:
    """sglang 0.5.23's own ``SWAKVPool``, ``SWATokenToKVPoolAllocator`` and a FULL + SWA ``UnifiedRadixCache``."""

    def __init__(self, backend: str):
        import torch
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.events import KvEventLoraNames
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
        self.pool = SWAKVPool(size=FULL_SLOTS, size_swa=SWA_SLOTS, page_size=1, dtype=torch.float32, head_num=1,
                              head_dim=4, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
        self.alloc = SWATokenToKVPoolAllocator(size=FULL_SLOTS, size_swa=SWA_SLOTS, page_size=1, dtype=torch.float32,
                                               device="cpu", kvcache=self.pool, need_sort=False)
        params = CacheInitParams(
            req_to_token_pool=ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False),
            token_to_kv_pool_allocator=self.alloc, page_size=1, disable=False, sliding_window_size=WINDOW,
            tree_components=(ComponentType.FULL, ComponentType.SWA), kv_event_lora_names=KvEventLoraNames())
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(backend):
            self.tree = UnifiedRadixCache(params=params)
        self.records = torch.zeros((FULL_SLOTS + 2, 5), dtype=torch.int64)

    def request(self, tokens) -> bool:
        """Match, allocate the rest, insert (as a finished request); False when the pools are full."""
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", tokens))
        m = self.tree.match_prefix(MatchPrefixParams(key=key))
        core = self.tree.tree_core
        prefix = core.collect_full_device_indices(m.last_device_node, core.root_node_handle())[:m.device_prefix_len]
        new = self.alloc.alloc(len(tokens) - len(prefix))
        if new is None:
            return False
        value = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self.records[value, 0] = torch.tensor(tokens, dtype=torch.int64)
        self.tree.insert(InsertParams(key=key, value=value, prev_prefix_len=len(prefix)))
        return True


@on_0_5_23
@pytest.mark.parametrize("backend", ["rust", "python"])
def test_the_sweep_reads_a_hybrid_swa_tree_and_reaches_the_swa_group_only_where_its_kv_is_held(backend):
    """The premise of the swa group's sweep (``unified_radix``): among the walked slots, those whose full -> swa
    mapping is > 0 are exactly the slots whose node still holds its SWA KV -- through inserts with shared
    prefixes, SWA eviction (tombstones), revival by a later insert and full eviction -- and the index the view
    builds before each sweep holds exactly the walked slots, at their positions, chained to their predecessors."""
    import random

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kv_canary.adapter.unified_radix import UnifiedRadixCacheView, unified_view_for
    from kv_canary.cache_index import CachedSlotIndex

    t = SwaTree(backend)
    manager = SimpleNamespace(groups=[SimpleNamespace(records=t.records)])
    view = unified_view_for(t.tree, manager)
    assert isinstance(view, UnifiedRadixCacheView)
    index = CachedSlotIndex(FULL_SLOTS + 2, torch.device("cpu"))
    view.attach_index(index)
    rng, prefixes, swa_tombstones = random.Random(5), [list(range(100, 112)), list(range(200, 208))], 0
    for step in range(40):
        op = rng.random()
        if op < 0.6:
            tokens = rng.choice(prefixes)[:rng.randrange(4, 13)] + [rng.randrange(300, 400) for _ in range(6)]
            if not t.request(tokens):
                t.tree.evict(EvictParams(num_tokens=24, swa_num_tokens=24))
        elif op < 0.85:
            t.tree.evict(EvictParams(num_tokens=0, swa_num_tokens=rng.randrange(4, 20)))
        else:
            t.tree.evict(EvictParams(num_tokens=rng.randrange(4, 20), swa_num_tokens=0))
        walk = t.tree.tree_core.walk_for_kv_canary(False, False)
        resident = set(t.tree.tree_core.walk_for_kv_canary(False, True).slot_indices.tolist())
        slots = walk.slot_indices
        mapped = set(slots[t.alloc.full_to_swa_index_mapping[slots] > 0].tolist())
        assert mapped == resident, (step, sorted(mapped ^ resident))
        swa_tombstones += len(slots) - len(resident)
        view.before_sweep()
        index.apply_pending()
        held = set(torch.nonzero(index.held).flatten().tolist())
        assert held == set(slots.tolist())
        if len(slots):
            assert torch.equal(index.position[slots].to(torch.int64), walk.positions)
            assert torch.equal(index.pred[slots].to(torch.int64), walk.prev_slot_indices.clamp(min=0))
            assert torch.equal(index.token[slots].to(torch.int64), t.records[slots, 0])
    assert swa_tombstones > 0  # the SWA eviction left full slots without their SWA KV along the way


# ---------------------------------------------------------------- the sweep over a hybrid-mamba UnifiedRadixCache

MAMBA_STATES = 6


class MambaTree:
    """sglang 0.5.23's own ``HybridReqToTokenPool`` (mamba states), KV allocator and a FULL + MAMBA tree."""

    def __init__(self, backend: str):
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.events import KvEventLoraNames
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        from kv_canary_testing.model_dir import write_tiny_hybrid_linear_model_dir

        set_global_server_args_for_scheduler(ServerArgs(
            model_path=str(write_tiny_hybrid_linear_model_dir()), page_size=1, device="cpu", load_format="dummy",
            attention_backend="torch_native", disable_cuda_graph=True, mamba_radix_cache_strategy="no_buffer",
            disable_overlap_schedule=True))
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4,
                                        state_size=4, conv_kernel=2)
        self.req_pool = HybridReqToTokenPool(
            size=4, mamba_size=MAMBA_STATES, mamba_spec_state_size=MAMBA_STATES, max_context_len=64, device="cpu",
            enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=[0]), mamba_layer_ids=[0],
            enable_mamba_extra_buffer=False, enable_overlap_schedule=False)
        pool = MHATokenToKVPool(size=FULL_SLOTS, page_size=1, dtype=torch.float32, head_num=1, head_dim=4,
                                layer_num=1, device="cpu", enable_memory_saver=False)
        self.alloc = TokenToKVPoolAllocator(size=FULL_SLOTS, dtype=torch.float32, device="cpu", kvcache=pool,
                                            need_sort=False)
        params = CacheInitParams(req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.alloc, page_size=1,
                                 disable=False, tree_components=(ComponentType.FULL, ComponentType.MAMBA),
                                 kv_event_lora_names=KvEventLoraNames())
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(backend):
            self.tree = UnifiedRadixCache(params=params)
        self.records = torch.zeros((FULL_SLOTS + 2, 5), dtype=torch.int64)

    def request(self, tokens) -> bool:
        """Match (up to the last cached mamba state), allocate the rest and a state, insert; False when full."""
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", tokens))
        m = self.tree.match_prefix(MatchPrefixParams(key=key))
        core = self.tree.tree_core
        prefix = core.collect_full_device_indices(m.last_device_node, core.root_node_handle())[:m.device_prefix_len]
        new, state = self.alloc.alloc(len(tokens) - len(prefix)), self.req_pool.mamba_allocator.alloc(1)
        if new is None or state is None:
            for held in (new, state):
                if held is not None:
                    (self.alloc if held is new else self.req_pool.mamba_allocator).free(held)
            return False
        value = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self.records[value, 0] = torch.tensor(tokens, dtype=torch.int64)
        result = self.tree.insert(InsertParams(key=key, value=value, mamba_value=state, prev_prefix_len=len(prefix)))
        if result.mamba_exist:
            self.req_pool.mamba_allocator.free(state)
        return True


@on_0_5_23
@pytest.mark.parametrize("backend", ["rust", "python"])
def test_the_sweep_reads_a_hybrid_mamba_tree_and_claims_only_slots_the_tree_holds(backend):
    """``unified_radix`` on a FULL + MAMBA tree: through inserts that share prefixes (sglang frees the duplicate
    slots of a prefix it already holds), mamba eviction (tombstones keep their KV) and full eviction, the
    walked slots are distinct, exactly the KV slots the tree keeps allocated (no request runs), and the index
    the view builds before each sweep holds exactly them, at their positions, chained to their predecessors."""
    import random

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kv_canary.adapter.unified_radix import UnifiedRadixCacheView, unified_view_for
    from kv_canary.cache_index import CachedSlotIndex

    t = MambaTree(backend)
    view = unified_view_for(t.tree, SimpleNamespace(groups=[SimpleNamespace(records=t.records)]))
    assert isinstance(view, UnifiedRadixCacheView)
    index = CachedSlotIndex(FULL_SLOTS + 2, torch.device("cpu"))
    view.attach_index(index)
    rng, prefixes, hits = random.Random(7), [list(range(100, 112)), list(range(200, 208))], 0
    for step in range(40):
        op = rng.random()
        if op < 0.6:
            tokens = rng.choice(prefixes)[:rng.randrange(4, 13)] + [rng.randrange(300, 400) for _ in range(6)]
            if not t.request(tokens):
                t.tree.evict(EvictParams(num_tokens=24, mamba_num=2))
        elif op < 0.85:
            t.tree.evict(EvictParams(num_tokens=0, mamba_num=rng.randrange(1, 3)))
        else:
            t.tree.evict(EvictParams(num_tokens=rng.randrange(4, 20)))
        walk = t.tree.tree_core.walk_for_kv_canary(False, False)
        slots = walk.slot_indices
        assert len(set(slots.tolist())) == len(slots) == FULL_SLOTS - t.alloc.available_size(), step
        view.before_sweep()
        index.apply_pending()
        assert set(torch.nonzero(index.held).flatten().tolist()) == set(slots.tolist())
        if len(slots):
            hits += 1
            assert torch.equal(index.position[slots].to(torch.int64), walk.positions)
            assert torch.equal(index.pred[slots].to(torch.int64), walk.prev_slot_indices.clamp(min=0))
            assert torch.equal(index.token[slots].to(torch.int64), t.records[slots, 0])
    assert hits > 0


@on_0_5_23
def test_only_the_no_buffer_mamba_strategy_is_accepted():
    """The hybrid-linear pool is verified with ``--mamba-radix-cache-strategy no_buffer`` only (install refuses
    the rest): the reader returns sglang's resolved strategy, and ``no_buffer`` when no radix cache is kept."""
    from sglang.srt.server_args import ServerArgs

    from kv_canary_testing.model_dir import write_tiny_hybrid_linear_model_dir

    kw = dict(model_path=str(write_tiny_hybrid_linear_model_dir()), device="cpu", attention_backend="torch_native",
              disable_cuda_graph=True, load_format="dummy", disable_overlap_schedule=True)
    assert v0_5_23.mamba_strategy(ServerArgs(mamba_radix_cache_strategy="no_buffer", **kw)) == "no_buffer"
    assert v0_5_23.mamba_strategy(ServerArgs(mamba_radix_cache_strategy="extra_buffer", **kw)) == "extra_buffer"
    assert v0_5_23.mamba_strategy(ServerArgs(**kw)) == "auto"  # refused: it may resolve to extra_buffer later
    assert v0_5_23.mamba_strategy(ServerArgs(disable_radix_cache=True, **kw)) == "no_buffer"


@on_0_5_23
def test_contain_runs_where_the_evictor_interface_is_there():
    """0.5.23 has what contain evicts through (0.5.22 does not: refused there, test_e2e_contain)."""
    from kv_canary.adapter.contain_unified import contain_evictor_gap

    args = SimpleNamespace(device="cpu", disable_cuda_graph=True, kv_canary="contain", tp_size=1, dp_size=1,
                           disaggregation_mode="null", speculative_algorithm=None)
    assert contain_evictor_gap() == "" and v0_5_23.unported(args) == ""
