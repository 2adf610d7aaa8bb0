"""The shipped alert rules and dashboard against a real Prometheus scraping a real sglang server.

One CPU server (``--kv-canary contain``, ``--enable-metrics``, the sweep on, a ``real_kv_used`` perturbation that
starts only after ``WARMUP`` forwards) and one ``prometheus`` process on loopback (scrape and rule evaluation every
second, the shipped ``kv_canary/ops/alerts.yml`` loaded, a temp config and TSDB):

* the clean run (a workload that ends before the perturbation's warmup, checked: no injection): every rule
  evaluates without error and no kv-canary alert was ever pending or firing (``ALERTS`` over the whole run);
* the perturbation run (the workload goes past the warmup: injections, violations, contained requests):
  ``KVCanaryViolation`` fires with the violation's ``kind`` and sglang's scheduler labels, the health, quiet and
  contained-rate alerts stay silent;
* every dashboard panel's query (``kv_canary.ops.dashboard_queries``) returns data from that Prometheus;
* ``kv-canary report`` on the server's log names every violation, injection and contained request (its text is
  printed: the CI log holds a real report).

Skips, saying why, where the ``prometheus`` binary is not installed (.ci/run installs Debian's package).
"""

from __future__ import annotations

import time

import pytest

from kv_canary.ops import ALERT_RULES, dashboard_queries
from kv_canary.ops.report import read_logs, summarize
from kv_canary.ops.report_render import to_text
from kv_canary.violations import CONTAIN_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci
from kv_canary_testing.prometheus import PrometheusServer, prometheus_missing_reason
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=90, suite="kv-canary-cpu")

WARMUP = 80  # forwards before the first injection: the clean run (and 0.5.23's startup forwards) stay below
ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.3",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": str(WARMUP),
    "SGLANG_KV_CANARY_PERTURB_SEED": "7",
    "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": "3",
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",  # inside the hashed window: every injection is detected
}
FORWARDS = 'sum({__name__=~"sglang[:_]kv_canary_forwards_total"})'  # either spelling (alerts.yml says why)
VIOLATIONS = 'sum({__name__=~"sglang[:_]kv_canary_violations_total"})'
ALERTS = ("KVCanaryViolation", "KVCanaryHealth", "KVCanaryQuiet", "KVCanaryContainedRequests")


def _settled_in_prometheus(prom: PrometheusServer, log: CanaryLog):
    """Prometheus has scraped the counters of this settled log (then waits two more rule evaluations)."""
    prom.wait_for(f"forwards_total == {log.last_stat('forwards_host')}",
                  lambda: prom.value(FORWARDS) == log.last_stat("forwards_host"))
    time.sleep(2.5)


@pytest.mark.e2e
def test_alerts_and_dashboard_against_a_real_prometheus(tmp_path):
    reason = prometheus_missing_reason()
    if reason:
        pytest.skip(reason)
    srv = canary_server("contain", log_path=tmp_path / "server.log", env=ENV,
                        extra_args=["--kv-canary-real-data", "partial", "--kv-canary-sweep-interval", "8",
                                    "--enable-metrics"])
    prom = PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{srv.port}"], [ALERT_RULES]).start()
    try:
        srv.start(timeout=600)
        # clean run: ends before the perturbation's warmup
        clean = run_requests(srv.base_url, build_workload(6, seed=41, n_aborts=0), concurrency=3, timeout=300)
        log = CanaryLog.read_settled(srv, canary_lines_only=True)  # scraped every second
        assert clean.failed == 0 and log.last_stat("perturbations") == 0 and not log.violations, log.text[-2000:]
        assert log.last_stat("forwards_host") < WARMUP, log.last_stat("forwards_host")
        _settled_in_prometheus(prom, log)
        rules = {r["name"]: r for r in prom.rules()}
        assert set(ALERTS) <= set(rules), sorted(rules)
        for name in ALERTS:  # loaded, evaluated, no evaluation error (e.g. a label-matching error on real series)
            assert rules[name]["health"] == "ok" and not rules[name].get("lastError"), rules[name]
        silent = prom.query('count_over_time(ALERTS{alertname=~"KVCanary.*"}[1h])')
        stored = sorted({r["metric"]["__name__"] for r in prom.query('{__name__=~"sglang[:_]kv_canary_forwards_total"}')})
        print(f"kv_canary_e2e_prometheus clean {clean.summary()} forwards={log.last_stat('forwards_host')} "
              f"alerts_ever={len(silent)} stored_as={stored}")
        assert silent == [], silent

        # perturbation run: past the warmup, the injections read and contained
        bad = run_requests(srv.base_url, build_workload(32, seed=42, n_aborts=0), concurrency=8, timeout=300)
        log = CanaryLog.read_settled(srv, canary_lines_only=True)  # scraped every second
        assert log.perturbations and log.violations, log.text[-3000:]
        _settled_in_prometheus(prom, log)
        kinds = {v["kind"] for v in log.violations}
        firing = prom.wait_for("KVCanaryViolation firing", lambda: [
            a for a in prom.alerts("KVCanaryViolation") if a["state"] == "firing"])
        others = [a for a in prom.alerts("KVCanary") if a["labels"]["alertname"] != "KVCanaryViolation"]
        print(f"kv_canary_e2e_prometheus perturbed {bad.summary()} injections={len(log.perturbations)} "
              f"violations={len(log.violations)} kinds={sorted(kinds)} "
              f"contained={log.last_stat('contained_requests')} firing={[a['labels'] for a in firing]}")
        assert {a["labels"]["kind"] for a in firing} == kinds
        for alert in firing:  # sglang's scheduler labels, the rule's severity and runbook
            assert alert["labels"]["tp_rank"] == "0" and alert["labels"]["severity"] == "page", alert
            assert alert["labels"]["model_name"] and alert["annotations"]["runbook_url"].startswith(
                "docs/operations.md#"), alert
        assert others == [], others  # 3 injections: under the contained-requests rate; health and quiet silent
        assert prom.value(VIOLATIONS) >= len(log.violations)

        # every dashboard panel's query returns data
        empty = []
        for title, expr in dashboard_queries(rate_interval="30s", range_="1h"):
            if not prom.query(expr):
                empty.append((title, expr))
        assert empty == [], empty

        # kv-canary report on the real log
        report = summarize(read_logs([str(srv.log_path)]))
        print(to_text(report))
        contained = {c["rid"] for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"}
        assert report["warnings"] == [] and report["violations_logged"] == len(log.violations)
        assert len(report["injections"]) == len(log.perturbations) and report["unexplained_violations"] == []
        assert contained and contained <= {r["rid"] for r in report["requests"]}
        assert next(iter(report["totals"].values()))["contained_requests"] == log.last_stat("contained_requests")
    finally:
        try:
            srv.stop()
        finally:
            prom.stop()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
