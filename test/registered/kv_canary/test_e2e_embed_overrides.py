"""Positional embedding overrides (``kv_canary.adapter.embed_overrides``) on a real server: a ``/v1/score`` request
whose query carries three override vectors, then ``/generate`` with the same ids (``kv_canary_testing.score_overrides``).

sglang 0.5.12 ships #27472: the score request's KV is cached under its plain token ids, the ``/generate`` hits it and
reads KV computed from the vectors; the canary (``log``) reports that read, ``token`` at the reader, and nothing on
the score request itself. 0.5.23 has the fix: no hit, 0 violations (the check is no false alarm). docs/detection.md.
"""

import pytest

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci
from kv_canary_testing.line_suites import installed_line
from kv_canary_testing.score_overrides import (check_no_hit, check_read_override_kv, check_reported_at_the_reader,
                                                check_served, score_then_generate)

register_cpu_ci(est_time=70, suite="kv-canary-cpu")

SHIPS_THE_BUG = installed_line() == "0.5.12"  # #27472's fix is in 0.5.22 and later


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    srv = canary_server("log", log_path=tmp_path_factory.mktemp("overrides") / "server.log", max_total_tokens=2048)
    with srv:
        result = score_then_generate(srv)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    return result, log, running


@pytest.mark.e2e
def test_a_read_of_a_scoring_requests_override_kv_is_reported_and_nothing_else(run):
    result, log, running = run
    check_served(result, running)
    assert log.installed
    if SHIPS_THE_BUG:  # the plain request read the score request's cached KV
        check_read_override_kv(result)
        check_reported_at_the_reader(log.violations, result)
    else:  # fixed: nothing cached, nothing reported (the score request's own fed ids pass under the marker)
        check_no_hit(result)
        assert log.violations == [] and log.last_stat("violations") == 0

if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
