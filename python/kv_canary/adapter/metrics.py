"""Prometheus export of the canary's counters through sglang's own metrics machinery (``--enable-metrics``).

sglang's scheduler creates its ``SchedulerMetricsCollector`` with labels
(``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ...) in prometheus
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher); the HTTP
server's ``/metrics`` aggregates every process's files. ``CanaryMetrics`` creates
its counters the same way, with the same labels, named ``sglang:kv_canary_*``
(exposed with prometheus' ``_total`` suffix), and ``update`` adds the increase
of each cumulative count since the last update (host integers only, no device
read: the device counters come from the canary's delayed copy).

Cost: sglang calls the export hook every scheduler step, and a multiprocess
counter's ``inc`` writes its mmap'd file (a few us each, several a step). While
serving, ``update`` exports at most every ``EXPORT_INTERVAL_S`` (the counters on
/metrics lag by at most that; a scrape every few seconds sees no difference); the
idle hook exports with ``force`` (exact once the scheduler is idle, e.g. when a
workload ends).
"""

from __future__ import annotations

import time
from typing import Callable, Dict

EXPORT_INTERVAL_S = 1.0

COUNTERS = {
    "forwards": "Forwards the canary bracketed (HEAD verify before, TAIL write after).",
    "slots_verified": "KV slots verified by HEAD before a forward read them.",
    "slots_written": "KV slots fingerprinted by TAIL after a forward wrote them.",
    "slots_swept": "KV slots held by the radix cache verified by the sweep.",
    "slots_witnessed": "KV slots whose every K/V row the write witness proved written by their forward.",
    "sweeps": "Radix-cache sweeps run.",
    "slots_scrubbed": "KV slots whose every K/V byte the scrub checked (SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD, "
                      "--kv-canary-real-data all).",
    "health_violations": "Times the canary found it did not run as launched (kind=health:*).",
    "perturbations": "Deliberate corruptions injected by SGLANG_KV_CANARY_PERTURB_*.",
    "contained_requests": "Requests aborted by --kv-canary contain.",
    "contain_evicted_tokens": "Radix-cache tokens evicted by --kv-canary contain.",
}


class CanaryMetrics:
    def __init__(self, labels: Dict[str, str], *, clock: Callable[[], float] = time.monotonic, registry=None):
        """``registry``: prometheus' default registry when None (a test passes its own)."""
        from prometheus_client import REGISTRY, Counter  # after sglang set PROMETHEUS_MULTIPROC_DIR

        reg = REGISTRY if registry is None else registry
        self._labels = dict(labels)
        self._counters = {
            name: Counter(f"sglang:kv_canary_{name}", doc, labelnames=list(self._labels),
                          registry=reg).labels(**self._labels)
            for name, doc in COUNTERS.items()
        }
        self._violations = Counter("sglang:kv_canary_violations", "KV-cache violations found (every row, "
                                   "repeats included), by kind.", labelnames=[*self._labels, "kind"], registry=reg)
        self._exported: Dict[str, int] = {}
        self._clock = clock
        self._last_export = float("-inf")

    def _add(self, key: str, value: int, counter) -> None:
        delta = value - self._exported.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._exported[key] = value

    def update(self, manager, containment=None, *, force: bool = False) -> None:
        """Export the increase since the last export: at most every ``EXPORT_INTERVAL_S``, or now with ``force``."""
        now = self._clock()
        if not force and now - self._last_export < EXPORT_INTERVAL_S:
            return
        self._last_export = now
        values = manager.metrics_snapshot()
        if containment is not None:
            values["contain_evicted_tokens"] = containment.evicted_tokens
        for name, value in values.items():
            if name in self._counters:
                self._add(name, value, self._counters[name])
        for kind, value in manager.violations_by_kind.items():
            self._add("kind:" + kind, value, self._violations.labels(**self._labels, kind=kind))
