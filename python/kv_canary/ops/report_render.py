"""Renderings of ``kv-canary report``'s data (``report.summarize``): plain text, JSON, HTML with an SVG timeline
of injections, violations (by kind) and contained requests per forward. No dependencies beyond the stdlib."""

from __future__ import annotations

import html
import json
from typing import Dict, List


def _span(forwards: List[int]) -> str:
    if not forwards:
        return "-"
    lo, hi = min(forwards), max(forwards)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _few(items, n: int = 6) -> str:
    items = list(items)
    return ",".join(map(str, items[:n])) + (f",... ({len(items)})" if len(items) > n else "")


def to_text(d: Dict) -> str:
    out = [f"kv-canary report: {len(d['logs'])} log(s)"]
    for log in d["logs"]:
        out.append(f"  {log['path']}: {log['impl'] or '?'} on sglang {log['sglang'] or '?'}, mode={log['mode']}, "
                   f"tp_rank={log['tp_rank'] or '?'}, {log['canary_lines']} canary lines"
                   + (", stopped by CanaryViolationError (raise): totals as of its last stats line" if log["stopped"]
                      else "" if log["settled"] else ", not settled"))
    n, hidden = d["violations_logged"], d["violations_not_itemized"]
    out.append("")
    out.append(f"Violations: {n} logged" + (f", {hidden} more not itemized" if hidden else "")
               + (" -- none: the canary found the KV cache intact" if not n and not hidden else ""))
    if d["violations_repeated"]:
        out.append(f"  + {d['violations_repeated']} repeat reads of logged bad slots, counted and not itemized "
                   f"(violations_repeated): readers other than those below are not named in the log")
    for kind, k in d["by_kind"].items():
        out.append(f"  {kind}: {k['logged']} logged, slots {_few(k['slots'])}, forwards {_span(k['forwards'])}, "
                   f"requests {_few(k['rids'], 4)}")
    if d["requests"]:
        out.append("")
        out.append(f"Requests that read bad KV: {len(d['requests'])}")
        for r in d["requests"]:
            seen = (f"kind={'+'.join(r['kinds'])} slots={_few(r['slots'])} forwards={_span(r['forwards'])}"
                    if r["kinds"] else "(contained for a repeat read of a bad slot; no itemized line)")
            out.append(f"  {r['rid']}: {seen} -> {r['fate']}")
    if d["slots"]:
        out.append("")
        out.append(f"Slots involved: {len(d['slots'])}")
        for key, s in d["slots"].items():
            ev = s["evicted"]
            out.append(f"  {key}: kind={'+'.join(s['kinds'])} positions={_few(s['positions'])} "
                       f"forwards={_span(s['forwards'])} read by {_few(s['readers'], 3)}"
                       + (f"; evicted by contain (nodes={ev['nodes']} tokens={ev['tokens']})" if ev else ""))
    if d["injections"]:
        out.append("")
        out.append(f"Injections (SGLANG_KV_CANARY_PERTURB_*): {len(d['injections'])}")
        for p in d["injections"]:
            where = " ".join(f"{k}={p[k]}" for k in ("layer", "half", "byte", "position", "rid") if k in p)
            seen = (f"explains violation(s) {_few(p['explains'])}, first at forward {p['first_detected_forward']}"
                    if p["explains"] else "no violation names it (not read again, or not detectable)")
            out.append(f"  forward {p['forward']}: {p['mode']} {p['group']}/{p['slot']} {where} -> {seen}")
        un = d["unexplained_violations"]
        out.append(f"  violations no injection explains: {_few(un) if un else 'none'}")
    for e in d["engine_errors"]:
        out.append(f"Engine error at forward {e['kv_canary_engine_error']}: "
                   + " ".join(f"{k}={v}" for k, v in e.items() if k not in ("kv_canary_engine_error", "log")))
    if d["totals"]:
        out.append("")
        out.append("Stats (each log's last kv_canary_stats= line):")
        for where, t in d["totals"].items():
            out.append(f"  {where}: " + " ".join(f"{k}={v}" for k, v in t.items()))
    if d["warnings"]:
        out.append("")
        out.append("Warnings:")
        out.extend(f"  {w}" for w in d["warnings"])
    return "\n".join(out) + "\n"


def to_json(d: Dict) -> str:
    return json.dumps(d, indent=2, sort_keys=False)


COLORS = ["#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def timeline_svg(d: Dict, width: int = 900) -> str:
    """Injections, violations (one row per kind) and contained requests against the forward index."""
    kinds = list(d["by_kind"])
    rows = ["injections", *kinds, "contained"]
    points = [(int(p["forward"]), "injections", f"{p['mode']} {p['group']}/{p['slot']}") for p in d["injections"]]
    points += [(int(v["forward"]), v["kind"], f"violation {v['kv_canary_violation']} {v['kind']} "
                f"{v['group']}/{v['slot']} rid={v['rid']}") for v in d["violations"]]
    points += [(int(c["after_forward"]), "contained", f"{c['kv_canary_contain']} "
                + " ".join(f"{k}={c[k]}" for k in ("rid", "state", "slot", "tokens") if k in c))
               for c in d["contains"] if int(c.get("after_forward", -1)) >= 0]
    last = max([f for f, _, _ in points] + [t.get("forwards_host", 0) for t in d["totals"].values()] + [1])
    left, top, row_h = 150, 20, 28
    height = top + row_h * len(rows) + 40
    x = lambda f: round(left + (width - left - 20) * f / last, 1)  # noqa: E731
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">']
    for i, row in enumerate(rows):
        y = top + row_h * i + row_h / 2
        svg.append(f'<text x="{left - 8}" y="{y + 4}" text-anchor="end">{html.escape(row)}</text>'
                   f'<line x1="{left}" y1="{y}" x2="{width - 20}" y2="{y}" stroke="#ddd"/>')
    for forward, row, title in points:
        y = top + row_h * rows.index(row) + row_h / 2
        cx = x(forward)
        tip = f"<title>forward {forward}: {html.escape(title)}</title>"
        if row == "injections":
            svg.append(f'<path d="M{cx - 5},{y - 5} L{cx + 5},{y + 5} M{cx - 5},{y + 5} L{cx + 5},{y - 5}" '
                       f'stroke="#ff7f0e" stroke-width="2">{tip}</path>')
        elif row == "contained":
            svg.append(f'<polygon points="{cx},{y - 6} {cx - 6},{y + 5} {cx + 6},{y + 5}" fill="#1f77b4" '
                       f'fill-opacity="0.7">{tip}</polygon>')
        else:
            color = COLORS[kinds.index(row) % len(COLORS)]
            svg.append(f'<circle cx="{cx}" cy="{y}" r="5" fill="{color}" fill-opacity="0.7">{tip}</circle>')
    axis_y = top + row_h * len(rows) + 5
    svg.append(f'<line x1="{left}" y1="{axis_y}" x2="{width - 20}" y2="{axis_y}" stroke="#333"/>')
    for k in range(6):
        f = round(last * k / 5)
        svg.append(f'<text x="{x(f)}" y="{axis_y + 16}" text-anchor="middle">{f}</text>')
    svg.append(f'<text x="{(left + width) / 2}" y="{axis_y + 32}" text-anchor="middle">forward</text></svg>')
    return "".join(svg)


def to_html(d: Dict) -> str:
    esc = html.escape
    body = ["<!doctype html><html><head><meta charset='utf-8'><title>kv-canary report</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 6px;font-size:13px}pre{background:#f6f6f6;padding:1em}</style></head><body>",
            "<h1>kv-canary report</h1>", "<h2>Timeline</h2>", timeline_svg(d),
            "<p>Orange crosses: injections; circles: violations (one row per kind); triangles: contain actions "
            "(placed at the newest violation forward logged before them).</p>"]
    if d["violations"]:
        cols = ["kv_canary_violation", "kind", "group", "slot", "position", "rid", "forward", "log"]
        body.append("<h2>Violations</h2><table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        body += ["<tr>" + "".join(f"<td>{esc(str(v.get(c, '')))}</td>" for c in cols) + "</tr>"
                 for v in d["violations"]]
        body.append("</table>")
    body += ["<h2>Summary</h2>", f"<pre>{esc(to_text(d))}</pre>", "</body></html>"]
    return "\n".join(body) + "\n"
