"""HiCache's first-read verification of loaded slots (docs/history/hicache.md 3.4), Triton (interpreter on CPU) and the
torch reference side by side: TAIL tags new slots verified (outside ``all``), a load-back copies the host
records into new device slots and zeroes their tags, HEAD lists only those (deferred: hashed beside the forward,
whole or in runs of layers then finalized), and a byte of a loaded slot flipped outside the hashed window is
caught by the deferred LIST, once."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

import pytest  # noqa: E402

from kv_canary import fingerprint as fp  # noqa: E402
from kv_canary.buffer_groups import KVRow, PoolLayout, build_group  # noqa: E402
from kv_canary.config import CanaryConfig, CanaryMode, RealData  # noqa: E402
from kv_canary.host_records import HostRecordStore  # noqa: E402
from kv_canary.kernels import reference as ref  # noqa: E402
from kv_canary.kernels import triton_kernels as tk  # noqa: E402
from kv_canary.runner.load_hashing import layer_parts  # noqa: E402
from kv_canary.views import ForwardView  # noqa: E402

SLOTS, LAYERS, N = 96, 3, 24
BACKENDS = (tk, ref)


def _config(real_data=RealData.PARTIAL):
    return CanaryConfig.build(mode="raise", real_data=real_data.value, environ={}, hicache=True)


def _group(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, 2, 8, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, 2, 8, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(LAYERS)]
    return build_group(PoolLayout("full", k, v), config, DEVICE)


def _state():
    counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
    counters[fp.C_REPORT_ENABLED] = 1
    return counters, torch.zeros(64, fp.RING_WIDTH, dtype=torch.int64, device=DEVICE)


def _extend(slots, prefix=0):
    n = int(slots.numel())
    return ForwardView(
        input_ids=torch.ones(n, dtype=torch.int64, device=DEVICE),
        positions=torch.arange(prefix, prefix + n, device=DEVICE),
        out_cache_loc=slots.to(DEVICE), req_pool_indices=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor([prefix + n], device=DEVICE),
        new_starts=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        new_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE), batch_size=1, max_new_len=n)


def _rows(counters, ring):
    return sorted(tuple(ring[i].tolist()) for i in range(int(counters[fp.C_VIOLATIONS])))


def _load_back(group, store, host_idx, new_slots, old_slots):
    """What the adapter's load-back does (the KV bytes: what sglang's H2D copy does)."""
    for row in group.rows:
        row.view[new_slots] = row.view[old_slots]
    group.records[new_slots] = store.records[store.index(host_idx)]
    group.full_row.tags[new_slots] = 0


def test_config_turns_on_full_rows_and_first_reads_without_clearing_tags():
    config = _config()
    assert config.full_row_hash and config.first_read and not config.clear_tags
    assert config.scrub_slots_per_forward == 0  # HiCache alone adds no scrub
    assert _config(RealData.ALL).clear_tags
    assert not CanaryConfig.build(mode="none", environ={}, hicache=True).hicache  # canary off: nothing
    group = _group(config)
    assert group.full_row.first_read and not group.full_row.clear_tags
    assert "hicache=1" in config.describe()


@pytest.mark.parametrize("flip,parts", [(None, 0), (-1, 0), (None, (1, 1)), (-1, (1,)), (1, (1,)), (3, (4, 1))])
def test_loaded_slots_are_listed_once_and_hashed_after_the_forward(flip, parts):
    """``flip``: the row (of ``group.rows``) a loaded slot's byte is flipped in, None: none; ``parts``: the LIST
    hashed in runs of layers (``layer_parts``' last runs) then finalized (``load_hashing``), 0: in one launch."""
    config = _config()
    groups = [_group(config, seed=1) for _ in BACKENDS]
    states = [_state() for _ in BACKENDS]
    old = torch.arange(1, N + 1)
    r2t = torch.zeros(2, 64, dtype=torch.int32, device=DEVICE)
    r2t[0, :N] = old.to(torch.int32).to(DEVICE)
    for backend, group, (counters, ring) in zip(BACKENDS, groups, states):
        backend.launch_write(group, _extend(old), r2t, counters, ring, True, check_fed=False)
        assert torch.equal(group.full_row.tags[old.to(DEVICE)], group.records[old.to(DEVICE), fp.F_FULL_HASH])
        # a read of resident slots lists nothing (TAIL tagged them verified)
        backend.launch_verify(group, _extend(torch.tensor([N + 1]), prefix=N), r2t, counters, ring, 2, 16,
                              defer_first_read=True)
        assert int(group.full_row.work_state[0]) == 0
    assert torch.equal(groups[0].records, groups[1].records)
    # back up the first 16 slots, then load them back into other device slots; the rest stay resident
    host_idx, loaded = torch.arange(100, 116), torch.arange(60, 76)
    for group in groups:
        store = HostRecordStore(128, group.records.device)
        store.backup(host_idx, group.records[old[:16].to(DEVICE)])
        _load_back(group, store, host_idx, loaded.to(DEVICE), old[:16].to(DEVICE))
    r2t[1, :N] = torch.cat([loaded, old[16:]]).to(torch.int32).to(DEVICE)
    bad = int(loaded[5])
    if flip is not None:  # outside the hashed window (layer 0's first 16 bytes)
        for group in groups:
            group.rows[flip].view[bad, 5] ^= 1 << 9
    reader = _extend(torch.tensor([N + 2]), prefix=N)
    reader.req_pool_indices.fill_(1)
    for backend, group, (counters, ring) in zip(BACKENDS, groups, states):
        before = int(counters[fp.C_VIOLATIONS])
        backend.launch_verify(group, reader, r2t, counters, ring, 2, 16, defer_first_read=True)
        assert int(counters[fp.C_VIOLATIONS]) == before  # HEAD's checks pass: nothing hashed yet
        assert int(group.full_row.work_state[0]) == 16  # only the loaded slots
        assert sorted(group.full_row.work[:16, 0].tolist()) == loaded.tolist()
        if parts:
            for r0, r1, _layer in layer_parts(group.rows, parts):
                backend.launch_first_read(group, counters, ring, rows=(r0, r1), finalize=False)
                assert int(counters[fp.C_VIOLATIONS]) == before  # a part alone compares nothing
            assert int(group.full_row.work_state[0]) == 16  # the list stays for the finalize
            backend.launch_first_read(group, counters, ring, rows=(0, 0))
        else:
            backend.launch_first_read(group, counters, ring)
        assert int(group.full_row.work_state[0]) == 0
        assert int(group.full_row.acc.abs().sum()) == 0  # the finalize zeroed every sum
        got = _rows(counters, ring)
        assert [(r[fp.V_SLOT], r[fp.V_REASON] & 0xFF) for r in got] == (
            [(bad, fp.R_KV_HASH)] if flip is not None else [])
        # read again: nothing listed (each loaded slot is verified once)
        backend.launch_verify(group, reader, r2t, counters, ring, 2, 16, defer_first_read=True)
        assert int(group.full_row.work_state[0]) == 0
    assert _rows(*states[0]) == _rows(*states[1])


def test_a_load_larger_than_all_modes_list_is_listed_whole_by_its_forward():
    """With HiCache the first-read list holds every slot of the pool (a load-back brings any number; none is left
    for a later forward's stream), counted in the memory estimate; ``all`` keeps FIRST_READ_CAPACITY."""
    from kv_canary.buffer_groups import FIRST_READ_CAPACITY
    from kv_canary.memory import canary_memory_bytes

    slots, n = FIRST_READ_CAPACITY + 200, FIRST_READ_CAPACITY + 100
    g = torch.Generator().manual_seed(4)
    kv = [torch.randn(slots, 1, 4, generator=g).to(torch.bfloat16) for _ in range(2)]  # 8-byte rows (witness)
    group = build_group(PoolLayout("full", kv[:1], kv[1:]), _config(), torch.device("cpu"))
    assert group.full_row.work.shape[0] == slots
    all_config = CanaryConfig.build(mode="raise", real_data=RealData.ALL.value, environ={})
    assert build_group(PoolLayout("full", kv[:1], kv[1:]), all_config,
                       torch.device("cpu")).full_row.work.shape[0] == FIRST_READ_CAPACITY
    common = dict(num_groups=1, req_rows=2, context_len=64, ring_capacity=16, token_oracle=False, max_batch_size=2,
                  full_row=True, first_read=True)
    assert (canary_memory_bytes(num_slots=slots, hicache=True, **common).full_row
            - canary_memory_bytes(num_slots=slots, **common).full_row) == 24 * (slots - FIRST_READ_CAPACITY)
    counters, ring = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64), torch.zeros(8, fp.RING_WIDTH, dtype=torch.int64)
    counters[fp.C_REPORT_ENABLED] = 1
    loaded = torch.arange(1, n + 1)
    r2t = torch.zeros(1, n + 8, dtype=torch.int32)
    r2t[0, :n] = loaded.to(torch.int32)
    ref.launch_write(group, ForwardView(
        input_ids=torch.ones(n, dtype=torch.int64), positions=torch.arange(n), out_cache_loc=loaded,
        req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.tensor([n]),
        new_starts=torch.zeros(1, dtype=torch.int32), new_lens=torch.tensor([n], dtype=torch.int32),
        batch_size=1, max_new_len=n), r2t, counters, ring, True, check_fed=False)
    group.full_row.tags[loaded] = 0  # a load-back filled them
    reader = ForwardView(
        input_ids=torch.ones(1, dtype=torch.int64), positions=torch.tensor([n]), out_cache_loc=torch.tensor([n + 1]),
        req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=torch.tensor([n + 1]),
        new_starts=torch.zeros(1, dtype=torch.int32), new_lens=torch.tensor([1], dtype=torch.int32),
        batch_size=1, max_new_len=1)
    ref.launch_verify(group, reader, r2t, counters, ring, 2, 256, defer_first_read=True)
    assert int(group.full_row.work_state[0]) == n  # every loaded slot, in the consuming forward's list
    ref.launch_first_read(group, counters, ring)
    assert int(counters[fp.C_SLOTS_FIRST_READ]) == n and int(counters[fp.C_VIOLATIONS]) == 0


def test_layer_parts_cover_every_row_once_in_runs_of_whole_layers_the_last_runs_short():
    """The last runs hold the given layer counts (the last one after the whole load landed: one layer by default),
    the first run the layers before them; runs a small model leaves empty are dropped."""
    group = _group(_config())  # 3 layers, K and V rows each
    assert layer_parts(group.rows) == ((0, 4, 1), (4, 6, 2))  # (4, 1): the 4 before the last are just 2 here
    assert layer_parts(group.rows, (1,)) == ((0, 4, 1), (4, 6, 2))
    assert layer_parts(group.rows, (1, 1)) == ((0, 2, 0), (2, 4, 1), (4, 6, 2))
    assert layer_parts(group.rows, (3,)) == ((0, 6, 2),)
    assert layer_parts(group.rows, (9, 9, 1)) == ((0, 4, 1), (4, 6, 2))
    rows = [KVRow(layer=i, half=h, view=torch.zeros(1, 1), words=1) for i in range(32) for h in ("k", "v")]
    assert [(r0 // 2, r1 // 2, last) for r0, r1, last in layer_parts(rows)] == [(0, 27, 26), (27, 31, 30),
                                                                                 (31, 32, 31)]
    with pytest.raises(ValueError, match="at least one layer"):
        layer_parts(group.rows, (2, 0))


@pytest.mark.parametrize("flip_row", [2, -1])  # outside the window HEAD's verify hashes (layer 0)
def test_undeferred_first_read_hashes_in_head(flip_row):
    """A loaded slot read first by a forward that consumes no load (its HEAD's LIST is one launch of a few
    programs, the last finalizing): hashed and compared there, as the reference does; the list is emptied."""
    out = []
    for backend in BACKENDS:
        config = _config()
        group = _group(config, seed=2)
        counters, ring = _state()
        slots = torch.arange(1, 9)
        r2t = torch.zeros(1, 64, dtype=torch.int32, device=DEVICE)
        r2t[0, :8] = slots.to(torch.int32).to(DEVICE)
        backend.launch_write(group, _extend(slots), r2t, counters, ring, True, check_fed=False)
        group.full_row.tags[slots[2:4].to(DEVICE)] = 0
        group.rows[flip_row].view[int(slots[3]), 0] ^= 1
        backend.launch_verify(group, _extend(torch.tensor([9]), prefix=8), r2t, counters, ring, 2, 16)
        assert [r[fp.V_SLOT] for r in _rows(counters, ring)] == [int(slots[3])]
        assert int(counters[fp.C_SLOTS_FIRST_READ]) == 2
        assert int(group.full_row.work_state.abs().sum()) == 0 and int(group.full_row.acc.abs().sum()) == 0
        out.append(_rows(counters, ring))
    assert out[0] == out[1]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a GPU: the parts run on a CUDA side stream, each behind "
                                                   "a per-layer event of a load on another stream")
def test_load_hashing_waits_for_each_layer_on_its_side_stream():
    """A load lands layer by layer on a stream of its own, each layer behind a GPU sleep; the LIST's parts hash
    each layer only after its event (a part that ran early would hash the slots' stale bytes: every loaded slot
    would be reported), and ``join`` orders the forward's stream after the finalize."""
    from kv_canary.kernels import select_kernels
    from kv_canary.config import KernelBackend
    from kv_canary.runner.load_hashing import LoadHashing, LoadWaits

    config = _config()
    group = _group(config, seed=3)
    counters, ring = _state()
    old = torch.arange(1, N + 1, device=DEVICE)
    r2t = torch.zeros(2, 64, dtype=torch.int32, device=DEVICE)
    r2t[0, :N] = old.to(torch.int32)
    tk.launch_write(group, _extend(old.cpu()), r2t, counters, ring, True, check_fed=False)
    loaded = torch.arange(60, 60 + N, device=DEVICE)
    group.records[loaded] = group.records[old]
    group.full_row.tags[loaded] = 0
    for row in group.rows:  # stale bytes in the new slots until the load lands
        row.view[loaded] = row.view[old] ^ 1
    r2t[1, :N] = loaded.to(torch.int32)
    reader = _extend(torch.tensor([N + 2]), prefix=N)
    reader.req_pool_indices.fill_(1)
    bad = int(loaded[7])
    load_stream = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(LAYERS)]
    load_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(load_stream):
        for layer in range(LAYERS):
            torch.cuda._sleep(50_000_000)  # tens of ms a layer: the host queues every part long before
            for row in group.rows:
                if row.layer == layer:
                    row.view[loaded] = row.view[old]
            if layer == LAYERS - 1:
                group.rows[-1].view[bad, 5] ^= 1 << 9  # the last layer lands with one bad byte
            events[layer].record(load_stream)
    torch.cuda.current_stream().wait_event(events[0])  # HEAD waits for the layer its window hashes (``head``)
    tk.launch_verify(group, reader, r2t, counters, ring, 2, 16, defer_first_read=True)  # lists the loaded slots
    hashing = LoadHashing([group], select_kernels(KernelBackend.TRITON, DEVICE), counters, ring)
    hashing.start(LoadWaits(head=lambda: None,
                            layer=lambda i: torch.cuda.current_stream().wait_event(events[i])))
    hashing.join()
    assert [(r[fp.V_SLOT], r[fp.V_REASON] & 0xFF) for r in _rows(counters, ring)] == [(bad, fp.R_KV_HASH)]
    assert int(counters[fp.C_SLOTS_FIRST_READ]) == N and int(group.full_row.work_state[0]) == 0
