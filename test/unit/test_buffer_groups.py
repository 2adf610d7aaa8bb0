"""buffer groups on a real sglang MHATokenToKVPool (CPU), page size 1 and > 1."""

from __future__ import annotations

import pytest
import torch

from kv_canary.adapter.pools import register_sglang_pools
from kv_canary.config import CanaryConfig, CanaryConfigError, RealData
from kv_canary.fingerprint import RECORD_WIDTH
from kv_canary.buffer_groups import attach_canary_buffers, int32_row_view

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")


def mha_pool(page_size=1, dtype=torch.float32, size=64, layers=3):
    return memory_pool.MHATokenToKVPool(
        size=size, page_size=page_size, dtype=dtype, head_num=2, head_dim=8, layer_num=layers,
        device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )


@pytest.mark.parametrize("page_size,dtype", [(1, torch.float32), (16, torch.bfloat16)])
def test_mha_pool_gets_one_full_group_viewing_live_kv(page_size, dtype):
    register_sglang_pools()
    pool = mha_pool(page_size=page_size, dtype=dtype)
    config = CanaryConfig(kv_hash_layers=(0, 2), kv_hash_bytes=16)
    groups = attach_canary_buffers(pool, config, torch.device("cpu"))
    assert pool.kv_canary_groups is groups and [g.name for g in groups] == ["full"]
    g = groups[0]
    assert g.num_slots == pool.size + page_size and g.records.shape == (pool.size + page_size, RECORD_WIDTH)
    assert [(s.layer, s.half, s.words) for s in g.sources] == [(0, "k", 4), (0, "v", 4), (2, "k", 4), (2, "v", 4)]
    assert [(r.layer, r.half) for r in g.rows] == [(layer, h) for layer in range(3) for h in ("k", "v")]
    # The views alias the pool: a write to the pool shows in the view.
    k2 = g.sources[2].view
    before = k2[5].clone()
    pool.k_buffer[2][5, 0, 0] = 3.0
    assert not torch.equal(before, k2[5])
    assert k2.data_ptr() == pool.k_buffer[2].data_ptr()
    words = g.hashed_words(torch.tensor([5, 6]))
    assert words.shape == (2, 2 * 2 * 4)
    # The device source table points the kernels at the same rows.
    table = g.source_table.tolist()
    for src, (offset, stride, nwords, first) in zip(g.sources, table):
        assert g.base.data_ptr() + 4 * offset == src.view.data_ptr() and stride == src.view.stride(0)
        assert nwords == src.words
    assert [t[3] for t in table] == [0, 4, 8, 12]


@pytest.mark.parametrize("real_data,words", [(RealData.ALL, 2 * 4), (RealData.NONE, 0)])
def test_real_data_all_hashes_every_row_and_none_no_byte(real_data, words):
    """all: the window (16 bytes of K and V, layer 0) at every read, and FULL_HASH state (every row, every
    byte: a slot's first read and the scrub); none: no byte."""
    register_sglang_pools()
    g = attach_canary_buffers(mha_pool(), CanaryConfig(real_data=real_data), torch.device("cpu"))[0]
    assert g.hashed_word_count == words
    assert len(g.rows) == 6 and sum(r.words for r in g.rows) == 6 * 8 * 2  # 3 layers x (K, V) x 2 heads x 8 fp32
    assert (g.full_row is not None and g.full_row.first_read) == (real_data is RealData.ALL)


def test_hash_bytes_are_capped_by_the_row():
    register_sglang_pools()
    pool = mha_pool()
    g = attach_canary_buffers(pool, CanaryConfig(kv_hash_bytes=4096), torch.device("cpu"))[0]
    assert [s.words for s in g.sources] == [2 * 8, 2 * 8]  # a float32 row of 2 heads x 8 dims = 16 words


def test_hashed_layer_out_of_range_names_the_env_var():
    register_sglang_pools()
    with pytest.raises(CanaryConfigError, match="SGLANG_KV_CANARY_KV_HASH_LAYERS names layer 7"):
        attach_canary_buffers(mha_pool(), CanaryConfig(kv_hash_layers=(7,)), torch.device("cpu"))


def test_unsupported_pool_class_is_named():
    class SomeOtherPool:
        pass

    with pytest.raises(CanaryConfigError, match="does not support the KV pool class SomeOtherPool"):
        attach_canary_buffers(SomeOtherPool(), CanaryConfig(), torch.device("cpu"))


def test_int32_row_view_is_zero_copy():
    buf = torch.zeros(10, 2, 4, dtype=torch.bfloat16)
    v = int32_row_view(buf)
    assert v.shape == (10, 4) and v.data_ptr() == buf.data_ptr()
    with pytest.raises(CanaryConfigError, match="not contiguous"):
        int32_row_view(torch.zeros(4, 10, 2).transpose(0, 1))
