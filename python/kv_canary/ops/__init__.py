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


def dashboard_queries(*, rate_interval: str = "1m", range_: str = "1h", instance: str = ".*",
                      model_name: str = ".*") -> list:
    """[(panel title, PromQL)] of every dashboard panel's targets, with Grafana's variables filled in as a
    Prometheus without Grafana takes them (``$__rate_interval``, ``$__range``, the ``instance`` and ``model_name``
    template variables as regexes)."""
    import json

    values = {"$__rate_interval": rate_interval, "$__range": range_, "$instance": instance,
              "$model_name": model_name}
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for name in sorted(values, key=len, reverse=True):
                expr = expr.replace(name, values[name])
            out.append((panel["title"], expr))
    return out
