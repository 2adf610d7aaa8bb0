"""The shipped Grafana dashboard (``kv_canary/ops/dashboard.json``): valid JSON, every canary counter on a panel,
only exported counters named, sglang's labels as template variables. Its queries run against a real Prometheus
scraping a real server in test/registered/kv_canary/test_e2e_prometheus.py."""

from __future__ import annotations

import json
import re

from kv_canary.adapter.metrics import COUNTERS
from kv_canary.ops import DASHBOARD, dashboard_queries

EXPORTED = {f"kv_canary_{name}_total" for name in COUNTERS} | {"kv_canary_violations_total"}


def test_dashboard_is_grafana_json_with_sglang_label_variables():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "model_name"} <= names
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert 'model_name=~"$model_name"' in target["expr"], target["expr"]


def test_every_exported_counter_is_on_a_panel_and_only_those():
    queries = dashboard_queries()
    named = {n for _, q in queries for n in re.findall(r'__name__=~"sglang\[:_\]([a-z_]+)"', q)}
    assert not any(re.search(r"sglang[:_][a-z]", q) for _, q in queries)  # both spellings everywhere
    assert named == EXPORTED, (sorted(EXPORTED - named), sorted(named - EXPORTED))
    assert all("$" not in q for _, q in queries), [q for _, q in queries if "$" in q]
    titles = {t for t, _ in queries}
    for wanted in ("Slots verified / written per second", "Violations by kind", "Contained requests",
                   "Sweep progress", "Scrub progress", "Health violations (in range)"):
        assert wanted in titles, sorted(titles)
