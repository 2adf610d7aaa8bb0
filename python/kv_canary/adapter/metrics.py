"""Prometheus export of the canary's counters through sglang's own metrics machinery (``--enable-metrics``).

sglang's scheduler creates its ``SchedulerMetricsCollector`` with labels
(``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ...) in prometheus
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher); the HTTP
server's ``/metrics`` aggregates every process's files. ``CanaryMetrics`` creates
its counters the same way, with the same labels, named ``sglang:kv_canary_*``
(exposed with prometheus' ``_total`` suffix), and ``update`` adds the increase
of each cumulative count since the last update (host integers only, no device
read: the device counters come from the canary's delayed copy).
"""

from __future__ import annotations

from typing import Dict

COUNTERS = {
    "forwards": "Forwards the canary bracketed (HEAD verify before, TAIL write after).",
    "slots_verified": "KV slots verified by HEAD before a forward read them.",
    "slots_written": "KV slots fingerprinted by TAIL after a forward wrote them.",
    "slots_swept": "KV slots held by the radix cache verified by the sweep.",
    "slots_witnessed": "KV slots whose every K/V row the write witness proved written by their forward.",
    "sweeps": "Radix-cache sweeps run.",
    "health_violations": "Times the canary found it did not run as launched (kind=health:*).",
    "perturbations": "Deliberate corruptions injected by SGLANG_KV_CANARY_PERTURB_*.",
    "contained_requests": "Requests aborted by --kv-canary contain.",
    "contain_evicted_tokens": "Radix-cache tokens evicted by --kv-canary contain.",
}


class CanaryMetrics:
    def __init__(self, labels: Dict[str, str]):
        from prometheus_client import Counter  # after sglang set PROMETHEUS_MULTIPROC_DIR

        self._labels = dict(labels)
        self._counters = {
            name: Counter(f"sglang:kv_canary_{name}", doc, labelnames=list(self._labels)).labels(**self._labels)
            for name, doc in COUNTERS.items()
        }
        self._violations = Counter("sglang:kv_canary_violations", "KV-cache violations found (every row, "
                                   "repeats included), by kind.", labelnames=[*self._labels, "kind"])
        self._exported: Dict[str, int] = {}

    def _add(self, key: str, value: int, counter) -> None:
        delta = value - self._exported.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._exported[key] = value

    def update(self, manager, containment=None) -> None:
        values = manager.metrics_snapshot()
        if containment is not None:
            values["contain_evicted_tokens"] = containment.evicted_tokens
        for name, value in values.items():
            if name in self._counters:
                self._add(name, value, self._counters[name])
        for kind, value in manager.violations_by_kind.items():
            self._add("kind:" + kind, value, self._violations.labels(**self._labels, kind=kind))
