#!/usr/bin/env python3
"""Where the time of a profiled window goes: a summary of one torch-profiler chrome trace (sglang's
``/start_profile`` writes ``*.trace.json.gz``), small enough to commit beside a benchmark's results.

- GPU: kernel / memcpy / memset time per stream, the time any stream was busy (the rest of the window the GPU
  idled) and its idle gaps by length, the top kernels by total time; the canary's own kernels (its Triton kernel
  names, ``CANARY_KERNELS``) summed apart and listed.
- CPU: per thread, the wall time inside python frames of the canary's code (``kv_canary/`` in the frame name,
  outermost frames only, so nested frames are not counted twice) and the top canary frames; needs a trace
  recorded ``with_stack`` (sglang's default).

    python3 benchmarks/trace_summary.py TRACE.json.gz [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

# the canary's Triton kernels (python/kv_canary/kernels/*.py, the @triton.jit entry points)
CANARY_KERNELS = ("verify_kernel", "write_kernel", "row_hash_kernel", "row_finalize_kernel", "stamp_kernel",
                  "check_kernel", "index_sweep_kernel", "record_accepted_kernel", "accepted_drafts_kernel", "track")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def is_canary_kernel(name: str) -> bool:
    return any(name == k or name.startswith(k + "_") or name.startswith(k + "(") for k in CANARY_KERNELS)


def _outermost(intervals: List[tuple]) -> List[tuple]:
    """(start, end, name) intervals of one thread -> the ones not inside another (sorted by start)."""
    out: List[tuple] = []
    for start, end, name in sorted(intervals, key=lambda x: (x[0], -x[1])):
        if out and start >= out[-1][0] and end <= out[-1][1]:
            continue
        out.append((start, end, name))
    return out


# the GPU's idle gaps (between the union's busy runs), by length: microseconds, upper bounds
GAP_BUCKETS_US = (20.0, 100.0, 1000.0, 5000.0, float("inf"))


def _busy_runs(intervals) -> List[tuple]:
    """The union of (start, end) intervals as sorted disjoint runs."""
    runs: List[list] = []
    for start, end in sorted(intervals):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    return [tuple(r) for r in runs]


def _union(intervals) -> float:
    """Total length of the union of (start, end) intervals."""
    return sum(end - start for start, end in _busy_runs(intervals))


def idle_gaps(runs: List[tuple]) -> List[Dict]:
    """Per ``GAP_BUCKETS_US`` bucket, the count and total length of the gaps between busy runs: many short gaps
    (the GPU waiting on the host between launches) read differently from a few long ones (between batches)."""
    out = [{"up_to_us": b, "count": 0, "us": 0.0} for b in GAP_BUCKETS_US]
    for (_, end), (start, _) in zip(runs, runs[1:]):
        gap = start - end
        bucket = next(b for b in out if gap <= b["up_to_us"])
        bucket["count"] += 1
        bucket["us"] += gap
    return [{**b, "up_to_us": str(b["up_to_us"]), "us": round(b["us"], 1)} for b in out]


def _median(xs: List[float]):
    """The upper median of ``xs``, rounded to 0.1 (None when empty)."""
    return round(sorted(xs)[len(xs) // 2], 1) if xs else None


def busy_run_lengths(runs: List[tuple], min_us: float = 1000.0) -> Dict:
    """The GPU's busy runs of at least ``min_us`` (decode steps, or several merged where the host kept up) and the
    idle gap after each: their count, median and total. A slower step is a longer run (GPU work) or a longer gap
    after it (the host late with the next launch)."""
    long_runs = [(i, end - start) for i, (start, end) in enumerate(runs) if end - start >= min_us]
    gaps = [runs[i + 1][0] - runs[i][1] for i, _ in long_runs if i + 1 < len(runs)]
    return {"min_us": min_us, "count": len(long_runs), "median_us": _median([d for _, d in long_runs]),
            "total_us": round(sum(d for _, d in long_runs), 1), "gap_after_median_us": _median(gaps),
            "gap_after_total_us": round(sum(gaps), 1)}


def runtime_calls(events: List[dict], top: int = 12) -> Dict[str, List[Dict]]:
    """Per thread with CUDA runtime / driver calls: the top calls by total time (count, total us): what each
    thread asks of the driver (a graph launch, a kernel launch, a copy, an event) and what it costs the host."""
    per: Dict[str, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = per[f"{e.get('pid')}/{e.get('tid')}"][e.get("name", "?")]
            c[0] += e["dur"]
            c[1] += 1
    return {t: [{"name": n, "us": round(v[0], 1), "count": v[1]}
                for n, v in sorted(calls.items(), key=lambda kv: -kv[1][0])[:top]]
            for t, calls in per.items()}


def graph_replays(events: List[dict], min_kernels: int = 50) -> List[tuple]:
    """The replays of the model's CUDA graphs (``cudaGraphLaunch`` calls whose kernels, matched by correlation id,
    number ``min_kernels`` or more: not a one-kernel graph such as the canary's counter publish), in launch order:
    (launch call's start, first kernel's start, last kernel's end, correlation id), us."""
    kernels: Dict[object, List[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS:
            kernels[(e.get("args") or {}).get("correlation")].append(e)
    steps = []
    for e in sorted((e for e in events if e.get("name") == "cudaGraphLaunch"), key=lambda e: e["ts"]):
        corr = (e.get("args") or {}).get("correlation")
        ks = kernels.get(corr, [])
        if len(ks) >= min_kernels:
            steps.append((e["ts"], min(k["ts"] for k in ks), max(k["ts"] + k["dur"] for k in ks), corr))
    return steps


def graph_steps(events: List[dict], min_kernels: int = 50) -> Dict:
    """The model graph's replays (``graph_replays``): the GPU span of each replay, the gap from its end to the next
    replay's start (sampling, the next step's inputs, the host), and how far ahead of the GPU the host launched it
    (``lead``: the launch call's start to its first kernel; a lead near 0 means the GPU waited for the host).
    Medians, us."""
    steps = graph_replays(events, min_kernels)
    gaps = [b[1] - a[2] for a, b in zip(steps, steps[1:])]
    return {"replays": len(steps), "span_median_us": _median([s[2] - s[1] for s in steps]),
            "gap_after_median_us": _median(gaps), "gap_after_max_us": round(max(gaps), 1) if gaps else None,
            "lead_median_us": _median([s[1] - s[0] for s in steps])}


def read_events(path: Path) -> List[dict]:
    """The complete events (``ph`` X, with a duration) of a chrome trace, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def summarize(path: Path, top: int = 25) -> Dict:
    """The summary dict of one trace (times in microseconds, as the trace's)."""
    events = read_events(path)
    t_lo = min((e["ts"] for e in events), default=0.0)
    t_hi = max((e["ts"] + e["dur"] for e in events), default=0.0)
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    per_stream: Dict[str, float] = defaultdict(float)
    per_kernel: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    canary_us = 0.0
    runs = _busy_runs((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    busy = sum(end - start for start, end in runs)  # any stream busy: the GPU not idle
    for e in gpu:
        per_stream[f"{e.get('cat')}:stream{(e.get('args') or {}).get('stream', e.get('tid'))}"] += e["dur"]
        k = per_kernel[e["name"][:120]]
        k[0] += e["dur"]
        k[1] += 1
        if is_canary_kernel(e["name"]):
            canary_us += e["dur"]
    frames: Dict[tuple, List[tuple]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and "kv_canary/" in e.get("name", ""):
            frames[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    cpu_threads, top_frames = {}, defaultdict(lambda: [0.0, 0])
    for key, intervals in frames.items():
        outer = _outermost(intervals)
        cpu_threads[f"{key[0]}/{key[1]}"] = round(sum(e - s for s, e, _ in outer), 1)
        for s, e, name in outer:
            top_frames[name[:160]][0] += e - s
            top_frames[name[:160]][1] += 1
    rank = lambda d: [{"name": n, "us": round(v[0], 1), "count": v[1]}  # noqa: E731
                      for n, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"trace": Path(path).name, "window_us": round(t_hi - t_lo, 1),
            "gpu_us_per_stream": {k: round(v, 1) for k, v in sorted(per_stream.items())},
            "gpu_busy_us": round(busy, 1), "gpu_idle_gaps": idle_gaps(runs),
            "gpu_long_busy_runs": busy_run_lengths(runs), "gpu_graph_steps": graph_steps(events),
            "cpu_runtime_calls": runtime_calls(events),
            "gpu_canary_kernel_us": round(canary_us, 1),
            "gpu_canary_kernels": rank({n: v for n, v in per_kernel.items() if is_canary_kernel(n)}),
            "gpu_canary_kernel_launches": sum(v[1] for n, v in per_kernel.items() if is_canary_kernel(n)),
            "gpu_top_kernels": rank(per_kernel),
            "cpu_canary_us_per_thread": cpu_threads, "cpu_top_canary_frames": rank(top_frames)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    print(json.dumps(summarize(Path(args.trace), args.top), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
