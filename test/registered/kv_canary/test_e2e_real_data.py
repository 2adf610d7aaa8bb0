"""``--kv-canary-real-data none|all``: the mixed workload (radix hits, chunked prefill, aborts,
eviction, the cache sweep) on page sizes 1 and 16 stays at zero violations with the new checks
(fed positions, fed tokens against the token oracle, whole-slot hashing) -- no false alarm.
``partial`` (the default) is covered by test_e2e_baseline and test_e2e_page_size."""

import pytest

from kv_canary_testing.canary_e2e import MAX_TOTAL_TOKENS, CanaryLog, canary_server, register_cpu_ci, register_cuda_ci
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=200, suite="kv-canary-cpu")
register_cuda_ci(est_time=300, suite="kv-canary-cuda")


@pytest.mark.e2e
# all at page size 1 is test_e2e_perturb_modes' log run (no unexplained violation); the page size only
# changes which slots a forward reads, not which bytes are hashed: one page size per setting suffices
@pytest.mark.parametrize("real_data,page_size", [("all", 16), ("none", 1)])
def test_mixed_workload_has_no_violation(tmp_path, real_data, page_size):
    # the CPU pool on every device: the 40-request workload must overflow it to force eviction (on the GPU
    # host's default 8,192-token pool it did not: 3,468 uncached prompt tokens, H100 2026-11-25)
    pool = MAX_TOTAL_TOKENS["cpu"]
    srv = canary_server("raise", log_path=tmp_path / "server.log", max_total_tokens=pool,
                        extra_args=["--kv-canary-real-data", real_data, "--page-size", str(page_size),
                                    "--kv-canary-sweep-interval", "8"])
    with srv:
        result = run_requests(srv.base_url, build_workload(40, seed=40 + page_size, n_aborts=4), concurrency=8,
                              abort_mode="mixed", timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    print(f"kv_canary_e2e_real_data real_data={real_data} page_size={page_size} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"slots_swept={log.last_stat('slots_swept')} violations={len(log.violations)}")
    assert f"real_data={real_data}" in log.text
    # the startup says what a read hashes and whether every byte is covered (and, when not, the flag for it)
    coverage = [ln for ln in log.text.splitlines() if f"kv_canary_coverage={real_data} " in ln]
    assert coverage, "no coverage line"
    cov = dict(item.split("=", 1) for item in coverage[-1].split() if "=" in item)
    assert cov["every_byte"] == ("1" if real_data == "all" else "0"), cov
    assert (int(cov["window_bytes_per_read"]) == 0) == (real_data == "none"), cov
    assert ("--kv-canary-real-data all hashes every byte" in log.text) == (real_data != "all")
    assert result.failed == 0 and running, "\n".join(result.errors[:5]) + srv.log_tail()
    assert result.cached_tokens > 0, "no radix-cache prefix hits"
    assert result.uncached_prompt_tokens > pool, "no eviction forced"
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("health_violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_swept") > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
