#!/usr/bin/env python3
"""Does a small host->device copy on the compute stream wait for a large layer-wise transfer queued before it on
another stream (HiCache's load-back, host -> device; or its write-through backup, device -> host)? If so, the
forward queued behind that small copy cannot start before the whole transfer landed: behind a load it loses
sglang's layer-by-layer overlap.

A transfer of ``--layers`` chunks (``--mib`` MiB in all, between pinned host memory and the device) on a side
stream, as sglang's ``start_loading`` (``h2d``) or ``start_writing`` (``d2h``); then on the compute stream:
optionally a small host->device copy of each size in ``--small-kib`` (pinned or pageable, queued after the
transfer, or before it), then a wait for the transfer's first layer (loads only) and a short kernel. Reported: ms
from the transfer's start to that kernel's end (the forward's first layer), and to the transfer's end, median of
``--reps``.

    python scripts/bench_copy_order.py --out copy_order.json      # a CUDA host, torch only
"""

import argparse
import json
import statistics

import torch

PLACES = ("none", "pinned_before", "pinned_after", "pageable_after")


def one(direction: str, place: str, kib: int, host: torch.Tensor, dev: torch.Tensor, layers: int,
        side: torch.cuda.Stream, compute: torch.cuda.Stream) -> tuple:
    chunk = host.numel() // layers
    n = max(1, kib * 1024 // 8)
    small = torch.arange(n, dtype=torch.int64)
    small = small.pin_memory() if place.startswith("pinned") else small
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    start, first, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    layer_ev = [torch.cuda.Event() for _ in range(layers)]
    with torch.cuda.stream(compute):
        start.record(compute)
        if place == "pinned_before":
            small.to("cuda", non_blocking=True)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for i in range(layers):
            part = slice(i * chunk, (i + 1) * chunk)
            (dev[part].copy_(host[part], non_blocking=True) if direction == "h2d"
             else host[part].copy_(dev[part], non_blocking=True))
            layer_ev[i].record(side)
        done.record(side)
    with torch.cuda.stream(compute):
        if place.endswith("_after"):
            small.to("cuda", non_blocking=True)
        if direction == "h2d":  # the forward's first layer waits for the load's first layer
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
    p.add_argument("--small-kib", default="72", help="comma-separated sizes of the small copy, KiB")
    p.add_argument("--directions", default="h2d", help="comma-separated: h2d (a load), d2h (a backup)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="copy_order.json")
    args = p.parse_args()
    sizes = [int(s) for s in args.small_kib.split(",")]
    host = torch.empty(args.mib * 1024 * 1024, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    side, compute = torch.cuda.Stream(), torch.cuda.Stream()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "cases": {}}
    cases = [(d, place, kib) for d in args.directions.split(",") for kib in sizes for place in PLACES
             if place != "none" or kib == sizes[0]]
    times = {c: [] for c in cases}
    for rep in range(args.reps + 2):
        for c in cases:
            t = one(*c, host, dev, args.layers, side, compute)
            if rep >= 2:
                times[c].append(t)
    for c in cases:
        first = statistics.median(t[0] for t in times[c])
        end = statistics.median(t[1] for t in times[c])
        name = c[0] + " " + (c[1] if c[1] == "none" else f"{c[1]} {c[2]} KiB")
        out["cases"][name] = {"first_layer_ms": round(first, 3), "transfer_end_ms": round(end, 3)}
        print(f"{name:32s} first layer done {first:8.3f} ms   transfer done {end:8.3f} ms")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
