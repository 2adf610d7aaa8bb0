"""``kv-canary report LOG [LOG ...]``: what the canary saw, from server logs, for the engineer on call.

Reads the canary's lines (``kv_canary.violations`` formats: ``kv_canary_installed=``, ``kv_canary_stats=``,
``kv_canary_violation=``, ``kv_canary_violation_summary=``, ``kv_canary_perturb=``, ``kv_canary_contain=``,
``kv_canary_engine_error=``) from one or more logs (TP ranks, PD sides) and summarizes: violations by kind, the
requests that read bad KV and what happened to them, the slots and forwards involved, the injections that explain
them, the stats totals. Text by default, ``--json``, ``--html FILE`` (with a timeline). Input it cannot use (no
canary line, a truncated log, lines of another version) is said in one message (exit 2) or a warning, never a
traceback. ``report_render`` renders; this module reads.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..violations import (CONTAIN_PREFIX, ENGINE_ERROR_PREFIX, INSTALLED_PREFIX, PERTURB_PREFIX, STATS_PREFIX,
                          SUMMARY_PREFIX, VIOLATION_PREFIX, parse_line)

PREFIXES = (INSTALLED_PREFIX, STATS_PREFIX, VIOLATION_PREFIX, SUMMARY_PREFIX, PERTURB_PREFIX, CONTAIN_PREFIX,
            ENGINE_ERROR_PREFIX)
# the fields each line must carry for the report to use it (a line without them: another version's, or cut off)
REQUIRED = {
    VIOLATION_PREFIX: ("kind", "group", "slot", "position", "rid", "forward"),
    PERTURB_PREFIX: ("group", "slot", "forward"),
    STATS_PREFIX: ("mode", "forwards_host", "slots_written", "slots_verified", "violations"),
    CONTAIN_PREFIX: (),
}
STAT_TOTALS = ("forwards_host", "slots_written", "slots_verified", "slots_witnessed", "sweeps", "slots_swept",
               "slots_scrubbed", "violations", "violations_repeated", "health_violations", "perturbations",
               "contained_requests")
IMPL = "sglang-kv-canary"
_ANY = re.compile(r"kv_canary_[a-z_]+=")


class ReportError(Exception):
    """Input the report cannot use at all (the message says why)."""


@dataclass
class Source:
    """One log: where its lines came from (``tp_rank`` from the lines' tag)."""

    path: str  # "FILE", or "FILE (run K, from line N)" where the log holds several server starts
    installed: Dict[str, str] = field(default_factory=dict)
    stats: List[Dict[str, str]] = field(default_factory=list)
    canary_lines: int = 0
    busy_at_end: bool = False  # canary lines after its last settled=1 stats line (the log ends mid-serving)
    stopped: bool = False  # raise: CanaryViolationError ended the server (its message repeats the lines)
    seen: set = field(default_factory=set)  # (seq, tp_rank) of the violation lines read


@dataclass
class Report:
    sources: List[Source]
    violations: List[Dict[str, str]]  # each with "log" (the source path) and "line"
    summaries: List[Dict[str, str]]
    injections: List[Dict[str, str]]
    contains: List[Dict[str, str]]  # each with "after_forward": the newest forward the log named before it
    engine_errors: List[Dict[str, str]]
    warnings: List[str]


def read_logs(paths: Sequence[str]) -> Report:
    """Parse every log; ReportError when none holds a usable canary line."""
    rep = Report([], [], [], [], [], [], [])
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as e:
            raise ReportError(f"{path}: cannot read it ({e.strerror or e})") from None
        _read_one(rep, path, text)
    if not any(s.canary_lines for s in rep.sources):
        raise ReportError(
            f"no kv-canary lines in {', '.join(paths)}: not an sglang server log with the canary on "
            f"(--kv-canary log|raise|contain writes kv_canary_installed=, kv_canary_stats=, ... lines), or the "
            f"server stopped before the canary was installed")
    return rep


def _read_one(rep: Report, path: str, text: str) -> None:
    """One log file: a new ``Source`` at each server start (``kv_canary_installed=``) after the first."""
    lines = text.splitlines()
    starts = [n for n, line in enumerate(lines, 1) if parse_line(line, INSTALLED_PREFIX) is not None]
    src = Source(path if len(starts) <= 1 else f"{path} (run 1, from line 1)")
    rep.sources.append(src)
    last_forward = -1
    for number, line in enumerate(lines, 1):
        if "CanaryViolationError" in line:
            src.stopped = True
        if "kv_canary_" not in line or not _ANY.search(line):
            continue
        if len(starts) > 1 and number in starts[1:]:  # the server restarted, appending to the same file
            _check_source(rep, src)
            src = Source(f"{path} (run {starts.index(number) + 1}, from line {number})")
            rep.sources.append(src)
            last_forward = -1
        for prefix in PREFIXES:
            rec = parse_line(line, prefix)
            if rec is None:
                continue
            missing = [k for k in REQUIRED.get(prefix, ()) if k not in rec]
            bad_int = [k for k in ("slot", "forward", "position") if k in rec and not _is_int(rec[k])]
            if missing or bad_int:
                cut = number == len(lines) and not text.endswith("\n")
                rep.warnings.append(f"{path}:{number}: {prefix}= line " + (
                    "cut off at the end of the log (truncated?)" if cut else
                    f"without {', '.join(missing + bad_int)} (another version of the canary?)") + "; skipped")
                break
            if prefix == VIOLATION_PREFIX:  # raise repeats each line in its error (and tracebacks may twice)
                key = (rec[VIOLATION_PREFIX], rec.get("tp_rank"))
                if key in src.seen:
                    break
                src.seen.add(key)
            src.canary_lines += 1
            src.busy_at_end = not (prefix == STATS_PREFIX and rec.get("settled") == "1") and (
                src.busy_at_end or prefix not in (INSTALLED_PREFIX, STATS_PREFIX))
            rec = {**rec, "log": src.path, "line": str(number)}
            if prefix == INSTALLED_PREFIX:
                src.installed = rec
            elif prefix == STATS_PREFIX:
                src.stats.append(rec)
            elif prefix == VIOLATION_PREFIX:
                rep.violations.append(rec)
                last_forward = max(last_forward, int(rec["forward"]))
            elif prefix == SUMMARY_PREFIX:
                rep.summaries.append(rec)
            elif prefix == PERTURB_PREFIX:
                rep.injections.append(rec)
            elif prefix == CONTAIN_PREFIX:
                rep.contains.append({**rec, "after_forward": str(last_forward)})
            else:
                rep.engine_errors.append(rec)
            break
    _check_source(rep, src)


def _check_source(rep: Report, src: Source) -> None:
    path = src.path
    if not src.canary_lines:
        rep.warnings.append(f"{path}: no kv-canary lines (not a canary server's log, or the canary was off)")
        return
    impl = src.installed.get("impl")
    if not src.installed:
        rep.warnings.append(f"{path}: no kv_canary_installed= line (the log starts after startup?)")
    elif impl != IMPL:
        rep.warnings.append(f"{path}: written by impl={impl or 'unknown'} (sglang's in-tree canary or an older "
                            f"plugin), not {IMPL}: fields may differ")
    if not src.stats:
        rep.warnings.append(f"{path}: no kv_canary_stats= line (stats off, or the log ends early): no totals")
    elif (src.busy_at_end or src.stats[-1].get("settled") != "1") and src.stats[-1]["mode"] != "raise" and not any(
            e["log"] == path for e in rep.engine_errors):
        rep.warnings.append(f"{path}: canary lines after the last settled=1 kv_canary_stats= line: the log ends "
                            f"while the server was serving (truncated, still running, or killed); totals are as of "
                            f"the last stats line")


def _is_int(value: str) -> bool:
    return bool(re.fullmatch(r"-?\d+", value))


def explains(injection: Dict[str, str], violation: Dict[str, str]) -> bool:
    """Does this injection account for this violation (same log's rank)?"""
    if (injection.get("tp_rank"), injection["log"]) != (violation.get("tp_rank"), violation["log"]):
        return False
    if injection.get("kv_canary_perturb") == "req_to_token":  # the redirected read and its successor's link
        return (violation["rid"] == injection.get("rid") and violation["forward"] == injection["forward"]
                and int(violation["position"]) - int(injection.get("position", "-9")) in (0, 1))
    return ((violation["group"], violation["slot"]) == (injection["group"], injection["slot"])
            and int(violation["forward"]) >= int(injection["forward"]))


def summarize(rep: Report) -> Dict:
    """The report as plain data (the JSON output; the text and HTML render it)."""
    multi = len(rep.sources) > 1
    where = lambda r: f'{r["group"]}/{r["slot"]}' + (f' [{r["log"]}]' if multi else "")  # noqa: E731
    kinds: Dict[str, Dict] = {}
    for v in rep.violations:
        k = kinds.setdefault(v["kind"], {"logged": 0, "slots": set(), "forwards": set(), "rids": set()})
        k["logged"] += 1
        k["slots"].add(where(v))
        k["forwards"].add(int(v["forward"]))
        k["rids"].add(v["rid"])
    outcome = {}
    for c in rep.contains:
        if c[CONTAIN_PREFIX] == "abort" and "rid" in c:
            outcome[c["rid"]] = {"aborted": "aborted by contain", "finished": "finished before the abort landed "
                                 "(within the detection delay)", "gone": "gone before the abort landed"}.get(
                                     c.get("state", ""), c.get("state", "?"))
    modes = sorted({s.stats[-1]["mode"] for s in rep.sources if s.stats} |
                   {s.installed.get("mode") for s in rep.sources if s.installed.get("mode")})
    default_fate = ("served on (log mode: nothing was stopped)" if modes == ["log"] else
                    "the server stopped (raise)" if modes == ["raise"] else "no contain line for it")
    requests: Dict[str, Dict] = {}
    for v in rep.violations:
        if v["rid"] in ("cache", "scrub", "host_scrub", "?", "health"):
            continue
        r = requests.setdefault(v["rid"], {"rid": v["rid"], "kinds": set(), "slots": set(), "forwards": set()})
        r["kinds"].add(v["kind"])
        r["slots"].add(where(v))
        r["forwards"].add(int(v["forward"]))
    for rid in outcome:  # contained for a repeat row (not itemized in the log) of a bad slot it read
        requests.setdefault(rid, {"rid": rid, "kinds": set(), "slots": set(), "forwards": set()})
    for r in requests.values():
        r["fate"] = outcome.get(r["rid"], default_fate)
    slots: Dict[str, Dict] = {}
    for v in rep.violations:
        s = slots.setdefault(where(v), {"kinds": set(), "forwards": set(), "positions": set(),
                                                             "readers": set(), "evicted": None})
        s["kinds"].add(v["kind"])
        s["forwards"].add(int(v["forward"]))
        s["positions"].add(int(v["position"]))
        s["readers"].add(v["rid"])
    for c in rep.contains:
        if c[CONTAIN_PREFIX] == "evict" and "slot" in c:
            for v in rep.violations:
                if (v["slot"], v["log"]) == (c["slot"], c["log"]):
                    slots[where(v)]["evicted"] = {"nodes": c.get("nodes"), "tokens": c.get("tokens")}
    injections = []
    for p in rep.injections:
        hits = [v for v in rep.violations if explains(p, v)]
        injections.append({**{k: p[k] for k in p if k not in ("line",)}, "mode": p[PERTURB_PREFIX],
                           "explains": [v[VIOLATION_PREFIX] for v in hits],
                           "first_detected_forward": min((int(v["forward"]) for v in hits), default=None)})
    unexplained = [v for v in rep.violations if rep.injections and not any(explains(p, v) for p in rep.injections)]
    totals = {}
    for s in rep.sources:
        if s.stats:
            last = s.stats[-1]
            totals[f'{s.path} tp_rank={last.get("tp_rank", "0")}'] = {k: int(last[k]) for k in STAT_TOTALS
                                                                      if _is_int(last.get(k, ""))}
    plain = lambda d: {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}  # noqa: E731
    return {
        "logs": [{"path": s.path, "sglang": s.installed.get("sglang"), "impl": s.installed.get("impl"),
                  "mode": (s.stats[-1]["mode"] if s.stats else s.installed.get("mode")),
                  "tp_rank": s.installed.get("tp_rank"), "canary_lines": s.canary_lines,
                  "settled": bool(s.stats) and s.stats[-1].get("settled") == "1", "stopped": s.stopped}
                 for s in rep.sources],
        "modes": modes,
        "violations_logged": len(rep.violations),
        "violations_not_itemized": sum(int(x.get("not_itemized", "0")) for x in rep.summaries if
                                       _is_int(x.get("not_itemized", ""))),
        "violations_repeated": sum(t.get("violations_repeated", 0) for t in totals.values()),
        "by_kind": {k: plain(v) for k, v in sorted(kinds.items())},
        "requests": [plain(r) for r in sorted(requests.values(), key=lambda r: (min(r["forwards"], default=1 << 62),
                                                                               r["rid"]))],
        "slots": {k: plain(v) for k, v in sorted(slots.items(), key=lambda kv: min(kv[1]["forwards"]))},
        "injections": injections,
        "unexplained_violations": [v[VIOLATION_PREFIX] for v in unexplained],
        "contains": [{k: c[k] for k in c if k != "line"} for c in rep.contains],
        "engine_errors": [{k: e[k] for k in e if k != "line"} for e in rep.engine_errors],
        "totals": totals,
        "violations": [{k: v[k] for k in v if k != "line"} for v in rep.violations],
        "warnings": rep.warnings,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-canary", description="sglang-kv-canary tools")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("report", help="summarize what the canary saw in server logs",
                        description=__doc__.split("\n\n")[0])
    rp.add_argument("logs", nargs="+", help="sglang server log(s): one per TP rank or PD side")
    out = rp.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    out.add_argument("--html", metavar="FILE", help="write an HTML report with a timeline to FILE")
    args = parser.parse_args(argv)
    from . import report_render

    try:
        data = summarize(read_logs(args.logs))
    except ReportError as e:
        print(f"kv-canary report: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(report_render.to_json(data))
    elif args.html:
        try:
            Path(args.html).write_text(report_render.to_html(data))
        except OSError as e:
            print(f"kv-canary report: cannot write {args.html} ({e.strerror or e})", file=sys.stderr)
            return 2
        print(f"kv-canary report: wrote {args.html}")
    else:
        print(report_render.to_text(data), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
