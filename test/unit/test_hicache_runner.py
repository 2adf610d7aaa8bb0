"""The runner's HiCache hand-over (runner/host_copies.py + SingleForwardManager): records backed up with the
slots' K/V, loaded back into new device slots with their tags zeroed; the forward that consumes the load waits
first (HEAD, before any launch) and hashes the loaded slots' full rows layer by layer (each part behind its
layer's wait) before its TAIL's write; a load no HEAD consumed
is an error. Torch reference kernels on CPU, a fake wait callable."""

from __future__ import annotations

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig
from kv_canary.host_records import HostRecordStore
from kv_canary.kernels import select_kernels
from kv_canary.config import KernelBackend
from kv_canary.runner.brackets import CanaryBracketError
from kv_canary.runner.host_copies import HostCopies
from kv_canary.runner.single_forward import SingleForwardManager
from kv_canary.views import ForwardView, LaunchCapacities

SLOTS, CTX = 64, 48


class Manager(HostCopies):
    """What ``HostCopies`` reads of a ``CanaryManager``, around one single-forward manager."""

    def __init__(self, events, scrub=0):
        self.config = CanaryConfig.build(mode="raise", environ={}, hicache=True)
        self.forwards = 0
        g = torch.Generator().manual_seed(0)
        self.k = [torch.randn(SLOTS, 2, 4, generator=g) for _ in range(2)]
        self.v = [torch.randn(SLOTS, 2, 4, generator=g) for _ in range(2)]
        self.groups = [build_group(PoolLayout("full", self.k, self.v), self.config, torch.device("cpu"))]
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64)
        self.counters[fp.C_REPORT_ENABLED] = 1
        self.ring = torch.zeros(16, fp.RING_WIDTH, dtype=torch.int64)
        ref = select_kernels(KernelBackend.TORCH, torch.device("cpu"))

        def spy(name, fn):
            def wrapped(*a, **kw):
                events.append((name, kw.get("defer_first_read")) if name == "verify" else
                              (name, int(a[1][fp.C_FORWARD_INDEX]), kw["after_write"]) if name == "scrub" else name)
                return fn(*a, **kw)
            return wrapped

        import dataclasses
        kernels = dataclasses.replace(ref, verify=spy("verify", ref.verify), write=spy("write", ref.write),
                                      first_read=spy("first_read", ref.first_read), scrub=spy("scrub", ref.scrub))
        self.kernels_for_tests = kernels
        self.r2t = torch.zeros(4, CTX, dtype=torch.int32)
        self.single_forward_managers = [SingleForwardManager(
            index=0, groups=self.groups, kernels=kernels, req_to_token=self.r2t, counters=self.counters,
            ring=self.ring, capacities=LaunchCapacities(max_batch_size=4, max_context_len=CTX, verify_programs_target=1),
            on_tail=lambda: None, check_fed=False, write_witness=False, scrub_slots_per_forward=scrub)]
        self._init_host_copies()
        self.attach_host_records(HostRecordStore(128))

    def forward(self, row, slots, prefix):
        """One extend forward of request ``row``: reads [0, prefix), writes ``slots`` at prefix..."""
        n = int(slots.numel())
        self.r2t[row, prefix:prefix + n] = slots.to(torch.int32)
        view = ForwardView(
            input_ids=torch.ones(n, dtype=torch.int64), positions=torch.arange(prefix, prefix + n),
            out_cache_loc=slots, req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([prefix + n]),
            new_starts=torch.zeros(1, dtype=torch.int32), new_lens=torch.tensor([n], dtype=torch.int32),
            batch_size=1, max_new_len=n)
        sfm = self.single_forward_managers[0]
        sfm.pre_ops_maybe_inside_graph(view)
        for layer in range(2):  # "attention" writes the new slots' K/V
            self.k[layer][slots] = float(prefix + 1)
            self.v[layer][slots] = -float(prefix + 1)
        sfm.post_ops_maybe_inside_graph(view)

    def violations(self):
        return [tuple(self.ring[i].tolist()) for i in range(int(self.counters[fp.C_VIOLATIONS]))]


def _load(m, host_idx, device_idx, load_id):
    """A load as the engine hook makes it: the ids staged before, the records moved after sglang queued it."""
    m.load_records(host_idx, device_idx, load_id=load_id, host_dev=m.stage_load(host_idx))


@pytest.mark.parametrize("flip", [False, True])
def test_a_load_back_forward_waits_first_and_hashes_the_loaded_rows_by_layer_before_its_write(flip):
    events = []
    m = Manager(events)
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    assert events == [("verify", False), "write"]  # no load: nothing deferred, no first-read launch
    m.backup_records(old, torch.arange(32, 48))
    new = torch.arange(40, 56)  # the engine evicts the device copy and loads it back into other slots
    for buf in (*m.k, *m.v):
        buf[new] = buf[old]
    _load(m, torch.arange(32, 48), new, 2)
    assert torch.equal(m.groups[0].records[new], m.groups[0].records[old])
    assert m.groups[0].full_row.tags[new].abs().sum() == 0
    if flip:
        m.v[1][int(new[9]), 1, 3] += 1.0  # outside the hashed window (layer 0's first 16 bytes of K and V)
    waited = []
    assert not m.load_in_flight(lambda layer: None, load_id=1)  # another load's name: not this one
    assert m.load_in_flight(lambda layer: (waited.append(layer), events.append("wait")), load_id=2)
    events.clear()
    m.r2t[1, :16] = new.to(torch.int32)
    m.forward(1, torch.tensor([60]), 16)
    assert waited == [0, 0, 1]  # HEAD: the hashed window's layer; then each part of the LIST behind its layer
    # the LIST in parts (on CPU: two runs of layers, each after its layer's wait), then its finalize, all before
    # the write (the LIST's rows name this forward)
    assert events == ["wait", ("verify", True), "wait", "first_read", "wait", "first_read", "first_read", "write"]
    assert all(r[fp.V_FORWARD] == 1 for r in m.violations())
    assert int(m.counters[fp.C_SLOTS_FIRST_READ]) == 16
    assert [(r[fp.V_SLOT], r[fp.V_REASON] & 0xFF) for r in m.violations()] == (
        [(int(new[9]), fp.R_KV_HASH)] if flip else [])
    assert m.host_copies_stats() == {"hicache_backups": 1, "hicache_slots_backed_up": 16, "hicache_loads": 1,
                                     "hicache_slots_loaded": 16, "hicache_loads_consumed": 1}
    events.clear()
    # sglang's decode batches keep naming the prefill's load (its consumer index): consumed already, not again,
    # so a CUDA-graph replay of them is no unconsumed load
    assert not m.load_in_flight(lambda layer: events.append("wait"), load_id=2)
    m._check_load_consumed()
    m.forward(1, torch.tensor([61]), 17)  # the next forward: no wait, nothing deferred, nothing listed
    assert events == [("verify", False), "write"] and int(m.counters[fp.C_SLOTS_FIRST_READ]) == 16


def test_a_load_back_forwards_scrub_runs_after_its_write_on_its_own_forwards_window():
    """The scrub of a forward that consumes a load runs after the write (the loaded rows' records are in place),
    when the write has bumped the forward counter: it says so (``after_write``), so the window is its forward's and
    the windows of consecutive forwards stay consecutive (HEAD at 0, after the write at 2 for forward 1, HEAD at 2)."""
    events = []
    m = Manager(events, scrub=8)
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    m.backup_records(old, torch.arange(32, 48))
    new = torch.arange(40, 56)
    for buf in (*m.k, *m.v):
        buf[new] = buf[old]
    _load(m, torch.arange(32, 48), new, 2)
    assert m.load_in_flight(lambda layer: None, load_id=2)
    m.r2t[1, :16] = new.to(torch.int32)
    m.forward(1, torch.tensor([60]), 16)
    m._check_load_consumed()
    m.forward(1, torch.tensor([61]), 17)
    scrubs = [e for e in events if e[0] == "scrub"]
    assert scrubs == [("scrub", 0, False), ("scrub", 2, True), ("scrub", 2, False)]
    assert [i - after for _, i, after in scrubs] == [0, 1, 2] and m.violations() == []
    assert events[events.index(("scrub", 2, True)) - 1] == "write"  # forward 1's: right after its write


def test_a_load_no_head_consumed_is_an_error():
    m = Manager([])
    _load(m, torch.arange(32, 48), torch.arange(40, 56), 0)
    assert m.load_in_flight(lambda layer: None)
    with pytest.raises(CanaryBracketError, match="load-back"):
        m._check_load_consumed()
    m._check_load_consumed()  # reported once


def test_a_cache_reset_drops_the_host_records_and_a_named_load():
    """``clear_host_records`` (sglang's tree reset): the host records are zeroed, a load named but never consumed
    is forgotten (sglang restarts its producer indices), and the load book is emptied."""
    m = Manager([])
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    m.backup_records(old, torch.arange(32, 48))
    m.flush_host_records()
    assert bool((m.host_records.records[32:48] != 0).any())
    _load(m, torch.arange(32, 48), torch.arange(40, 56), 0)
    m.clear_host_records()
    assert not bool((m.host_records.records != 0).any())
    assert not m.load_in_flight(lambda layer: None, load_id=0)  # the reset forgot it: nothing handed over
    assert int(m._loaded_from.max()) == -1


def test_a_flipped_copy_loaded_back_stays_counted_after_its_host_copy_is_freed():
    """``hicache_flipped_copies_loaded`` counts flipped host copies loaded back, ever: sglang freeing the host copy
    later (host eviction) does not undo the load the canary had to report."""
    import dataclasses

    m = Manager([])
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    m.backup_records(old, torch.arange(32, 48))
    m.config = dataclasses.replace(m.config, perturb_host_copy_prob=0.5)
    m._flipped.update({33: False, 40: False})  # what the host-copy perturbation records at its flips
    _load(m, torch.arange(32, 48), torch.arange(40, 56), 0)
    _load(m, torch.arange(32, 48), torch.arange(40, 56), 1)  # loaded again: still one load each
    assert m.host_copies_stats()["hicache_flipped_copies_loaded"] == 2
    m.free_host_slots(torch.arange(32, 48))
    assert m.host_copies_stats()["hicache_flipped_copies_loaded"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: torch's sync debug mode counts device "
                    "synchronizations, which a CPU run has none of (the GPU host runs it: gpu_host.sh unit)")
def test_the_hicache_hooks_never_wait_for_the_device():
    """What the scheduler thread calls at a backup, a write ack, a load-back and a host eviction only queues device
    work: a synchronization there stalls sglang's scheduling behind the forward in flight (a ``tags[idx] = 0`` did,
    at every load-back)."""
    from kv_canary.adapter.batch_adapter import SglangBatchAdapter
    from kv_canary.runner import CanaryManager

    device = torch.device("cuda")
    config = CanaryConfig.build(mode="log", environ={}, hicache=True)
    k = [torch.randn(SLOTS, 2, 4, device=device) for _ in range(2)]
    v = [torch.randn(SLOTS, 2, 4, device=device) for _ in range(2)]
    group = build_group(PoolLayout("full", k, v), config, device)
    m = CanaryManager(config=config, groups=[group], kernels=select_kernels(config.kernel_backend, device),
                      req_to_token=torch.zeros(4, CTX, dtype=torch.int32, device=device),
                      capacities=LaunchCapacities(max_batch_size=4, max_context_len=CTX, verify_programs_target=1),
                      batch_adapter=SglangBatchAdapter(max_batch_size=4, device=device), device=device)
    m.attach_host_records(HostRecordStore(128, device))
    group.records.random_(1, 1 << 40)
    side = torch.cuda.Stream(device)
    old, new, host = torch.arange(1, 17, device=device), torch.arange(40, 56, device=device), torch.arange(32, 48)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.backup_records(old, host)
        m.backup_queued(host, side)
        m.host_backups_acked()
        m.load_records(host, new, load_id=0, host_dev=m.stage_load(host))
        m.free_host_slots(host[:8])
        m.backup_records(old[:4], torch.arange(60, 64))
        m.flush_host_records()  # the batched free and backup: one copy of their host slot ids, no wait
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(group.records[new], group.records[old])
    assert not bool(group.full_row.tags[new].any())
    assert not bool(m.host_records.records[32:40].any()) and bool(m.host_records.records[40:48].all())
    assert torch.equal(m.host_records.records[60:64], group.records[old[:4]])


def test_a_copy_is_marked_landed_once_its_event_completes_never_dropped():
    """``host_backups_acked`` asks each copy's event once: a copy whose event completes while the list is walked is
    either landed now or kept for the next ack, never dropped (it would never be scrubbed or flipped)."""
    import dataclasses

    class Event:  # not done at its first query, done at every later one
        def __init__(self):
            self.queries = 0

        def query(self):
            self.queries += 1
            return self.queries > 1

    m = Manager([])
    m.config = dataclasses.replace(m.config, perturb_host_copy_prob=1e-9)  # the copies are tracked
    m.perturb = type("P", (), {"perturb_host_copies": staticmethod(lambda **kw: [])})()
    ev = Event()
    m._copies_in_flight = [(torch.arange(32, 40), ev)]
    m.host_backups_acked()
    assert len(m._copies_in_flight) == 1 and ev.queries == 1  # not landed yet: kept
    m.host_backups_acked()
    assert m._copies_in_flight == []  # landed at the second ack


def test_a_load_handed_to_a_manager_without_load_hashing_is_refused():
    """Only a manager whose host records are attached hashes loads; a hand-over elsewhere would leave the loaded
    slots listed and never hashed, so it is an error at the hand-over."""
    from kv_canary.runner.load_hashing import LoadWaits

    m = Manager([])
    bare = SingleForwardManager(
        index=1, groups=m.groups, kernels=m.kernels_for_tests, req_to_token=m.r2t, counters=m.counters, ring=m.ring,
        capacities=LaunchCapacities(max_batch_size=4, max_context_len=CTX, verify_programs_target=1),
        on_tail=lambda: None, check_fed=False, write_witness=False)
    with pytest.raises(ValueError, match="without load hashing"):
        bare.expect_load(LoadWaits(head=lambda: None, layer=lambda layer: None))
    bare.expect_load(None)  # forgetting a load needs none
    m.single_forward_managers[0].expect_load(LoadWaits(head=lambda: None, layer=lambda layer: None))  # attached


def _rows(m, slots):
    return m.groups[0].records[slots].clone()


def test_backups_and_frees_are_batched_until_the_next_flush_in_their_order():
    """Without a storage tier, the host-copy perturbation or the host scrub, backups and host frees wait for the
    engine's next ack check (``flush_host_records``): nothing is written before it; the flush zeroes the freed
    slots and writes every backup, a slot freed and backed up again ending with its new record; the stats count
    the engine's backups."""
    m = Manager([])
    assert m.defer_host_ops
    a, b = torch.arange(1, 9), torch.arange(9, 17)
    m.forward(0, torch.arange(1, 17), 0)
    m.backup_records(a, torch.arange(32, 40))
    m.flush_host_records()
    assert torch.equal(m.host_records.records[32:40], _rows(m, a))
    m.free_host_slots(torch.arange(32, 40))  # host eviction, then the engine backs up other slots into some of them
    m.backup_records(b[:4], torch.arange(36, 40))
    m.backup_records(b[4:], torch.arange(44, 48))
    assert torch.equal(m.host_records.records[32:40], _rows(m, a))  # nothing landed yet
    assert not bool(m.host_records.records[44:48].any())
    m.flush_host_records()
    assert not bool(m.host_records.records[32:36].any())  # freed, not backed up again: zeroed
    assert torch.equal(m.host_records.records[36:40], _rows(m, b[:4]))  # freed, then backed up: the new record
    assert torch.equal(m.host_records.records[44:48], _rows(m, b[4:]))
    assert m.host_copies_stats()["hicache_backups"] == 3
    m.free_host_slots(torch.arange(44, 46))
    m.flush_host_records()  # frees alone
    assert not bool(m.host_records.records[44:46].any()) and bool(m.host_records.records[46:48].all())


def test_a_load_flushes_what_is_batched_first_a_forward_only_past_the_bound():
    """A load-back reads host records the flush writes (flushed first); a forward leaves a few batched backups and
    frees batched (nothing it runs reads them), and flushes them past ``MAX_BATCHED_HOST_OPS``; a cache reset
    drops what is batched."""
    from kv_canary.runner import CanaryManager
    from kv_canary.runner import host_copies

    m = Manager([])
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    m.backup_records(old, torch.arange(32, 48))
    _load(m, torch.arange(32, 48), torch.arange(40, 56), 0)
    assert torch.equal(m.groups[0].records[40:56], _rows(m, old))
    m.free_host_slots(torch.arange(32, 40))
    m.init_finished = True
    m.token_oracle, m._arrivals, m.perturb = None, [], type("P", (), {"active": False})()
    CanaryManager._pre_ops_outside_graph(m, object())  # a forward's outside pre-ops (nothing else of them runs)
    assert bool(m.host_records.records[32:40].any())  # one free batched: left for the next ack or load
    for h in range(host_copies.MAX_BATCHED_HOST_OPS):
        m.free_host_slots(torch.tensor([100 + h % 20]))
    CanaryManager._pre_ops_outside_graph(m, object())  # past the bound: flushed
    assert not bool(m.host_records.records[32:40].any()) and not (m._pending_frees or m._pending_backups)
    m.backup_records(old, torch.arange(60, 76))
    m.clear_host_records()
    m.flush_host_records()
    assert not bool(m.host_records.records.any())


def test_a_load_staged_before_the_engine_queues_its_copy_moves_its_records_and_an_unstaged_one_is_refused():
    """``stage_load`` (called before sglang queues the load's K/V copy) flushes what is batched and returns the host
    ids on the device; ``load_records`` moves the records with them, and refuses a load without them (a copy made
    after the engine's load would wait for all of it)."""
    m = Manager([])
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    m.backup_records(old, torch.arange(32, 48))
    m.free_host_slots(torch.arange(60, 62))
    host_dev = m.stage_load(torch.arange(32, 48))
    assert not m._pending_backups and not m._pending_frees  # flushed ahead of the engine's copy
    assert torch.equal(host_dev, torch.arange(32, 48))
    with pytest.raises(ValueError, match="stage_load"):
        m.load_records(torch.arange(32, 48), torch.arange(40, 56), load_id=3, host_dev=None)
    assert m._pending_load_id is None  # refused before anything moved
    m.load_records(torch.arange(32, 48), torch.arange(40, 56), load_id=3, host_dev=host_dev)
    assert torch.equal(m.groups[0].records[40:56], _rows(m, old)) and m._pending_load_id == 3
    assert not m.groups[0].full_row.tags[40:56].any()  # first reads pending
    assert torch.equal(m._loaded_from[40:56, 0], torch.arange(32, 48))
    assert Manager([]).stage_load(torch.zeros(0, dtype=torch.int64)) is None  # nothing to load: nothing staged


def test_with_the_host_copy_perturbation_backups_and_frees_are_immediate():
    """The perturbation (and the host scrub, and a storage tier) act on host records after the engine's write ack:
    there every backup lands ahead of the engine's copy and every free at once."""
    import dataclasses

    m = Manager([])
    m.config = dataclasses.replace(m.config, perturb_host_copy_prob=0.5)
    m.attach_host_records(HostRecordStore(128), {(0, "k"): torch.zeros(128, 32, dtype=torch.uint8)})
    assert not m.defer_host_ops
    old = torch.arange(1, 17)
    m.forward(0, old, 0)
    m.backup_records(old, torch.arange(32, 48))
    assert torch.equal(m.host_records.records[32:48], _rows(m, old))
    m.free_host_slots(torch.arange(32, 40))
    assert not bool(m.host_records.records[32:40].any())
