"""Register sglang 0.5.12's KV pool classes with the buffer-group builder."""

from __future__ import annotations

from typing import List

from ..buffer_groups import PoolLayout, register_pool_class


def _mha_layouts(pool) -> List[PoolLayout]:
    return [PoolLayout(name="full", k_buffers=pool.k_buffer, v_buffers=pool.v_buffer)]


def register_sglang_pools() -> None:
    """Idempotent. MHA only for now; MLA (no V half) and hybrid SWA (two groups) come next."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    register_pool_class(MHATokenToKVPool, _mha_layouts)
