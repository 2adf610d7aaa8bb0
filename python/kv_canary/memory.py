"""Device memory the canary allocates, computed by one function.

``canary_memory_bytes`` is the single source for the install log line, the
docs' memory table (``benchmarks/overhead_summary.py``) and the unit test that
checks it against the tensors a real ``CanaryManager`` allocates. When a
buffer's shape changes (the token oracle, a sweep index), change it here.

Nothing here grows with the context length except the token oracle's staging of
one forward's fed tokens (8 bytes per token a forward can feed): the per-slot
records are 40 bytes per KV slot (+13 with the sweep), the rest is per request
row or fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import fingerprint as fp
from .buffer_groups import FullRowState, first_read_capacity
from .cache_index import BYTES_PER_SLOT as INDEX_BYTES_PER_SLOT

INT64 = 8
INT32 = 4
DEFAULT_MAX_PREFILL_TOKENS = 16384  # sglang's --max-prefill-tokens default


def tokens_per_forward_bound(*, context_len: int, max_batch_size: int,
                             max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS) -> int:
    """New tokens one forward can feed, bounded from above: sglang's prefill budget, plus one request that
    exceeds it (a prompt of up to the context length when chunked prefill is off), plus one decode token per
    running request (a mixed batch)."""
    return int(max_prefill_tokens) + int(context_len) + int(max_batch_size)


def token_oracle_bytes(*, req_rows: int, max_batch_size: int, max_tokens_per_forward: int) -> int:
    """``TokenOracle``'s device tensors: int64 row_chain[rows], next_token[rows + 1], staged[tokens + 4 x max_bs],
    next_rows[max_bs], sampled[max_bs], pending[1]."""
    return INT64 * ((2 * req_rows + 1) + (max_tokens_per_forward + 4 * max_batch_size) + 2 * max_batch_size + 1)


@dataclass(frozen=True)
class CanaryMemory:
    """Bytes per canary device buffer (all int64 unless noted)."""

    records: int  # [num_groups][num_slots, RECORD_WIDTH]
    counters: int  # [NUM_COUNTERS]
    ring: int  # [ring_capacity, RING_WIDTH]
    token_table: int  # the token oracle (``token_oracle_bytes``; 0 when off)
    sweep_index: int = 0  # CachedSlotIndex: int8 + 3 x int32 per slot (0 without the sweep)
    full_row: int = 0  # [num_groups] FullRowState (the scrub or real data all: 20 bytes per slot + the work list)

    @property
    def total(self) -> int:
        return self.records + self.counters + self.ring + self.token_table + self.sweep_index + self.full_row

    def pct_of(self, kv_pool_bytes: int) -> float:
        """Total as a percentage of the KV pool's bytes (0 when unknown)."""
        return 100.0 * self.total / kv_pool_bytes if kv_pool_bytes > 0 else 0.0


def canary_memory_bytes(*, num_slots: int, num_groups: int, req_rows: int, context_len: int,
                        ring_capacity: int, token_oracle: bool, max_batch_size: int,
                        sweep: bool = False, max_tokens_per_forward: int = 0, full_row: bool = False,
                        first_read: bool = False, hicache: bool = False) -> CanaryMemory:
    """Device bytes of the canary for a pool of ``num_slots`` slots per group and ``req_rows`` x ``context_len``
    req_to_token; ``max_tokens_per_forward`` 0: ``tokens_per_forward_bound`` of the context length."""
    tokens = max_tokens_per_forward or tokens_per_forward_bound(context_len=context_len,
                                                                max_batch_size=max_batch_size)
    return CanaryMemory(
        records=num_groups * num_slots * fp.RECORD_WIDTH * INT64,
        counters=fp.NUM_COUNTERS * INT64,
        ring=ring_capacity * fp.RING_WIDTH * INT64,
        token_table=(token_oracle_bytes(req_rows=req_rows, max_batch_size=max_batch_size,
                                        max_tokens_per_forward=tokens) if token_oracle else 0),
        sweep_index=num_slots * INDEX_BYTES_PER_SLOT if sweep else 0,
        full_row=(num_groups * FullRowState.bytes(num_slots, first_read, first_read_capacity(num_slots, hicache))
                  if full_row else 0),
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


def host_record_bytes(host_slots: int) -> int:
    """Bytes of ``host_records.HostRecordStore`` for a host pool of ``host_slots`` slots (HiCache): int64
    records[RECORD_WIDTH] per host slot, on the KV pool's device."""
    return int(host_slots) * INT64 * fp.RECORD_WIDTH
