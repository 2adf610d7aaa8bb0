"""Fingerprint records of the KV copies a hierarchical cache keeps in host memory (HiCache, docs/hicache.md 3.1).

``HostRecordStore`` holds one record row per *host* slot, the same layout as a buffer group's device
``records`` (``fingerprint.RECORD_WIDTH`` int64: token, position, chain, KV_HASH, FULL_HASH; zeros = never
written). Records carry no slot id, so moving a slot's KV to another index is "write the row at the new index":
a backup copies ``device records[device slots]`` to ``host records[host slots]``, a load-back the reverse into
the new device slots.

A backup's records leave the device on the engine's copy stream, so they reach the host later: ``add_pending``
keeps the staged rows with the event that marks their copy done, and ``settle`` scatters them into ``records``.
Every reader of host rows (``read``: a load-back; ``rows``: a storage write) settles the rows it reads first; the
engine's write ack normally comes after the copy, so settling then does not wait (``settle_ready``). Host copies
read back from the storage tier bring their records with them (``put``).

Plain tensors and events only: no engine class is named here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Optional, Protocol

import torch

from .fingerprint import RECORD_WIDTH


class CopyEvent(Protocol):
    """What the store needs of a stream event (``torch.cuda.Event``, ``torch.cpu.Event``, or a test fake)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class _Pending:
    host_idx: torch.Tensor  # int64[n], CPU
    stage: torch.Tensor  # int64[n, RECORD_WIDTH], CPU (pinned on CUDA), filled by the copy ``event`` marks
    event: Optional[CopyEvent]  # None: the copy is already done


@dataclass
class HostStats:
    """Counts for the stats line (host side; never reset by the store)."""

    backups: int = 0
    slots_backed_up: int = 0
    loads: int = 0
    slots_loaded: int = 0


class HostRecordStore:
    """Records of one buffer group's host copies, indexed by host slot.

    records: int64[num_host_slots, RECORD_WIDTH] (CPU; pinned when ``pin``); a slot's row is final once no
        pending backup overlaps it (``pending_backups``)
    """

    def __init__(self, num_host_slots: int, *, pin: bool = False):
        if num_host_slots <= 0:
            raise ValueError(f"kv-canary: a host record store needs host slots, got {num_host_slots}")
        self.num_host_slots = int(num_host_slots)
        self._pin = pin
        self.records = torch.zeros((self.num_host_slots, RECORD_WIDTH), dtype=torch.int64, pin_memory=pin)
        self.stats = HostStats()
        self._pending: List[_Pending] = []
        self._lock = threading.Lock()

    def new_stage(self, n: int) -> torch.Tensor:
        """An int64[n, RECORD_WIDTH] host buffer a backup's records are copied into (pinned when the store is)."""
        return torch.empty((n, RECORD_WIDTH), dtype=torch.int64, pin_memory=self._pin)

    def add_pending(self, host_idx: torch.Tensor, stage: torch.Tensor, event: Optional[CopyEvent]) -> None:
        """A backup of ``host_idx`` (int[n]) whose records land in ``stage`` once ``event`` completes."""
        host_idx = host_idx.to(device="cpu", dtype=torch.int64)
        if stage.shape != (host_idx.numel(), RECORD_WIDTH):
            raise ValueError(f"kv-canary: host stage of shape {tuple(stage.shape)} for {host_idx.numel()} host slots")
        with self._lock:
            self._pending.append(_Pending(host_idx, stage, event))
        self.stats.backups += 1
        self.stats.slots_backed_up += host_idx.numel()

    def settle(self, host_idx: Optional[torch.Tensor] = None) -> None:
        """Land the pending backups that overlap ``host_idx`` (all when None), waiting for their copies."""
        self._settle(host_idx, wait=True)

    def settle_ready(self) -> List[torch.Tensor]:
        """Land the pending backups whose copies are done, without waiting (after the engine's write ack); their
        host slots, one tensor per backup."""
        return self._settle(None, wait=False)

    def _settle(self, host_idx: Optional[torch.Tensor], *, wait: bool) -> List[torch.Tensor]:
        settled: List[torch.Tensor] = []
        with self._lock:
            if not self._pending:
                return settled
            wanted = None
            if host_idx is not None:
                wanted = torch.zeros(self.num_host_slots, dtype=torch.bool)
                wanted[host_idx.to(device="cpu", dtype=torch.int64)] = True
            keep: List[_Pending] = []
            for p in self._pending:  # in issue order: a later backup of the same host slot lands last
                overlaps = wanted is None or bool(wanted[p.host_idx].any())
                if overlaps and p.event is not None and not p.event.query():
                    if not wait:
                        keep.append(p)
                        continue
                    p.event.synchronize()
                if not overlaps:
                    keep.append(p)
                    continue
                self.records[p.host_idx] = p.stage
                settled.append(p.host_idx)
            self._pending = keep
        return settled

    def read(self, host_idx: torch.Tensor) -> torch.Tensor:
        """int64[n, RECORD_WIDTH]: the records of ``host_idx`` (CPU), settled first (a load-back reads them)."""
        host_idx = host_idx.to(device="cpu", dtype=torch.int64)
        self.settle(host_idx)
        self.stats.loads += 1
        self.stats.slots_loaded += host_idx.numel()
        out = self.records[host_idx]
        return out.pin_memory() if self._pin else out

    def rows(self, host_idx: torch.Tensor) -> torch.Tensor:
        """int64[n, RECORD_WIDTH]: a copy of the records of ``host_idx``, settled first (a storage write reads them;
        not counted as a load)."""
        host_idx = host_idx.to(device="cpu", dtype=torch.int64)
        self.settle(host_idx)
        with self._lock:
            return self.records[host_idx].clone()

    def put(self, host_idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Host copies read from the storage tier into ``host_idx`` (int[n]) carry ``rows`` (int64[n, RECORD_WIDTH]):
        settled at once (any engine thread)."""
        host_idx = host_idx.to(device="cpu", dtype=torch.int64)
        if rows.shape != (host_idx.numel(), RECORD_WIDTH):
            raise ValueError(f"kv-canary: {tuple(rows.shape)} records for {host_idx.numel()} host slots")
        self.settle(host_idx)
        with self._lock:
            self.records[host_idx] = rows.to(dtype=torch.int64)

    def free(self, host_idx: torch.Tensor) -> None:
        """The engine freed ``host_idx``: its records are gone (a pending backup there lands first, then is zeroed)."""
        host_idx = host_idx.to(device="cpu", dtype=torch.int64)
        self.settle(host_idx)
        with self._lock:
            self.records[host_idx] = 0

    def clear(self) -> None:
        """The engine dropped every host copy (a cache reset)."""
        self.settle()
        with self._lock:
            self.records.zero_()

    @property
    def pending_backups(self) -> int:
        return len(self._pending)

    @property
    def nbytes(self) -> int:
        return self.records.numel() * self.records.element_size()
