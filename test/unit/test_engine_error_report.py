"""An engine error in the step whose forward found a violation (``Reporting.report_before_engine_error``, called from
the scheduler loop's hook ``adapter/hooks.around_run_event_loop``): what the device counted up to the error is
reported before it propagates, even though the counter copies lag (``d2h`` delay) and the failed step's host
bookkeeping never ran. The e2e on real servers: ``test_e2e_write_witness.py`` (engine error)."""

from __future__ import annotations

import logging

import pytest

from kv_canary.config import CanaryMode
from kv_canary.violations import ENGINE_ERROR_PREFIX, VIOLATION_PREFIX, CanaryViolationError, parse_lines

pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
from kv_canary_testing.runner_harness import Harness  # noqa: E402 - needs sglang


def _failed_step(mode):
    """A harness whose second forward drops r2's store, then raises in the model's last stage (after the TAIL, which
    runs at that stage's pre-hook), with the counter copies 3 forwards behind. Returns (harness, the error)."""
    h = Harness(mode=mode, delay=3, anchor=True)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    h.model.drop_lane = 1

    def fail(input_ids):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    h.model.logits_processor.forward = fail
    with pytest.raises(RuntimeError) as failed:
        h.step(h.batch({1: [10], 2: [11]}, decode=True))
    assert h.manager.last_counters is None  # nothing was read yet: the delay
    return h, failed.value


def test_the_failed_forwards_violation_is_reported_naming_its_request(caplog):
    h, error = _failed_step(CanaryMode.LOG)
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.manager.report_before_engine_error(error)
    assert caplog.text.index(ENGINE_ERROR_PREFIX) < caplog.text.index(VIOLATION_PREFIX)
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [(v["kind"], v["rid"], v["slot"], v["forward"]) for v in found] == [("unwritten", "r2", "7", "1")]
    assert parse_lines(caplog.text, ENGINE_ERROR_PREFIX)[0]["error"] == "RuntimeError"


def test_raise_mode_raises_the_canary_report_chained_to_the_engine_error():
    h, error = _failed_step(CanaryMode.RAISE)
    with pytest.raises(CanaryViolationError, match="kind=unwritten"):
        try:
            raise error
        except RuntimeError as e:
            h.manager.report_before_engine_error(e)


def test_an_unreadable_device_is_said_in_one_line_with_the_landed_count(caplog, monkeypatch):
    """A CUDA context lost to a device-side assert: the ring cannot be read; the landed counter copy still says how
    many violations the device counted."""
    h, error = _failed_step(CanaryMode.LOG)

    def lost(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(h.manager._ring_reader, "read", lost)
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.manager.report_before_engine_error(error)
    lines = parse_lines(caplog.text, ENGINE_ERROR_PREFIX)
    assert [(x.get("unread"), x.get("violations_counted"), x.get("violations_read")) for x in lines[1:]] == [
        ("RuntimeError", "1", "0")]
    assert parse_lines(caplog.text, VIOLATION_PREFIX) == []
