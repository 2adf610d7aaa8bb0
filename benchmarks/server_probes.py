"""A benchmarked server's processes, for ``bench_hicache_overhead.py`` and ``bench_overhead.py`` (bench only): the
host's CPUs' speeds, pinned to a CPU set (``--cpu-sets``, ``--cpu-set``), and what its stack sampler and host timers
(``benchmarks/stack_sampler``) recorded, summed over the timed repetitions."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional


def pin_process_tree(root_pid: int, cpus: set) -> int:
    """Every thread of ``root_pid`` and its descendants runs on ``cpus`` only (``--cpu-sets``); threads made later
    inherit it. Returns how many threads were pinned."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    pinned, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                pinned += 1
            except OSError:
                pass
    return pinned


# A fixed pure-Python loop, run pinned to one CPU: the host's CPUs are not equal. On the H200 host (a VM, 16 vCPUs)
# the same loop took 21-22 ms on some vCPUs and 35-42 ms on others at one time (docs/results/
# gpu-h200-2026-12-02d-host-cpu-draw-0.5.12): a scheduler that lands on a slow one runs its host work ~1.7x slower.
_SPEED_LOOP = ("import os, time\nos.sched_setaffinity(0, {%d})\nbest = 9.0\nfor _ in range(5):\n"
               "    t = time.perf_counter(); s = 0\n    for i in range(300000): s += i\n"
               "    best = min(best, time.perf_counter() - t)\nprint(best)")


def cpu_speeds_ms() -> Dict[int, float]:
    """CPU -> ms of the best of 5 runs of a 300k-add Python loop pinned there (lower is faster; ~2 s in all)."""
    out: Dict[int, float] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        r = subprocess.run([sys.executable, "-c", _SPEED_LOOP % cpu], capture_output=True, text=True)
        try:
            out[cpu] = round(float(r.stdout.strip()) * 1000, 2)
        except ValueError:
            continue  # the probe failed on that CPU (no timing printed): left out, not guessed
    return out


def fastest_cpus(speeds: Dict[int, float], count: int) -> set:
    """The ``count`` CPUs of ``speeds`` with the fastest loop."""
    return set(sorted(speeds, key=speeds.get)[:count])


def parse_cpu_set(text: str) -> set:
    """'0-3,8' -> {0, 1, 2, 3, 8}."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def read_stacks(stacks_dir: Path) -> Dict[int, dict]:
    """The stack sampler's latest files of one server, by pid (cumulative since each process started)."""
    docs = {}
    for f in sorted(stacks_dir.glob("[0-9]*.json")):
        doc = json.loads(f.read_text())
        docs[doc["pid"]] = doc
    return docs


def stack_summary(docs: Dict[int, dict], base: Dict[int, dict], top: int = 25) -> dict:
    """Per process title, the samples since ``base`` (a ``read_stacks`` taken after the warmup: startup and
    imports left out, +-5 s): their count, the canary's share (samples whose innermost sglang/canary frame is the
    canary's), the top owners and the canary's frame chains."""
    def minus(now: dict, then: dict) -> dict:
        diff = {k: n - then.get(k, 0) for k, n in now.items()}
        return dict(sorted(((k, n) for k, n in diff.items() if n > 0), key=lambda kv: -kv[1]))

    out = {}
    for pid, doc in docs.items():
        then = base.get(pid, {})
        owners = minus(doc.get("owners", {}), then.get("owners", {}))
        samples = doc.get("samples", 0) - then.get("samples", 0)
        canary = sum(n for o, n in owners.items() if o.startswith("kv_canary/"))
        out[f"{doc.get('title', '?')[:60]} (pid {pid})"] = {
            "samples": samples, "canary_samples": canary, "canary_pct": round(100.0 * canary / max(1, samples), 2),
            "top_owners": dict(list(owners.items())[:top]),
            "canary_paths": minus(doc.get("canary_paths", {}), then.get("canary_paths", {})),
            "canary_lines": minus(doc.get("canary_lines", {}), then.get("canary_lines", {})),
            "gc": gc_summary(doc.get("gc", {}), then.get("gc", {})),
            "timers": timer_summary(doc.get("timers"), then.get("timers"))}
    return out


def gc_summary(now: dict, then: dict) -> dict:
    """The process's garbage collections since ``then``, per generation: [collections, seconds, longest ever]."""
    out = {}
    for g, (n, t, longest) in now.items():
        n0, t0 = then.get(g, [0, 0.0])[:2]
        out[g] = [n - n0, round(t - t0, 4), longest]
    return out


def timer_summary(now: Optional[dict], then: Optional[dict]) -> Optional[dict]:
    """The scheduler's host timers (``benchmarks/stack_sampler/host_timers.py``) since ``then``: per method calls,
    milliseconds in all and per call; per batch-boundary segment the count, median and mean milliseconds."""
    if not now or not now.get("calls"):
        return None
    then = then or {"calls": {}, "boundaries": {}}
    calls = {}
    for k, (n, t, _mx) in now["calls"].items():
        n0, t0 = then["calls"].get(k, [0, 0.0])[:2]
        if n > n0:
            calls[k] = {"calls": n - n0, "ms": round((t - t0) * 1e3, 1),
                        "us_per_call": round((t - t0) / (n - n0) * 1e6, 1)}
    bounds = {}
    for k, v in now["boundaries"].items():
        v = v[len(then["boundaries"].get(k, [])):]
        if v:
            bounds[k] = {"n": len(v), "median_ms": round(statistics.median(v), 3),
                         "mean_ms": round(statistics.fmean(v), 3)}
    syncs = {k: n - then.get("syncs", {}).get(k, 0) for k, n in now.get("syncs", {}).items()}
    spans = {}
    for k, (n, ms) in now.get("gpu_spans", {}).items():
        n0, ms0 = then.get("gpu_spans", {}).get(k, [0, 0.0])
        if n > n0:
            spans[k] = {"spans": n - n0, "ms_per_span": round((ms - ms0) / (n - n0), 3)}
    return {"calls": calls, "boundaries": bounds, "syncs": {k: n for k, n in syncs.items() if n > 0},
            "gpu_spans": spans}


def stack_lines(stacks: Dict[str, dict]) -> List[str]:
    """The report lines of ``stack_summary`` results by process title: the scheduler's samples, its host timers
    (a batch boundary's segments, the calls, the GPU spans), the syncs and the collections."""
    out: List[str] = []
    for title, st in stacks.items():
        if "scheduler" not in title:
            continue
        out.append(f"    stacks {title}: {st['samples']} samples, canary {st['canary_pct']}%; top "
                   + ", ".join(f"{o}={n}" for o, n in list(st["top_owners"].items())[:8]))
        tm = st.get("timers") or {}
        if tm.get("boundaries"):  # a batch boundary's host segments (median ms)
            out.append("      boundary ms (median/mean): " + ", ".join(
                f"{k} {b['median_ms']}/{b['mean_ms']} (n {b['n']})" for k, b in tm["boundaries"].items()))
            out.append("      host ms: " + ", ".join(f"{k} {c['ms']} ({c['us_per_call']} us x {c['calls']})"
                                             for k, c in tm["calls"].items()))
        if tm.get("gpu_spans"):
            out.append("      gpu ms per span: " + ", ".join(f"{k} {v['ms_per_span']} (n {v['spans']})"
                                                    for k, v in tm["gpu_spans"].items()))
        for site, n in sorted((tm.get("syncs") or {}).items(), key=lambda kv: -kv[1])[:25]:
            out.append(f"      sync {n}x {site}")
        if st.get("gc"):  # collections / seconds / longest, per generation, over the timed repetitions
            out.append("      gc: " + ", ".join(f"gen{g} {n}x {t:.3f}s (max {mx * 1e3:.1f} ms)"
                                             for g, (n, t, mx) in sorted(st["gc"].items())))
    return out
