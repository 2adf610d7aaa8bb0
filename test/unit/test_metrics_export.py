"""``adapter/metrics.CanaryMetrics``: the canary's counters go to prometheus at most every ``EXPORT_INTERVAL_S`` while
serving (sglang calls the export every scheduler step; each multiprocess ``inc`` writes a file), and exactly when
forced (the idle hook): nothing is lost, only delayed."""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from kv_canary.adapter.metrics import EXPORT_INTERVAL_S, CanaryMetrics  # noqa: E402


class FakeManager:
    def __init__(self):
        self.forwards = 0
        self.violations_by_kind = {}

    def metrics_snapshot(self):
        return {"forwards": self.forwards, "slots_verified": 10 * self.forwards}


def _value(registry, name):
    return registry.get_sample_value(f"sglang:kv_canary_{name}_total", {"model_name": "m"})


def test_exports_at_most_every_interval_and_exactly_when_forced():
    now = [100.0]
    registry = prometheus_client.CollectorRegistry()
    metrics = CanaryMetrics({"model_name": "m"}, clock=lambda: now[0], registry=registry)
    m = FakeManager()
    m.forwards = 5
    metrics.update(m)  # the first step exports
    assert _value(registry, "forwards") == 5 and _value(registry, "slots_verified") == 50
    m.forwards = 9
    now[0] += EXPORT_INTERVAL_S / 2
    metrics.update(m)  # within the interval: skipped
    assert _value(registry, "forwards") == 5
    metrics.update(m, force=True)  # idle: now, whatever the interval
    assert _value(registry, "forwards") == 9 and _value(registry, "slots_verified") == 90
    m.forwards = 12
    m.violations_by_kind = {"kv_hash": 2}
    now[0] += EXPORT_INTERVAL_S / 2
    metrics.update(m)  # the interval since the forced export has not passed
    assert _value(registry, "forwards") == 9
    now[0] += EXPORT_INTERVAL_S
    metrics.update(m)
    assert _value(registry, "forwards") == 12
    assert registry.get_sample_value("sglang:kv_canary_violations_total", {"model_name": "m", "kind": "kv_hash"}) == 2


@pytest.mark.parametrize("line", ["v0_5_12", "v0_5_23"])
def test_idle_drain_runs_before_sglangs_idle_sleep(line):
    """``Scheduler.on_idle`` ends in sglang's idle sleep (``--sleep-on-idle``: up to a second, or until a request
    arrives): the line's idle hook, wrapped the way sglang's hook registry wraps it, drains the counter copies and
    exports the metrics before that body runs, not after it."""
    import importlib
    from types import SimpleNamespace

    hook_registry = pytest.importorskip("sglang.srt.plugins.hook_registry")
    HookType, _wrap_fn = hook_registry.HookType, hook_registry._wrap_fn

    from kv_canary.sglang_plugin import resolve_hook

    events = []

    class Manager:
        init_finished = True

        def poll(self, *, drain=False):
            events.append(("drain", drain))

    class Metrics:
        def update(self, manager, containment=None, *, force=False):
            events.append(("export", force))

    class Scheduler:
        def on_idle(self):
            events.append(("sleep", None))

    runner = SimpleNamespace(canary_manager=Manager(), is_draft_worker=False)
    scheduler = Scheduler()
    scheduler.tp_worker = SimpleNamespace(model_runner=runner)
    scheduler.kv_canary_metrics = Metrics()
    hooks = importlib.import_module(f"kv_canary.adapter.lines.{line}").HOOKS
    name, kind = hooks["sglang.srt.managers.scheduler.Scheduler.on_idle"]
    _wrap_fn(Scheduler.on_idle, resolve_hook(name), HookType(kind))(scheduler)
    assert events == [("drain", True), ("export", True), ("sleep", None)]
