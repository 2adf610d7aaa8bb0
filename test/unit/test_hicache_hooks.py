"""adapter/hicache's hook bodies against fake objects shaped like sglang 0.5.12's (HiCacheController's queues of
CacheOperation, start_* clearing them, the layer counter's consumer index, HostKVCache.free): the records follow
exactly the queued (host, device) pairs, only for a load sglang issued, and a consumed load is handed over."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kv_canary.adapter import hicache


class FakeManager:
    def __init__(self):
        self.calls = []
        self.host_records = object()

    def backup_records(self, device_idx, host_idx, stream=None):
        self.calls.append(("backup", device_idx.tolist(), host_idx.tolist(), stream))

    def load_records(self, host_idx, device_idx, load_id=0):
        self.calls.append(("load", host_idx.tolist(), device_idx.tolist(), load_id))

    def settle_host_records(self):
        self.calls.append(("settle",))

    def free_host_slots(self, host_idx):
        self.calls.append(("free", host_idx.tolist()))

    def clear_host_records(self):
        self.calls.append(("clear",))

    def load_in_flight(self, wait_until_layer, load_id=0):
        self.calls.append(("load_in_flight", wait_until_layer, load_id))


def _op(host, device):
    return SimpleNamespace(host_indices=torch.tensor(host), device_indices=torch.tensor(device))


def _controller(manager):
    c = SimpleNamespace(write_queue=[_op([8, 9], [3, 4]), _op([10], [7])], load_queue=[_op([8, 9], [20, 21])],
                        write_stream="w", kv_canary_manager=manager)
    return c


def test_backup_and_load_follow_the_queued_operations():
    m = FakeManager()
    c = _controller(m)

    def start_writing(controller):  # sglang's: merges the queue, copies, clears it
        assert m.calls and m.calls[-1][0] == "backup"  # the records were queued first
        controller.write_queue.clear()

    hicache.around_start_writing(start_writing, c)
    assert m.calls == [("backup", [3, 4, 7], [8, 9, 10], None)]  # CPU indices: the current stream

    def start_loading(controller):
        controller.load_queue.clear()
        return 1

    assert hicache.around_start_loading(start_loading, c) == 1
    assert m.calls[-1] == ("load", [8, 9], [20, 21], 1)  # named by sglang's producer index


def test_no_load_issued_no_records_moved_and_no_manager_no_work():
    m = FakeManager()
    c = _controller(m)
    assert hicache.around_start_loading(lambda controller: -1, c) == -1
    assert m.calls == []
    c.kv_canary_manager = None
    hicache.around_start_writing(lambda controller: None, c)
    assert m.calls == []


def test_settle_free_and_consumer_hand_over():
    m = FakeManager()
    hicache.after_writing_check(None, SimpleNamespace(kv_canary_manager=m))
    hicache.after_host_free(2, SimpleNamespace(kv_canary_manager=m), torch.tensor([5, 6]))
    assert m.calls == [("settle",), ("free", [5, 6])]
    counter = SimpleNamespace(consumer_index=-1, wait_until=lambda layer: None)
    runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(layer_transfer_counter=counter))
    hicache.note_load_consumer(m, runner)
    assert m.calls[-1][0] == "free"  # no load consumed: nothing handed over
    counter.consumer_index = 2
    hicache.note_load_consumer(m, runner)
    assert m.calls[-1] == ("load_in_flight", counter.wait_until, 2)
    n = len(m.calls)
    hicache.after_host_clear(None, SimpleNamespace())  # the host pool's own __init__ clears before attach
    hicache.after_host_clear(None, SimpleNamespace(kv_canary_manager=m, size=8))  # HiRadixCache.reset (/flush_cache)
    assert m.calls[n:] == [("clear",)]
