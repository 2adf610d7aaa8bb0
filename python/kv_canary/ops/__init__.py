"""The operator's kit shipped with the plugin: Prometheus alert rules, their promtool tests, a Grafana dashboard.

``ALERT_RULES``, ``ALERT_RULES_TESTS`` and ``DASHBOARD`` are the files' paths inside the installed package
(``promtool check rules $(python -c 'import kv_canary.ops as o; print(o.ALERT_RULES)')``); docs/operations.md
("Alerts and dashboard") says what each rule and panel watches. ``kv-canary report`` lives in ``report``.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
ALERT_RULES = HERE / "alerts.yml"
ALERT_RULES_TESTS = HERE / "alerts_test.yml"
DASHBOARD = HERE / "dashboard.json"
