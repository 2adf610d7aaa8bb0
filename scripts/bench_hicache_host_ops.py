#!/usr/bin/env python3
"""Host cost per call of the canary's HiCache bookkeeping (no server): what sglang's scheduler thread pays.

Builds a real ``CanaryManager`` on a synthetic Llama-3-8B-row pool with a host record store beside it (the host
pool ``--hicache-ratio`` times the device pool), then times on the host, per call, what the HiCache hooks call:

* ``backup``: ``backup_records`` of one radix node (``--backup-slots``), then ``backup_queued`` (sglang's D2H
  stream named: what the start_writing hook calls);
* ``acked``: ``host_backups_acked`` (the write-ack hook, every scheduler step);
* ``load``: ``stage_load`` + ``load_records`` of one load-back batch (``--load-slots``) into new device slots;
* ``free``: ``free_host_slots`` of one node's host slots (host eviction);
* ``batch_end``: what a batch of 8 finished requests costs: 8 backups and 8 host evictions, then (since backups and
  frees are batched) the flush at sglang's next ack check; per batch, not per call.

and, for comparison, what every forward pays: ``snapshot`` (the counters' delayed D2H copy, ``d2h.snapshot`` +
``ready``) and ``sampled`` (``record_sampled`` of a batch of 8 tokens). ``--primitives``: the torch calls those are
made of instead (an H2D copy of host slot ids pageable / through ``pin_memory()`` / through a pinned arena,
``index_select``, ``index_copy_``, ``index_fill_``, a CPU and a device ``cat``, an event record and wait,
``record_stream``), at a node's size and a load-back's.

Each is timed over ``--calls`` calls (median of 5 rounds); the device is synchronized between rounds, not inside
them. ``syncs`` counts the device synchronizations torch reports per call (``set_sync_debug_mode("warn")``):
any is a stall of the scheduler thread. ``--busy-ms X``: before each call a GPU sleep of X ms is queued on the
current stream once the previous one finished (exactly one forward in flight, as with sglang's overlap scheduler),
and only the call is timed: a call that waits for the stream (torch's synchronizations, or the driver's implicit
ones, which torch does not report: a copy from pageable host memory) costs up to ~X ms more there. GPU time is
in ``bench_hicache_overhead.py``'s profile.

    export PYTHONPATH=/tmp/site:$PWD/python
    python scripts/bench_hicache_host_ops.py [--calls 200] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from bench_output import emit


def primitive_ops(torch, records, store, dev_idx, host_dev, cpu_ids, device) -> dict:
    """``--primitives``: call i of each torch op the hooks use. ``records``/``store``: int64[slots / host slots, 5]
    on ``device``; ``dev_idx``/``host_dev``: n device / host slot ids on ``device``; ``cpu_ids``: CPU int64[n] per
    call (an allocator's ids, pageable)."""
    n = int(dev_idx.numel())
    arena = torch.empty(n, dtype=torch.int64, pin_memory=device.type == "cuda")
    events = [torch.cuda.Event() for _ in range(8)] if device.type == "cuda" else []
    rows = records[:n]

    def to_arena(i):
        arena.numpy()[:] = cpu_ids[i].numpy()
        return arena.to(device, non_blocking=True)

    ops = {"h2d_pageable": lambda i: cpu_ids[i].to(device, non_blocking=True),
           "index_select": lambda i: records.index_select(0, dev_idx),
           "index_copy": lambda i: store.index_copy_(0, host_dev, rows),
           "index_fill": lambda i: store.index_fill_(0, host_dev, 0),
           "gather_scatter": lambda i: store.index_copy_(0, host_dev, records.index_select(0, dev_idx)),
           "cat_cpu": lambda i: torch.cat([cpu_ids[i], cpu_ids[i - 1]]),
           "cat_device_2": lambda i: torch.cat([host_dev[: n // 2], host_dev[n // 2:]])}
    if events:  # CUDA only
        ops.update({"h2d_pin_memory": lambda i: cpu_ids[i].pin_memory().to(device, non_blocking=True),
                    "h2d_pinned_arena": to_arena,
                    "event_record": lambda i: events[i % 8].record(),
                    "wait_event": lambda i: torch.cuda.current_stream().wait_event(events[0]),
                    "record_stream": lambda i: host_dev.record_stream(torch.cuda.current_stream())})
    return ops


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--slots", type=int, default=16384, help="device pool slots (--max-total-tokens)")
    p.add_argument("--hicache-ratio", type=int, default=5)
    p.add_argument("--backup-slots", type=int, default=1088)
    p.add_argument("--load-slots", type=int, default=9344)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only proves the script runs")
    p.add_argument("--busy-ms", type=float, default=0.0,
                   help="queue a GPU sleep of this many ms before each call (a forward in flight); 0: none")
    p.add_argument("--primitives", action="store_true",
                   help="time the torch calls the hooks are made of instead of the hooks")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import logging

    import torch

    logging.getLogger("kv_canary").setLevel(logging.CRITICAL)
    from kv_canary.adapter.batch_adapter import SglangBatchAdapter
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.config import CanaryConfig
    from kv_canary.host_records import HostRecordStore
    from kv_canary.kernels import select_kernels
    from kv_canary.runner import CanaryManager
    from kv_canary.views import LaunchCapacities

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    slots, host_slots = args.slots, args.slots * args.hicache_ratio
    k = [torch.randn(slots, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.randn(slots, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2)]
    config = CanaryConfig.build(mode="log", environ={}, hicache=True)
    group = build_group(PoolLayout("full", k, v), config, device)
    r2t = torch.zeros(9, 4096, dtype=torch.int32, device=device)
    caps = LaunchCapacities(max_batch_size=9, max_context_len=4096, verify_programs_target=1)
    m = CanaryManager(config=config, groups=[group], kernels=select_kernels(config.kernel_backend, device),
                      req_to_token=r2t, capacities=caps,
                      batch_adapter=SglangBatchAdapter(max_batch_size=9, device=device), device=device)
    m.attach_host_records(HostRecordStore(host_slots, device))
    m.mark_init_finished()
    group.records.random_(1, 1 << 40)
    side = torch.cuda.Stream(device) if on_gpu else None
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def pick(n, total):  # distinct slot ids, as sglang's allocators hand out (device ids on the device)
        return torch.randperm(total - 1, generator=gen)[:n] + 1

    nb, nl = args.backup_slots, args.load_slots
    flush = getattr(m, "flush_host_records", lambda: None)  # batched backups and frees (absent before 2026-11-27)
    backups = [(pick(nb, slots).to(device), pick(nb, host_slots)) for _ in range(args.calls)]
    loads = [(pick(nl, host_slots), pick(nl, slots).to(device)) for _ in range(args.calls)]

    def backup(i):
        dev, host = backups[i]
        m.backup_records(dev, host)
        m.backup_queued(host, side)

    def acked(i):
        m.host_backups_acked()

    def load(i):  # what the start_loading hook calls: the ids staged before sglang's copy, the records after it
        host, dev = loads[i]
        m.load_records(host, dev, load_id=i, host_dev=m.stage_load(host))

    def free(i):
        m.free_host_slots(backups[i][1])

    def batch_end(i):  # a batch's 8 finished requests: 8 backups, 8 host evictions, then the next ack check
        for k in range(8):
            dev, host = backups[(8 * i + k) % args.calls]
            m.backup_records(dev, host)
            m.backup_queued(host, side)
            m.free_host_slots(backups[(8 * i + k + 1) % args.calls][1])
        flush()

    def snapshot(i):
        m._d2h.snapshot(i)
        m._d2h.ready(i)

    sampled = torch.zeros(8, dtype=torch.int64, device=device)

    def record_sampled(i):
        m.record_sampled(sampled)

    sleep_cycles = 0
    if on_gpu and args.busy_ms > 0:  # calibrate torch.cuda._sleep: cycles per ms on this GPU
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        sleep_cycles = int(10_000_000 / start.elapsed_time(end) * args.busy_ms)

    def timed(fn, prepare=None):
        rounds, syncs = [], 0
        for _ in range(5):
            if prepare is not None:
                prepare()
            sync()
            dt = 0.0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if on_gpu:
                    torch.cuda.set_sync_debug_mode("warn")
                in_flight = None
                for i in range(args.calls):
                    if sleep_cycles:  # exactly one forward in flight, as with sglang's overlap scheduler
                        if in_flight is not None:
                            in_flight.synchronize()
                        torch.cuda._sleep(sleep_cycles)
                        in_flight = torch.cuda.Event()
                        in_flight.record()
                    t0 = time.perf_counter()
                    fn(i)
                    dt += time.perf_counter() - t0
                if on_gpu:
                    torch.cuda.set_sync_debug_mode(0)
            syncs += sum("synchroniz" in str(w.message) for w in caught)
            flush()  # untimed: what a timed op left batched (``batch_end`` times the flush)
            sync()
            rounds.append(dt / args.calls * 1e6)
        return {"host_us_per_call": round(statistics.median(rounds), 1),
                "syncs_per_call": round(syncs / (5 * args.calls), 3)}

    def backed_up():  # settle's work: every backup's copy done, not yet settled
        for i in range(args.calls):
            backup(i)

    result = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu (meaningless)",
              "device_slots": slots, "host_slots": host_slots, "backup_slots": nb, "load_slots": nl,
              "calls": args.calls, "busy_ms": args.busy_ms}
    if args.primitives:  # the torch calls the hooks are made of, at a node's size and a load-back's
        store = m.host_records.records
        for n, dev_idx, cpu_ids in ((nb, backups[0][0], [h for _, h in backups]),
                                    (nl, loads[0][1], [h for h, _ in loads])):
            host_dev = cpu_ids[0].to(device)
            for name, fn in primitive_ops(torch, group.records, store, dev_idx, host_dev, cpu_ids, device).items():
                result[f"{name}[{n}]"] = timed(fn)
    else:
        result.update({"backup": timed(backup),
                       "acked": timed(acked, prepare=backed_up),
                       "load": timed(load),
                       "free": timed(free, prepare=backed_up),
                       "batch_end": timed(batch_end),
                       "snapshot": timed(snapshot),
                       "sampled": timed(record_sampled)})
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
