#!/usr/bin/env python3
"""sglang's own decode lines of a server log, as windows of time: where a row's difference sits.

With ``--decode-log-interval N`` sglang logs ``gen throughput (token/s)`` every N decode steps: the tokens of
those steps over the time since the last line. Each line is a window of ``interval x running requests /
throughput`` seconds. Windows of decode steps alone are short; a window that spans a batch boundary also holds the
client's round trip, the next prefill (and its load from the host tier) and is longer. Split by length
(``--boundary-ms``, ``--fresh-ms``), the medians say what a decode step costs and what a boundary costs, per
server, over every timed repetition (a profile covers two batches, one server at a time):

    python3 scripts/decode_windows.py logs/hc_off1.log logs/hc_ours1.log [--interval 8]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Dict, List

LINE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([0-9.]+)")


def windows(text: str, interval: int) -> List[float]:
    """Each decode line's window, in ms (lines with a throughput of 0 are skipped)."""
    out = []
    for m in LINE.finditer(text):
        running, tput = int(m.group(1)), float(m.group(2))
        if tput > 0:
            out.append(1e3 * interval * running / tput)
    return out


def split(ms: List[float], boundary_ms: float, fresh_ms: float) -> Dict[str, dict]:
    """Median and count of the decode-only windows (< ``boundary_ms``), the boundary windows with a load-back or
    a cached prefix (< ``fresh_ms``) and those with a fresh prefill."""
    groups = {"decode": [x for x in ms if x < boundary_ms],
              "boundary": [x for x in ms if boundary_ms <= x < fresh_ms],
              "fresh_boundary": [x for x in ms if x >= fresh_ms]}
    return {k: {"n": len(v), "median_ms": round(statistics.median(v), 2) if v else None} for k, v in groups.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--interval", type=int, default=8, help="the servers' --decode-log-interval")
    p.add_argument("--boundary-ms", type=float, default=60.0, help="windows this long or longer span a boundary")
    p.add_argument("--fresh-ms", type=float, default=150.0, help="boundary windows this long or longer hold a "
                                                                 "fresh prefill (the HiCache row's turn 0)")
    args = p.parse_args(argv)
    for log in args.logs:
        print(f"{log.name}: " + json.dumps(split(windows(log.read_text(errors="replace"), args.interval),
                                                 args.boundary_ms, args.fresh_ms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
