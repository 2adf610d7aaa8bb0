"""The overhead bench's summary: each canary against its stack's off server (``summarize``), the canary memory
table, the storm verdict, the quick markdown table, and the report files (``write_results``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from kv_canary.config import ENV_PREFIX, CanaryConfig
from kv_canary.memory import canary_memory_bytes
from overhead_plan import ROWS, Row

MIN_HIT_RATE = 0.9  # the shared-prefix row must be served from the radix cache
MEMORY_CONTEXT_LENS = (131072,)  # extra context lengths the memory table is computed for
LAYOUT_CONTROL = "ours_idle"  # overhead_plan's installed-but-idle server
DEFAULT_REQ_ROWS = 4097  # sglang's req pool on a large GPU without --max-running-requests (memory table)


def pct(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """100 * (value - base) / base, or None when either is missing or base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return round(100.0 * (value - base) / base, 2)


def _median(run: Optional[dict], row: str) -> Optional[float]:
    return None if run is None else run["rows"].get(row, {}).get("median_s")


def _first(runs: Sequence[dict], role: str, row: str, skip: Sequence[dict] = ()) -> Optional[dict]:
    """The first run of ``role`` that measured ``row`` (not in ``skip``)."""
    for r in runs:
        if r["role"] == role and row in r["rows"] and all(r is not s for s in skip):
            return r
    return None


def summarize(runs: Sequence[dict], rows: Sequence[Row]) -> Tuple[dict, dict]:
    """(the run's overhead rows for its overhead.json, per-row details for overhead_extra.json).

    off_s: the first off server's median of the row's baseline shape; ours_pct / upstream_pct: the
    canary server against the off server of its own stack (upstream against sglang 0.5.14 without
    canary when measured, else against 0.5.12 off); noise_pct: the second off server against the first.
    With the layout control (``ours_idle``) in the run, the details add ours against it (the canary's work) and it
    against off (the canary's presence: its memory layout and hooks).
    """
    table, details = {}, {}
    for row in rows:
        base_row = row.baseline
        off1 = _first(runs, "off", base_row)
        off2 = _first(runs, "off", base_row, skip=[off1] if off1 else [])
        ours = _first(runs, "ours", row.name)
        up = _first(runs, "upstream", row.name)
        up_off = _first(runs, "upstream_off", base_row)
        off_s = _median(off1, base_row)
        up_base = _median(up_off, base_row) if up_off else off_s
        table[row.name] = {
            "off_s": off_s,
            "ours_pct": pct(_median(ours, row.name), off_s),
            "upstream_pct": pct(_median(up, row.name), up_base),
            "noise_pct": pct(_median(off2, base_row), off_s),
        }
        details[row.name] = {
            "shape": row.describe(),
            "baseline_row": base_row,
            "medians_s": {r["label"]: _median(r, row.name if r["role"] in ("ours", "upstream", "storm") else base_row)
                          for r in runs if row.name in r["rows"] or base_row in r["rows"]},
            "upstream_baseline": (up_off["label"] if up_off else (off1["label"] if off1 else None)),
            "upstream_vs_ours_off_pct": pct(_median(up, row.name), off_s),
            "upstream_off_vs_ours_off_pct": pct(up_base, off_s) if up_off else None,
            "hit_rate_min": {r["label"]: min(r["rows"][row.name]["hit_rate"]) for r in runs if row.name in r["rows"]},
        }
        idle = next((r for r in runs if r.get("config") == LAYOUT_CONTROL and base_row in r["rows"]), None)
        if idle is not None:  # the layout control: what the canary's work costs, apart from its presence
            details[row.name]["ours_vs_idle_pct"] = pct(_median(ours, row.name), _median(idle, base_row))
            details[row.name]["idle_vs_off_pct"] = pct(_median(idle, base_row), off_s)
        if row.shared_prefix_len:
            details[row.name]["hit_rate_ok"] = all(v >= MIN_HIT_RATE
                                                   for v in details[row.name]["hit_rate_min"].values())
    return table, details


def _install_fields(run: Optional[dict]) -> Dict[str, str]:
    line = (run or {}).get("canary_installed_line") or ""
    return dict(item.split("=", 1) for item in line.split() if "=" in item and not item.startswith("["))


def memory_table(runs: Sequence[dict]) -> Optional[dict]:
    """Canary device bytes vs KV pool bytes: this run (from the install line), and computed for longer contexts.

    One set of cases per canary setting the run's ``ours`` servers logged (real data, scrub, HiCache, sweep: what
    sizes the canary's buffers), each computed with that setting's buffers (``all``: the full-row state too); this
    run's case uses the line's own ``max_tokens_per_forward``, so it equals the line's ``canary_bytes``."""
    seen: Dict[MemorySetting, Dict[str, str]] = {}
    for r in runs:
        f = _install_fields(r) if r["role"] == "ours" else {}
        if "canary_bytes" in f:
            seen.setdefault(_memory_setting(f), f)
    if not seen:
        return None
    table = []
    for setting, f in seen.items():
        table += _memory_cases(f, setting, f" ({setting.described})" if len(seen) > 1 else "")
    first = next(iter(seen.values()))
    reserved = first.get("reserved_before_kv_pool", "none")
    return {"logged_canary_bytes": int(first["canary_bytes"]), "cases": table,
            "logged_by_setting": {k.described: int(f["canary_bytes"]) for k, f in seen.items()},
            "reserved_before_kv_pool": int(reserved) if reserved.isdigit() else None}


@dataclass(frozen=True)
class MemorySetting:
    """What sizes a server's canary buffers besides the pool, as its install line logged it."""

    described: str
    full_row: bool
    first_read: bool
    hicache: bool
    sweep: bool


def _memory_setting(f: Dict[str, str]) -> MemorySetting:
    """The install line's setting; which buffers it holds is ``CanaryConfig``'s own rule (``full_row_hash``,
    ``first_read``)."""
    real_data, scrub = f.get("real_data", "partial"), int(f.get("scrub_slots_per_forward", "0"))
    hicache, sweep = f.get("hicache") == "1", int(f.get("sweep_interval", "0")) > 0
    config = CanaryConfig.build(mode=f.get("mode", "raise"), real_data=real_data, hicache=hicache,
                                environ={ENV_PREFIX + "SCRUB_SLOTS_PER_FORWARD": str(scrub)})
    described = f"real data {real_data}" + (f", scrub {scrub}" if scrub else "") + (", HiCache" if hicache else "") \
        + (", sweep" if sweep else "")
    return MemorySetting(described, config.full_row_hash, config.first_read, config.hicache, sweep)


def _memory_cases(f: Dict[str, str], setting: MemorySetting, suffix: str) -> List[dict]:
    slots, rows, ctx = int(f["slots"]), int(f["req_rows"]), int(f["max_context_len"])
    kv = int(f["kv_pool_bytes"])
    common = dict(num_slots=slots, num_groups=len(f["groups"].split(",")),
                  ring_capacity=int(f["ring_capacity"]), token_oracle=f.get("token_oracle", "1") == "1",
                  max_batch_size=int(f["max_batch_size"]), sweep=setting.sweep, full_row=setting.full_row,
                  first_read=setting.first_read, hicache=setting.hicache)
    this_tokens = int(f.get("max_tokens_per_forward", "0"))
    cases = [("this run", rows, ctx, this_tokens)] + [(f"context {c}", rows, c, 0) for c in MEMORY_CONTEXT_LENS] + [
        (f"context {c}, {DEFAULT_REQ_ROWS} request rows", DEFAULT_REQ_ROWS, c, 0) for c in MEMORY_CONTEXT_LENS]
    table = []
    for label, r, c, tokens in cases:
        m = canary_memory_bytes(req_rows=r, context_len=c, max_tokens_per_forward=tokens, **common)
        table.append({"case": label + suffix, "slots": slots, "req_rows": r, "context_len": c, "kv_pool_bytes": kv,
                      "canary_bytes": m.total, "canary_pct_of_kv_pool": round(m.pct_of(kv), 3),
                      "breakdown": asdict(m)})
    return table


def storm_summary(runs: Sequence[dict]) -> Optional[dict]:
    """Log mode under one persistent corruption of a shared-prefix slot, against the clean ours/off servers."""
    storm = next((r for r in runs if r["role"] == "storm"), None)
    if storm is None:
        return None
    row = "shared_prefix"
    ours, off = _first(runs, "ours", row), _first(runs, "off", row)
    st = storm.get("canary_stats_last") or {}
    logged = storm.get("violations_logged") or []
    keys = [tuple(v.get(k) for k in ("kind", "group", "slot", "position", "stored", "expected")) for v in logged]
    pert = storm.get("perturbations") or []
    prefix_len = ROWS[row].shared_prefix_len
    return {
        "storm_s": _median(storm, row),
        "clean_ours_s": _median(ours, row),
        "off_s": _median(off, row),
        "storm_vs_clean_ours_pct": pct(_median(storm, row), _median(ours, row)),
        "storm_vs_off_pct": pct(_median(storm, row), _median(off, row)),
        "injections": len(pert),
        "injected_position": int(pert[0]["position"]) if pert else None,
        "injected_in_shared_prefix": bool(pert) and int(pert[0]["position"]) < prefix_len,
        "violation_rows_on_device": int(st.get("violations", 0) or 0),
        "violations_repeated": int(st.get("violations_repeated", 0) or 0),
        "violation_lines": storm.get("violation_lines"),
        "distinct_violations_logged_once": len(keys) == len(set(keys)),
        "error": storm.get("error"),
    }


def markdown_table(runs: Sequence[dict], rows: Sequence[Row]) -> str:
    """Per row and server: median seconds (a quick look; docs tables come from benchmarks/overhead_report.py)."""
    labels = [r["label"] for r in runs]
    head = ["row", "shape"] + [f"{lb} s" for lb in labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.name, row.describe()]
        for r in runs:
            m = _median(r, row.name)
            cells.append("" if m is None else f"{m:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

def write_results(report: dict, out_path: Path, results_dir: Path) -> None:
    out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    results_dir.mkdir(parents=True, exist_ok=True)
    overhead = {"device": report["host"].get("device_name"), "date": report["date"][:10],
                "command": report["command"],
                "stacks": {role: sorted({r["stack"] for r in report["runs"] if r["role"] == role})
                           for role in ("off", "ours", "upstream")},
                "rows": report["overhead_rows"]}
    (results_dir / "overhead.json").write_text(json.dumps(overhead, indent=2) + "\n")
    extra = {k: report.get(k) for k in ("host", "date", "reps", "warmup_reps", "scale", "max_total_tokens",
                                        "configs", "row_details", "memory", "storm", "elapsed_s")}
    extra["servers"] = [{k: r.get(k) for k in ("label", "describe", "startup_s", "error", "canary_installed_line",
                                               "canary_stats_last", "violation_lines", "upstream_canary_lines",
                                               "kv_cache_allocated", "decode_log_lines_cuda_graph")}
                        for r in report["runs"]]
    (results_dir / "overhead_extra.json").write_text(json.dumps(extra, indent=2, default=str) + "\n")
