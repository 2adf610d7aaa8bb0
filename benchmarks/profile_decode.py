#!/usr/bin/env python3
"""Where a decode step's device time goes, per kernel, with and without the canary: torch-profiler traces of real
servers, one per ``--configs`` entry.

Each server (the overhead bench's Llama-3-8B-shaped dummy model, CUDA graphs, ``overhead_plan``'s flags) runs, per
batch size of ``--batches``, a warmup batch (1k in; 512 out at bs1, else 256), ``--reps`` timed batches, then one
more batch during whose decode phase sglang's own profiler (``/start_profile``, CPU + GPU activities, no stacks)
records ``--steps`` forwards. ``analyze_trace`` reduces the trace to per-step numbers (with ``trace_summary``'s
reader, graph replays, interval union and canary kernel names). A step is one replay of the forward's graph
(``MAIN_GRAPH_KERNELS`` kernels or more); the canary's one-kernel counter publish graph (``kv_canary/d2h.py``) is
counted apart (``small_graph_*``) and is outside work:

- ``device_period_us``: between the first kernels of consecutive forward graphs; ``host_period_us``: between their
  ``cudaGraphLaunch`` calls; ``launch_lead_us``: how far ahead of the device the host launched (small: host-bound);
- ``graph_span_us`` / ``graph_kernel_us`` / ``graph_gaps_us``: one replay's device span, summed kernel time, and
  span not covered by any of its kernels;
- ``graph_kernels_by_name_us_per_step``: [us, calls] per kernel name: which of the forward's own kernels moved;
- ``canary_kernel_us``: the canary's Triton kernels inside the replay; ``overlapped_us_per_step``: per kernel name
  of the replay, the time another kernel (any stream, inside the graph or not) ran beside it;
- ``between_busy_us`` / ``device_idle_us``: device work outside the graphs and idle time per period;
- ``runtime_us_per_step``: CUDA runtime calls by name (syncs show up here); ``cpu_ops_us_per_step``: aten ops.

``--configs`` entries are ``LABEL[:CONFIG][;ENV=VALUE...][;@PATH]``: ``CONFIG`` one of ``overhead_plan.CONFIGS``
(default ``LABEL``; ``ours_idle`` is the layout control: the canary installed, its work skipped), extra server
environment (``KVC_DIAG_DEVICE_BYTES=N`` on ``off``: the layout probe, ``stack_sampler/device_bytes.py``; one step
of the install at a time, ``stack_sampler/layout_ablations.py``: ``KVC_DIAG_RESERVE_BYTES=N`` on ``off``,
``KVC_DIAG_SKIP_PRECOMPILE=1`` or ``KVC_DIAG_PRECOMPILE_LAUNCH=load|compile`` on ``ours_idle``,
``KVC_DIAG_PRECOMPILE_POOL=1`` / ``_EMPTY_CACHE=1``; ``KVC_DIAG_DUMMY_MODULES=K`` on any: K tiny modules loaded after the
KV pool, another draw of the placement), and
``PATH`` first on ``PYTHONPATH`` (another build of the canary package, an A/B of one change).
Output: ``--out`` (the JSON summary), the traces and server logs beside it.

    export PYTHONPATH=/tmp/site:$PWD/python
    python3 benchmarks/profile_decode.py --configs off,ours_idle,ours --batches 1 --out /tmp/prof/summary.json
    python3 benchmarks/profile_decode.py --configs "off,nowit:ours;SGLANG_KV_CANARY_WRITE_WITNESS=0" --batches 32
    python3 benchmarks/profile_decode.py --eagle v1 --configs off,ours --batches 1,32   # EAGLE spec v1 servers
    python3 benchmarks/profile_decode.py --configs off,ours --rows shared_prefix --from-start --steps 3 --reps 1
        # the shared-prefix row's extend and first decode steps, Python stacks on (trace_summary's summary)

With ``--eagle`` a decode step is several graph replays (spec v1: draft phase, tree verify, draft extend), so the
per-replay numbers mix the three; compare off and ours per round (3 replays) instead.

What it found: docs/history/performance.md (decode bs32, 2026-11-22; decode bs1's gate_up GEMM, 2026-12-01; the
shared-prefix row's extend, 2026-12-01b).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_client import PromptSource, fill_pool, run_batch  # noqa: E402
from overhead_plan import (  # noqa: E402
    CONFIGS, ROWS, Row, ServerConfig, plan_eagle_args, server_env, server_plan,
)
from trace_summary import GPU_CATS, _union, graph_replays, is_canary_kernel, read_events, summarize  # noqa: E402

from kv_canary_testing.server import SglangServer  # noqa: E402

PROFILE_WAIT_S = 120.0
MAIN_GRAPH_KERNELS = 20  # fewer kernels: not the forward's graph (the canary's counter publish graph)


def _pct(values: List[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _stats(values: List[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2), "mean": round(statistics.fmean(values), 2),
            "p10": round(_pct(values, 0.1), 2), "p90": round(_pct(values, 0.9), 2)}


def analyze_trace(path: Path) -> dict:
    """Per-step numbers of one chrome trace written by sglang's torch profiler.

    A step is one replay of the forward's graph (>= MAIN_GRAPH_KERNELS kernels); smaller replays (the canary's
    one-kernel counter publish graph) are counted apart and their kernels are outside work."""
    events = read_events(path)
    kernels = [e for e in events if e.get("cat") in GPU_CATS]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    by_corr: Dict[int, list] = defaultdict(list)
    for k in kernels:
        by_corr[(k.get("args") or {}).get("correlation")].append(k)  # graph_replays' key
    steps = []
    for host_ts, start, end, corr in graph_replays(events, MAIN_GRAPH_KERNELS):
        ks = by_corr[corr]
        canary = defaultdict(float)
        for k in ks:
            if is_canary_kernel(k["name"]):
                canary[f"stream{k.get('args', {}).get('stream')}"] += k["dur"]
        steps.append({"host_ts": host_ts, "start": start, "end": end, "kernels": len(ks), "corr": corr,
                      "busy": _union([(k["ts"], k["ts"] + k["dur"]) for k in ks]),
                      "kernel_us": sum(k["dur"] for k in ks), "canary": dict(canary)})
    main_corr = {s["corr"] for s in steps}
    small = []  # the other graph launches with kernels: the counter publish graph
    for e in runtime:
        c = (e.get("args") or {}).get("correlation")
        if e["name"] == "cudaGraphLaunch" and c not in main_corr and by_corr.get(c):
            small.append(by_corr[c])
    out = {"trace": path.name, "graph_replays": len(steps), "small_graph_replays": len(small)}
    if len(steps) < 3:
        return out
    t0, t1 = steps[0]["start"], steps[-1]["start"]
    host_period = [b["host_ts"] - a["host_ts"] for a, b in zip(steps, steps[1:])]
    dev_period = [b["start"] - a["start"] for a, b in zip(steps, steps[1:])]
    between_busy, idle = [], []
    outside_k = [k for k in kernels if k.get("args", {}).get("correlation") not in main_corr and t0 <= k["ts"] < t1]
    outside = sorted((k["ts"], k["ts"] + k["dur"]) for k in outside_k)
    for a, b in zip(steps, steps[1:]):
        window = [(max(x, a["end"]), min(y, b["start"])) for x, y in outside if x < b["start"] and y > a["end"]]
        busy = _union([w for w in window if w[1] > w[0]])
        between_busy.append(busy)
        idle.append(max(0.0, (b["start"] - a["end"]) - busy))
    per_step = len(steps) - 1
    rt = defaultdict(float)
    rt_n = defaultdict(int)
    for e in runtime:
        if t0 <= e["ts"] < t1:
            rt[e["name"]] += e["dur"]
            rt_n[e["name"]] += 1
    graph_names, graph_calls, overlapped = defaultdict(float), defaultdict(int), defaultdict(float)
    ordered = sorted(kernels, key=lambda k: k["ts"])
    starts = [k["ts"] for k in ordered]
    longest = max(k["dur"] for k in kernels)
    for st in steps:
        ks = by_corr.get(st["corr"], [])
        for k in ks:
            graph_names[k["name"][:90]] += k["dur"]
            graph_calls[k["name"][:90]] += 1
            # how much of it ran beside another kernel (any stream, in or outside the graph)
            a0, a1 = k["ts"], k["ts"] + k["dur"]
            i = bisect.bisect_left(starts, a0 - longest)
            beside = []
            while i < len(ordered) and ordered[i]["ts"] < a1:
                o = ordered[i]
                i += 1
                if o is not k and o["ts"] + o["dur"] > a0:
                    beside.append((max(a0, o["ts"]), min(a1, o["ts"] + o["dur"])))
            if beside:
                overlapped[k["name"][:90]] += _union(beside)
    n = len(steps)
    outside_names = defaultdict(float)
    for k in outside_k:
        outside_names[f"s{k.get('args', {}).get('stream')}:" + k["name"][:90]] += k["dur"]
    ops = defaultdict(float)
    for e in cpu_ops:
        if t0 <= e["ts"] < t1:
            ops[e["name"]] += e["dur"]
    canary_streams = sorted({s for st in steps for s in st["canary"]})
    out.update({
        "host_period_us": _stats(host_period),
        "device_period_us": _stats(dev_period),
        "graph_span_us": _stats([s["end"] - s["start"] for s in steps]),
        "graph_kernel_us": _stats([s["kernel_us"] for s in steps]),
        "graph_gaps_us": _stats([s["end"] - s["start"] - s["busy"] for s in steps]),
        "graph_kernels": _stats([float(s["kernels"]) for s in steps]),
        "canary_kernel_us": {st: _stats([s["canary"].get(st, 0.0) for s in steps]) for st in canary_streams},
        "between_busy_us": _stats(between_busy),
        "device_idle_us": _stats(idle),
        "launch_lead_us": _stats([s["start"] - s["host_ts"] for s in steps]),
        "small_graph_kernel_us_per_step": round(sum(k["dur"] for ks in small for k in ks) / n, 2),
        "runtime_us_per_step": {k: {"us": round(v / per_step, 2), "calls": round(rt_n[k] / per_step, 2)}
                                for k, v in sorted(rt.items(), key=lambda kv: -kv[1])[:20]},
        "graph_kernels_by_name_us_per_step": {k: [round(v / n, 2), round(graph_calls[k] / n, 2)] for k, v in
                                              sorted(graph_names.items(), key=lambda kv: -kv[1])[:40]},
        "overlapped_us_per_step": {k: round(v / n, 2) for k, v in
                                   sorted(overlapped.items(), key=lambda kv: -kv[1])[:15]},
        "outside_kernels_by_name_us_per_step": {k: round(v / per_step, 2) for k, v in
                                                sorted(outside_names.items(), key=lambda kv: -kv[1])[:25]},
        "cpu_ops_us_per_step": {k: round(v / per_step, 2) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:25]},
    })
    return out


def _latest_trace(folder: Path, after: float) -> Optional[Path]:
    found = [p for p in folder.rglob("*.trace.json*") if p.stat().st_mtime >= after]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def profile_batch(server: SglangServer, prompts: PromptSource, row: Row, steps: int, trace_dir: Path,
                  reps: int, from_start: bool = False) -> dict:
    """Warmup, ``reps`` timed batches, then a batch whose decode phase is profiled for ``steps`` forwards
    (``from_start``: its first ``steps`` forwards, the prefill first, with Python stacks: ``trace_summary``'s
    summary instead of the per-replay numbers)."""
    run_batch(server.base_url, prompts.batch(row, -1), row.output_len)
    times = [run_batch(server.base_url, prompts.batch(row, r), row.output_len)["wall_s"] for r in range(reps)]
    wall = statistics.median(times)
    sub = trace_dir / row.name
    sub.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    batch = prompts.batch(row, reps)
    worker = threading.Thread(target=lambda: result.update(run_batch(server.base_url, batch, row.output_len)))
    began = time.time()
    session = requests.Session()
    session.trust_env = False

    def start_profile():
        return session.post(server.base_url + "/start_profile", timeout=60, json={
            "output_dir": str(sub), "num_steps": steps, "activities": ["CPU", "GPU"],
            "with_stack": from_start, "record_shapes": False})

    if from_start:
        r = start_profile()
        worker.start()
    else:
        worker.start()
        time.sleep(0.4 * wall)  # into the decode phase (prefill is well under 40% of a row)
        r = start_profile()
    worker.join()
    deadline = time.monotonic() + PROFILE_WAIT_S
    trace = None
    while time.monotonic() < deadline and trace is None:
        trace = _latest_trace(sub, began)
        time.sleep(1.0)
    time.sleep(2.0)  # the export finishes writing
    summary = {"row": row.describe(), "times_s": [round(t, 4) for t in times], "median_s": round(wall, 4),
               "start_profile_http": r.status_code}
    if trace is None:
        summary["error"] = f"no trace in {sub} (/start_profile said {r.status_code}: {r.text[:300]})"
    else:
        summary["trace_path"] = str(trace)
        summary.update(summarize(trace) if from_start else analyze_trace(trace))
    return summary


def parse_config(spec: str) -> Tuple[str, ServerConfig, Dict[str, str], str]:
    """``LABEL[:CONFIG][;ENV=VALUE...][;@PATH]`` -> (label, config, extra env, path first on PYTHONPATH)."""
    head, *extras = spec.split(";")
    name, _, cname = head.partition(":")
    config = CONFIGS.get(cname or name)
    if not name or config is None:
        raise SystemExit(f"--configs {spec!r}: expected LABEL[:CONFIG][;ENV=VALUE...][;@PATH] with CONFIG one of "
                         f"{', '.join(sorted(CONFIGS))}")
    env, path = {}, ""
    for extra in extras:
        key, eq, value = extra.partition("=")
        if extra.startswith("@") and len(extra) > 1:
            path = extra[1:]
        elif eq and key:
            env[key] = value
        else:
            raise SystemExit(f"--configs {spec!r}: {extra!r} is neither ENV=VALUE nor @PATH")
    return name, config, env, path


def select_rows(batches: str, rows: str) -> List[Row]:
    """The rows to profile: ``rows`` (names of ``overhead_plan.ROWS``) if given, else a decode row per batch size
    of ``batches`` (1k in; 512 out at bs1, else 256). An unknown name is refused before any server starts."""
    if rows:
        unknown = [r for r in rows.split(",") if r not in ROWS]
        if unknown:
            raise SystemExit(f"--rows {rows!r}: {', '.join(unknown)} not among {', '.join(ROWS)}")
        return [ROWS[r] for r in rows.split(",")]
    return [Row(f"decode_bs{b}", batch=int(b), input_len=1024, output_len=512 if int(b) == 1 else 256)
            for b in batches.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="off,ours",
                   help="comma-separated LABEL[:CONFIG][;ENV=VALUE...][;@PATH] (PATH first on PYTHONPATH)")
    p.add_argument("--batches", default="32,64",
                   help="decode batch sizes (1k in; 512 out at bs1, else 256), default 32,64")
    p.add_argument("--rows", default="",
                   help="comma-separated rows of overhead_plan.ROWS in place of --batches (e.g. shared_prefix)")
    p.add_argument("--from-start", action="store_true",
                   help="profile each batch's first --steps forwards (its prefill first) with Python stacks, and "
                        "summarize them with trace_summary (the prefill is eager: no per-replay numbers)")
    p.add_argument("--steps", type=int, default=40, help="forwards profiled per batch (default 40)")
    p.add_argument("--fill-pool", action="store_true",
                   help="before the batches, write every KV slot once (bench_overhead.py --fill-pool): the scrub's "
                        "window then hashes whole rows")
    p.add_argument("--reps", type=int, default=2, help="timed batches before the profiled one (default 2)")
    p.add_argument("--eagle", choices=["", "v2", "v1"], default="",
                   help="EAGLE on every server, as the bench's eagle_* (v2) or eagle_v1_* (v1) configs (default off)")
    p.add_argument("--out", default="/tmp/kvc-prof/summary.json")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    base = out.parent
    base.mkdir(parents=True, exist_ok=True)
    rows = select_rows(args.batches, args.rows)
    specs = [parse_config(spec) for spec in args.configs.split(",")]  # a bad entry fails before any server starts
    plan = server_plan("cuda", 1.0, rows + [ROWS["decode_bs64"]])
    report = {"command": " ".join(["python3", *sys.argv]), "configs": {}}
    for name, config, extra_env, path in specs:
        env = server_env(dataclasses.replace(config, env=config.env + tuple(extra_env.items())), plan, None, {})
        if path:
            rest = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = os.pathsep.join(x for x in (path, rest) if x)
        server = SglangServer([*config.args, *plan["args"], *plan_eagle_args(plan, args.eagle)], env=env,
                              log_path=base / f"{name}.log", device="cuda", model_path=plan["model_path"],
                              max_total_tokens=plan["max_total_tokens"])
        prompts = PromptSource(plan["token_range"], 0)
        entry = report["configs"][name] = {"args": config.describe(), "eagle": args.eagle or None,
                                           "pythonpath_first": path or None}
        print(f"[{name}] starting server ...", flush=True)
        try:
            server.start(timeout=600)
            if args.fill_pool:  # every KV slot written once first (bench_overhead --fill-pool)
                entry["fill_pool"] = fill_pool(server.base_url, prompts, rows, plan["max_total_tokens"])
            for row in rows:
                entry[row.name] = profile_batch(server, prompts, row, args.steps, base / name, args.reps,
                                                args.from_start)
                print(f"[{name}] {row.name}: {json.dumps(entry[row.name])[:1500]}", flush=True)
        except Exception as exc:  # keep the other configs
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] FAILED: {entry['error'][:2000]}", flush=True)
        finally:
            server.stop(grace=10)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
