#!/usr/bin/env python3
"""Serving overhead of the kv-canary on a PD pair (issue 25): canary on both sides against off on both sides.

One run starts, per entry of ``--configs``, a prefill server, a decode server and sglang's mini router
(``kv_canary_testing.pd.PDCluster``: mooncake over TCP on 127.0.0.1), times the rows on the router with the
client of ``benchmarks/overhead_client.py`` (one batched ``/generate`` of fresh prompts, ``ignore_eos``, one
untimed warmup, then ``--reps`` timed repetitions, medians), and stops the pair. ``pd_off``: both sides
``--kv-canary none``; ``pd_ours``: both sides ``--kv-canary raise`` (default settings: records travel with
the KV, the decode side verifies every transferred slot at its first read). A second ``pd_off`` gives the
off-vs-off noise.

GPU (default): the Llama-3-8B shape with dummy weights (overhead_plan's server_plan), CUDA graphs on the decode
side (sglang runs the prefill side without them). Both servers share one GPU (``--mem-fraction-static``
``ONE_GPU_MEM_FRACTION`` each) or, with two GPUs, the decode side takes the second one. CPU (``--device
cpu``): the tiny model, sizes scaled down; the timings only prove the script works.

    export PYTHONPATH=/tmp/site:$PWD/python LD_LIBRARY_PATH=/tmp/pd-libs/lib
    python benchmarks/bench_pd_overhead.py --out pd_overhead.json            # GPU host, after install-pd
    python benchmarks/bench_pd_overhead.py --device cpu --rows decode_bs1     # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_client import (  # noqa: E402
    SETTLE_TIMEOUT_S, PromptSource, _progress, log_facts, probe_environment, run_batch, wait_settled,
)
from overhead_plan import CPU_DEFAULT_SCALE, ROWS, needed_kv_tokens, server_plan  # noqa: E402
from overhead_summary import pct  # noqa: E402
from kv_canary_testing.pd import PDCluster, pd_skip_reason  # noqa: E402

CONFIGS: Dict[str, tuple] = {"pd_off": ("off", ("--kv-canary", "none")), "pd_ours": ("ours", ("--kv-canary", "raise"))}
DEFAULT_CONFIGS = ("pd_off", "pd_ours", "pd_off")
DEFAULT_ROWS = ("decode_bs1", "decode_bs32", "prefill_bs8")
ONE_GPU_MEM_FRACTION = 0.8  # sglang sizes "rest" = free - total x (1 - this) after its weights, seeing the other
# side's memory as used: 0.42 left the second side nothing; the pool itself is capped by --max-total-tokens
STARTUP_TIMEOUT_S = 900


def pd_args(plan: dict, device: str) -> List[str]:
    """The plan's server flags for one PD side: its own --mem-fraction-static dropped (PDCluster sizes the
    sides; on one GPU ``ONE_GPU_MEM_FRACTION`` each)."""
    args, out, skip = list(plan["args"]), [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--mem-fraction-static":
            skip = True
            continue
        out.append(a)
    if device == "cuda":
        import torch

        out += ["--mem-fraction-static", str(ONE_GPU_MEM_FRACTION if torch.cuda.device_count() < 2 else 0.8)]
    return out


def run_pair(label: str, name: str, plan: dict, args, rows: Sequence, log_dir: Path) -> dict:
    """Start one PD pair, time the rows through its router, stop it; return its results (``error`` on failure)."""
    role, canary = CONFIGS[name]
    result = {"label": label, "config": name, "role": role, "describe": f"both sides {' '.join(canary)}",
              "rows": {}, "error": None}
    lo = plan["token_range"][0]
    cluster = PDCluster(log_dir=log_dir / label.replace("#", ""), device=args.device,
                        prefill_args=[*canary, *pd_args(plan, args.device)],
                        decode_args=[*canary, *pd_args(plan, args.device)],
                        prefill_env=plan["env"], decode_env=plan["env"], model_path=plan["model_path"],
                        max_total_tokens=plan["max_total_tokens"],
                        probe_payload={"input_ids": [lo + 1, lo + 2, lo + 3],
                                       "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
    prompts = PromptSource(plan["token_range"], args.seed)
    _progress(f"[{label}] starting a PD pair ({result['describe']}) ...")
    try:
        cluster.start(timeout=STARTUP_TIMEOUT_S if args.device == "cuda" else plan["startup_timeout"])
        result["startup_s"] = round(cluster.startup_seconds or 0.0, 1)
        _progress(f"[{label}] up in {result['startup_s']:.0f}s, router {cluster.base_url}")
        for row in rows:
            run_batch(cluster.base_url, prompts.batch(row, -1), row.output_len)  # warmup, untimed
            times = [run_batch(cluster.base_url, prompts.batch(row, rep), row.output_len)["wall_s"]
                     for rep in range(args.reps)]
            result["rows"][row.name] = {"times_s": [round(t, 4) for t in times],
                                        "median_s": round(statistics.median(times), 4)}
            _progress(f"[{label}] {row.name:<14} {row.describe():<36} median {statistics.median(times):8.3f}s "
                      f"(reps {', '.join(f'{t:.3f}' for t in times)})")
        if role == "ours":
            for side in (cluster.prefill, cluster.decode):
                wait_settled(side, SETTLE_TIMEOUT_S)
    except Exception as exc:  # keep the other pairs' results: record and go on
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        _progress(f"[{label}] FAILED: {result['error']}")
    finally:
        cluster.stop()
    for side_name, side in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        result[side_name] = log_facts(side.log_text())
    return result


def summarize(runs: Sequence[dict], rows: Sequence) -> dict:
    """{row: off_s (first pd_off), ours_pct (first pd_ours), noise_pct (second pd_off vs first)}."""
    table = {}
    for row in rows:
        med = {r["label"]: r["rows"].get(row.name, {}).get("median_s") for r in runs}
        offs = [med[r["label"]] for r in runs if r["role"] == "off" and med[r["label"]] is not None]
        ours = [med[r["label"]] for r in runs if r["role"] == "ours" and med[r["label"]] is not None]
        off_s = offs[0] if offs else None
        table[row.name] = {"off_s": off_s, "ours_pct": pct(ours[0] if ours else None, off_s),
                           "noise_pct": pct(offs[1] if len(offs) > 1 else None, off_s), "shape": row.describe()}
    return table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"from {', '.join(CONFIGS)}")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="rows of benchmarks/bench_overhead.py")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scale", type=float, default=None, help="row sizes x this (default 1 on cuda, 1/64 on cpu)")
    p.add_argument("--seed", type=int, default=2025)
    p.add_argument("--out", default="pd_overhead.json")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    args.scale = args.scale or (1.0 if args.device == "cuda" else CPU_DEFAULT_SCALE)
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.row_names = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [c for c in args.config_names if c not in CONFIGS] + [r for r in args.row_names if r not in ROWS]
    if bad or not args.config_names or not args.row_names:
        p.error(f"--configs / --rows: unknown or empty {bad}; configs from {', '.join(CONFIGS)}, rows from "
                f"{', '.join(ROWS)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    skip = pd_skip_reason(args.device)
    if skip:
        raise SystemExit(f"PD cannot run here: {skip}")
    out = Path(args.out).resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else out.with_name(out.stem + "_logs")
    rows = [ROWS[n].scaled(args.scale) for n in args.row_names]
    plan = server_plan(args.device, args.scale, rows)
    plan["max_total_tokens"] = needed_kv_tokens(rows) if args.device == "cuda" else plan["max_total_tokens"]
    host = probe_environment(args.device)
    t0 = time.monotonic()
    _progress(f"device={host.get('device_name')} sglang={host.get('sglang')} rows={','.join(args.row_names)} "
              f"configs={','.join(args.config_names)} reps={args.reps} scale={args.scale:g}")
    report = {"benchmark": "kv_canary serving overhead on a PD pair (canary on both sides vs off on both sides)",
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["python3", *sys.argv]), "host": host, "device": args.device,
              "scale": args.scale, "reps": args.reps, "max_total_tokens": plan["max_total_tokens"],
              "timing": "wall time of one batched /generate through the router; median of the timed reps",
              "runs": []}
    counts: Dict[str, int] = {}
    for name in args.config_names:
        counts[name] = counts.get(name, 0) + 1
        report["runs"].append(run_pair(f"{name}#{counts[name]}", name, plan, args, rows, log_dir))
        report["overhead_rows"] = summarize(report["runs"], rows)
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n## kv-canary overhead on a PD pair ({host.get('device_name')}, reps={args.reps}, scale={args.scale:g})")
    for name, v in report["overhead_rows"].items():
        print(f"  {name:<14} {v['shape']:<36} off {v['off_s']}s  ours {v['ours_pct']}%  noise {v['noise_pct']}%")
    for run in report["runs"]:
        sides = []
        for side in ("prefill", "decode"):
            st = run[side].get("canary_stats_last") or {}
            graph = run[side].get("decode_log_lines_cuda_graph", {})
            sides.append(f"{side}: slots_verified={st.get('slots_verified')} pd_slots_verified="
                         f"{st.get('pd_slots_verified')} graph_forwards={st.get('graph_forwards')} violations="
                         f"{st.get('violations')} violation_lines={run[side].get('violation_lines')} "
                         f"cuda graph lines True/False {graph.get('True', 0)}/{graph.get('False', 0)}")
        print(f"- {run['label']} ({run['describe']}): startup {run.get('startup_s', 'n/a')}s; " + "; ".join(sides)
              + (f"; ERROR {run['error'][:300]}" if run.get("error") else ""))
    print(f"\nresults: {out}  logs: {log_dir}  elapsed: {report['elapsed_s']:.0f}s")
    return 1 if any(r.get("error") for r in report["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
