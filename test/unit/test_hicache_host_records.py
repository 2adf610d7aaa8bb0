"""HostRecordStore (HiCache's host copies' records, a table indexed by host slot on the pool's device): a backup
writes the host slots' rows, a read gathers them, a later backup of a slot wins, free and clear zero, storage
rows come out as a CPU copy and go in landed; bad shapes are refused; the memory formula matches the tensors."""

from __future__ import annotations

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.host_records import HostRecordStore
from kv_canary.memory import host_record_bytes


def rows(n: int, base: int) -> torch.Tensor:
    return torch.arange(base, base + n * fp.RECORD_WIDTH, dtype=torch.int64).view(n, fp.RECORD_WIDTH)


def test_backup_then_read_gathers_the_rows_of_the_host_slots():
    store = HostRecordStore(16)
    store.backup(torch.tensor([3, 4, 5]), rows(3, 100))
    assert torch.equal(store.records[3:6], rows(3, 100)) and store.records[:3].abs().sum() == 0
    got = store.records[store.index(torch.tensor([5, 3]))]
    assert torch.equal(got, rows(3, 100)[[2, 0]])
    store.count_load(2)
    assert store.stats.backups == 1 and store.stats.slots_backed_up == 3
    assert store.stats.loads == 1 and store.stats.slots_loaded == 2


def test_a_later_backup_of_a_host_slot_wins():
    store = HostRecordStore(8)
    store.backup(torch.tensor([2, 3]), rows(2, 0))
    store.backup(torch.tensor([3, 4]), rows(2, 1000))
    assert torch.equal(store.records[3], rows(2, 1000)[0])
    assert torch.equal(store.records[2], rows(2, 0)[0])


def test_free_and_clear_zero():
    store = HostRecordStore(8)
    store.backup(torch.tensor([5, 6, 7]), rows(3, 7))
    store.free(torch.tensor([5, 6]))
    assert store.records[5:7].abs().sum() == 0 and torch.equal(store.records[7], rows(3, 7)[2])
    store.clear()
    assert store.records.abs().sum() == 0


def test_storage_rows_are_a_cpu_copy_and_put_lands_them():
    store = HostRecordStore(8)
    store.put(torch.tensor([1, 2]), rows(2, 50).to(torch.int32))  # any integer dtype in, int64 stored
    out = store.rows(torch.tensor([2, 1]))
    assert out.device.type == "cpu" and torch.equal(out, rows(2, 50)[[1, 0]])
    out.zero_()  # a copy: the store keeps its rows
    assert torch.equal(store.records[1:3], rows(2, 50))
    assert store.stats.loads == 0  # a storage write's read is not a load-back


def test_bad_shapes_are_refused():
    store = HostRecordStore(4)
    with pytest.raises(ValueError, match="1 host slots"):
        store.backup(torch.tensor([1]), rows(2, 0))
    with pytest.raises(ValueError, match="2 host slots"):
        store.put(torch.tensor([1, 2]), rows(1, 0))
    with pytest.raises(ValueError, match="needs host slots"):
        HostRecordStore(0)


def test_memory_formula_matches_the_store():
    store = HostRecordStore(1000)
    assert host_record_bytes(1000) == store.nbytes == 1000 * 8 * fp.RECORD_WIDTH


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the driver's wait on a pageable host copy")
def test_a_load_backs_host_ids_reach_the_device_without_waiting_for_the_forward_in_flight():
    """A load-back's host slot ids (CPU, pageable, over PAGEABLE_INLINE_BYTES) are staged in pinned memory, so their
    copy is queued behind a forward in flight instead of the driver waiting for it: ``index`` returns while a long
    GPU sleep is still running, and the ids arrive."""
    from kv_canary.host_records import PAGEABLE_INLINE_BYTES

    store = HostRecordStore(1 << 16, torch.device("cuda"))
    ids = torch.randperm(1 << 16)[: PAGEABLE_INLINE_BYTES // 8 + 1024]  # pageable int64, over the inline size
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s on an H100: the forward in flight
    busy = torch.cuda.Event()
    busy.record()
    dev = store.index(ids)
    assert not busy.query(), "index() waited for the work queued before it"
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), ids)
