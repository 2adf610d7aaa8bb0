"""Fingerprint records of the KV copies a hierarchical cache keeps in host memory (HiCache, docs/history/hicache.md 3.1).

``HostRecordStore`` holds one record row per *host* slot, the same layout as a buffer group's device
``records`` (``fingerprint.RECORD_WIDTH`` int64: token, position, chain, KV_HASH, FULL_HASH; zeros = never
written). Records carry no slot id, so moving a slot's KV to another index is "write the row at the new index":
a backup copies ``device records[device slots]`` to ``host records[host slots]``, a load-back the reverse into
the new device slots.

The table lives on the KV pool's device, indexed by host slot (40 B of device memory per host slot): a backup,
a load-back and a host eviction are each one or two device ops queued on the caller's stream, in the engine's
own order, with no host gather, no pinned staging and no wait on the scheduler thread (docs/history/hicache.md 3.1 says
why it moved from host memory). A backup's records land in stream order before the engine's K/V copy starts, so
the engine's write ack covers them. The storage tier's threads read rows out (``rows``) and put rows in (``put``)
with a copy that completes before they return.

Plain tensors only: no engine class is named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .fingerprint import RECORD_WIDTH


@dataclass
class HostStats:
    """Counts for the stats line (host side; never reset by the store)."""

    backups: int = 0
    slots_backed_up: int = 0
    loads: int = 0
    slots_loaded: int = 0


# the size up to which CUDA copies a pageable host buffer to the device inline, without waiting for the stream
PAGEABLE_INLINE_BYTES = 64 * 1024


class HostRecordStore:
    """Records of one buffer group's host copies, indexed by host slot.

    records: int64[num_host_slots, RECORD_WIDTH] on ``device`` (the KV pool's)
    """

    def __init__(self, num_host_slots: int, device: torch.device = torch.device("cpu")):
        if num_host_slots <= 0:
            raise ValueError(f"kv-canary: a host record store needs host slots, got {num_host_slots}")
        self.num_host_slots = int(num_host_slots)
        self.records = torch.zeros((self.num_host_slots, RECORD_WIDTH), dtype=torch.int64, device=device)
        self.stats = HostStats()

    def index(self, host_idx: torch.Tensor) -> torch.Tensor:
        """int64[n] on the store's device: the engine's host slot ids (CPU, from its host allocator), copied without
        a wait (queued on the current stream). A large pageable source (over ``PAGEABLE_INLINE_BYTES``) is staged in
        pinned memory first (torch's caching host allocator): the driver stages such a copy itself and may wait for
        the stream, i.e. for the forward in flight (H100, one 5 ms forward in flight, ``bench_hicache_host_ops.py
        --busy-ms 5``: a 9,344-slot load-back 369 -> 191 us; a 1,088-slot backup, copied inline, gains nothing)."""
        if (self.records.is_cuda and host_idx.device.type == "cpu" and not host_idx.is_pinned()
                and host_idx.numel() * 8 > PAGEABLE_INLINE_BYTES):
            host_idx = host_idx.to(torch.int64).pin_memory()
        return host_idx.to(self.records.device, torch.int64, non_blocking=True)

    def backup(self, host_idx: torch.Tensor, rows: torch.Tensor, *, freed: Optional[torch.Tensor] = None,
               backups: int = 1) -> None:
        """The engine copies device slots to host slots ``host_idx`` (int[n]); ``rows`` (int64[n, RECORD_WIDTH], on the
        store's device) are their records, written on the current stream. ``freed`` (int[m], CPU, optional): host
        slots freed before these copies, zeroed first (``free``), their ids copied to the device with ``host_idx``
        in one copy. ``backups``: how many engine backups the call carries (batched: ``runner/host_copies``)."""
        if rows.shape != (host_idx.numel(), RECORD_WIDTH):
            raise ValueError(f"kv-canary: {tuple(rows.shape)} records for {host_idx.numel()} host slots")
        if freed is not None and freed.numel():
            both = self.index(torch.cat([freed.reshape(-1).to(host_idx.dtype), host_idx.reshape(-1)]))
            self.records.index_fill_(0, both[:freed.numel()], 0)
            dev = both[freed.numel():]
        else:
            dev = self.index(host_idx)
        self.records.index_copy_(0, dev, rows)
        self.stats.backups += backups
        self.stats.slots_backed_up += host_idx.numel()

    def count_load(self, slots: int) -> None:
        """A load-back of ``slots`` host copies read their rows (``kernels.record_moves.load_records`` moves them)."""
        self.stats.loads += 1
        self.stats.slots_loaded += int(slots)

    def rows(self, host_idx: torch.Tensor) -> torch.Tensor:
        """int64[n, RECORD_WIDTH] on the CPU: a copy of the records of ``host_idx``, done when it returns (a storage
        write reads them, after the engine's write ack covered their backup; not counted as a load)."""
        return self.records.index_select(0, self.index(host_idx)).cpu()

    def put(self, host_idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Host copies read from the storage tier into ``host_idx`` (int[n]) carry ``rows`` (int64[n, RECORD_WIDTH]):
        landed when it returns (any engine thread)."""
        if rows.shape != (host_idx.numel(), RECORD_WIDTH):
            raise ValueError(f"kv-canary: {tuple(rows.shape)} records for {host_idx.numel()} host slots")
        self.records.index_copy_(0, self.index(host_idx), rows.to(self.records.device, torch.int64))
        if self.records.is_cuda:
            torch.cuda.current_stream(self.records.device).synchronize()

    def free(self, host_idx: torch.Tensor) -> None:
        """The engine freed ``host_idx``: its records are gone (zeroed on the current stream)."""
        self.records.index_fill_(0, self.index(host_idx), 0)

    def clear(self) -> None:
        """The engine dropped every host copy (a cache reset)."""
        self.records.zero_()

    @property
    def nbytes(self) -> int:
        return self.records.numel() * self.records.element_size()
