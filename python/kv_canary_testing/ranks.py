"""What the e2e tests of several scheduler ranks (tensor parallel, data parallel) read from one server log.

Every canary line of a rank carries its rank (``tp_rank=`` / ``dp_rank=``): lines are grouped by it, a test waits
until every rank's last stats line says ``settled=1``, and the retries of the requests ``contain`` aborted must be
computed fresh.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import requests

from kv_canary.violations import STATS_PREFIX, parse_lines


def cpu_tp_env() -> Dict[str, str]:
    """A CPU-only host's ``--tp-size 2`` setting: the cores split over the two ranks (sglang binds one rank per NUMA
    node otherwise), and no NCCL library (the CUDA build of torch in the test venv ships one, and sglang's PyNccl
    communicator would take it and ask for a CUDA device)."""
    import os

    half = max(2, os.cpu_count() or 2) // 2
    return {"SGLANG_CPU_OMP_THREADS_BIND": f"0-{half - 1}|{half}-{2 * half - 1}",
            "SGLANG_NCCL_SO_PATH": "/nonexistent/kv-canary-cpu-tp/libnccl.so.2"}


def by_rank(lines: Sequence[dict], key: str) -> Dict[str, List[dict]]:
    """{rank: its lines}: ``key`` is ``tp_rank`` or ``dp_rank``."""
    out: Dict[str, List[dict]] = {}
    for line in lines:
        out.setdefault(line.get(key), []).append(line)
    return out


def settled_by_rank(srv, ranks: Sequence[str], key: str, timeout: float = 60.0) -> Tuple[str, Dict[str, List[dict]]]:
    """(the log, its stats lines by rank) once every rank's last stats line says ``settled=1`` (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = srv.log_text()
        stats = by_rank(parse_lines(text, STATS_PREFIX), key)
        if all(stats.get(r) and stats[r][-1].get("settled") == "1" for r in ranks) or time.monotonic() > deadline:
            return text, stats
        time.sleep(0.5)


def retry_aborted(srv, specs, failed) -> None:
    """Send each aborted request's prompt again (greedy, 8 tokens): each must be served to its length."""
    by_index = {s.index: s for s in specs}
    for o in failed:
        r = requests.post(srv.base_url + "/generate", timeout=300, json={
            "text": by_index[o.index].text(), "rid": f"retry-{o.rid}",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})
        r.raise_for_status()
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
