"""RingReader: only new rows, wrap-around, budget, and rows overwritten before the copy counted lost (CPU and CUDA)."""

from __future__ import annotations

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.runner.ring_reader import RingReader

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _append(ring, counters, n, start_value):
    """Append n rows as the kernels do: reserve seq numbers, write row seq at seq % capacity."""
    base = int(counters[fp.C_VIOLATIONS])
    for k in range(n):
        ring[(base + k) % ring.shape[0]] = start_value + k
    counters[fp.C_VIOLATIONS] += n


@pytest.mark.parametrize("device", DEVICES)
def test_reads_new_rows_across_the_wrap_within_the_budget(device):
    ring = torch.zeros(8, fp.RING_WIDTH, dtype=torch.int64, device=device)
    counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=device)
    reader = RingReader(ring, counters, budget=4)
    _append(ring, counters, 6, 100)
    first, rows, lost = reader.read(0, 6)
    assert (first, [r[0] for r in rows], lost) == (0, [100, 101, 102, 103], 0)  # budget: 4 of 6
    first, rows, lost = reader.read(4, 6)
    assert (first, [r[0] for r in rows], lost) == (4, [104, 105], 0)
    _append(ring, counters, 4, 106)  # rows 6..9 wrap to ring indices 6, 7, 0, 1
    first, rows, lost = reader.read(6, 10)
    assert (first, [r[0] for r in rows], lost) == (6, [106, 107, 108, 109], 0)
    assert reader.rows_read == 10


@pytest.mark.parametrize("device", DEVICES)
def test_rows_overwritten_before_the_read_are_lost_not_misreported(device):
    ring = torch.zeros(8, fp.RING_WIDTH, dtype=torch.int64, device=device)
    counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=device)
    reader = RingReader(ring, counters, budget=8)
    _append(ring, counters, 4, 0)  # the host was told about rows 0..3
    _append(ring, counters, 7, 4)  # ...but 7 more landed before it read them: rows 0..2 are overwritten
    first, rows, lost = reader.read(0, 4)
    assert lost == 3 and first == 3 and [r[0] for r in rows] == [3]
    _append(ring, counters, 9, 11)  # 20 rows in all
    first, rows, lost = reader.read(0, 20)  # more than the ring holds: the oldest are lost up front
    assert (lost, first, [r[0] for r in rows]) == (12, 12, list(range(12, 20)))
