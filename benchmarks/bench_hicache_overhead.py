#!/usr/bin/env python3
"""Serving overhead of the kv-canary with HiCache (issue 24): multi-turn traffic served from the host tier.

One run starts, per entry of ``--configs``, one sglang server with ``--enable-hierarchical-cache`` (write
through, ``layer_first``, page 1) and times a multi-turn workload on it, then stops it. ``hc_off``:
``--kv-canary none``; ``hc_ours``: ``--kv-canary raise`` (default settings; with HiCache every new slot's bytes
are hashed at its write, records follow the KV to the host and back, and every loaded-back slot is hashed once
at its first read). A second ``hc_off`` gives the off-vs-off noise.

Workload (one repetition): ``--conversations`` conversations, each a fresh ``--system-len``-token system prompt
and ``--turns`` turns of ``--turn-len`` new tokens and ``--output-len`` generated ones, sent turn by turn in
batched ``/generate`` calls of ``--group`` conversations. The device pool (``--max-total-tokens``) holds a
fraction of the conversations, so by its next turn a conversation's prefix has left the device and comes back
from the host (``sglang:load_back_tokens_total``, read from sglang's /metrics per repetition, proves it). One
untimed warmup repetition, then ``--reps`` timed ones (fresh conversations each); the row is the median wall
time of a repetition. ``--interleave``: all servers up at once (``--mem-fraction-static`` shares the GPU), one
repetition on each per round, orders rotated, the same prompts per round; ``overhead.paired`` gives each run
against the first ``hc_off`` round by round (median, mean, a bootstrap 90% interval of the median): drift
between servers started minutes apart no longer lands in the row. With two servers or more of a configuration
and of ``hc_off`` (``--configs hc_off,hc_ours,hc_off,hc_ours``), ``overhead.pooled`` compares their means per
round: a server process's own speed offset is averaged over the processes of its configuration.
``hc_ours_d2h4``: ``hc_ours`` with ``SGLANG_KV_CANARY_D2H_INTERVAL=4``; ``hc_ours_lean`` (an ablation, to size
what the token oracle and the write witness cost): that, and neither of them.

GPU (default): overhead_plan's Llama-3-8B shape with dummy weights, CUDA graphs. CPU (``--device cpu``): the
tiny model through the HiCache test shim (``KVC_TEST_HICACHE_CPU``), small sizes; the timings only prove the
script works.

    export PYTHONPATH=/tmp/site:$PWD/python
    python benchmarks/bench_hicache_overhead.py --out hicache_overhead.json        # GPU host
    python benchmarks/bench_hicache_overhead.py --device cpu                        # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Sequence

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_client import (  # noqa: E402
    SETTLE_TIMEOUT_S, STOP_GRACE_S, _progress, log_facts, probe_environment, run_batch, wait_settled,
)
from overhead_plan import (  # noqa: E402 - IDLE_ENV: canary_idle.py
    HOST_TIMER_INTERVAL_S, IDLE_ENV, ROWS, sampler_env, sampler_pythonpath, server_plan,
)
from overhead_summary import pct  # noqa: E402
from paired_rounds import paired, pooled  # noqa: E402
from server_probes import parse_cpu_set, pin_process_tree, read_stacks, stack_lines, stack_summary  # noqa: E402
from thread_cpu import busiest, snapshot as thread_snapshot  # noqa: E402
from trace_summary import summarize as summarize_trace  # noqa: E402
from kv_canary_testing.hicache_cpu import ENV as HICACHE_SHIM_ENV  # noqa: E402
from kv_canary_testing.prometheus import sglang_counter  # noqa: E402
from kv_canary_testing.server import SglangServer  # noqa: E402


# name: (role, server args, canary env); hc_ours_d2h4: the counters copied to the host after every 4th forward.
# Real data named: partial is 0.5.12's default, and what sglang 0.5.23 (default none) verifies with HiCache
OURS = ("--kv-canary", "raise", "--kv-canary-real-data", "partial")
CONFIGS: Dict[str, tuple] = {"hc_off": ("off", ("--kv-canary", "none"), {}),
                             "hc_ours": ("ours", OURS, {}),
                             "hc_ours_d2h4": ("ours", OURS, {"SGLANG_KV_CANARY_D2H_INTERVAL": "4"}),
                             # ablation (not a setting to run): the copy interval, no token oracle, no write witness
                             "hc_ours_lean": ("ours", OURS,
                                              {"SGLANG_KV_CANARY_D2H_INTERVAL": "4",
                                               "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE": "0",
                                               "SGLANG_KV_CANARY_WRITE_WITNESS": "0"}),
                             # ablation: installed, its per-forward work skipped (stack_sampler/canary_idle.py)
                             "hc_ours_idle": ("ours", OURS, {IDLE_ENV: "1"})}
DEFAULT_CONFIGS = ("hc_off", "hc_ours", "hc_off")
# (conversations, system_len, turns, turn_len, output_len, group, max_total_tokens, hicache_ratio) per device:
# on the GPU 48 x ~1.3k tokens of prefixes against a 16k-token device pool and a 5x host pool
SHAPES = {"cuda": (48, 1024, 3, 64, 32, 8, 16384, 5), "cpu": (12, 200, 3, 12, 4, 4, 1024, 8)}
LOAD_BACK = "sglang:load_back_tokens_total"
EVICTED = "sglang:evicted_tokens_total"


def repetition(args, token_range, rep: int) -> List[List[List[int]]]:
    """The batches of one repetition, in send order: turn by turn, ``args.group`` conversations a batch; each
    prompt is its conversation's system prompt and turns so far (fresh ids per repetition: no cross-rep hits)."""
    rng = random.Random(args.seed * 1000 + rep + 1)
    lo, hi = token_range
    draw = lambda n: [rng.randrange(lo, hi) for _ in range(n)]  # noqa: E731
    systems = [draw(args.system_len) for _ in range(args.conversations)]
    turns = [[draw(args.turn_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    batches = []
    for t in range(args.turns):
        for g in range(0, args.conversations, args.group):
            batches.append([systems[c] + sum(turns[c][: t + 1], []) for c in range(g, min(g + args.group,
                                                                                          args.conversations))])
    return batches


def start_server(label: str, name: str, plan: dict, args, log_dir: Path) -> tuple:
    """Start one HiCache server; (server, its result record: ``error`` set when the start failed)."""
    role, canary, canary_env = CONFIGS[name]
    result = {"label": label, "config": name, "role": role, "reps": [], "error": None,
              "describe": " ".join([*canary, *(f"{k}={v}" for k, v in canary_env.items())])}
    hicache = ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio), "--hicache-write-policy",
               "write_through", "--enable-metrics"]
    env = {**plan["env"], **canary_env}
    if args.device == "cpu":
        env[HICACHE_SHIM_ENV] = "1"
    sampling = args.sample_stacks or args.host_timers or args.sync_debug  # each process samples its main thread
    if sampling:  # the sampler directory's sitecustomize samples (and makes the canary idle where asked)
        stacks = log_dir / f"stacks-{label.replace('#', '')}"
        result["stacks_dir"] = str(stacks)
        # --host-timers alone: the scheduler's timers, few samples
        env = sampler_env(env, stacks, None if args.sample_stacks else HOST_TIMER_INTERVAL_S)
        if args.sync_debug:
            env["KVC_SYNC_DEBUG"] = "1"
    elif IDLE_ENV in canary_env:  # the sampler directory's sitecustomize makes the canary idle
        env["PYTHONPATH"] = sampler_pythonpath(os.environ.get("PYTHONPATH", ""))
    extra = ["--mem-fraction-static", str(args.mem_fraction_static)] if args.mem_fraction_static else []
    extra += [a for arg in args.server_arg for a in shlex.split(arg)]  # the same on every server, off and ours
    server = SglangServer([*canary, *plan["args"], *hicache, *extra], env=env,
                          log_path=log_dir / f"{label.replace('#', '')}.log", device=args.device,
                          model_path=plan["model_path"], max_total_tokens=args.max_total_tokens)
    result["command"] = server.command()
    _progress(f"[{label}] starting a HiCache server ({result['describe']}) ...")
    try:
        server.start(timeout=plan["startup_timeout"])
        cpus = args.cpu_set_of.get(label)
        if cpus is not None:  # --cpu-sets: the server's processes on its CPU set
            result["cpus"] = sorted(cpus)
            result["threads_pinned"] = pin_process_tree(server.proc.pid, cpus)
        result["startup_s"] = round(server.startup_seconds or 0.0, 1)
        _progress(f"[{label}] up in {result['startup_s']:.0f}s on {server.base_url}")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        _progress(f"[{label}] FAILED to start: {result['error']}")
    return server, result


def time_repetition(server: SglangServer, result: dict, args, plan: dict, rep: int) -> None:
    """Time repetition ``rep`` (-1: the untimed warmup) on ``server``; a timed one joins ``result["reps"]``."""
    loaded0 = sglang_counter(server.base_url, LOAD_BACK)
    t0, cached = time.perf_counter(), 0
    batches = repetition(args, plan["token_range"], rep)
    per_turn = len(batches) // args.turns
    turn_s = [0.0] * args.turns  # each turn's batches: which turn carries a difference
    for i, batch in enumerate(batches):
        tb = time.perf_counter()
        cached += run_batch(server.base_url, batch, args.output_len)["cached_tokens"]
        turn_s[i // per_turn] += time.perf_counter() - tb
    wall = time.perf_counter() - t0
    loaded = sglang_counter(server.base_url, LOAD_BACK) - loaded0
    if rep == -1 and "stacks_dir" in result:  # the samples counted from here on (after the startup and warmup)
        time.sleep(1.2)  # the sampler rewrites its file every second
        result["stacks_base"] = read_stacks(Path(result["stacks_dir"]))
    if rep == -1 and server.proc is not None:  # each thread's CPU time from here on (thread_cpu)
        result["threads_base"] = thread_snapshot(server.proc.pid)
    if rep >= 0:
        result["reps"].append({"rep": rep, "wall_s": round(wall, 4), "turn_s": [round(t, 4) for t in turn_s],
                               "cached_tokens": cached, "load_back_tokens": int(loaded)})
    _progress(f"[{result['label']}] rep {rep if rep >= 0 else 'warmup'}: {wall:8.3f}s cached_tokens={cached} "
              f"load_back_tokens={loaded:.0f} turn_s={','.join(f'{t:.4f}' for t in turn_s)}")  # a cut-off run's log
    # still holds every repetition's turns (paired_rounds.runs_from_log)


def finish_server(server: SglangServer, result: dict, args, plan: dict, log_dir: Path) -> dict:
    """Profile (if asked), read the eviction counter, wait for the canary to settle, stop; the final record."""
    try:
        if result["error"] is None:
            if "threads_base" in result and server.proc is not None:  # the timed repetitions' CPU by thread
                result["threads"] = busiest(result.pop("threads_base"), thread_snapshot(server.proc.pid))
            if args.profile_batches and result["label"].endswith("#1"):  # the first server of each config
                for turn in args.profile_turns:  # a profile that fails leaves the timings standing
                    key = f"turn{turn}"
                    try:
                        prof = profile_batches(server.base_url, args, plan, turn, log_dir
                                               / f"profile-{result['label'].replace('#', '')}-{key}")
                    except Exception as exc:
                        prof = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                        _progress(f"[{result['label']}] profile of {key} FAILED: {prof['error']}")
                    result.setdefault("profile", {})[key] = prof
            result["evicted_tokens"] = int(sglang_counter(server.base_url, EVICTED))
            if result["role"] == "ours" and IDLE_ENV not in CONFIGS[result["config"]][2]:  # idle: never settles
                wait_settled(server, SETTLE_TIMEOUT_S)
    except Exception as exc:  # keep the other servers' results: record and go on
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        _progress(f"[{result['label']}] FAILED: {result['error']}")
    finally:
        server.stop(grace=STOP_GRACE_S)
    if result["reps"]:
        result["median_s"] = round(statistics.median(r["wall_s"] for r in result["reps"]), 4)
    result.update(log_facts(server.log_text()))
    if "stacks_dir" in result:
        result["stacks"] = stack_summary(read_stacks(Path(result["stacks_dir"])), result.pop("stacks_base", {}))
    result["hicache_line"] = next((ln.strip() for ln in server.log_text().splitlines() if "kv_canary_hicache=1" in ln),
                                  None)
    return result


def run_server(label: str, name: str, plan: dict, args, log_dir: Path) -> dict:
    """One server after the other: start, warmup + ``--reps`` timed repetitions, stop."""
    server, result = start_server(label, name, plan, args, log_dir)
    try:
        for rep in range(-1, args.reps) if result["error"] is None else ():
            time_repetition(server, result, args, plan, rep)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        _progress(f"[{label}] FAILED: {result['error']}")
    return finish_server(server, result, args, plan, log_dir)


def round_order(items: Sequence, rnd: int) -> list:
    """Round ``rnd``'s order: rotated by ``rnd``, reversed every other cycle of ``len(items)`` rounds, so over
    ``2 * len(items)`` rounds each item runs in each position equally often (3 items: all 6 orders)."""
    n = len(items)
    k = rnd % n
    order = list(items[k:]) + list(items[:k])
    return order[::-1] if (rnd // n) % 2 else order


def run_interleaved(labels: Sequence[tuple], plan: dict, args, log_dir: Path) -> List[dict]:
    """Every server up at once (started one after the other), then round r times repetition r on each in
    ``round_order`` (each server in each position equally often): a round's repetitions run the same prompts
    within seconds of each other, so drift between them (clocks, the host's other load) cancels."""
    if args.parallel_start:  # all starts at once: the row's startup takes the slowest start, not their sum
        with ThreadPoolExecutor(max_workers=len(labels)) as pool:
            started = list(pool.map(lambda ln: start_server(ln[0], ln[1], plan, args, log_dir), labels))
    else:
        started = [start_server(label, name, plan, args, log_dir) for label, name in labels]
    live = [(srv, res) for srv, res in started if res["error"] is None]
    round_s = 0.0
    try:
        if len(live) == len(started):
            for rep in range(-1, args.reps):
                if args.time_budget_s and time.monotonic() - args.t0 + round_s > args.time_budget_s:
                    _progress(f"--time-budget-s {args.time_budget_s:.0f}: stopping before round {rep} (the last "
                              f"took {round_s:.0f}s); {max(rep, 0)} rounds timed")
                    break
                t_round = time.monotonic()
                if args.rotate_cpu_sets:  # server i on set (i + round) % n: each on each set equally often
                    for i, (server, result) in enumerate(live):
                        k = (i + rep) % len(args.cpu_set_list)
                        pin_process_tree(server.proc.pid, args.cpu_set_list[k])
                        result.setdefault("cpu_set_by_rep", []).append(k)
                for server, result in round_order(live, rep):
                    time_repetition(server, result, args, plan, rep)
                round_s = time.monotonic() - t_round
    except Exception as exc:
        for _, result in live:
            result["error"] = result["error"] or f"{type(exc).__name__}: {exc}"[:3000]
        _progress(f"interleaved run FAILED: {type(exc).__name__}: {exc}")
    return [finish_server(srv, res, args, plan, log_dir) for srv, res in started]


def profile_batches(base_url: str, args, plan: dict, turn: int, out_dir: Path) -> dict:
    """One more (fresh, untimed) repetition with sglang's torch profiler on ``--profile-batches`` batches from the
    first of turn ``turn`` on (0: fresh prompts written and backed up; 1: prefixes loaded back from the host); the
    trace's summary (``trace_summary``)."""
    batches = repetition(args, plan["token_range"], args.reps + turn)  # prompts no timed or profiled run sent
    first = turn * (len(batches) // args.turns)  # the turn's first batch
    session = requests.Session()
    session.trust_env = False  # loopback only
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, batch in enumerate(batches[:first + args.profile_batches]):  # the turns before it fill the host tier
        if i == first:
            body = {"output_dir": str(out_dir), "activities": ["CPU", "GPU"], "with_stack": args.profile_stack}
            session.post(base_url + "/start_profile", json=body, timeout=60).raise_for_status()
        run_batch(base_url, batch, args.output_len)
    session.post(base_url + "/stop_profile", timeout=300).raise_for_status()
    traces = sorted(out_dir.glob("*.trace.json*"), key=lambda f: f.stat().st_mtime)
    if not traces:
        return {"error": f"no trace written under {out_dir}"}
    return summarize_trace(traces[-1])


def profile_line(prof: dict) -> str:
    """One line of a run's profile summary (``trace_summary.summarize``'s dict, or ``{"error": ...}``)."""
    if "error" in prof:
        return f"profile: ERROR {prof['error'][:300]}"
    gaps = ", ".join(f"<={g['up_to_us']}us {g['count']} / {g['us'] / 1e3:.1f} ms"
                     for g in prof.get("gpu_idle_gaps", []))
    return (f"profile: window {prof['window_us'] / 1e3:.1f} ms, GPU busy {prof['gpu_busy_us'] / 1e3:.1f} ms, canary "
            f"kernels {prof['gpu_canary_kernel_us'] / 1e3:.1f} ms in {prof['gpu_canary_kernel_launches']} launches; "
            f"idle gaps (count / total) {gaps}")


def summarize(runs: Sequence[dict]) -> dict:
    """off_s (first hc_off), ours_pct (first hc_ours), noise_pct (second hc_off vs first), host hits."""
    offs = [r for r in runs if r["role"] == "off" and r.get("median_s") is not None]
    ours = [r for r in runs if r["role"] == "ours" and r.get("median_s") is not None]
    off_s = offs[0]["median_s"] if offs else None
    return {"off_s": off_s, "ours_pct": pct(ours[0]["median_s"] if ours else None, off_s),
            "noise_pct": pct(offs[1]["median_s"] if len(offs) > 1 else None, off_s),
            "load_back_tokens_per_rep": {r["label"]: [x["load_back_tokens"] for x in r["reps"]] for r in runs},
            "paired": paired(runs, seed=len(runs)), "pooled": pooled(runs, seed=len(runs))}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"from {', '.join(CONFIGS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--interleave", action="store_true",
                   help="all servers up at once, one repetition on each per round, orders rotated (paired: see run_interleaved)")
    p.add_argument("--profile-stack", action="store_true",
                   help="the profile records Python frames (the canary's host time per thread; inflates the host "
                        "side of the window: --sample-stacks attributes host time at a lower cost)")
    p.add_argument("--sample-stacks", action="store_true",
                   help="every server process samples its main thread's stack (benchmarks/stack_sampler): where the "
                        "host time goes, the canary's share; costs the servers a little (attribution, not timing)")
    p.add_argument("--sync-debug", action="store_true",
                   help="--host-timers, and the synchronizing torch calls inside the scheduler's run_batch and "
                        "get_next_batch_to_run counted by call site (torch's sync debug mode; bench only)")
    p.add_argument("--host-timers", action="store_true",
                   help="the scheduler's host timers alone (benchmarks/stack_sampler/host_timers.py: sglang's and the "
                        "canary's methods, each batch boundary's segments), the stacks sampled only every 0.25 s")
    p.add_argument("--cpu-sets", type=lambda v: v.split(":"), default=None,
                   help="bench only: CPU sets separated by ':' ('0-7:8-15'), one per server in start order (cycled): "
                        "every thread of a server's process tree pinned to its set once it is up")
    p.add_argument("--rotate-cpu-sets", action="store_true",
                   help="with --interleave --cpu-sets: before each round server i's tree is pinned to set "
                        "(i + round) mod n, so every server runs on every set equally often")
    p.add_argument("--parallel-start", action="store_true",
                   help="with --interleave: start every server at once (each still gets --max-total-tokens; "
                        "with --mem-fraction-static the last to profile its memory must find room for it)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="with --interleave: no round starts once the time since the bench started plus the last "
                        "round's length would pass this (the row ends, stops its servers and writes its report "
                        "inside one device call); 0: every --reps round")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="each server's --mem-fraction-static (with --interleave several share the GPU)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra sglang flags for every server (repeatable), e.g. '--sleep-on-idle' (idle servers "
                        "sleep instead of spinning a core beside the one being timed) or '--decode-log-interval 8' "
                        "(decode throughput lines inside a 32-step batch, not across its boundary)")
    p.add_argument("--seed", type=int, default=2025)
    for flag in ("conversations", "system-len", "turns", "turn-len", "output-len", "group", "max-total-tokens",
                 "hicache-ratio"):
        p.add_argument(f"--{flag}", type=int, default=None, help="default: per device (SHAPES)")
    p.add_argument("--profile-batches", type=int, default=0,
                   help="after the timed repetitions, profile this many load-back batches (sglang's /start_profile) "
                        "and summarize the trace (benchmarks/trace_summary.py); 0: off")
    p.add_argument("--profile-turn", default="1",
                   help="the turns (comma-separated, one trace each) whose first batches --profile-batches profiles "
                        "(0: fresh prompts; 1: the first load-backs), on the first server of each config")
    p.add_argument("--out", default="hicache_overhead.json")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    names = ("conversations", "system_len", "turns", "turn_len", "output_len", "group", "max_total_tokens",
             "hicache_ratio")
    for name, default in zip(names, SHAPES[args.device]):
        value = getattr(args, name)
        if value is None:
            setattr(args, name, default)
        elif value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_names if c not in CONFIGS]
    if bad or not args.config_names:
        p.error(f"--configs: unknown or empty {bad}; choose from {', '.join(CONFIGS)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.time_budget_s < 0 or (args.time_budget_s and not args.interleave):
        p.error(f"--time-budget-s: needs --interleave (it cuts rounds) and a value >= 0, got {args.time_budget_s}")
    turns = [t.strip() for t in str(args.profile_turn).split(",") if t.strip()]
    args.profile_turns = sorted({int(t) for t in turns if t.isdigit()})
    if not turns or len(args.profile_turns) < len(set(turns)) or max(args.profile_turns) >= args.turns:
        p.error(f"--profile-turn must be within 0..{args.turns - 1} (--turns {args.turns}), got {args.profile_turn}")
    per_turn = args.conversations // args.group
    last = max(args.profile_turns)
    if args.profile_batches < 0 or args.profile_batches > per_turn * (args.turns - last):
        p.error(f"--profile-batches must be within 0..(the batches from --profile-turn {last} on), got "
                f"{args.profile_batches}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else out.with_name(out.stem + "_logs")
    plan = server_plan(args.device, 1.0, [ROWS["decode_bs1"]])  # flags, model and token range (its pool: ours)
    host = probe_environment(args.device)
    shape = {k: getattr(args, k) for k in ("conversations", "system_len", "turns", "turn_len", "output_len", "group",
                                            "max_total_tokens", "hicache_ratio")}
    t0 = args.t0 = time.monotonic()
    _progress(f"device={host.get('device_name')} sglang={host.get('sglang')} configs={','.join(args.config_names)} "
              f"reps={args.reps} shape={shape}")
    report = {"benchmark": "kv_canary serving overhead with HiCache (multi-turn, prefixes loaded back from the host)",
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["python3", *sys.argv]), "host": host, "device": args.device, "shape": shape,
              "reps": args.reps, "timing": "wall time of one repetition (all turns, batched /generate calls); "
                                           "median of the timed repetitions", "runs": []}
    counts: Dict[str, int] = {}
    labels = []
    for name in args.config_names:
        counts[name] = counts.get(name, 0) + 1
        labels.append((f"{name}#{counts[name]}", name))
    sets = [parse_cpu_set(text) for text in args.cpu_sets or ()]  # --cpu-sets: one per server in start order
    if args.rotate_cpu_sets and not (args.interleave and len(sets) >= 2):
        raise SystemExit("--rotate-cpu-sets: needs --interleave and --cpu-sets with two sets or more")
    if args.parallel_start and not args.interleave:
        raise SystemExit("--parallel-start: needs --interleave (one server after the other otherwise)")
    args.cpu_set_list = sets
    args.cpu_set_of = {label: sets[i % len(sets)] for i, (label, _) in enumerate(labels)} if sets else {}
    report["interleaved"] = args.interleave

    def save(runs: Sequence[dict]) -> None:  # after each server (all at once when interleaved): partial results
        report["runs"].extend(runs)
        report["overhead"] = summarize(report["runs"])
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    if args.interleave:
        save(run_interleaved(labels, plan, args, log_dir))
    else:
        for label, name in labels:
            save([run_server(label, name, plan, args, log_dir)])
    v = report["overhead"]
    print(f"\n## kv-canary overhead with HiCache ({host.get('device_name')}, reps={args.reps}, shape={shape})")
    print(f"  hicache_multiturn  off {v['off_s']}s  ours {v['ours_pct']}%  noise {v['noise_pct']}%")
    for label, p in v["paired"].items():
        print(f"  paired vs the first off, {label}: median {p['median_pct']}% (90% CI {p['ci90_pct']}), "
              f"mean {p['mean_pct']}%, rounds {p['pair_pct']}; per turn (median) {p['turn_median_pct']}")
    for name, p in v["pooled"].items():
        print(f"  pooled, {name}'s servers' mean vs the off servers' mean per round ({p['servers']}): median "
              f"{p['median_pct']}% (90% CI {p['ci90_pct']}), rounds {p['pair_pct']}; per turn (median) "
              f"{p['turn_median_pct']}")
    for run in report["runs"]:
        st = run.get("canary_stats_last") or {}
        print(f"- {run['label']} ({run['describe']}): startup {run.get('startup_s', 'n/a')}s; median "
              f"{run.get('median_s')}s; load_back_tokens/rep {[r['load_back_tokens'] for r in run['reps']]}; "
              f"evicted {run.get('evicted_tokens')}; hicache_slots_loaded={st.get('hicache_slots_loaded')} "
              f"slots_first_read={st.get('slots_first_read')} violations={st.get('violations')} "
              f"violation_lines={run.get('violation_lines')}"
              + (f"; ERROR {run['error'][:300]}" if run.get("error") else ""))
        for key, prof in (run.get("profile") or {}).items():  # --profile-batches: each turn's trace's summary
            print(f"    {key} " + profile_line(prof))
        if run.get("threads"):  # the timed repetitions' CPU by thread (thread_cpu): the busiest four
            print("    threads (cpu s / preempted): " + ", ".join(
                f"{t['process'][:24]}:{t['thread'][:16]} {t['cpu_s']}/{t['preempted']}" for t in run["threads"][:4]))
        for line in stack_lines(run.get("stacks") or {}):  # --sample-stacks / --host-timers: the scheduler's
            print(line)
    print(f"\nresults: {out}  logs: {log_dir}  elapsed: {report['elapsed_s']:.0f}s")
    return 1 if any(r.get("error") for r in report["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
