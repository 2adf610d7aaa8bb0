"""Paired rounds of an interleaved overhead run (``bench_hicache_overhead.py --interleave``): every server runs
repetition r in round r, so each run's repetitions compare with the base server's of the same round.

A run is a dict: ``label``, ``config``, ``role`` (``off`` / ``ours``) and ``reps`` (dicts of ``rep``, ``wall_s``
and, optionally, ``turn_s``: each turn's seconds).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
from typing import Dict, List, Sequence

_START = re.compile(r"\[(?P<label>(?P<config>\w+)#\d+)\] starting a HiCache server \(--kv-canary (?P<mode>\w+)")
_STAMP = re.compile(r"(?=\[\d\d:\d\d:\d\d\] )")
_REP = re.compile(r"\[(?P<label>\w+#\d+)\] rep (?P<rep>\d+):\s+(?P<wall>[\d.]+)s.*?(?: turn_s=(?P<turns>[\d.,]+))?$")


def paired(runs: Sequence[dict], seed: int) -> dict:
    """Per round, each run's repetition against the first ``off`` run's same repetition (percent); the median over
    rounds and a bootstrap 90% interval of that median (2,000 resamples of the rounds)."""
    offs = [r for r in runs if r["role"] == "off" and r["reps"]]
    if not offs:
        return {}
    base = {x["rep"]: x["wall_s"] for x in offs[0]["reps"]}
    rng = random.Random(seed)
    out = {}
    for run in runs:
        if run is offs[0] or not run["reps"]:
            continue
        diffs = [100.0 * (x["wall_s"] - base[x["rep"]]) / base[x["rep"]] for x in run["reps"] if x["rep"] in base]
        if not diffs:
            continue
        boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
        out[run["label"]] = {"role": run["role"], "pair_pct": [round(d, 3) for d in diffs],
                             "median_pct": round(statistics.median(diffs), 3),
                             "mean_pct": round(statistics.fmean(diffs), 3),
                             "ci90_pct": [round(boots[100], 3), round(boots[1899], 3)],
                             "turn_median_pct": _turn_medians(run["reps"], offs[0]["reps"])}
    return out


def pooled(runs: Sequence[dict], seed: int) -> dict:
    """With two or more servers of a configuration and of ``hc_off`` (``--configs hc_off,hc_ours,hc_off,hc_ours``):
    per configuration, per round the mean of its servers' repetitions against the mean of the off servers'
    (percent), the median over rounds and a bootstrap 90% interval. A server process's own speed offset (0.3-0.6%
    on an H100, which pairing by round does not cancel) is averaged over the processes of each configuration (a
    configuration of one server, e.g. an ablation, keeps its own offset; the off side is still averaged)."""
    by_config: Dict[str, List[dict]] = {}
    for r in runs:
        if r["reps"]:
            by_config.setdefault(r.get("config", r["role"]), []).append(r)
    offs = [r for r in runs if r["role"] == "off" and r["reps"]]
    out = {}
    for name, group in by_config.items():
        if group[0]["role"] == "off" or len(offs) < 2:
            continue
        walls = [{x["rep"]: x["wall_s"] for x in r["reps"]} for r in offs + group]
        rounds = sorted(set.intersection(*(set(w) for w in walls)))
        if not rounds:
            continue
        diffs = _pooled_pct(walls, len(offs), rounds)
        rng = random.Random(seed)
        boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
        out[name] = {"servers": {"off": [r["label"] for r in offs], name: [r["label"] for r in group]},
                     "pair_pct": [round(d, 3) for d in diffs], "median_pct": round(statistics.median(diffs), 3),
                     "ci90_pct": [round(boots[100], 3), round(boots[1899], 3)],
                     "turn_median_pct": _pooled_turn_medians(offs, group, rounds)}
    return out


def _pooled_turn_medians(offs: Sequence[dict], group: Sequence[dict], rounds: Sequence[int]) -> List[float]:
    """Per turn, the median over ``rounds`` of the configuration's servers' mean turn time against the off
    servers' mean (percent): which turns carry the difference (the HiCache row's first turn writes fresh prompts,
    the later ones load prefixes back from the host). [] when a repetition carries no per-turn times."""
    return [round(statistics.median(by_round), 3) for by_round in _pooled_turns(offs, group, rounds)]


def _pooled_turns(offs: Sequence[dict], group: Sequence[dict], rounds: Sequence[int], *,
                  ms: bool = False) -> List[List[float]]:
    """Per turn, per round of ``rounds``: ``_pooled_pct`` of the servers' turn times (percent, or ``ms``); [] when
    a repetition carries no per-turn times."""
    turns = [{x["rep"]: x.get("turn_s") for x in r["reps"]} for r in list(offs) + list(group)]
    if any(not t.get(rep) for t in turns for rep in rounds) or not rounds:
        return []
    return [_pooled_pct([{rep: t[rep][i] for rep in rounds} for t in turns], len(offs), rounds, ms=ms)
            for i in range(len(turns[0][rounds[0]]))]


def _pooled_pct(times: Sequence[Dict[int, float]], n_offs: int, rounds: Sequence[int], *,
                ms: bool = False) -> List[float]:
    """Per round, the mean of ``times[n_offs:]`` (a configuration's servers, round -> seconds) against the mean of
    ``times[:n_offs]`` (the off servers'), percent (``ms``: their difference in milliseconds)."""
    out = []
    for rep in rounds:
        off = statistics.fmean(t[rep] for t in times[:n_offs])
        diff = statistics.fmean(t[rep] for t in times[n_offs:]) - off
        out.append(1000.0 * diff if ms else 100.0 * diff / off)
    return out


def _turn_medians(reps: Sequence[dict], base_reps: Sequence[dict]) -> List[float]:
    """Per turn, the median over rounds of the turn's time against the base run's same round (percent); [] when
    the repetitions carry no per-turn times."""
    base = {x["rep"]: x.get("turn_s") for x in base_reps}
    pairs = [(x["turn_s"], base[x["rep"]]) for x in reps if x.get("turn_s") and base.get(x["rep"])]
    if not pairs:
        return []
    return [round(statistics.median(100.0 * (t[i] - b[i]) / b[i] for t, b in pairs), 3)
            for i in range(len(pairs[0][0]))]


def runs_from_log(text: str) -> List[dict]:
    """The runs of a bench log (``bench_hicache_overhead.py``'s progress lines): a run cut off before its report
    (a device call that ended) still pairs its complete rounds. A server is ``off`` when it ran ``--kv-canary
    none``; a repetition's ``turn_s`` when the line has it; only rounds every server finished are kept. Servers
    started in parallel print from threads, so one line may hold two messages: each ``[HH:MM:SS] `` begins one."""
    runs: Dict[str, dict] = {}
    for line in (m for raw in text.splitlines() for m in _STAMP.split(raw)):
        m = _START.search(line)
        if m:
            runs[m["label"]] = {"label": m["label"], "config": m["config"], "reps": [],
                                "role": "off" if m["mode"] == "none" else "ours"}
        m = _REP.search(line.rstrip())
        if m and m["label"] in runs:
            rep = {"rep": int(m["rep"]), "wall_s": float(m["wall"])}
            if m["turns"]:
                rep["turn_s"] = [float(t) for t in m["turns"].split(",")]
            runs[m["label"]]["reps"].append(rep)
    done = set.intersection(*({x["rep"] for x in r["reps"]} for r in runs.values())) if runs else set()
    for r in runs.values():
        r["reps"] = [x for x in r["reps"] if x["rep"] in done]
    return list(runs.values())


def across_hosts(logs: Sequence[Sequence[dict]], seed: int) -> dict:
    """Rows of one package measured on several hosts (``logs``: each bench log's runs, ``runs_from_log``), pooled:
    per configuration, every log's pooled rounds together (each round against its own log's off servers: a host's
    speed never mixes into another's), their median and a bootstrap 90% interval (20,000 resamples of the rounds),
    and per turn the median over those rounds of the configuration's servers' mean minus the off servers' mean,
    in ms a repetition. A configuration missing from a log (or a log without two off servers) adds no rounds."""
    per_log = [pooled(runs, seed) for runs in logs]
    out = {}
    for name in sorted({n for p in per_log for n in p}):
        diffs, ms = [], []
        for runs, p in zip(logs, per_log):
            if name not in p:
                continue
            diffs += p[name]["pair_pct"]
            ms += _turn_ms(runs, name)
        rng = random.Random(seed)
        boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(20000))
        out[name] = {"logs": sum(name in p for p in per_log), "rounds": len(diffs),
                     "per_log_median_pct": [p[name]["median_pct"] for p in per_log if name in p],
                     "median_pct": round(statistics.median(diffs), 3), "mean_pct": round(statistics.fmean(diffs), 3),
                     "ci90_pct": [round(boots[1000], 3), round(boots[18999], 3)],
                     "turn_ms_per_rep": [round(statistics.median(m[i] for m in ms), 1) for i in range(len(ms[0]))]
                     if ms and all(len(m) == len(ms[0]) for m in ms) else []}
    return out


def _turn_ms(runs: Sequence[dict], name: str) -> List[List[float]]:
    """Per round every server finished: per turn, the configuration's servers' mean minus the off servers' mean,
    ms (``_pooled_turns``; [] when a repetition carries no per-turn times)."""
    offs = [r for r in runs if r["role"] == "off" and r["reps"]]
    group = [r for r in runs if r.get("config", r["role"]) == name and r["reps"]]
    rounds = sorted(set.intersection(*({x["rep"] for x in r["reps"]} for r in offs + group))) if offs + group else []
    return [list(by_turn) for by_turn in zip(*_pooled_turns(offs, group, rounds, ms=True))]


if __name__ == "__main__":
    # python3 benchmarks/paired_rounds.py BENCH_LOG [BENCH_LOG ...]: the pooled rows of a (cut-off) run; with several
    # logs (one package's rows on several hosts), each log's pooled rows and all their rounds pooled
    logs = [runs_from_log(open(path, encoding="utf-8").read()) for path in sys.argv[1:]]
    if len(logs) == 1:
        logged = logs[0]
        rounds = len(logged[0]["reps"]) if logged else 0
        print(json.dumps({"rounds": rounds, "pooled": pooled(logged, seed=len(logged))}, indent=1))  # the bench's seed
    else:
        print(json.dumps({"per_log": {path: pooled(runs, seed=len(runs)) for path, runs in zip(sys.argv[1:], logs)},
                          "across_hosts": across_hosts(logs, seed=0)}, indent=1))
