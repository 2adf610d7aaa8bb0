"""``kv-canary report`` on real server logs: test/unit/fixtures/report_contain_<line>.log are the sglang logger lines
(tokenizer and server_args lines left out) of a real CPU server per sglang line, ``--kv-canary contain`` with a
``real_kv_used`` perturbation (3 injections, ``hashed`` bytes) and a 24-request workload (the capture behind the
docs' sample; the 0.5.23 file holds two such runs, appended by two server starts: a restart within one log);
report_log_0.5.12.log and report_raise_0.5.12.log are the same 0.5.12 server and perturbation in ``log`` and
``raise``. Bad input gets a message and exit 2, or a warning, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_canary.ops.report import main, read_logs, summarize
from kv_canary.violations import PERTURB_PREFIX, STATS_PREFIX, VIOLATION_PREFIX, parse_lines

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LOGS = sorted(FIXTURES.glob("report_contain_*.log"))


def _run(capsys, *argv):
    code = main(["report", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.stem)
def test_text_report_of_a_real_contain_run(capsys, log):
    text = log.read_text()
    violations, injections = parse_lines(text, VIOLATION_PREFIX), parse_lines(text, PERTURB_PREFIX)
    last = parse_lines(text, STATS_PREFIX)[-1]
    assert violations and injections and last["settled"] == "1"
    code, out, err = _run(capsys, log)
    assert code == 0 and err == ""
    assert f"Violations: {len(violations)} logged" in out
    assert f"Injections (SGLANG_KV_CANARY_PERTURB_*): {len(injections)}" in out
    assert "violations no injection explains: none" in out
    for v in violations:  # every slot and reader is named
        assert f"full/{v['slot']}" in out and v["rid"] in out
    assert f"slots_verified={last['slots_verified']} " in out and f"contained_requests={last['contained_requests']}" in out
    assert "-> aborted by contain" in out and "Warnings" not in out


def _runs(text):
    """The log's text per server start (the 0.5.23 capture appended two runs to one file)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if "kv_canary_installed=" in line] + [len(lines)]
    return ["".join(lines[(0 if k == 0 else a):b]) for k, (a, b) in enumerate(zip(starts, starts[1:]))]


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.stem)
def test_summary_matches_the_log_run_by_run(log):
    d = summarize(read_logs([str(log)]))
    runs = _runs(log.read_text())
    assert len(d["logs"]) == len(runs) and len(d["totals"]) == len(runs)
    contained, evicted = set(), 0
    for text, totals in zip(runs, d["totals"].values()):
        last = parse_lines(text, STATS_PREFIX)[-1]
        assert totals["slots_verified"] == int(last["slots_verified"])
        assert totals["perturbations"] == len(parse_lines(text, PERTURB_PREFIX))
        contains = parse_lines(text, "kv_canary_contain")
        contained |= {c["rid"] for c in contains if c["kv_canary_contain"] == "abort"}
        evicted += len({c["slot"] for c in contains if c["kv_canary_contain"] == "evict"})
    text = log.read_text()
    assert {r["rid"] for r in d["requests"]} == contained | {v["rid"] for v in parse_lines(text, VIOLATION_PREFIX)}
    assert list(d["by_kind"]) == ["kv_hash"] and d["violations_logged"] == len(parse_lines(text, VIOLATION_PREFIX))
    assert all(p["explains"] for p in d["injections"])  # hashed bytes: every injection detected, in its own run
    assert sum(1 for s in d["slots"].values() if s["evicted"]) == evicted  # every bad slot was evicted
    assert d["unexplained_violations"] == [] and d["warnings"] == []


def test_several_logs_json_and_html(capsys, tmp_path):
    code, out, _ = _run(capsys, "--json", *LOGS)
    d = json.loads(out)
    assert code == 0 and [x["sglang"] for x in d["logs"]] == [
        p.stem.rsplit("_", 1)[1] for p in LOGS for _ in _runs(p.read_text())]
    assert d["violations_logged"] == sum(len(parse_lines(p.read_text(), VIOLATION_PREFIX)) for p in LOGS)
    page = tmp_path / "report.html"
    code, out, _ = _run(capsys, "--html", page, LOGS[0])
    html = page.read_text()
    assert code == 0 and str(page) in out and "<svg" in html
    n = len(parse_lines(LOGS[0].read_text(), VIOLATION_PREFIX))
    assert html.count("<circle") == n and html.count("<polygon") > 0  # one dot per violation, contain triangles


def test_no_canary_lines_or_unreadable_is_a_message(capsys, tmp_path):
    plain = tmp_path / "plain.log"
    plain.write_text("[2026-11-29 09:53:06] Cuda graph is disabled because of using torch native attention backend\n")
    code, out, err = _run(capsys, plain)
    assert code == 2 and out == "" and "no kv-canary lines" in err and "Traceback" not in err
    code, _, err = _run(capsys, tmp_path / "missing.log")
    assert code == 2 and "cannot read it" in err
    code, _, err = _run(capsys, tmp_path)  # a directory
    assert code == 2 and "cannot read it" in err
    code, _, err = _run(capsys, "--html", tmp_path / "no" / "such" / "dir.html", LOGS[0])
    assert code == 2 and "cannot write" in err


def test_truncated_log_warns_and_reports_what_it_has(capsys, tmp_path):
    text = LOGS[0].read_text()
    cut = text.index("kv_canary_violation=") + len("kv_canary_violation=0 kind=kv_hash group=full sl")
    log = tmp_path / "cut.log"
    log.write_text(text[:cut])
    code, out, _ = _run(capsys, log)
    assert code == 0 and "cut off at the end of the log (truncated?)" in out
    assert "the log ends while the server was serving" in out and "Violations: 0 logged" in out


def test_lines_of_another_version_warn(capsys, tmp_path):
    text = LOGS[0].read_text().replace(" slot=", " kv_slot=").replace("impl=sglang-kv-canary", "impl=in-tree")
    log = tmp_path / "other.log"
    log.write_text(text)
    code, out, _ = _run(capsys, log)
    assert code == 0 and "another version of the canary?" in out and "written by impl=in-tree" in out


def test_console_script_is_declared():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'kv-canary = "kv_canary.ops.report:main"' in text
    assert main.__module__ == "kv_canary.ops.report"


def test_raise_run_names_the_stop_and_counts_each_violation_once(capsys):
    """report_raise_0.5.12.log: the same server and perturbation in ``raise`` (the server stops at the first
    violation; CanaryViolationError's message repeats the violation line, which is one violation)."""
    log = FIXTURES / "report_raise_0.5.12.log"
    assert log.read_text().count("kv_canary_violation=0 ") == 2
    code, out, _ = _run(capsys, log)
    assert code == 0 and "stopped by CanaryViolationError (raise)" in out
    assert "Violations: 1 logged" in out and "-> the server stopped (raise)" in out
    assert "explains violation(s) 0," in out and "Warnings" not in out


def test_log_run_says_the_readers_were_served_and_repeats_are_unnamed(capsys):
    """report_log_0.5.12.log: the same server and perturbation in ``log`` (serving goes on; a bad slot read again is
    counted in violations_repeated, not logged)."""
    log = FIXTURES / "report_log_0.5.12.log"
    repeated = parse_lines(log.read_text(), STATS_PREFIX)[-1]["violations_repeated"]
    code, out, _ = _run(capsys, log)
    assert code == 0 and "-> served on (log mode: nothing was stopped)" in out and "aborted" not in out
    assert f"+ {repeated} repeat reads of logged bad slots" in out and "violations no injection explains: none" in out
