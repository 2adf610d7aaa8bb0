#!/usr/bin/env python3
"""End-to-end serving overhead of the kv-canary, side by side with upstream sglang 0.5.14's in-tree canary.

One run starts a real sglang server once per entry of ``--configs`` and, on
each, times the rows that config measures, with the same client: one
``/generate`` request carrying a batch of ``input_ids`` (exact concurrency),
``ignore_eos``, temperature 0, fixed ``max_new_tokens``; one untimed warmup
repetition per row, then ``--reps`` timed ones (medians reported).

Configs (``CONFIGS``): ``off`` (sglang 0.5.12, ``--kv-canary none``), ``ours``
(``--kv-canary raise``, default settings), ``ours_sweep16`` (+
``--kv-canary-sweep-interval 16``; decode bs64 only), ``upstream_off`` /
``upstream`` / ``upstream_sweep16`` (sglang 0.5.14 from ``--upstream-site``:
no canary; ``--kv-canary raise --kv-canary-real-data partial`` with
``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``; + sweep 16), and ``storm``
(ours in ``log`` mode with one persistent corruption of a shared-prefix slot
that every later request reads; shared-prefix row only). A second ``off``
measures run-to-run noise. ``eagle_off`` / ``eagle_ours`` / ``upstream_eagle_off`` /
``upstream_eagle``: the same stacks with EAGLE speculative decoding on (a one-layer
``LlamaForCausalLMEagle`` draft of the target's shape, dummy weights, topk 1, 3 steps,
4 draft tokens), decode bs 1 and 32 only, run on their own so the summary compares
EAGLE servers with EAGLE servers (``--configs`` from ``EAGLE_CONFIGS``, ``--rows
decode_bs1,decode_bs32``, their own ``--results-dir``).

Rows: decode bs 1/32/64, prefill bs 8 x 8k (fresh random prompts whose first
two tokens encode a per-server counter: no radix hits), ``shared_prefix`` (64
requests sharing a 4k-token system prompt + 64 own tokens: radix hits, the
hit rate is checked from sglang's cached-token counts) and
``decode_bs64_sweep16`` (the decode bs64 shape on the sweep servers, compared
with the off server's decode bs64).

Issue 22 (full-byte verification): ``ours_all_rows`` / ``upstream_all`` (``--kv-canary-real-data all``, rows
``decode_bs1_all``, ``decode_bs32_all``, ``decode_bs64_all``, ``prefill_bs8_all``, ``shared_prefix_all``: issue 60's every
row) and ``ours_scrub_rows`` (``decode_bs64_scrub``,
``SCRUB_ROW_SLOTS`` slots per forward), each against its own stack's off server: ``--configs`` from
``ALL_CONFIGS`` with ``--rows decode_bs1_all,decode_bs64_all,prefill_bs8_all,decode_bs64_scrub``. The older
``ours_all`` / ``ours_scrub`` variants (issue 7) keep their meaning (plain rows, role variant).

``--fill-pool``: before its rows, each server (off and canary alike) is sent prefill-only requests that write every
slot of its KV pool once (``overhead_plan.fill_row``). Without it a decode row's pool is mostly never written (a
bs1 row writes ~6k of 131k slots), so the scrub's window at bs1 holds few recorded slots and hashes little; with
it the window holds whole rows, as in a server that has run a while (the scrub's steady cost).

``--cpu-set auto|LIST``: every server's processes pinned to the same CPUs once it is up (``auto``: the two fastest
at a pinned pure-Python loop). Unpinned, a server's scheduler runs on whichever vCPU it draws; an H200 host's 16
vCPUs ran that loop in 21-42 ms, and the full-pool shared prefix measured +1.4..+2.0% unpinned against +0.45% pinned
(docs/results/gpu-h200-2026-12-02d-host-cpu-draw-0.5.12). Every run records each CPU's speed at its start and end,
and each row's busiest threads over its timed repetitions (``thread_cpu``: CPU-s, switches, moves, last CPU).

Outputs (``--out`` and ``--results-dir``, rewritten after every server so an
interrupted run keeps what it measured): the full report, ``overhead.json``
(the run's per-row summary: its rows go into docs/results/overhead.json, the
current table ``benchmarks/overhead_report.py`` renders) and ``overhead_extra.json``
(baselines, hit rates, the memory table and the storm measurement).

Budget (the default 8 servers on one H100/H200): each server starts in 70-95 s
(dummy weights, CUDA-graph capture of bs 1..64; our canary's servers also
precompile its kernels, cached on disk after the first); a server of all five
rows runs 4 x (~3.5 + 2.9 + 4.5 + 2.2 + 5) s of requests (one warmup + 3 timed
repetitions), a one-row server ~20 s. About 19-20 minutes in all: run it in the
background on the GPU host (``scripts/gpu_host.sh bench-start`` /
``bench-wait``). Drop ``upstream_off`` from ``--configs`` to save ~2.5 min
(upstream is then compared with sglang 0.5.12 without canary).

GPU (default): sglang's own ``LlamaForCausalLM`` with the Llama-3-8B shape and
dummy weights, no tokenizer (``--skip-tokenizer-init``), CUDA graphs, triton
attention, ``--cuda-graph-max-bs 64``. CPU (``--device cpu``): the bundled tiny
model, sizes scaled down by ``--scale``; the canary's Triton kernels run under
``TRITON_INTERPRET=1``; upstream configs need ``--upstream-site``. CPU timings
only prove the script works.

    export PYTHONPATH=/tmp/site:$PWD/python
    python benchmarks/bench_overhead.py --out bench_overhead.json --results-dir results/
    python benchmarks/bench_overhead.py --device cpu                      # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional, Sequence

from kv_canary_testing.server import SglangServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_client import (  # noqa: E402
    SETTLE_TIMEOUT_S, STOP_GRACE_S, PromptSource, _progress, fill_pool, log_facts, probe_environment, run_batch,
    wait_settled,
)
from overhead_plan import (  # noqa: E402
    CONFIGS, CPU_DEFAULT_CONFIGS, CPU_DEFAULT_SCALE, DEFAULT_CONFIGS, DEFAULT_ROWS, DEFAULT_UPSTREAM_SITE,
    IDLE_ENV, IN_TREE_CONFIGS, LLAMA3_8B_CONFIG, OURS, ROWS, UPSTREAM, Row, ServerConfig, _installed_sglang,
    HOST_TIMER_INTERVAL_S, plan_eagle_args, sampler_env, server_env, server_plan,
)
from overhead_summary import markdown_table, memory_table, storm_summary, summarize, write_results  # noqa: E402
from thread_cpu import busiest, snapshot as thread_snapshot  # noqa: E402
from server_probes import (  # noqa: E402
    cpu_speeds_ms, fastest_cpus, parse_cpu_set, pin_process_tree, read_stacks, stack_lines, stack_summary,
)

SAMPLER_FLUSH_S = 1.2  # the stack sampler rewrites its files every second

# ---------------------------------------------------------------- one server


def host_timer_env(env: Dict[str, str], stacks_dir: Path) -> Dict[str, str]:
    """``env`` for a server whose scheduler keeps the host timers (``--host-timers``): the stack sampler, a sample
    every 0.25 s (``overhead_plan.sampler_env``)."""
    return sampler_env(env, stacks_dir, HOST_TIMER_INTERVAL_S)


def run_config(label: str, config: ServerConfig, plan: dict, args, rows: Dict[str, Row], log_dir: Path,
               extra_env: Dict[str, str]) -> dict:
    """Start one server, time the config's rows on it, stop it; return its results (``error`` set on failure)."""
    result = {"label": label, "config": config.name, "role": config.role, "stack": config.stack,
              "describe": config.describe(), "rows": {}, "error": None}
    my_rows = [rows[n] for n in config.rows if n in rows]
    if not my_rows:
        result["skipped"] = "none of its rows selected"
        return result
    try:
        env = server_env(config, plan, args.upstream_site, extra_env)
    except ValueError as exc:
        result["error"] = str(exc)
        _progress(f"[{label}] SKIPPED: {exc}")
        return result
    if config.eagle and "eagle_args" not in plan:
        result["error"] = f"config {config.name} runs EAGLE, measured on --device cuda only"
        _progress(f"[{label}] SKIPPED: {result['error']}")
        return result
    stacks_dir = None
    if args.host_timers:
        stacks_dir = log_dir / f"stacks-{label.replace('#', '')}"
        env = host_timer_env(env, stacks_dir)
    server = SglangServer(
        [*config.args, *plan["args"], *plan_eagle_args(plan, config.eagle)],
        env=env,
        log_path=log_dir / f"{label.replace('#', '')}.log",
        device=args.device,
        model_path=plan["model_path"],
        max_total_tokens=plan["max_total_tokens"],
    )
    result.update({"command": server.command(), "env": env, "log_path": str(server.log_path)})
    prompts = PromptSource(plan["token_range"], args.seed)
    _progress(f"[{label}] starting server ({config.describe()}) ...")
    try:
        server.start(timeout=plan["startup_timeout"])
        result["startup_s"] = round(server.startup_seconds or 0.0, 1)
        if args.cpus:  # --cpu-set: every server's processes on the same CPUs (before any timed batch)
            result["cpu_set"] = sorted(args.cpus)
            result["threads_pinned"] = pin_process_tree(server.proc.pid, args.cpus)
        _progress(f"[{label}] up in {result['startup_s']:.0f}s on {server.base_url}")
        if args.fill_pool:
            fill = result["fill_pool"] = fill_pool(server.base_url, prompts, list(rows.values()),
                                                   plan["max_total_tokens"])
            _progress(f"[{label}] pool filled: {fill['prompt_tokens']} prompt tokens for {fill['pool_tokens']} "
                      f"slots in {fill['wall_s']:.1f}s")
        for row in my_rows:
            warm = run_batch(server.base_url, prompts.batch(row, -1), row.output_len)  # warmup, untimed
            if stacks_dir is not None:  # the timed repetitions' host time only
                time.sleep(SAMPLER_FLUSH_S)
                base = read_stacks(stacks_dir)
            threads_base = thread_snapshot(server.proc.pid) if server.proc is not None else None
            reps = [run_batch(server.base_url, prompts.batch(row, rep), row.output_len) for rep in range(args.reps)]
            threads = busiest(threads_base, thread_snapshot(server.proc.pid), 4) if threads_base is not None else []
            host = None
            if stacks_dir is not None:
                time.sleep(SAMPLER_FLUSH_S)
                host = stack_summary(read_stacks(stacks_dir), base)
            times = [r["wall_s"] for r in reps]
            hit = [round(r["cached_tokens"] / row.prompt_tokens(), 4) for r in reps]
            result["rows"][row.name] = {
                "times_s": [round(t, 4) for t in times],
                "median_s": round(statistics.median(times), 4),
                "min_s": round(min(times), 4),
                "max_s": round(max(times), 4),
                "warmup_s": round(warm["wall_s"], 4),
                "cached_tokens": [r["cached_tokens"] for r in reps],
                "hit_rate": hit,
                "output_tokens_per_rep": reps[0]["output_tokens"],
                # the timed repetitions' busiest threads (thread_cpu): CPU-s, preemptions, moves, last CPU
                "threads": threads,
            }
            if host is not None:
                result["rows"][row.name]["host"] = host
            _progress(f"[{label}] {row.name:<20} {row.describe():<36} median {statistics.median(times):8.3f}s "
                      f"(reps {', '.join(f'{t:.3f}' for t in times)}; radix hit rate {min(hit):.3f}"
                      + ("".join(f"; busiest thread {t['thread']} {t['cpu_s']:.1f} CPU-s on CPU {t['cpu']}, "
                                 f"{t['migrations']} moves" for t in threads[:1])) + ")")
        if config.stack == OURS and config.role != "off" and IDLE_ENV not in dict(config.env):  # idle: no drain
            wait_settled(server, SETTLE_TIMEOUT_S)
    except Exception as exc:  # keep the other configs' results: record and go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        _progress(f"[{label}] FAILED: {result['error'][:2000]}")
    finally:
        server.stop(grace=STOP_GRACE_S)
    result.update(log_facts(server.log_text()))
    return result


# ---------------------------------------------------------------- the run


def _fmt_pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:+.2f}%"


def _parse_env_pairs(pairs: Sequence[str]) -> Dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key.startswith("SGLANG_KV_CANARY_"):
            raise SystemExit(f"--canary-env expects SGLANG_KV_CANARY_NAME=VALUE, got {p!r}")
        out[key] = value
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: Llama-3-8B-shaped dummy model; cpu: tiny model smoke run (default cuda)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated rows to run (default: {','.join(DEFAULT_ROWS)}; all: {','.join(ROWS)})")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated servers in order, from {', '.join(CONFIGS)} ('on' = ours); default "
                        f"{','.join(DEFAULT_CONFIGS)} (cpu: {','.join(CPU_DEFAULT_CONFIGS)})")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per row, after one warmup (default 3)")
    p.add_argument("--scale", type=float, default=None,
                   help=f"multiply prompt/output lengths (default 1 on cuda, {CPU_DEFAULT_SCALE:g} on cpu)")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed (same prompts on every server)")
    p.add_argument("--upstream-site", default=None,
                   help=f"folder holding sglang 0.5.14 (scripts/build_bundle.sh --upstream; default on cuda "
                        f"{DEFAULT_UPSTREAM_SITE})")
    p.add_argument("--canary-env", action="append", default=[], metavar="SGLANG_KV_CANARY_X=V",
                   help="extra canary env var for our canary servers (repeatable; default: none, i.e. defaults)")
    p.add_argument("--out", default="bench_overhead.json", help="full JSON report (default bench_overhead.json)")
    p.add_argument("--results-dir", default=None,
                   help="also write overhead.json + overhead_extra.json here (default: next to --out)")
    p.add_argument("--log-dir", default=None, help="server logs folder (default: <out stem>_logs next to --out)")
    p.add_argument("--host-timers", action="store_true",
                   help="bench only: each server's scheduler host timers per row over the timed repetitions "
                        "(benchmarks/stack_sampler/host_timers.py: sglang's and the canary's methods, each batch "
                        "boundary's segments, the garbage collections; stacks sampled every 0.25 s)")
    p.add_argument("--cpu-set", default="",
                   help="pin every server's processes to these CPUs once it is up ('2,3', '0-3'), or 'auto': the two "
                        "CPUs fastest at a pure-Python loop at the bench's start. The host's CPUs differ (an H200 "
                        "host's vCPUs by up to 2x, 2026-12-02d): unpinned, each server's scheduler draws one, and a "
                        "row bound by host work (a batch boundary) moves by more than the canary's cost. Each "
                        "CPU's speed is probed and recorded at the start and the end either way (default: unpinned)")
    p.add_argument("--fill-pool", action="store_true",
                   help="before its rows, write every slot of each server's KV pool once (prefill-only requests "
                        "of the longest row's prompt length): the scrub's window then hashes whole rows, as in a "
                        "server that has run a while")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    args.cpus = set()  # --cpu-set's CPUs (auto: chosen by main from the speed probe)
    if args.cpu_set not in ("", "auto"):
        try:
            args.cpus = parse_cpu_set(args.cpu_set)
        except ValueError:
            p.error(f"--cpu-set {args.cpu_set!r}: give CPU numbers and ranges ('2,3', '0-3') or 'auto'")
        if not args.cpus <= os.sched_getaffinity(0):
            p.error(f"--cpu-set {args.cpu_set!r}: this process may run on CPUs "
                    f"{','.join(map(str, sorted(os.sched_getaffinity(0))))} only")
    if args.scale is None:
        args.scale = 1.0 if args.device == "cuda" else CPU_DEFAULT_SCALE
    if args.scale <= 0:
        p.error("--scale must be > 0")
    if args.upstream_site is None and args.device == "cuda":
        args.upstream_site = DEFAULT_UPSTREAM_SITE
    args.row_names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.row_names if r not in ROWS]
    if unknown or not args.row_names:
        p.error(f"--rows: unknown {unknown or 'empty'}; choose from {', '.join(ROWS)}")
    # A row compared with another shape's off median (the sweep row) needs that shape measured too.
    for name in list(args.row_names):
        if ROWS[name].baseline not in args.row_names:
            args.row_names.insert(args.row_names.index(name), ROWS[name].baseline)
    default = CPU_DEFAULT_CONFIGS if args.device != "cuda" else (
        DEFAULT_CONFIGS if _installed_sglang() == "0.5.12" else IN_TREE_CONFIGS)
    names = [c.strip() for c in (args.configs or ",".join(default)).split(",") if c.strip()]
    args.config_names = ["ours" if c == "on" else c for c in names]
    bad = [c for c in args.config_names if c not in CONFIGS]
    if bad or not args.config_names:
        p.error(f"--configs: unknown {bad or 'empty'}; choose from {', '.join(CONFIGS)}")
    needs_upstream = [c for c in args.config_names if CONFIGS[c].stack == UPSTREAM]
    if needs_upstream and not (args.upstream_site and Path(args.upstream_site, "sglang").is_dir()):
        p.error(f"--configs {','.join(needs_upstream)} need sglang 0.5.14 in --upstream-site "
                f"(got {args.upstream_site!r}, which holds no sglang/): run its install.sh first")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    out_path = Path(args.out).resolve()
    results_dir = Path(args.results_dir).resolve() if args.results_dir else out_path.parent
    log_dir = Path(args.log_dir).resolve() if args.log_dir else out_path.with_name(out_path.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    stray = sorted(k for k in os.environ if k.startswith("SGLANG_KV_CANARY_"))
    if stray:
        raise SystemExit(f"unset {', '.join(stray)} first (each server's canary settings come from its config); "
                         "pass non-default settings with --canary-env")
    canary_env = _parse_env_pairs(args.canary_env)
    rows = {n: ROWS[n].scaled(args.scale) for n in args.row_names}
    plan = server_plan(args.device, args.scale, list(rows.values()))
    plan["storm_warmup_forwards"] = ROWS["shared_prefix"].scaled(args.scale).output_len

    host = probe_environment(args.device)
    speeds = cpu_speeds_ms()
    if args.cpu_set == "auto":
        args.cpus = fastest_cpus(speeds, 2)
    if host.get("kv_canary_plugin_entry_point") is False:
        raise SystemExit("the sglang plugin entry point 'kv_canary' is not installed in this environment "
                         "(pip install -e . or add its dist-info); --kv-canary would be an unknown flag")
    _progress(f"device={host.get('device_name')} sglang={host.get('sglang')} torch={host.get('torch')} "
              f"rows={','.join(rows)} configs={','.join(args.config_names)} reps={args.reps} "
              f"scale={args.scale:g} upstream_site={args.upstream_site} "
              f"cpu_set={','.join(map(str, sorted(args.cpus))) or 'unpinned'} cpu_speed_ms={speeds}")
    report = {
        "benchmark": "kv_canary end-to-end serving overhead, side by side with upstream sglang 0.5.14's canary",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", *sys.argv]),
        "cwd": os.getcwd(),
        "host": host,
        "device": args.device,
        "model": dict(LLAMA3_8B_CONFIG) if args.device == "cuda" else "kv_canary_testing tiny model",
        "model_path": str(plan["model_path"]),
        "scale": args.scale,
        "reps": args.reps,
        "warmup_reps": 1,
        "fill_pool": args.fill_pool,
        "seed": args.seed,
        "canary_env": canary_env,
        "max_total_tokens": plan["max_total_tokens"],
        "cpu_set": sorted(args.cpus) or None,
        "cpu_speed_ms_at_start": speeds,
        "configs": {n: CONFIGS[n].describe() for n in dict.fromkeys(args.config_names)},
        "rows": {r.name: asdict(r) for r in rows.values()},
        "timing": "wall time of one batched /generate request (all prompts at once); median of the timed reps",
        "runs": [],
    }
    table_rows = [r for r in rows.values()]
    counts: Dict[str, int] = {}
    for name in args.config_names:
        counts[name] = counts.get(name, 0) + 1
        label = f"{name}#{counts[name]}"
        report["runs"].append(run_config(label, CONFIGS[name], plan, args, rows, log_dir, canary_env))
        report["overhead_rows"], report["row_details"] = summarize(report["runs"], table_rows)
        report["memory"] = memory_table(report["runs"])
        report["storm"] = storm_summary(report["runs"])
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        write_results(report, out_path, results_dir)

    table = markdown_table(report["runs"], table_rows)
    report["table_markdown"] = table
    report["cpu_speed_ms_at_end"] = cpu_speeds_ms()
    write_results(report, out_path, results_dir)

    print(f"\n## kv-canary serving overhead ({host.get('device_name')}, reps={args.reps}, scale={args.scale:g})\n")
    print(table)
    print("\noverhead.json rows:")
    for name, v in report["overhead_rows"].items():
        print(f"  {name:<20} off {v['off_s']}s  ours {_fmt_pct(v['ours_pct'])}  upstream {_fmt_pct(v['upstream_pct'])}"
              f"  noise {_fmt_pct(v['noise_pct'])}")
    for name, d in report["row_details"].items():
        if "hit_rate_ok" in d:
            print(f"  {name}: radix hit rate per server (min of reps) {d['hit_rate_min']} ok={d['hit_rate_ok']}")
    if report["memory"]:
        for c in report["memory"]["cases"]:
            print(f"  memory {c['case']}: canary {c['canary_bytes'] / 2**20:.1f} MiB = "
                  f"{c['canary_pct_of_kv_pool']:.2f}% of the KV pool ({c['kv_pool_bytes'] / 2**30:.2f} GiB)")
    if report["storm"]:
        print(f"  storm: {json.dumps(report['storm'])}")
    for run in report["runs"]:
        st = run.get("canary_stats_last") or {}
        graph = run.get("decode_log_lines_cuda_graph", {})
        canary = (f"slots_verified={st.get('slots_verified')} slots_written={st.get('slots_written')} "
                  f"sweeps={st.get('sweeps')} graph_forwards={st.get('graph_forwards')} "
                  f"violations={st.get('violations')}" if st else
                  f"upstream [canary] lines={run.get('upstream_canary_lines')}")
        print(f"- {run['label']} ({run.get('describe')}): startup {run.get('startup_s', 'n/a')}s; "
              f"decode lines cuda graph True/False: {graph.get('True', 0)}/{graph.get('False', 0)}; "
              f"{canary}; violation lines={run.get('violation_lines')}"
              + (f"; ERROR {run['error'][:300]}" if run.get("error") else ""))
        for name, r in run.get("rows", {}).items():  # --host-timers: the scheduler's host time per row
            if r.get("host"):
                print(f"  {name}:")
                for line in stack_lines(r["host"]):
                    print(line)
    if args.device == "cpu":
        print("\nnote: CPU smoke run (tiny model, Triton interpreter): the timings say nothing about GPU overhead.")
    print(f"\nresults: {out_path} {results_dir}/overhead.json  logs: {log_dir}  elapsed: {report['elapsed_s']:.0f}s")
    return 1 if any(r.get("error") for r in report["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
