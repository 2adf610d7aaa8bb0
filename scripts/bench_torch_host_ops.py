#!/usr/bin/env python3
"""Host cost of the torch calls the HiCache hooks are made of, with and without a forward in flight (no server).

Each primitive is timed per call on the host (median of 5 rounds of ``--calls``), idle and with one GPU sleep of
``--busy-ms`` queued before each call (one forward in flight, as under sglang's overlap scheduler): a primitive that
waits for the stream (a driver-staged pageable copy, an allocator wait) shows it only there. Sizes: a radix node's
backup (``--small`` host slot ids) and a load-back batch's (``--large``).

    python3 scripts/bench_torch_host_ops.py [--calls 200] [--busy-ms 5] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--busy-ms", type=float, default=5.0)
    p.add_argument("--small", type=int, default=1088)
    p.add_argument("--large", type=int, default=9344)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    dev = torch.device("cuda")
    host_slots, slots = 81920, 16384
    records = torch.randint(1, 1 << 40, (slots, 5), dtype=torch.int64, device=dev)
    store = torch.zeros((host_slots, 5), dtype=torch.int64, device=dev)
    gen = torch.Generator().manual_seed(0)
    idx = {n: [torch.randperm(host_slots - 1, generator=gen)[:n] + 1 for _ in range(args.calls)]
           for n in (args.small, args.large)}
    didx = {n: (torch.randperm(slots - 1, generator=gen)[:n] + 1).to(dev) for n in (args.small, args.large)}
    pinned = torch.empty(1 << 20, dtype=torch.int64, pin_memory=True)
    pinned_np = pinned.numpy()
    events = [torch.cuda.Event() for _ in range(8)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(10_000_000); end.record(); end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)

    def prims(n):
        d = didx[n]
        h_dev = idx[n][0].to(dev)
        return {
            "h2d_pageable": lambda i: idx[n][i].to(dev, non_blocking=True),
            "h2d_pin_memory": lambda i: idx[n][i].pin_memory().to(dev, non_blocking=True),
            "h2d_pinned_arena": lambda i: (pinned_np.__setitem__(slice(0, n), idx[n][i].numpy()),
                                           pinned[:n].to(dev, non_blocking=True)),
            "index_select": lambda i: records.index_select(0, d),
            "index_copy": lambda i: store.index_copy_(0, h_dev, records[:n]),
            "index_fill": lambda i: store.index_fill_(0, h_dev, 0),
            "gather_scatter": lambda i: store.index_copy_(0, h_dev, records.index_select(0, d)),
            "cat_cpu": lambda i: torch.cat([idx[n][i], idx[n][i - 1]]),
            "cat_cuda_2": lambda i: torch.cat([h_dev[: n // 2], h_dev[n // 2:]]),
            "event_record": lambda i: events[i % 8].record(),
            "wait_event": lambda i: torch.cuda.current_stream().wait_event(events[0]),
            "record_stream": lambda i: h_dev.record_stream(torch.cuda.current_stream()),
        }

    def timed(fn, busy_ms):
        cycles = int(cycles_per_ms * busy_ms)
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            dt, in_flight = 0.0, None
            for i in range(1, args.calls):
                if cycles:
                    if in_flight is not None:
                        in_flight.synchronize()
                    torch.cuda._sleep(cycles)
                    in_flight = torch.cuda.Event()
                    in_flight.record()
                t0 = time.perf_counter()
                fn(i)
                dt += time.perf_counter() - t0
            torch.cuda.synchronize()
            rounds.append(dt / (args.calls - 1) * 1e6)
        return round(statistics.median(rounds), 1)

    events[0].record()
    result = {"device": torch.cuda.get_device_name(dev), "calls": args.calls, "busy_ms": args.busy_ms, "us": {}}
    for n in (args.small, args.large):
        for name, fn in prims(n).items():
            key = f"{name}[{n}]"
            result["us"][key] = {"idle": timed(fn, 0), "busy": timed(fn, args.busy_ms)}
            print(f"{key:32s} idle {result['us'][key]['idle']:8.1f} us   busy {result['us'][key]['busy']:8.1f} us",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
