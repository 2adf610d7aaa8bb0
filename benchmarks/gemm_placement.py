#!/usr/bin/env python3
"""Does the decode bs1 gate_up GEMM's speed depend on where its buffers sit in device memory? (issue 60, an
investigation tool: it leaves the tree once its finding is recorded.)

One trial is one fresh process: ``--pad-before`` MiB held first (shifts the weights), then ``--layers`` gate_up
weights of a Llama-3-8B shape (bf16 [28672, 4096], randn), then ``--pad-between`` MiB (shifts what is allocated
after: the activations, the output and cuBLAS's workspace, which torch takes from the caching allocator at the
first GEMM), then x [bs, 4096]. A CUDA graph on a side stream holds one GEMM per layer
(``F.linear(x, w)``, as a decode step's 32 layers; the kernel cuBLAS picks is recorded); after a warmup, ``--replays`` timed replays
(CUDA events), median us per GEMM. The driver (no ``--trial``) runs every (pad_before, pad_between) of the grid
``--repeats`` times, each in its own process, in a shuffled order, and prints one JSON summary: per placement the
median of its repeats, the spread across placements against the spread across repeats of one placement.

    python3 benchmarks/gemm_placement.py --pads-before 0,2,4,32 --pads-between 0,2,20,34 --repeats 2 --out F.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import time

HIDDEN, GATE_UP = 4096, 28672  # Llama-3-8B: gate_up_proj's merged weight [2 x 14336, 4096]


def trial(args) -> dict:
    import torch

    dev = torch.device("cuda")
    torch.cuda.init()
    pad_before = torch.empty(int(args.pad_before * (1 << 20)) or 1, dtype=torch.uint8, device=dev)
    weights = []
    for _ in range(args.layers):
        w = torch.empty(GATE_UP, HIDDEN, dtype=torch.bfloat16, device=dev)
        w.normal_(0, 0.02)
        weights.append(w)
    pad_between = torch.empty(int(args.pad_between * (1 << 20)) or 1, dtype=torch.uint8, device=dev)
    x = torch.randn(args.bs, HIDDEN, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warmup on the capture stream (cuBLAS workspace, heuristics)
            for w in weights:
                torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.linear(x, weights[0])
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for w in weights:
            out = torch.nn.functional.linear(x, w)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / args.layers)
    return {"pad_before_mib": args.pad_before, "pad_between_mib": args.pad_between,
            "us_per_gemm": round(statistics.median(times), 3), "p10": round(sorted(times)[len(times) // 10], 3),
            "p90": round(sorted(times)[9 * len(times) // 10], 3), "kernels": kernels,
            "addresses": {"pad_before": pad_before.data_ptr(), "w0": weights[0].data_ptr(),
                          "pad_between": pad_between.data_ptr(), "x": x.data_ptr(), "out": out.data_ptr()}}


def drive(args) -> dict:
    befores = [float(v) for v in args.pads_before.split(",")]
    betweens = [float(v) for v in args.pads_between.split(",")]
    runs = [(b, m) for b, m in itertools.product(befores, betweens) for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(runs)
    results = []
    t0 = time.monotonic()
    for b, m in runs:
        cmd = [sys.executable, __file__, "--trial", "--pad-before", str(b), "--pad-between", str(m),
               "--layers", str(args.layers), "--bs", str(args.bs), "--replays", str(args.replays)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"trial {b},{m} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(row)
        print(json.dumps(row), flush=True)
    by_place = {}
    for row in results:
        by_place.setdefault((row["pad_before_mib"], row["pad_between_mib"]), []).append(row["us_per_gemm"])
    medians = {f"{b},{m}": round(statistics.median(v), 3) for (b, m), v in sorted(by_place.items())}
    repeat_spread = [max(v) / min(v) - 1 for v in by_place.values() if len(v) > 1]
    values = list(medians.values())
    return {"device": _device_name(), "layers": args.layers, "bs": args.bs, "replays": args.replays,
            "elapsed_s": round(time.monotonic() - t0, 1), "trials": results, "median_by_placement": medians,
            "placement_spread_pct": round((max(values) / min(values) - 1) * 100, 2),
            "max_repeat_spread_pct": round(max(repeat_spread) * 100, 2) if repeat_spread else None}


def _device_name() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trial", action="store_true", help="one placement in this process (the driver's child)")
    p.add_argument("--pad-before", type=float, default=0.0)
    p.add_argument("--pad-between", type=float, default=0.0)
    p.add_argument("--pads-before", default="0,2,32")
    p.add_argument("--pads-between", default="0,2,20,34")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    if args.trial:
        print(json.dumps(trial(args)))
        return
    summary = drive(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "trials"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
