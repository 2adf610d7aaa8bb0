"""HostScrub (HiCache's host copies checked at rest): the numpy FULL_HASH twin equals the device formula bit for bit
(whole rows or split); a landed copy hashing to its record passes, a flipped byte is found naming its host slot;
copies not landed, never written, or written (backup, eviction, reset) while being hashed are never reported; the
thread walks the pool at its rate."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.host_scrub import HostScrub

SLOTS, ROWS, WORDS = 100, 4, 8


def _pool(seed=0):
    """ROWS host rows of uint32[SLOTS, WORDS], and records whose FULL_HASH matches them (positions = slot)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(-2 ** 31, 2 ** 31 - 1, (SLOTS, WORDS), generator=g, dtype=torch.int64).to(torch.int32)
            for _ in range(ROWS)]
    records = torch.zeros(SLOTS, fp.RECORD_WIDTH, dtype=torch.int64)
    records[:, fp.F_FULL_HASH] = fp.full_hash_from_words(torch.cat(rows, dim=1))
    records[:, fp.F_POSITION] = torch.arange(SLOTS)
    return [r.numpy().view(np.uint32) for r in rows], records.numpy()


def test_numpy_full_hash_is_the_device_formula():
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (9, 70), dtype=torch.int64).to(torch.int32)
    u = words.numpy().view(np.uint32)
    want = fp.full_hash_from_words(words).numpy()
    assert np.array_equal(fp.full_hash_finalize_np(fp.full_hash_terms_np(u)), want)
    split = fp.full_hash_terms_np(u[:, :33]) + fp.full_hash_terms_np(u[:, 33:], 33)
    assert np.array_equal(fp.full_hash_finalize_np(split), want)


def _scrub(rows, records, on_read=None, rate=1000, chunk=SLOTS):
    def read(idx):
        if on_read is not None:
            on_read(idx)
        return records[idx].copy()
    return HostScrub(rows, read, rate, chunk=chunk)


def test_a_flipped_landed_copy_is_found_and_clean_ones_pass():
    rows, records = _pool()
    s = _scrub(rows, records)
    s.backup_landed(np.arange(SLOTS))
    rows[2][17, 5] ^= 1 << 30  # one bit of one word of one row of host slot 17
    assert s.step() == SLOTS
    found = s.drain()
    assert [(m.host_slot, m.position, m.stored) for m in found] == [(17, 17, int(records[17, fp.F_FULL_HASH]))]
    assert found[0].live != found[0].stored and s.slots_scrubbed == SLOTS and s.passes == 1


def test_copies_not_landed_or_never_written_are_skipped():
    rows, records = _pool()
    s = _scrub(rows, records)
    s.backup_landed(np.arange(50))
    records[10] = 0  # never written (or freed)
    for r in rows:
        r[10] ^= 1
        r[60] ^= 1  # not landed: its copy may still be on the way
    assert s.step() == 49 and s.drain() == []


@pytest.mark.parametrize("event", ["backup", "free", "clear"])
def test_a_copy_written_while_it_is_hashed_is_not_reported(event):
    """The engine starts writing slot 5 after the scrub took its generation (here: while it reads the records), and
    the bytes it hashes are half old, half new: discarded, never reported."""
    rows, records = _pool()

    def engine_writes(idx):
        if event == "backup":
            s.backup_started(np.array([5]))
        elif event == "free":
            s.freed(np.array([5]))
        else:
            s.cleared()
        for r in rows:
            r[5] ^= 7

    s = _scrub(rows, records, on_read=engine_writes)
    s.backup_landed(np.arange(SLOTS))
    n = s.step()
    assert s.drain() == []
    assert n == (SLOTS - 1 if event != "clear" else 0)


def test_a_copy_that_landed_while_hashed_waits_for_the_next_pass():
    rows, records = _pool()
    for r in rows:
        r[3] ^= 1
    s = _scrub(rows, records, on_read=lambda idx: s.backup_landed(np.array([3])))
    s.backup_landed(np.arange(3))
    assert s.step() == 3 and s.drain() == []  # slot 3 was not landed when its turn began
    assert s.step() == 4 and [m.host_slot for m in s.drain()] == [3]


def test_the_thread_walks_the_pool_at_its_rate():
    rows, records = _pool()
    s = _scrub(rows, records, rate=2000, chunk=10)
    s.backup_landed(np.arange(SLOTS))
    rows[0][99, 0] ^= 1
    s.start()
    try:
        deadline = time.monotonic() + 5
        while s.passes < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        s.stop()
    assert s.passes >= 2  # 100 slots at 2,000 a second: a pass every ~50 ms
    assert {m.host_slot for m in s.drain()} == {99}


def test_bad_arguments_are_refused():
    rows, records = _pool()
    with pytest.raises(ValueError, match="rate > 0"):
        HostScrub(rows, lambda idx: records[idx], 0)


def test_a_failing_scrub_stops_and_says_why():
    rows, records = _pool()

    def broken(idx):
        raise RuntimeError("device gone")

    s = HostScrub(rows, broken, 100000, chunk=10)
    s.backup_landed(np.arange(SLOTS))
    s.start()
    s._thread.join(timeout=5)
    assert s.error == "RuntimeError: device gone" and not s._thread.is_alive()
