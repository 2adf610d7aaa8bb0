"""CPU time per thread of one server's processes (Linux ``/proc``, no dependency): which threads burn the host's
CPU while a benchmark runs (a busy thread beside the scheduler's slows it on a shared core), how often the
scheduler thread was preempted (``nonvoluntary_ctxt_switches``), gave up its CPU (``voluntary_ctxt_switches``) and
moved to another CPU (``se.nr_migrations`` in ``sched``: a move leaves its caches behind), and where it last ran.

``snapshot(session_id)`` reads every thread of the processes in that session (``SglangServer`` starts its server
in a new session: the launcher's pid); ``busiest(before, after)`` the threads' CPU seconds and preemptions between
two snapshots, busiest first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(text: str) -> List[str]:
    """/proc/.../stat's fields after the ``(comm)`` one (which may hold spaces): fields[0] is the state."""
    return text[text.rindex(")") + 2:].split()


def _counts(text: str, sep: str) -> Dict[str, int]:
    """The integer fields of a ``name<sep> value`` file (``status``, ``sched``)."""
    out: Dict[str, int] = {}
    for line in text.splitlines():
        name, found, value = line.partition(sep)
        if found:
            try:
                out[name.strip()] = int(value.strip())
            except ValueError:
                continue
    return out


def snapshot(session_id: int) -> Dict[str, dict]:
    """``"pid/tid"`` -> {process, thread, cpu_s, preempted, voluntary, migrations, cpu} for every thread of session
    ``session_id`` (``cpu``: the CPU it last ran on)."""
    out: Dict[str, dict] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = _stat_fields((proc / "stat").read_text())
            if int(fields[3]) != session_id:  # field 6 of stat: the session id
                continue
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[-60:]
            for task in (proc / "task").iterdir():
                tf = _stat_fields((task / "stat").read_text())
                status = _counts((task / "status").read_text(), ":")
                try:
                    sched = _counts((task / "sched").read_text(), ":")
                except OSError:  # a kernel without CONFIG_SCHED_DEBUG
                    sched = {}
                out[f"{proc.name}/{task.name}"] = {
                    "process": title, "thread": (task / "comm").read_text().strip(),
                    "cpu_s": (int(tf[11]) + int(tf[12])) / TICKS,
                    "preempted": status.get("nonvoluntary_ctxt_switches", 0),
                    "voluntary": status.get("voluntary_ctxt_switches", 0),
                    "migrations": sched.get("se.nr_migrations", 0), "cpu": int(tf[36])}
        except (OSError, ValueError, IndexError):
            continue  # a process or thread that ended while read
    return out


def busiest(before: Dict[str, dict], after: Dict[str, dict], top: int = 12) -> List[dict]:
    """The ``top`` threads by CPU seconds between two snapshots (threads started in between count from 0)."""
    rows = []
    for key, now in after.items():
        then = before.get(key, {})
        rows.append({"id": key, "process": now["process"], "thread": now["thread"],
                     "cpu_s": round(now["cpu_s"] - then.get("cpu_s", 0.0), 2),
                     **{k: now.get(k, 0) - then.get(k, 0) for k in ("preempted", "voluntary", "migrations")},
                     "cpu": now.get("cpu")})
    return sorted(rows, key=lambda r: -r["cpu_s"])[:top]
