#!/usr/bin/env python3
"""Regenerate docs/performance.md's current overhead table, memory and storm tables from docs/results/overhead.json.

``docs/results/overhead.json`` is the one current table: per sglang line, device, row and canary configuration
the most recent recorded figure, each pointing to its run (``rows``); the memory and storm tables come from the
run ``memory_and_storm`` names (the memory table from the file ``memory`` names instead, when it is set: a run
whose servers ran the current default). A new run (``benchmarks/bench_overhead.py`` writes its ``overhead.json`` and
``overhead_extra.json`` into its result folder) updates the rows it measured, by hand. This script rewrites the
part of the doc between the ``<!-- overhead:begin -->`` / ``<!-- overhead:end -->`` markers and leaves everything
else (the history) alone.

    python benchmarks/overhead_report.py                      # rewrite docs/performance.md
    python benchmarks/overhead_report.py --check              # exit 1 if the doc is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"
ROW_LABELS = {
    "decode_bs1": "decode bs1 (1k in, 512 out)",
    "decode_bs32": "decode bs32 (1k in, 256 out)",
    "decode_bs64": "decode bs64 (1k in, 256 out)",
    "prefill_bs8": "prefill bs8 × 8k",
    "shared_prefix": "shared prefix (64 × (4k common + 64 own), 256 out, radix hits)",
    "hicache_multiturn": "multi-turn, prefixes loaded back from the host tier",
}
DEFAULT_GOAL_PCT = 0.5
STORM_GOAL_PCT = 5.0


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:+.2f}%"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def overhead_section(current: dict) -> str:
    """The current table: one line per (sglang line, device, row, configuration), its run linked."""
    goals = current.get("goals_pct") or {}
    lines = [
        "The current figure of every row (`docs/results/overhead.json`: the most recent recorded run per sglang "
        "line, device, row and canary configuration; Llama-3-8B shape, dummy weights, CUDA graphs, triton "
        "attention; each canary against the server without canary of its own sglang, in the same run; upstream: "
        "sglang's in-tree canary with the same flags; ours vs installed-idle: against the same run's server with "
        "the canary installed and its per-forward work skipped, `ours_idle`, which takes the canary's presence in "
        "the process out of the figure: docs/results/gpu-h200-2026-12-01-decode-bs1-profile).",
        "",
        "| sglang | device | row | canary | date | off s | ours | ours vs installed-idle | upstream | off-vs-off noise | "
        "goal (ours) | run |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in current["rows"]:
        goal = goals.get(r["config"], DEFAULT_GOAL_PCT)
        ours = r.get("ours_pct")
        met = "n/a" if ours is None else ("met" if ours <= goal else "**missed**")
        if r.get("ours_ci90_pct"):
            lo, hi = r["ours_ci90_pct"]
            ours_text = f"{_pct(ours)} (90%: {lo:+.2f}..{hi:+.2f})"
        else:
            ours_text = _pct(ours)
        off = "n/a" if r.get("off_s") is None else f"{r['off_s']:.3f}"
        run = r["run"].replace("docs/results/", "")
        lines.append(f"| {r['line']} | {r['device']} | {ROW_LABELS.get(r['row'], r['row'])} | {r['config']} | "
                     f"{r['date']} | {off} | {ours_text} | {_pct(r.get('ours_vs_idle_pct'))} | "
                     f"{_pct(r.get('upstream_pct'))} | "
                     f"{_pct(r.get('noise_pct'))} | ≤ {goal:g}%: {met} | `{run}` |")
    return "\n".join(lines)


def memory_section(memory: Optional[dict]) -> str:
    if not memory:
        return "No memory table recorded (the run had no `ours` server install line)."
    lines = [
        "Canary device memory from `kv_canary.memory.canary_memory_bytes` (the function the install log line "
        f"uses; this run's line said {memory['logged_canary_bytes']:,} bytes) against the KV pool's bytes"
        + (f" (held back from the KV pool's budget before sglang sized it: {memory['reserved_before_kv_pool']:,} "
           "bytes, the canary's buffers for as many slots as the free memory could buy; a pool capped below that, "
           "as the bench's `--max-total-tokens` caps it, needs fewer)" if memory.get("reserved_before_kv_pool") else "")
        + ":",
        "",
        "| case | slots | request rows | context | records (+ sweep index) | token table | ring + counters | "
        "full-row state (`all`, scrub) | canary total | KV pool | canary / KV pool |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in memory["cases"]:
        b = c["breakdown"]
        lines.append(
            f"| {c['case']} | {c['slots']:,} | {c['req_rows']:,} | {c['context_len']:,} | "
            f"{_mib(b['records'] + b.get('sweep_index', 0))} | "
            f"{_mib(b['token_table'])} | {_mib(b['ring'] + b['counters'])} | {_mib(b.get('full_row', 0))} | "
            f"{_mib(c['canary_bytes'])} | "
            f"{c['kv_pool_bytes'] / 2**30:.2f} GiB | {c['canary_pct_of_kv_pool']:.2f}% |")
    return "\n".join(lines)


def storm_section(storm: Optional[dict]) -> str:
    if not storm:
        return "No storm measurement recorded."
    verdict = ("n/a" if storm.get("storm_vs_clean_ours_pct") is None else
               ("met" if storm["storm_vs_clean_ours_pct"] <= STORM_GOAL_PCT else "**missed**"))
    return "\n".join([
        "`--kv-canary log` with one persistent corruption (`SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB=1`, "
        "`..._MAX_INJECTIONS=1`: one flipped K/V byte of a slot a forward reads, at position "
        f"{storm.get('injected_position')}, {'inside' if storm.get('injected_in_shared_prefix') else 'outside'} "
        "the shared 4k prefix), shared-prefix row:",
        "",
        "| storm median s | clean `ours` median s | storm vs clean | storm vs off | violation rows on the device | "
        "lines logged | repeats counted | each distinct violation logged once |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {storm.get('storm_s')} | {storm.get('clean_ours_s')} | {_pct(storm.get('storm_vs_clean_ours_pct'))} "
        f"(goal ≤ {STORM_GOAL_PCT:g}%: {verdict}) | {_pct(storm.get('storm_vs_off_pct'))} | "
        f"{storm.get('violation_rows_on_device')} | {storm.get('violation_lines')} | "
        f"{storm.get('violations_repeated')} | {storm.get('distinct_violations_logged_once')} |",
    ])


def _read(results: Path, relative: Optional[str]) -> Optional[dict]:
    """The JSON file ``relative`` (to the repository root) names, or None."""
    if not relative:
        return None
    path = results.parent.parent / relative
    return json.loads(path.read_text()) if path.exists() else None


def render(results: Path) -> str:
    current_path = results / "overhead.json"
    if not current_path.exists():
        body = ("No run recorded yet: run the benchmark on the GPU host (`scripts/gpu_host.sh`, steps `bench-start` / "
                "`bench-wait`), keep its results in a folder of `docs/results/`, add its rows to "
                "`docs/results/overhead.json` and run `python benchmarks/overhead_report.py`.")
        return f"{BEGIN}\n{body}\n{END}"
    current = json.loads(current_path.read_text())
    extra = _read(results, current.get("memory_and_storm"))
    memory_source = current.get("memory") or current.get("memory_and_storm")
    memory = _read(results, current["memory"]) if current.get("memory") else extra
    details = (extra or {}).get("row_details") or {}
    parts = [
        BEGIN,
        "<!-- generated by benchmarks/overhead_report.py from docs/results/overhead.json: do not edit by hand -->",
        "",
        "### Serving overhead: the current table",
        "",
        overhead_section(current),
        "",
        "### Canary memory",
        "",
        memory_section((memory or {}).get("memory")),
        "",
        "### Violation storm (log mode)",
        "",
        storm_section((extra or {}).get("storm")),
    ]
    hits = details.get("shared_prefix", {}).get("hit_rate_min")
    if hits:
        storm = "Storm and memory" if memory_source == current["memory_and_storm"] else "Storm"
        parts += ["", f"{storm}: `{current['memory_and_storm']}`; its shared-prefix radix hit rate (cached prompt "
                  "tokens / prompt tokens, lowest repetition) per server: "
                  + ", ".join(f"{k} {v:.1%}" for k, v in hits.items()) + "."]
    if memory_source and memory_source != current.get("memory_and_storm"):
        about = (memory or {}).get("about")
        parts += ["", f"Memory: `{memory_source}`" + (f" ({about})" if about else "") + "."]
    parts.append(END)
    return "\n".join(parts)


def update_doc(doc: str, section: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"the doc has no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section + tail


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "docs" / "results"), help="folder with the current overhead.json")
    p.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"))
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if the doc is out of date")
    args = p.parse_args(argv)
    doc_path = Path(args.doc)
    doc = doc_path.read_text()
    new = update_doc(doc, render(Path(args.results)))
    if args.check:
        if new != doc:
            print(f"{doc_path} is out of date: run python benchmarks/overhead_report.py", file=sys.stderr)
            return 1
        return 0
    doc_path.write_text(new)
    print(f"wrote {doc_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
