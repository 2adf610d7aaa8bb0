"""The shipped Prometheus alert rules (``kv_canary/ops/alerts.yml``): promtool accepts them and their unit tests
(``alerts_test.yml``) pass; every rule is exercised there, names only counters the plugin exports, and carries a
runbook link to a section of docs/operations.md. promtool comes with Debian's ``prometheus`` package (.ci/run
installs it); without it the promtool checks skip, saying so."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from kv_canary.adapter.metrics import COUNTERS  # noqa: E402
from kv_canary.ops import ALERT_RULES, ALERT_RULES_TESTS  # noqa: E402

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def _rules():
    return [r for g in yaml.safe_load(ALERT_RULES.read_text())["groups"] for r in g["rules"]]


def _promtool(*args):
    return subprocess.run([PROMTOOL, *args], cwd=ALERT_RULES.parent, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_checks_the_rules():
    done = _promtool("check", "rules", ALERT_RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    done = _promtool("test", "rules", ALERT_RULES_TESTS.name)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


@needs_promtool
def test_promtool_unit_tests_can_fail(tmp_path):
    """The unit tests see a rule's threshold: the same tests against rules with the contained-requests rate raised."""
    (tmp_path / ALERT_RULES.name).write_text(ALERT_RULES.read_text().replace("[10m]) > 10", "[10m]) > 1000"))
    (tmp_path / ALERT_RULES_TESTS.name).write_text(ALERT_RULES_TESTS.read_text())
    done = subprocess.run([PROMTOOL, "test", "rules", ALERT_RULES_TESTS.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "KVCanaryContainedRequests" in done.stdout + done.stderr


def test_every_rule_is_unit_tested_and_has_a_runbook_section():
    tested = {t["alertname"] for case in yaml.safe_load(ALERT_RULES_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"]}
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    rules = _rules()
    assert {"KVCanaryViolation", "KVCanaryHealth", "KVCanaryQuiet", "KVCanaryContainedRequests"} <= {
        r["alert"] for r in rules}
    for rule in rules:
        assert rule["alert"] in tested, rule["alert"]
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "docs/operations.md" and anchor in anchors, (rule["alert"], anchor, sorted(anchors))
        assert rule["labels"]["severity"] in ("page", "warning")


def test_rules_name_only_exported_counters_in_both_spellings():
    """Each selector matches sglang:NAME and sglang_NAME (Prometheus 2.x stores the latter scraping over
    OpenMetrics, as the e2e's does); the names are the plugin's counters (and sglang's generation tokens)."""
    exported = {f"kv_canary_{name}_total" for name in COUNTERS} | {"kv_canary_violations_total",
                                                                   "generation_tokens_total"}
    for rule in _rules():
        assert not re.search(r"sglang[:_][a-z]", rule["expr"]), rule["expr"]  # no name in one spelling only
        names = re.findall(r'\{__name__=~"sglang\[:_\]([a-z_]+)"', rule["expr"])
        assert names and set(names) <= exported, (rule["alert"], names)
