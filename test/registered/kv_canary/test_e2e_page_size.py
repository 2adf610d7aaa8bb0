"""Paged KV pool (``--page-size 16``): the canary verifies slot by slot inside pages, with
radix hits, chunked prefill, aborts and the cache sweep, and reports nothing on a clean run."""

import pytest

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci, register_cuda_ci
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=90, suite="kv-canary-cpu")
register_cuda_ci(est_time=90, suite="kv-canary-cuda")

PAGE_SIZE = 16


@pytest.mark.e2e
def test_paged_pool_has_no_violation(tmp_path):
    srv = canary_server("raise", log_path=tmp_path / "server.log",
                        extra_args=["--page-size", str(PAGE_SIZE), "--kv-canary-sweep-interval", "4"])
    with srv:
        result = run_requests(srv.base_url, build_workload(40, seed=16, n_aborts=2), concurrency=8, timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    print(f"kv_canary_e2e_page_size page_size={PAGE_SIZE} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_swept={log.last_stat('slots_swept')}")
    # sglang prints its server args as ServerArgs(page_size=16, ...) (0.5.12) or {'page_size': 16, ...} (0.5.23)
    assert f"page_size={PAGE_SIZE}" in log.text or f"'page_size': {PAGE_SIZE}" in log.text
    assert result.failed == 0 and running, "\n".join(result.errors[:5])
    assert result.cached_tokens > 0
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_swept") > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
