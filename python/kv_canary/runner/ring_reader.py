"""Host reads of the violation ring: only the rows not read yet, at most a budget per read, never a stream sync.

The ring is ``int64[capacity, RING_WIDTH]``; the kernels append row ``seq`` at
``seq % capacity`` after reserving ``seq`` with an atomic add on
``counters[C_VIOLATIONS]``. The host learns that rows up to ``end`` exist from a
counter copy that landed after the kernels which wrote them, so those rows are
complete on the device: ``read`` copies just them (one or two contiguous slices,
at most ``budget`` rows) on a side stream into a pinned buffer and waits for that
copy alone, not for the forward in flight. The violation counter is copied right
after the rows on the same stream; rows the device may have overwritten before
the copy read them (the ring wrapped) are reported as lost, never as data.

Host work per read is O(rows read) <= O(budget), whatever the ring holds.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .. import fingerprint as fp


class RingReader:
    def __init__(self, ring: torch.Tensor, counters: torch.Tensor, budget: int):
        self._ring = ring
        self._counters = counters
        self.capacity = int(ring.shape[0])
        self.budget = max(1, min(budget, self.capacity))
        self._cuda = ring.device.type == "cuda"
        self._host = torch.zeros((self.budget, ring.shape[1]), dtype=ring.dtype, pin_memory=self._cuda)
        self._host_total = torch.zeros(1, dtype=torch.int64, pin_memory=self._cuda)
        self._stream = torch.cuda.Stream(device=ring.device) if self._cuda else None
        self._event = torch.cuda.Event() if self._cuda else None
        self.rows_read = 0  # cumulative rows copied to the host (tests and stats)
        self.reads = 0

    def read(self, first: int, end: int) -> Tuple[int, List[List[int]], int]:
        """Rows with sequence numbers in ``[first, end)``: returns (first seq read, rows, lost).

        Reads at most ``budget`` rows, the oldest first: the caller continues from
        ``first_read + len(rows)`` (plus ``lost``) next time. ``lost`` counts rows
        overwritten on the device before they could be read.
        """
        lost = max(0, end - first - self.capacity)
        first += lost
        n = min(end - first, self.budget)
        if n <= 0:
            return first, [], lost
        a = first % self.capacity
        n1 = min(n, self.capacity - a)
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._host[:n1].copy_(self._ring[a:a + n1], non_blocking=True)
                if n > n1:
                    self._host[n1:n].copy_(self._ring[: n - n1], non_blocking=True)
                self._host_total.copy_(self._counters[fp.C_VIOLATIONS:fp.C_VIOLATIONS + 1], non_blocking=True)
                self._event.record(self._stream)
            self._event.synchronize()  # this copy only: the forward stream keeps running
            total_after = int(self._host_total[0])
        else:
            self._host[:n1].copy_(self._ring[a:a + n1])
            if n > n1:
                self._host[n1:n].copy_(self._ring[: n - n1])
            total_after = int(self._counters[fp.C_VIOLATIONS])
        # Row s is intact unless a later row s + capacity was reserved before the copy: total_after > s + capacity.
        overwritten = min(n, max(0, total_after - self.capacity - first))
        rows = self._host[overwritten:n].tolist()
        self.rows_read += n
        self.reads += 1
        return first + overwritten, rows, lost + overwritten
