"""The host scrub: every K/V byte of HiCache's host copies checked against their records, at rest (docs/history/hicache.md 3.7).

A flipped byte in a host copy is otherwise found when the copy is loaded back (its first read hashes every byte);
a copy never loaded back again is never read, and nothing reports it. ``HostScrub`` walks the host pool
round-robin in a daemon thread of the scheduler process at ``SGLANG_KV_CANARY_HOST_SCRUB_SLOTS_PER_SECOND`` slots
a second, hashes each landed copy's rows in host memory (numpy, ``fingerprint.full_hash_terms_np``: bit-equal to the
device's FULL_HASH) and queues the slots whose hash differs from their record's. So a flipped byte is reported
within ``ceil(host slots / rate)`` seconds, or at its load-back if that comes first.

Never a false alarm: only copies whose K/V copy *landed* are hashed (the engine wiring marks them after the copy's
event: ``backup_landed``), and a slot is reported only if no backup, eviction or reset touched it while it was
being hashed: each of those bumps its generation (``backup_started``, ``freed``, ``cleared``) before the engine
writes the slot, and the scrub compares generations before and after. A slot with zero records (never written)
is skipped.

Plain numpy arrays and callables: no engine class is named here. The scheduler thread only flips flags
(``backup_started`` & co., O(slots of the operation)); the thread holds the GIL for the Python between numpy calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Sequence

import numpy as np

from .fingerprint import F_FULL_HASH, F_POSITION, full_hash_finalize_np, full_hash_terms_np

CHUNK = 32  # host slots hashed per step (one records read and one numpy pass per row)


@dataclass(frozen=True)
class HostMismatch:
    """A landed host copy whose bytes no longer hash to its record."""

    host_slot: int
    position: int
    stored: int  # the record's FULL_HASH
    live: int  # the host bytes' hash


class HostScrub:
    """rows: uint32[host_slots, row_words] numpy views of the host copies, every layer's K and V row in the canonical
    order of the device's FULL_HASH; read_records(host_idx int64[n]) -> int64[n, RECORD_WIDTH] (a CPU copy of the
    host slots' records, done when it returns)."""

    def __init__(self, rows: Sequence[np.ndarray], read_records: Callable[[np.ndarray], np.ndarray],
                 slots_per_second: int, chunk: int = CHUNK):
        if not rows or slots_per_second <= 0:
            raise ValueError("kv-canary: a host scrub needs host rows and a rate > 0")
        self.num_slots = int(rows[0].shape[0])
        self._rows = list(rows)
        self._first_word = np.cumsum([0] + [int(r.shape[1]) for r in rows])[:-1].tolist()
        self._read_records = read_records
        self._rate = int(slots_per_second)
        self._chunk = max(1, min(int(chunk), self._rate))
        self.landed = np.zeros(self.num_slots, dtype=bool)  # the slot's last K/V copy has landed
        self.generation = np.zeros(self.num_slots, dtype=np.int64)  # bumped before the engine writes the slot
        self.found: "queue.SimpleQueue[HostMismatch]" = queue.SimpleQueue()
        self.slots_scrubbed = 0  # landed copies hashed and compared (the stats' hicache_host_scrubbed)
        self.passes = 0  # full walks of the host pool
        self._cursor = 0
        self.error = ""  # why the thread stopped, if it did (the stats' hicache_host_scrub_stopped)
        self._stop = threading.Event()
        self._thread = None

    # ---------------------------------------------------------------- the engine's side (scheduler thread)

    def backup_started(self, host_idx: np.ndarray) -> None:
        """The engine is about to write these host slots (a backup, a storage read)."""
        self.generation[host_idx] += 1
        self.landed[host_idx] = False

    def backup_landed(self, host_idx: np.ndarray) -> None:
        """Their K/V copy and records are in place."""
        self.landed[host_idx] = True

    def freed(self, host_idx: np.ndarray) -> None:
        self.backup_started(host_idx)

    def cleared(self) -> None:
        self.generation += 1
        self.landed[:] = False

    # ---------------------------------------------------------------- the scrub

    def step(self) -> int:
        """Hash the next chunk of landed host slots; queue mismatches; the number of slots compared."""
        start = self._cursor
        idx = np.arange(start, min(start + self._chunk, self.num_slots), dtype=np.int64)
        self._cursor = 0 if idx[-1] + 1 >= self.num_slots else int(idx[-1]) + 1
        if self._cursor == 0:
            self.passes += 1
        gen, was_landed = self.generation[idx].copy(), self.landed[idx].copy()
        idx = idx[was_landed]
        if idx.size == 0:
            return 0
        gen = gen[was_landed]
        records = self._read_records(idx)
        sums = np.zeros(idx.size, dtype=np.uint64)
        for row, first in zip(self._rows, self._first_word):
            with np.errstate(over="ignore"):
                sums += full_hash_terms_np(row[idx], first)
        live = full_hash_finalize_np(sums)
        stored = records[:, F_FULL_HASH]
        # untouched while hashed (same generation, still landed) and ever written (records not zero)
        ok = (self.generation[idx] == gen) & self.landed[idx] & (stored != 0)
        for k in np.nonzero(ok & (live != stored))[0].tolist():
            self.found.put(HostMismatch(int(idx[k]), int(records[k, F_POSITION]), int(stored[k]), int(live[k])))
        n = int(ok.sum())
        self.slots_scrubbed += n
        return n

    def drain(self) -> List[HostMismatch]:
        out = []
        while True:
            try:
                out.append(self.found.get_nowait())
            except queue.Empty:
                return out

    def start(self) -> None:
        """The daemon thread: one chunk, then sleep so that chunks go at the configured rate."""
        self._thread = threading.Thread(target=self._run, name="kv-canary-host-scrub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        period = self._chunk / self._rate
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self.step()
                self._stop.wait(max(0.0, period - (time.monotonic() - t0)))
        except Exception as exc:  # noqa: BLE001 - never silent: the stats say it stopped, the log says why
            self.error = f"{type(exc).__name__}: {exc}"
            logging.getLogger("kv_canary").exception("kv_canary_host_scrub_stopped=1 error=%s", type(exc).__name__)
