"""Device memory the canary allocates, computed by one function.

``canary_memory_bytes`` is the single source for the install log line, the
docs' memory table (``scripts/bench_overhead.py``) and the unit test that
checks it against the tensors a real ``CanaryManager`` allocates. When a
buffer's shape changes (the token table, a sweep index), change it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import fingerprint as fp
from .cache_index import BYTES_PER_SLOT as INDEX_BYTES_PER_SLOT

INT64 = 8
INT32 = 4


@dataclass(frozen=True)
class CanaryMemory:
    """Bytes per canary device buffer (all int64 unless noted)."""

    records: int  # [num_groups][num_slots, RECORD_WIDTH]
    counters: int  # [NUM_COUNTERS]
    ring: int  # [ring_capacity, RING_WIDTH]
    token_table: int  # the token oracle: int32[req_rows, context_len] + int32[req_rows] + 2 x int64[max_bs] (or 0)
    sweep_index: int = 0  # CachedSlotIndex: int8 + 3 x int32 per slot (0 without the sweep)

    @property
    def total(self) -> int:
        return self.records + self.counters + self.ring + self.token_table + self.sweep_index

    def pct_of(self, kv_pool_bytes: int) -> float:
        """Total as a percentage of the KV pool's bytes (0 when unknown)."""
        return 100.0 * self.total / kv_pool_bytes if kv_pool_bytes > 0 else 0.0


def canary_memory_bytes(*, num_slots: int, num_groups: int, req_rows: int, context_len: int,
                        ring_capacity: int, token_oracle: bool, max_batch_size: int,
                        sweep: bool = False) -> CanaryMemory:
    """Device bytes of the canary for a pool of ``num_slots`` slots per group and ``req_rows`` x ``context_len``
    req_to_token."""
    return CanaryMemory(
        records=num_groups * num_slots * fp.RECORD_WIDTH * INT64,
        counters=fp.NUM_COUNTERS * INT64,
        ring=ring_capacity * fp.RING_WIDTH * INT64,
        token_table=(req_rows * context_len * INT32 + req_rows * INT32 + 2 * max_batch_size * INT64
                     if token_oracle else 0),
        sweep_index=num_slots * INDEX_BYTES_PER_SLOT if sweep else 0,
    )


def kv_pool_bytes(pool: object) -> int:
    """Bytes of a KV pool's K and V buffers (sglang pools' ``get_kv_size_bytes``); 0 if it cannot tell."""
    getter = getattr(pool, "get_kv_size_bytes", None)
    if getter is None:
        return 0
    try:
        sizes = getter()
    except Exception:  # noqa: BLE001 - a pool that cannot report its size: report 0, never fail install
        return 0
    return int(sum(sizes)) if isinstance(sizes, (tuple, list)) else int(sizes)
