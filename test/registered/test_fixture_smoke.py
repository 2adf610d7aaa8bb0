"""Smoke check of the CPU test fixture: a real sglang 0.5.12 server (no kv-canary flag)
serving a small mixed workload with prefix sharing, chunked prefill, aborts and eviction.

It doubles as the ``--kv-canary none`` test: the plugin is installed and loaded,
but the default mode must install nothing and run nothing."""

import socket

import pytest

from kv_canary_testing.canary_e2e import register_cpu_ci
register_cpu_ci(est_time=60, suite="kv-canary-cpu")

from kv_canary_testing.server import SglangServer
from kv_canary_testing.workload import build_workload, run_requests

CHUNKED_PREFILL_SIZE = 128
MAX_TOTAL_TOKENS = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    srv = SglangServer(
        ["--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE)],
        log_path=log,
        max_total_tokens=MAX_TOTAL_TOKENS,
    )
    # the port the fixture picked is taken before sglang binds it (as another process may): start() must see
    # uvicorn's bind error, on which sglang does not exit, and serve on a new port
    srv.taken_port = srv.port
    with socket.socket() as blocker:
        blocker.bind((srv.host, srv.port))
        blocker.listen()
        srv.start(timeout=300)
    yield srv
    srv.stop()


@pytest.mark.e2e
def test_a_taken_port_is_replaced_by_a_new_one(server):
    assert server.port != server.taken_port
    assert "address already in use" in server.log_text()
    assert server.base_url.endswith(f":{server.port}") and server.is_running()


@pytest.mark.e2e
def test_mixed_workload_smoke(server):
    specs = build_workload(30, seed=1, n_aborts=2)
    kinds = [s.kind for s in specs]
    assert kinds.count("shared") >= 3, kinds
    assert kinds.count("abort") == 2, kinds
    assert any(len(s.words) > CHUNKED_PREFILL_SIZE for s in specs if s.kind == "long"), kinds

    result = run_requests(server.base_url, specs, concurrency=8, abort_mode="mixed")

    assert result.failed == 0, "\n".join(result.errors) + "\n" + server.log_tail()
    assert result.aborted == 2
    assert result.succeeded == 28
    for outcome in result.outcomes:
        if outcome.status == "ok":
            assert outcome.output_ids, outcome
            assert outcome.text.strip(), outcome
    assert result.cached_tokens > 0, "no radix-cache prefix hits"
    assert max(o.prompt_tokens for o in result.outcomes) > CHUNKED_PREFILL_SIZE
    assert result.uncached_prompt_tokens > MAX_TOTAL_TOKENS, "workload too small to force eviction"
    assert server.is_running()
    log = server.log_text()
    assert "Traceback" not in log
    # --kv-canary none (the default): the plugin loaded, yet nothing of the canary was installed.
    assert "kv_canary_off=1" in log
    assert "kv_canary_installed" not in log and "kv_canary_stats" not in log


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v"]))
