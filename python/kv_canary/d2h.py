"""Delayed device->host copies of the canary counters: no forward waits for the host.

After each forward, ``snapshot()`` copies the counters tensor (int64[n]) into
one of ``delay + 2`` pinned host slots and records an event. On CUDA the copy
is in two parts: a device-to-device copy into a staging buffer on the current
stream (ordered after the forward that produced the counters, before the next
one changes them) and the device-to-host copy of that buffer on a side stream.
The forward's stream never waits for the copy engine: a device-to-host copy
between a decode graph and sampling held sampling back ~10 us on an H200
(docs/performance.md).
``ready()`` returns, oldest first, the snapshots whose copy has finished
(``event.query()``, never a blocking wait) and that are at least ``delay``
forwards old. So the host learns of a violation from forward N while handling
forward N + delay (or a little later if the copy is still in flight, bounded by
``delay + 2`` slots: the oldest is waited for rather than overwritten).

On CPU the copy is immediate and ``delay`` still applies, so the step at which
``raise`` fires is the same on both devices.

``interval`` (``SGLANG_KV_CANARY_D2H_INTERVAL``): ``snapshot`` copies after every ``interval``-th forward only
(the counters are cumulative: a skipped copy loses nothing but time), and ``flush`` copies the last forward's
counters if no copy has (before an idle drain, so what the host settles on is current): the host learns of a
violation up to ``delay + interval - 1`` forwards after it, and the scheduler thread pays for 1/``interval`` of
the copies (~25 us each on an H100 host, docs/hicache-results.md 7.4).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Tuple

import torch


class DelayedDeviceHostHandler:
    def __init__(self, source: torch.Tensor, delay: int, interval: int = 1):
        if interval < 1:
            raise ValueError(f"kv-canary: the counter copy interval must be >= 1 forward, not {interval}")
        self._source = source
        self._delay = delay
        self._interval = interval
        self._copied_step = None  # the forward of the last copy queued
        self._is_cuda = source.device.type == "cuda"
        n = delay + 2
        pin = self._is_cuda
        self._slots = [torch.zeros_like(source, device="cpu").pin_memory() if pin else
                       torch.zeros_like(source, device="cpu") for _ in range(n)]
        self._events = [torch.cuda.Event() if self._is_cuda else None for _ in range(n)]
        # CUDA: per slot, the device copy the side stream reads; reused only after that read finished
        self._staging = [torch.empty_like(source) for _ in range(n)] if self._is_cuda else []
        self._copy_stream = torch.cuda.Stream(device=source.device) if self._is_cuda else None
        # CUDA: per slot, marks the staging copy on the forward's stream (the side stream's copy waits for it)
        self._staged = [torch.cuda.Event() for _ in range(n)] if self._is_cuda else []
        self._used = [False] * n
        self._pending: Deque[Tuple[int, int]] = deque()  # (step, slot index)
        self._next_slot = 0

    def snapshot(self, step: int, *, force: bool = False) -> None:
        """Queue a copy of the counters as they are after forward ``step``: every ``interval``-th forward, or
        ``force``."""
        if not force and step % self._interval:
            return
        self._copied_step = step
        if len(self._pending) == len(self._slots):
            # All slots in flight: wait for the oldest (only when the host runs far ahead).
            old_step, old_slot = self._pending[0]
            if self._events[old_slot] is not None:
                self._events[old_slot].synchronize()
        idx = self._next_slot
        self._next_slot = (idx + 1) % len(self._slots)
        if self._pending and self._pending[0][1] == idx:
            # Counters are cumulative: dropping an unread snapshot loses nothing.
            self._pending.popleft()
        if self._is_cuda:
            # Every forward pays this on the scheduler thread: few torch calls, preallocated events, no stream
            # context manager (38-58 us a call before on an H100 host, bench_hicache_host_ops.py ``snapshot``).
            main = torch.cuda.current_stream(self._source.device)
            if self._used[idx]:  # the last read of this staging buffer (n forwards ago: long finished)
                main.wait_event(self._events[idx])
            self._staging[idx].copy_(self._source, non_blocking=True)
            staged = self._staged[idx]  # re-recorded: a wait binds to the record before it, not to later ones
            staged.record(main)
            self._copy_stream.wait_event(staged)
            torch.cuda.set_stream(self._copy_stream)
            try:
                self._slots[idx].copy_(self._staging[idx], non_blocking=True)
                self._events[idx].record(self._copy_stream)
            finally:
                torch.cuda.set_stream(main)
            self._used[idx] = True
        else:
            self._slots[idx].copy_(self._source)
        self._pending.append((step, idx))

    def ready(self, current_step: int) -> List[Tuple[int, List[int]]]:
        """(step, counters as a list of ints) for each finished copy at least ``delay`` forwards old."""
        out = []
        while self._pending:
            step, idx = self._pending[0]
            if current_step - step < self._delay:
                break
            event = self._events[idx]
            if event is not None and not event.query():
                break
            out.append((step, self._slots[idx].tolist()))
            self._pending.popleft()
        return out

    def flush(self, step: int) -> None:
        """Queue a copy after forward ``step`` unless one was (an interval's skipped forwards, before a drain)."""
        if self._copied_step != step:
            self.snapshot(step, force=True)

    def restart_steps(self) -> None:
        """The forward count starts again from 0 (init finished): no copy is of the new count's forwards yet."""
        self._copied_step = None

    def drain(self) -> List[Tuple[int, List[int]]]:
        """Wait for every queued copy (shutdown, tests)."""
        for _, idx in self._pending:
            if self._events[idx] is not None:
                self._events[idx].synchronize()
        return self.ready(current_step=1 << 62)
