"""Register sglang 0.5.12's KV pool classes with the buffer-group builder.

| pool class | groups | what is hashed |
| --- | --- | --- |
| ``MHATokenToKVPool`` | ``full`` | K and V rows of every layer (window or all, per ``--kv-canary-real-data``) |
| ``MLATokenToKVPool`` | ``full`` | the one latent row per layer (``kv_lora_rank + qk_rope_head_dim``; no V half), as stored (any dtype, fp8 included) |
| ``SWAKVPool`` | ``full`` (full-attention layers), ``swa`` (sliding-window layers: slots through the allocator's ``full_to_swa_index_mapping``, verified inside the window) | each group's own K/V rows |
| ``HybridLinearKVPool`` | ``full`` (the full-attention layers: its inner MHA or MLA pool, engine slots) | the inner pool's rows; the linear-attention (mamba) state is not covered |

Any other class is refused at install by ``attach_canary_buffers`` (naming it and listing these).
"""

from __future__ import annotations

from typing import List

from ..buffer_groups import PoolContext, PoolLayout, register_pool_class
from ..config import CanaryConfigError


def _mha_layouts(pool, context: PoolContext) -> List[PoolLayout]:
    del context
    return [PoolLayout(name="full", k_buffers=pool.k_buffer, v_buffers=pool.v_buffer, kv_dtype=pool.dtype)]


def _mla_layouts(pool, context: PoolContext) -> List[PoolLayout]:
    """``MLATokenToKVPool``: one latent row per layer (K = the row, V = its first kv_lora_rank values)."""
    del context
    return [PoolLayout(name="full", k_buffers=pool.kv_buffer, v_buffers=None, kv_dtype=pool.dtype)]


def _swa_layouts(pool, context: PoolContext) -> List[PoolLayout]:
    """``SWAKVPool``: ``full_kv_pool`` (engine slots) and ``swa_kv_pool`` (translated, windowed)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    for name in ("full_kv_pool", "swa_kv_pool"):
        inner = getattr(pool, name)
        if type(inner) is not MHATokenToKVPool:
            raise CanaryConfigError(
                f"--kv-canary: SWAKVPool's {name} is {type(inner).__name__}; only MHATokenToKVPool halves "
                "are supported. Run with --kv-canary none for this model/configuration."
            )
    if getattr(pool, "swa_req_ring_size", None) is not None:  # sglang >= 0.5.13: SWA KV in a per-request ring
        raise CanaryConfigError(
            f"--kv-canary: SWAKVPool with a per-request SWA ring (swa_req_ring_size={pool.swa_req_ring_size}): its "
            "SWA slots are not reached through full_to_swa_index_mapping; run with --kv-canary none"
        )
    mapping = getattr(pool, "full_to_swa_index_mapping", None)
    if mapping is None:
        raise CanaryConfigError(
            "--kv-canary: SWAKVPool has no full -> swa slot mapping registered (the SWA allocator was not built); "
            "run with --kv-canary none"
        )
    window = context.sliding_window
    if window is None or int(window) <= 0:
        raise CanaryConfigError(
            f"--kv-canary: SWAKVPool without a positive sliding window (sliding_window_size={window}); "
            "run with --kv-canary none"
        )
    full, swa = pool.full_kv_pool, pool.swa_kv_pool
    return [
        PoolLayout(name="full", k_buffers=full.k_buffer, v_buffers=full.v_buffer, kv_dtype=full.dtype),
        PoolLayout(name="swa", k_buffers=swa.k_buffer, v_buffers=swa.v_buffer, slot_translation=mapping,
                   window=int(window), kv_dtype=swa.dtype),
    ]


def _hybrid_linear_layouts(pool, context: PoolContext) -> List[PoolLayout]:
    """``HybridLinearKVPool`` (Qwen3-Next, Kimi-Linear class): the full-attention layers' inner pool.

    Its ``full_kv_pool`` (an ``MHATokenToKVPool``, or ``MLATokenToKVPool`` with ``use_mla``) holds only the
    full-attention layers, indexed by the engine's slots; sglang maps model layer ids onto it
    (``full_attention_layer_id_mapping``), so its layer k is the k-th full-attention layer. The
    linear-attention state lives in ``mamba_pool`` (one in-place-updated state per request, not a per-slot
    row) and is not covered.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    inner = pool.full_kv_pool
    if type(inner) is MHATokenToKVPool:
        return _mha_layouts(inner, context)
    if type(inner) is MLATokenToKVPool:
        return _mla_layouts(inner, context)
    raise CanaryConfigError(
        f"--kv-canary: HybridLinearKVPool's full_kv_pool is {type(inner).__name__}; only MHATokenToKVPool and "
        "MLATokenToKVPool are supported. Run with --kv-canary none for this model/configuration."
    )


def pool_context(model_runner) -> PoolContext:
    """What the extractors need from sglang's ``ModelRunner`` besides the pool."""
    window = getattr(model_runner, "sliding_window_size", None)
    return PoolContext(sliding_window=None if window is None else int(window))


def register_sglang_pools() -> None:
    """Idempotent: MHA, MLA, hybrid sliding-window (two groups) and hybrid linear attention (its full layers)."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    register_pool_class(MHATokenToKVPool, _mha_layouts)
    register_pool_class(MLATokenToKVPool, _mla_layouts)
    register_pool_class(SWAKVPool, _swa_layouts)
    register_pool_class(HybridLinearKVPool, _hybrid_linear_layouts)
