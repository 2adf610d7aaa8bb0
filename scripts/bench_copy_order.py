#!/usr/bin/env python3
"""Does a small host->device copy on the compute stream wait for a large layer-wise host->device load queued
before it on another stream (HiCache's load-back)? If so, the forward queued behind that small copy loses sglang's
layer-by-layer overlap with the load: it cannot start before the whole load landed.

A load of ``--layers`` chunks (``--mib`` MiB in all, pinned host -> device) on a side stream, as sglang's
``start_loading``; then on the compute stream: optionally a small copy (``--small-kib``, pinned or pageable,
queued after or before the load), then a wait for the load's first layer and a short kernel. Reported: ms from the
load's start to that kernel's end (the forward's first layer), and to the load's end, median of ``--reps``.

    python scripts/bench_copy_order.py --out copy_order.json      # a CUDA host, torch only
"""

import argparse
import json
import statistics

import torch


def one(case: str, host: torch.Tensor, dev: torch.Tensor, layers: int, small_kib: int, load: torch.cuda.Stream,
        compute: torch.cuda.Stream) -> tuple:
    chunk = host.numel() // layers
    n = small_kib * 1024 // 8
    small_pinned = torch.arange(n, dtype=torch.int64).pin_memory()
    small_pageable = torch.arange(n, dtype=torch.int64)
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    start, first, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    layer_ev = [torch.cuda.Event() for _ in range(layers)]
    with torch.cuda.stream(compute):
        start.record(compute)
        if case == "small_before":
            small_dev = small_pinned.to("cuda", non_blocking=True)
    load.wait_stream(compute)
    with torch.cuda.stream(load):
        for i in range(layers):
            dev[i * chunk:(i + 1) * chunk].copy_(host[i * chunk:(i + 1) * chunk], non_blocking=True)
            layer_ev[i].record(load)
        done.record(load)
    with torch.cuda.stream(compute):
        if case == "small_pinned_after":
            small_dev = small_pinned.to("cuda", non_blocking=True)
        elif case == "small_pageable_after":
            small_dev = small_pageable.to("cuda", non_blocking=True)
        compute.wait_event(layer_ev[0])
        y = x @ x
        first.record(compute)
    torch.cuda.synchronize()
    del y
    return start.elapsed_time(first), start.elapsed_time(done)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--small-kib", type=int, default=72)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="copy_order.json")
    args = p.parse_args()
    host = torch.empty(args.mib * 1024 * 1024, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    load, compute = torch.cuda.Stream(), torch.cuda.Stream()
    cases = ("none", "small_before", "small_pinned_after", "small_pageable_after")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "cases": {}}
    times = {c: [] for c in cases}
    for rep in range(args.reps + 2):
        for c in cases:
            t = one(c, host, dev, args.layers, args.small_kib, load, compute)
            if rep >= 2:
                times[c].append(t)
    for c in cases:
        first = statistics.median(t[0] for t in times[c])
        end = statistics.median(t[1] for t in times[c])
        out["cases"][c] = {"first_layer_ms": round(first, 3), "load_end_ms": round(end, 3)}
        print(f"{c:22s} first layer done {first:8.3f} ms   load done {end:8.3f} ms")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
