"""sglang 0.5.12's real pool objects -> canary groups: MLA (no V half), fp8 stores, SWAKVPool (two groups,
the allocator's live mapping), and the refusal of pools still unsupported (HybridLinearKVPool ...).

HEAD/TAIL run with the torch reference kernels on the pools' own buffers, written
through the pools' own ``set_kv_buffer``: what is hashed is the stored bytes, whatever the dtype.
"""

from __future__ import annotations

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.pools import register_sglang_pools
from kv_canary.buffer_groups import PoolContext, attach_canary_buffers, registered_pool_classes
from kv_canary.config import CanaryConfig, CanaryConfigError, RealData
from kv_canary.kernels import reference as ref
from kv_canary.views import ForwardView

from sglang.srt.mem_cache import memory_pool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool, SWATokenToKVPoolAllocator  # noqa: E402

CPU = torch.device("cpu")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _mha(dtype, size=64, layers=2):
    return memory_pool.MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=2, head_dim=8,
                                        layer_num=layers, device="cpu", enable_memory_saver=False,
                                        enable_alt_stream=False)


def _mla(dtype, size=64, layers=2):
    return memory_pool.MLATokenToKVPool(size=size, page_size=1, dtype=dtype, kv_lora_rank=32, qk_rope_head_dim=16,
                                        layer_num=layers, device="cpu", enable_memory_saver=False)


def _one_forward(group, slots, write_kv):
    """Prefill of one request into ``slots`` (KV written by ``write_kv``), then a HEAD verify of it."""
    n = len(slots)
    r2t = torch.zeros(2, 32, dtype=torch.int32)
    r2t[1, :n] = torch.tensor(slots, dtype=torch.int32)
    counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64)
    counters[fp.C_REPORT_ENABLED] = 1
    ring = torch.zeros(64, fp.RING_WIDTH, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    view = ForwardView(input_ids=torch.arange(5, 5 + n), positions=torch.arange(n),
                       out_cache_loc=torch.tensor(slots, dtype=torch.int64), req_pool_indices=one,
                       seq_lens=one * n, new_starts=one * 0, new_lens=one * n, batch_size=1, max_new_len=n)
    write_kv(view.out_cache_loc)
    ref.launch_write(group, view, r2t, counters, ring, True, check_fed=False)
    decode = ForwardView(input_ids=one, positions=one * n, out_cache_loc=torch.zeros(1, dtype=torch.int64),
                         req_pool_indices=one, seq_lens=one * (n + 1), new_starts=one * 0, new_lens=one,
                         batch_size=1, max_new_len=1)

    def verify():
        """HEAD of a decode forward; with real data all, then a scrub pass over the whole pool (a flip after a
        slot's first read is the scrub's to find: docs/design.md)."""
        before = int(counters[fp.C_VIOLATIONS])
        ref.launch_verify(group, decode, r2t, counters, ring)
        if group.full_row is not None:
            ref.launch_scrub(group, counters, ring, group.num_slots - 1)
        return [ring[i].tolist() for i in range(before, int(counters[fp.C_VIOLATIONS]))]

    return verify


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU pool: with CUDA present sglang's MHATokenToKVPool."
                    "set_kv_buffer calls its CUDA-only store_cache op; this runs on the CPU machine (CI)")
@pytest.mark.parametrize("dtype", FP8, ids=["fp8_e4m3", "fp8_e5m2"])
def test_fp8_mha_pool_hashes_the_stored_bytes(dtype):
    register_sglang_pools()
    pool = _mha(dtype)
    assert pool.store_dtype == torch.uint8 and pool.k_buffer[0].dtype == torch.uint8
    group = attach_canary_buffers(pool, CanaryConfig(real_data=RealData.ALL), CPU)[0]
    assert [r.row_words for r in group.rows] == [4] * 4  # 2 heads x 8 dims x 1 byte = 16 bytes = 4 words

    def write(loc):  # sglang's own write path: cast to fp8, stored as uint8
        for layer in range(2):
            k, v = torch.randn(len(loc), 2, 8), torch.randn(len(loc), 2, 8)
            pool.set_kv_buffer(None, loc, k, v, layer_id_override=layer)

    verify = _one_forward(group, [3, 4, 5, 6], write)
    assert verify() == []
    pool.v_buffer[1][5].view(-1)[7] ^= 1  # one bit of one fp8 value of layer 1's V
    bad = verify()
    assert [(r[fp.V_REASON], r[fp.V_SLOT]) for r in bad] == [(fp.R_KV_HASH, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_mla_pool_one_latent_row_no_v_half(dtype):
    register_sglang_pools()
    pool = _mla(dtype)
    group = attach_canary_buffers(pool, CanaryConfig(real_data=RealData.ALL), CPU)[0]
    assert group.name == "full" and [r.half for r in group.rows] == ["k", "k"]
    row_bytes = (32 + 16) * torch.tensor([], dtype=dtype).element_size()
    assert group.rows[0].row_words * 4 == row_bytes
    assert group.rows[1].view.data_ptr() == pool.kv_buffer[1].data_ptr()  # live, zero-copy

    class Layer:
        def __init__(self, i):
            self.layer_id = i

    def write(loc):
        for layer in range(2):
            pool.set_kv_buffer(Layer(layer), loc, torch.randn(len(loc), 1, 48), None)

    verify = _one_forward(group, [7, 8, 9], write)
    assert verify() == []
    pool.kv_buffer[0][8].view(torch.uint8).view(-1)[-1] ^= 0x10  # the last byte: the rotary part of the row
    assert [(r[fp.V_REASON], r[fp.V_SLOT]) for r in verify()] == [(fp.R_KV_HASH, 8)]


def test_swa_pool_two_groups_on_the_allocators_live_mapping():
    register_sglang_pools()
    pool = SWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.float32, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], enable_kvcache_transpose=False,
                     device="cpu", enable_alt_stream=False)
    alloc = SWATokenToKVPoolAllocator(size=64, size_swa=32, page_size=1, dtype=torch.float32, device="cpu",
                                      kvcache=pool, need_sort=False)
    with pytest.raises(CanaryConfigError, match="sliding window"):
        attach_canary_buffers(pool, CanaryConfig(), CPU)  # no window known: refused, never guessed
    full, swa = attach_canary_buffers(pool, CanaryConfig(), CPU, PoolContext(sliding_window=8))
    assert (full.name, swa.name) == ("full", "swa") and (full.window, swa.window) == (0, 8)
    assert full.slot_map is None and swa.slot_map is alloc.full_to_swa_index_mapping  # the live tensor
    assert full.num_slots == 65 and swa.num_slots == 33
    assert full.rows[0].view.data_ptr() == pool.full_kv_pool.k_buffer[0].data_ptr()
    assert swa.rows[0].view.data_ptr() == pool.swa_kv_pool.k_buffer[0].data_ptr()
    loc = alloc.alloc(5)
    assert torch.equal(swa.slot_map[loc], alloc.full_to_swa_index_mapping[loc])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU pool: with CUDA present sglang's MHATokenToKVPool."
                    "set_kv_buffer calls its CUDA-only store_cache op; this runs on the CPU machine (CI)")
def test_hybrid_linear_pool_verifies_the_full_attention_layers_of_its_inner_pool():
    """``HybridLinearKVPool`` (Qwen3-Next class): one ``full`` group = its inner MHA pool (full layers only)."""
    register_sglang_pools()
    pool = memory_pool.HybridLinearKVPool(size=32, dtype=torch.float32, page_size=1, head_num=2, head_dim=8,
                                          full_attention_layer_ids=[1, 3], enable_kvcache_transpose=False,
                                          device="cpu", mamba_pool=None)
    (group,) = attach_canary_buffers(pool, CanaryConfig(real_data=RealData.ALL), CPU)
    assert group.name == "full" and group.slot_map is None and group.num_slots == 33
    assert sorted({r.layer for r in group.rows}) == [0, 1]  # the two full-attention layers, nothing else
    assert group.rows[2].view.data_ptr() == pool.full_kv_pool.k_buffer[1].data_ptr()

    class Layer:  # sglang's RadixAttention as set_kv_buffer sees it: model layer id 3 = inner layer 1
        layer_id, k_scale, v_scale = 3, None, None

    def write(loc):
        k = torch.randn(len(loc), 2, 8)
        pool.set_kv_buffer(Layer(), loc, k, k + 1)
        pool.full_kv_pool.k_buffer[0][loc] = torch.randn(len(loc), 2, 8)  # the other full layer

    verify = _one_forward(group, list(range(1, 9)), write)
    assert verify() == []
    pool.get_key_buffer(3)[5].view(-1)[3] += 1.0  # model layer 3's K row of slot 5
    assert [(r[fp.V_REASON], r[fp.V_SLOT]) for r in verify()] == [(fp.R_KV_HASH, 5)]
    inner = pool.full_kv_pool
    pool.full_kv_pool = object()
    with pytest.raises(CanaryConfigError, match="HybridLinearKVPool's full_kv_pool is object"):
        attach_canary_buffers(pool, CanaryConfig(), CPU)
    pool.full_kv_pool = inner


def test_unsupported_pools_are_refused_naming_the_class_and_listing_the_supported():
    register_sglang_pools()
    assert registered_pool_classes() == ["HybridLinearKVPool", "MHATokenToKVPool", "MLATokenToKVPool", "SWAKVPool"]
    for cls in (memory_pool.MHATokenToKVPoolFP4, memory_pool.MLATokenToKVPoolFP4, memory_pool.NSATokenToKVPool):
        pool = cls.__new__(cls)  # the class is what matters (exact match: subclasses must register)
        with pytest.raises(CanaryConfigError) as e:
            attach_canary_buffers(pool, CanaryConfig(), CPU)
        msg = str(e.value)
        assert f"does not support the KV pool class {cls.__name__}" in msg
        assert "supported: HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool, SWAKVPool" in msg and "--kv-canary none" in msg
