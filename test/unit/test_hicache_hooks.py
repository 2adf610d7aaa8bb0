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

    def backup_records(self, device_idx, host_idx, wait_for=None):
        self.calls.append(("backup", device_idx.tolist(), host_idx.tolist()))

    def flush_host_records(self):
        self.calls.append(("flush",))

    def backup_queued(self, host_idx, stream=None):
        self.calls.append(("queued", host_idx.tolist(), stream))

    def stage_load(self, host_idx):
        self.calls.append(("stage", host_idx.tolist()))
        return ("staged", tuple(host_idx.tolist()))

    def load_records(self, host_idx, device_idx, load_id=0, host_dev=None):
        if host_dev != ("staged", tuple(host_idx.tolist())):
            raise AssertionError(f"load_records without its staged host ids: {host_dev}")
        self.calls.append(("load", host_idx.tolist(), device_idx.tolist(), load_id))

    def host_backups_acked(self):
        self.calls.append(("acked",))

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
    # the records first; then sglang's copy is queued (CPU indices: done already, no stream to watch)
    assert m.calls == [("backup", [3, 4, 7], [8, 9, 10]), ("queued", [8, 9, 10], None)]

    def start_loading(controller):  # sglang's: queues the K/V copy, clears the queue
        # the host ids went to the device first: behind sglang's copy they would hold the forward for all of it
        assert m.calls[-1] == ("stage", [8, 9])
        controller.load_queue.clear()
        return 1

    assert hicache.around_start_loading(start_loading, c) == 1
    assert m.calls[-2:] == [("stage", [8, 9]), ("load", [8, 9], [20, 21], 1)]  # named by sglang's producer index


def test_no_load_issued_no_records_moved_and_no_manager_no_work():
    m = FakeManager()
    c = _controller(m)
    assert hicache.around_start_loading(lambda controller: -1, c) == -1
    assert [call[0] for call in m.calls] == ["stage"]  # staged ahead, no records moved
    c.load_queue.clear()
    assert hicache.around_start_loading(lambda controller: -1, c) == -1 and len(m.calls) == 1  # an empty queue
    m.calls.clear()
    c.kv_canary_manager = None
    hicache.around_start_writing(lambda controller: None, c)
    assert m.calls == []


def test_acks_free_and_consumer_hand_over():
    m = FakeManager()
    queue = [object(), object()]  # sglang's ack_write_queue: (start, finish event, node ids) per backup
    tree = SimpleNamespace(kv_canary_manager=m, cache_controller=SimpleNamespace(ack_write_queue=queue))

    def check(t, *a, acks=0, **kw):
        m.calls.append(("check", a, kw))
        del queue[:acks]
        return 7
    # batched backups and frees land right after a check that acked a backup (before the scheduler can reuse the
    # acked device slots), or a blocking write-back check (it may write and ack in it)
    assert hicache.around_writing_check(check, tree) == 7  # nothing acked: they stay batched
    assert hicache.around_writing_check(lambda t, *a: check(t, *a, acks=1), tree) == 7
    assert hicache.around_writing_check(check, tree, True) == 7
    assert hicache.around_writing_check(check, tree, write_back=True) == 7
    hicache.after_host_free(2, SimpleNamespace(kv_canary_manager=m), torch.tensor([5, 6]))
    assert m.calls == [("check", (), {}), ("acked",), ("check", (), {}), ("flush",), ("acked",),
                       ("check", (True,), {}), ("flush",), ("acked",), ("check", (), {"write_back": True}),
                       ("flush",), ("acked",), ("free", [5, 6])]
    m.calls.clear()  # a tree without the controller's queue: every check flushes
    assert hicache.around_writing_check(check, SimpleNamespace(kv_canary_manager=m)) == 7
    assert m.calls == [("check", (), {}), ("flush",), ("acked",)]
    assert hicache.around_writing_check(lambda t: 3, SimpleNamespace()) == 3  # no canary: sglang's body alone
    counter = SimpleNamespace(consumer_index=-1, wait_until=lambda layer: None)
    runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(layer_transfer_counter=counter))
    hicache.note_load_consumer(m, runner)
    assert m.calls[-1][0] == "acked"  # no load consumed: nothing handed over
    counter.consumer_index = 2
    hicache.note_load_consumer(m, runner)
    assert m.calls[-1] == ("load_in_flight", counter.wait_until, 2)
    n = len(m.calls)
    hicache.after_host_clear(None, SimpleNamespace())  # the host pool's own __init__ clears before attach
    hicache.after_host_clear(None, SimpleNamespace(kv_canary_manager=m, size=8))  # HiRadixCache.reset (/flush_cache)
    assert m.calls[n:] == [("clear",)]


# ---------------------------------------------------------------- sglang 0.5.23's shapes (adapter/hicache_0_5_23)


def _controller_0_5_23(manager):
    """HybridCacheController: the queues as 0.5.12's, the streams on its L2 transfer engine, fenced on the forward."""
    engine = SimpleNamespace(device_to_host_stream="d2h", host_to_device_stream="h2d")
    return SimpleNamespace(write_queue=[_op([8, 9], [3, 4])], load_queue=[_op([12, 13], [30, 31])],
                           l2_transfer_engine=engine, write_fence_stream="fwd", load_fence_stream="fwd",
                           kv_canary_manager=manager)


def test_0_5_23_backup_and_load_follow_the_queued_operations():
    from kv_canary.adapter import hicache_0_5_23 as h23

    m = FakeManager()
    c = _controller_0_5_23(m)
    h23.around_start_writing(lambda controller: controller.write_queue.clear(), c)
    assert m.calls == [("backup", [3, 4], [8, 9]), ("queued", [8, 9], None)]  # CPU: no fence, no stream
    assert h23.d2h_stream(c) == "d2h" and h23.write_fence(c) == h23.load_fence(c) == "fwd"
    assert h23.around_start_loading(lambda controller: (controller.load_queue.clear(), 2)[1], c) == 2
    assert m.calls[-2:] == [("stage", [12, 13]), ("load", [12, 13], [30, 31], 2)]
    assert h23.around_start_loading(lambda controller: -1, c) == -1 and len(m.calls) == 4  # empty queue: no load


def _group(*entries):
    return SimpleNamespace(anchor_entry=entries[0], entries=list(entries))


def _entry(name, layers=2, target=2):
    return SimpleNamespace(name=SimpleNamespace(value=name),
                           host_pool=SimpleNamespace(layer_num=layers, target_layer_num=target))


def test_0_5_23_host_pool_is_the_groups_only_anchor_entry():
    import pytest

    from kv_canary.adapter import hicache_0_5_23 as h23
    from kv_canary.config import CanaryConfigError

    kv = _entry("kv")
    assert h23.host_pool(SimpleNamespace(mem_pool_host=_group(kv))) is kv.host_pool
    assert h23.host_pool(SimpleNamespace(mem_pool_host=None)) is None
    with pytest.raises(CanaryConfigError, match="the host pools kv, swa"):
        h23.host_pool(SimpleNamespace(mem_pool_host=_group(kv, _entry("swa"))))
    with pytest.raises(CanaryConfigError, match="draft model's layers"):
        h23.host_pool(SimpleNamespace(mem_pool_host=_group(_entry("kv", layers=3, target=2))))
    with pytest.raises(CanaryConfigError, match="draft model's pool"):  # 0.5.12's reader
        hicache.host_pool_0_5_12(SimpleNamespace(has_draft=True, mem_pool_host=object()))


def test_0_5_23_forward_entry_names_the_consumed_load():
    """sglang 0.5.23 sets the layer counter's consumer before ``ModelRunner.forward`` enters the canary through
    ``InTreeSlot.with_ops_outside_graph``: the load is handed over there; without HiCache nothing is read."""
    from kv_canary.adapter.lines.v0_5_23 import InTreeSlot

    m = FakeManager()
    m.with_ops_outside_graph = lambda **kw: "bracket"
    counter = SimpleNamespace(consumer_index=1, wait_until=lambda layer: None)
    runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(layer_transfer_counter=counter, layer_num=4))
    slot = InTreeSlot(m, runner)
    assert slot.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=None) == "bracket"
    assert m.calls == [("load_in_flight", counter.wait_until, 1)]
    m.host_records = None
    slot.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=None)
    assert len(m.calls) == 1
