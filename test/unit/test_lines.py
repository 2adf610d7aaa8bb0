"""Every line the canary prints parses with ``kv_canary.violations.parse_lines``.

The lines come from the code that prints them (a CanaryManager driven through
real forwards, the install line builder), not from hand-written samples.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kv_canary.api import installed_line
from kv_canary.config import CanaryConfig, CanaryMode
from kv_canary.views import LaunchCapacities
from kv_canary.violations import (
    INSTALLED_PREFIX, OFF_PREFIX, PERTURB_PREFIX, READY_PREFIX, STATS_PREFIX, SUMMARY_PREFIX, VIOLATION_PREFIX,
    format_line, parse_line, parse_lines,
)

pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
from kv_canary_testing.runner_harness import Harness  # noqa: E402 - needs sglang


def _run_corrupting_workload(caplog, decodes=3, **config_fields):
    """Log mode, every forward perturbed: violations, perturb lines, stats and a settled line."""
    fields = {"perturb_real_kv_used_prob": 1.0, **config_fields}
    h = Harness(mode=CanaryMode.LOG, stats_print_every_n_steps=1, perturb_warmup_steps=0, **fields)
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        h.manager.mark_init_finished()
        h.step(h.batch({1: [5, 6, 7, 8], 2: [1, 2, 3, 4]}))
        for t in range(decodes):
            h.step(h.batch({1: [9 + t], 2: [20 + t]}, decode=True))
        h.manager.poll(drain=True)
    return h, caplog.text


def test_violation_perturb_stats_settled_and_ready_lines_parse(caplog):
    h, text = _run_corrupting_workload(caplog)
    ready = parse_lines(text, READY_PREFIX)
    assert ready == [{READY_PREFIX: "1", "mode": "log", "groups": "full", "kernels": "spy"}]
    perturbs = parse_lines(text, PERTURB_PREFIX)
    assert len(perturbs) == 3 and {p[PERTURB_PREFIX] for p in perturbs} == {"real_kv_used"}
    assert {"group", "slot", "rid", "position", "forward", "half", "layer", "byte"} <= set(perturbs[0])
    violations = parse_lines(text, VIOLATION_PREFIX)
    assert violations and all(v["kind"] == "kv_hash" for v in violations)
    assert set(violations[0]) == {VIOLATION_PREFIX, "kind", "group", "slot", "position", "rid", "row",
                                  "batch_index", "stored", "expected", "forward", "cuda_graph"}
    assert {(v["slot"]) for v in violations} <= {p["slot"] for p in perturbs}
    stats = parse_lines(text, STATS_PREFIX)
    assert stats[-1]["settled"] == "1" and int(stats[-1]["violations"]) == h.manager.violations_reported
    assert all("settled" not in s for s in stats[:-1])
    assert int(stats[-1]["perturbations"]) == 3 and int(stats[-1]["slots_verified"]) > 0


def test_summary_line_parses_and_is_not_a_violation_line(caplog):
    # a redirected req_to_token entry gives two new violations in one forward (the position and its
    # successor's chain link); with one itemized line per read the other is summarised
    h, text = _run_corrupting_workload(caplog, decodes=8, max_logged_violations=1, perturb_real_kv_used_prob=0.0,
                                       perturb_req_to_token_prob=1.0)
    summaries = parse_lines(text, SUMMARY_PREFIX)
    assert summaries, text
    for s in summaries:
        assert set(s) == {SUMMARY_PREFIX, "not_itemized"}
        assert int(s[SUMMARY_PREFIX]) >= int(s["not_itemized"]) >= 1
    violations = parse_lines(text, VIOLATION_PREFIX)  # a summary line is never taken for a violation line
    assert violations and all("not_itemized" not in v and "kind" in v for v in violations)


def test_installed_and_off_lines_parse():
    config = CanaryConfig(mode=CanaryMode.RAISE, sweep_interval=4)
    h = Harness()
    caps = LaunchCapacities(max_batch_size=9, max_context_len=64, verify_programs_target=1)
    line = "[2026-11-22 08:00:00 TP0] " + installed_line(config, "MHATokenToKVPool", h.manager.groups, "triton",
                                                          caps)
    parsed = parse_line(line, INSTALLED_PREFIX)
    assert parsed[INSTALLED_PREFIX] == "1" and parsed["mode"] == "raise" and parsed["sweep_interval"] == "4"
    assert parsed["pool"] == "MHATokenToKVPool" and parsed["groups"] == "full"
    assert parsed["slots"] == str(h.manager.groups[0].num_slots) and parsed["kernels"] == "triton"
    assert parsed["max_batch_size"] == "9" and parsed["max_context_len"] == "64"
    assert parsed["perturb_real_kv_post_forward_prob"] == "0.0"
    off = format_line(OFF_PREFIX, 1, {"mode": "none"}) + " (no canary buffers, no device work)"
    assert parse_line(off, OFF_PREFIX) == {OFF_PREFIX: "1", "mode": "none"}


def test_prefixes_do_not_cross_match():
    text = "\n".join([
        "x kv_canary_violation_summary=5 not_itemized=2",
        "y kv_canary_violation=3 kind=slot group=full slot=0 position=1 rid=a",
    ])
    assert parse_lines(text, SUMMARY_PREFIX) == [{SUMMARY_PREFIX: "5", "not_itemized": "2"}]
    assert parse_lines(text, VIOLATION_PREFIX) == [
        {VIOLATION_PREFIX: "3", "kind": "slot", "group": "full", "slot": "0", "position": "1", "rid": "a"}]


def test_contain_order_names_each_reader_once_and_every_bad_slot():
    from kv_canary.containment import build_order
    from kv_canary.violations import Violation, health_violation

    def v(rid, slot, kind="kv_hash"):
        return Violation(seq=0, kind=kind, group="full", slot=slot, position=3, rid=rid, row=1, batch_index=0,
                         stored=1, expected=2, forward=7, cuda_graph=False)

    rows = [v("a", 5), v("b", 5), v("a", 9, "chain"), v("cache", 11), v("?", 0, "slot"),
            health_violation("forwards", 3, 4, 7)]
    order = build_order(rows, num_slots=64, already_aborted={"b"})
    assert set(order.aborts) == {"a"} and order.slots == (5, 9, 11)
    assert "kv-canary contain" in order.aborts["a"] and "kind=kv_hash" in order.aborts["a"] and "slot=5" in \
        order.aborts["a"]
    assert not build_order([health_violation("forwards", 3, 4, 7)], num_slots=64)
    assert order.host_slots == ()
    # HiCache: a loaded slot's violation names the host copy it came from; the order carries it to the host side
    loaded = dataclasses.replace(v("c", 12), identity=(("hicache", "load"), ("host_slot", 301)))
    assert build_order([loaded, v("c", 13)], num_slots=64).host_slots == (301,)
    line = "[x] kv_canary_contain=abort rid=a state=aborted"
    assert parse_line(line, "kv_canary_contain") == {"kv_canary_contain": "abort", "rid": "a", "state": "aborted"}
