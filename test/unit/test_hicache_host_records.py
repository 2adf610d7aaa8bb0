"""HostRecordStore (HiCache's host copies' records): pending backups land when settled, in issue order; reads
settle what they read; free zeroes; the memory formula matches the tensors."""

from __future__ import annotations

import threading

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.host_records import HostRecordStore
from kv_canary.memory import host_record_bytes


class FakeEvent:
    """A copy event: not done until ``done`` is set; ``synchronize`` completes it (and counts the waits)."""

    def __init__(self, done: bool = False):
        self.done = done
        self.waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def rows(n: int, base: int) -> torch.Tensor:
    return torch.arange(base, base + n * fp.RECORD_WIDTH, dtype=torch.int64).view(n, fp.RECORD_WIDTH)


def test_pending_backup_lands_only_when_settled():
    store = HostRecordStore(16)
    idx = torch.tensor([3, 4, 5])
    ev = FakeEvent()
    store.add_pending(idx, rows(3, 100), ev)
    assert store.settle_ready() == []  # the copy is not done: nothing lands, nothing waits
    assert store.records[idx].abs().sum() == 0 and ev.waits == 0 and store.pending_backups == 1
    ev.done = True
    settled = store.settle_ready()
    assert len(settled) == 1 and torch.equal(settled[0], idx)
    assert torch.equal(store.records[idx], rows(3, 100))
    assert store.pending_backups == 0
    assert store.stats.backups == 1 and store.stats.slots_backed_up == 3


def test_read_settles_only_what_it_reads_and_waits_for_it():
    store = HostRecordStore(16)
    ev_a, ev_b = FakeEvent(), FakeEvent()
    store.add_pending(torch.tensor([1, 2]), rows(2, 10), ev_a)
    store.add_pending(torch.tensor([8, 9]), rows(2, 50), ev_b)
    got = store.read(torch.tensor([2, 1]))
    assert ev_a.waits == 1 and ev_b.waits == 0  # the other backup is left pending
    assert torch.equal(got, rows(2, 10).flip(0))
    assert store.pending_backups == 1 and store.records[8].abs().sum() == 0
    assert store.stats.loads == 1 and store.stats.slots_loaded == 2


def test_overlapping_backups_land_in_issue_order():
    store = HostRecordStore(8)
    store.add_pending(torch.tensor([2, 3]), rows(2, 0), FakeEvent(done=True))
    store.add_pending(torch.tensor([3, 4]), rows(2, 1000), None)
    store.settle()
    assert torch.equal(store.records[3], rows(2, 1000)[0])  # the later backup of slot 3 wins
    assert torch.equal(store.records[2], rows(2, 0)[0])


def test_free_and_clear_zero():
    store = HostRecordStore(8)
    idx = torch.tensor([5, 6])
    store.add_pending(idx, rows(2, 7), FakeEvent())
    store.free(idx)  # a pending backup there lands first, then is dropped
    assert store.records[idx].abs().sum() == 0 and store.pending_backups == 0
    store.add_pending(torch.tensor([1]), rows(1, 3), None)
    store.clear()
    assert store.records.abs().sum() == 0 and store.pending_backups == 0


def test_bad_stage_shape_is_refused():
    store = HostRecordStore(4)
    with pytest.raises(ValueError):
        store.add_pending(torch.tensor([1, 2]), rows(1, 0), None)


def test_concurrent_settles_land_every_backup_once():
    store = HostRecordStore(4096)
    events = []
    for i in range(64):
        ev = FakeEvent()
        events.append(ev)
        store.add_pending(torch.arange(i * 32, i * 32 + 32), rows(32, i * 1000), ev)
    for ev in events:
        ev.done = True
    threads = [threading.Thread(target=store.settle) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.pending_backups == 0
    for i in (0, 31, 63):
        assert torch.equal(store.records[i * 32: i * 32 + 32], rows(32, i * 1000))


def test_memory_formula_matches_the_store():
    store = HostRecordStore(1000)
    assert host_record_bytes(1000) == store.nbytes == 1000 * 8 * fp.RECORD_WIDTH
