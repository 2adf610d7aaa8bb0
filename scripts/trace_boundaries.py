#!/usr/bin/env python3
"""A HiCache row's batch boundaries in one torch-profiler trace (``bench_hicache_overhead.py --profile-batches``):
per batch, where the GPU waits between a prefill and its decode steps.

For each batch (its decode-step graph replays, told apart by a gap of eager work > 5 ms):

- ``load_ms``: a load-back's span (sglang's per-layer host-to-device kernels, ``hicache_transfer_per_layer``) and
  ``host_bound_layers``: the layers whose attention kernel was launched after its layer's load had landed (the
  scheduler thread, not the load, then sets the pace);
- ``tail_us``: from the end of the prefill's last attention kernel to the first kernel of its first decode replay
  (the last layer's MLP, the LM head, the sampling; with the canary also its TAIL and the last run of a load's
  hashing, where the GPU waits for them);
- ``after_first_decode_us``: the GPU's gap between the first and the second decode replay (the scheduler processes
  the prefill's results, e.g. sglang's backups, between their launches);
- ``canary_us``: the canary's kernels in the batch's eager part (name, start after the load's start, duration).

    python3 scripts/trace_boundaries.py TRACE.json.gz [TRACE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import GPU_CATS, graph_replays, is_canary_kernel, read_events  # noqa: E402

LOAD_KERNEL = "hicache_transfer_per_layer"
BATCH_GAP_US = 5000.0  # eager work between two replays longer than this: a new batch's prefill


def _is_attention(name: str) -> bool:
    """The triton backend's prefill attention kernel (one a layer), not its decode stages."""
    return name.startswith("_fwd_kernel") and not name.startswith("_fwd_kernel_stage")


def boundaries(trace: Path) -> List[Dict]:
    """One dict a batch of the trace (see the module docstring)."""
    events = read_events(trace)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launch_ts = {(e.get("args") or {}).get("correlation"): e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    replays = graph_replays(events)  # (launch, first kernel, end, correlation): the model's decode steps
    graphs = {r[3] for r in replays}
    batches: List[List[tuple]] = []
    for _, start, end, _ in sorted(replays, key=lambda r: r[1]):
        if batches and start - batches[-1][-1][1] <= BATCH_GAP_US:
            batches[-1].append((start, end))
        else:
            batches.append([(start, end)])
    out, prev_end = [], gpu[0]["ts"] if gpu else 0.0
    for batch in batches:
        first = batch[0][0]
        eager = [e for e in gpu if prev_end <= e["ts"] < first and e["args"].get("correlation") not in graphs]
        attention = [e for e in eager if _is_attention(e["name"])]
        loads = [e for e in eager if LOAD_KERNEL in e["name"]]
        row = {"decode_replays": len(batch)}
        if attention:
            last = attention[-1]
            row["tail_us"] = round(first - (last["ts"] + last["dur"]), 1)
        if len(batch) > 1:
            row["after_first_decode_us"] = round(batch[1][0] - batch[0][1], 1)
        t0 = loads[0]["ts"] if loads else (eager[0]["ts"] if eager else first)
        if loads:
            ends = [e["ts"] + e["dur"] for e in loads]
            row["load_ms"] = round((ends[-1] - t0) / 1e3, 2)
            launched = [launch_ts[a["args"]["correlation"]] for a in attention[-len(loads):]]
            row["host_bound_layers"] = sum(1 for lt, le in zip(launched, ends) if lt > le)
            row["last_load_to_decode_us"] = round(first - ends[-1], 1)
        row["canary_us"] = [(e["name"].split("(")[0], round((e["ts"] - t0) / 1e3, 2), round(e["dur"], 1))
                            for e in eager if is_canary_kernel(e["name"])]
        out.append(row)
        prev_end = batch[-1][1]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    args = p.parse_args(argv)
    for trace in args.traces:
        for i, row in enumerate(boundaries(trace)):
            print(f"{trace.name} batch {i}: " + json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
