"""Data parallel (``--dp-size 2``) on CPU: every DP rank is its own scheduler process with its own ModelRunner and
KV pool, so each installs and runs its own canary; every canary line names its rank (``dp_rank=`` beside
``tp_rank=``), the sweep runs per rank, ``contain`` aborts on the rank that read the bad slot and nowhere else.

The perturbation runs on DP rank 1 only (``SGLANG_KV_CANARY_PERTURB_DP_RANK=1``): rank 0's pool is never touched,
so rank 0 must report nothing (a false alarm there fails the test). The server runs as on a CPU-only host: one core
set per rank (``SGLANG_CPU_OMP_THREADS_BIND``; sglang binds one rank per NUMA node otherwise). sglang's data-parallel
controller sends the requests round-robin, so both ranks serve.

CI runs two servers on sglang 0.5.23 (line_suites): a clean ``raise`` run and a ``contain`` run with
``--enable-metrics`` (the canary's counters on /metrics carry sglang's ``dp_rank`` label). ``raise`` on one rank
stopping the server is a third server, run by hand (``KVC_E2E_DP_RAISE=1``) for CI time. 0.5.12 passes all three
by hand (its core bind: ``_cpu_dp_env``).
"""

from __future__ import annotations

import os
import re
import time

import pytest
import requests

from kv_canary.violations import CONTAIN_PREFIX, PERTURB_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import canary_server, e2e_device, register_cpu_ci
from kv_canary_testing.ranks import by_rank, retry_aborted, settled_by_rank
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=240, suite="kv-canary-cpu")

pytestmark = pytest.mark.skipif(e2e_device() != "cpu", reason="the DP=2 e2e runs on CPU (two scheduler processes)")

INJECTIONS = 3
PERTURB = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.2",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "5",
    "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": str(INJECTIONS),
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
    "SGLANG_KV_CANARY_PERTURB_DP_RANK": "1",
}
MESSAGE = "kv-canary contain: aborted"
RANKS = ("0", "1")


def _cpu_dp_env():
    """The cores of a CPU-only host: 0.5.23 takes one core set per DP rank; 0.5.12 checks the list against the TP
    size (1) in each DP rank's ModelRunner, so both ranks get the one set."""
    from kv_canary_testing.line_suites import installed_sglang

    n = max(2, os.cpu_count() or 2)
    half = n // 2
    if installed_sglang() == "0.5.12":
        return {"SGLANG_CPU_OMP_THREADS_BIND": f"0-{n - 1}"}
    return {"SGLANG_CPU_OMP_THREADS_BIND": f"0-{half - 1}|{half}-{2 * half - 1}"}


def _server(tmp_path_factory, mode, name, env=None, extra=()):
    return canary_server(mode, log_path=tmp_path_factory.mktemp(name) / "server.log",
                         env={**_cpu_dp_env(), **(env or {})},
                         extra_args=["--dp-size", "2", "--kv-canary-real-data", "partial",
                                     "--kv-canary-sweep-interval", "8", *extra])


def _by_rank(lines):
    return by_rank(lines, "dp_rank")


def _settled(srv):
    return settled_by_rank(srv, RANKS, "dp_rank")


def _metrics_by_dp_rank(base_url, name):
    """{dp_rank label: value} of a counter on sglang's /metrics (the canary's carry sglang's scheduler labels)."""
    session = requests.Session()
    session.trust_env = False  # loopback only
    text = session.get(f"{base_url}/metrics", timeout=30).text
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels.get("dp_rank")] = out.get(labels.get("dp_rank"), 0.0) + float(m.group(2))
    return out


@pytest.mark.e2e
def test_dp2_raise_mixed_workload_has_no_violation_on_either_rank(tmp_path_factory):
    """Shared prefixes, chunked prefill, aborts, eviction (a small pool) under --dp-size 2 in raise mode."""
    srv = _server(tmp_path_factory, "raise", "dp-clean", extra=["--max-total-tokens", "2048"])
    srv.start(timeout=600)
    try:
        specs = build_workload(40, seed=2029, n_aborts=4)
        result = run_requests(srv.base_url, specs, concurrency=12, abort_mode="disconnect", timeout=600)
        text, stats = _settled(srv)
        violations = parse_lines(text, VIOLATION_PREFIX)
        installed = _by_rank(parse_lines(text, "kv_canary_installed"))
        print(f"kv_canary_e2e_dp_clean dp=2 {result.summary()} " + " ".join(
            f"rank{r}_slots_verified={stats[r][-1]['slots_verified']} rank{r}_slots_swept="
            f"{stats[r][-1]['slots_swept']} rank{r}_forwards={stats[r][-1]['forwards_host']}" for r in sorted(stats))
            + f" violations={len(violations)}")
        assert result.failed == 0, "\n".join(result.errors[:5])
        assert result.succeeded == len(specs) - 4 and result.cached_tokens > 0
        assert srv.is_running() and violations == [], violations[:3]
        # one canary per DP rank, each on its own pool; every line names its rank
        assert set(installed) == set(RANKS) and set(stats) == set(RANKS), (sorted(installed), sorted(stats))
        for r in RANKS:
            last = stats[r][-1]
            assert last.get("tp_rank") == "0"
            assert int(last["forwards_host"]) > 0 and int(last["slots_verified"]) > 0 and int(last["slots_swept"]) > 0
            assert int(last["violations"]) == 0 and int(last["health_violations"]) == 0
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def contain_dp(tmp_path_factory):
    srv = _server(tmp_path_factory, "contain", "dp-contain", env=PERTURB, extra=["--enable-metrics"])
    srv.start(timeout=600)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.e2e
def test_dp2_perturbed_rank_is_named_and_contain_aborts_only_its_readers(contain_dp):
    srv = contain_dp
    specs = build_workload(32, seed=31, n_aborts=0)
    result = run_requests(srv.base_url, specs, concurrency=8, timeout=300)
    text, stats = _settled(srv)
    injections = _by_rank(parse_lines(text, PERTURB_PREFIX))
    violations = _by_rank(parse_lines(text, VIOLATION_PREFIX))
    contains = _by_rank([c for c in parse_lines(text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"])
    failed = [o for o in result.outcomes if o.status != "ok"]
    print(f"kv_canary_e2e_dp_contain dp=2 {result.summary()} injections_rank1={len(injections.get('1', []))} "
          f"violations_rank0={len(violations.get('0', []))} violations_rank1={len(violations.get('1', []))} "
          + " ".join(f"slots_verified_rank{r}={stats[r][-1]['slots_verified']}" for r in sorted(stats))
          + f" aborts_rank0={len(contains.get('0', []))} aborts_rank1={len(contains.get('1', []))} "
          f"aborted_by_canary={len(failed)}")
    assert set(stats) == set(RANKS) and all(int(stats[r][-1]["slots_verified"]) > 0 for r in RANKS)
    assert set(injections) == {"1"} and len(injections["1"]) == INJECTIONS  # rank 1's pool only
    # rank 0's pool is intact: it reports nothing; rank 1 names itself and exactly the flipped slots
    assert "0" not in violations and violations.get("1"), text[-3000:]
    flipped = {p["slot"] for p in injections["1"]}
    assert all(v["kind"] == "kv_hash" and v["slot"] in flipped for v in violations["1"])
    # contain: only rank 1 aborts, the requests that read the flipped slots; everything else is served
    assert "0" not in contains and contains.get("1"), contains
    aborted = {c["rid"] for c in contains["1"] if c["state"] == "aborted"}
    assert {v["rid"] for v in violations["1"]} <= {c["rid"] for c in contains["1"]}
    assert failed and all(MESSAGE in o.error and "kind=kv_hash" in o.error for o in failed)
    assert {o.rid for o in failed} == aborted
    assert result.succeeded == len(specs) - len(failed) and srv.is_running()
    # retries of the aborted prompts are computed fresh (whichever rank serves them): no new violation
    before = len(parse_lines(text, VIOLATION_PREFIX))
    retry_aborted(srv, specs, failed)
    text2, stats2 = _settled(srv)
    assert len(parse_lines(text2, VIOLATION_PREFIX)) == before and srv.is_running()
    # /metrics: the canary's counters carry sglang's dp_rank label, one series per rank
    deadline = time.monotonic() + 30
    while True:
        verified = _metrics_by_dp_rank(srv.base_url, "sglang:kv_canary_slots_verified_total")
        found = _metrics_by_dp_rank(srv.base_url, "sglang:kv_canary_violations_total")
        contained = _metrics_by_dp_rank(srv.base_url, "sglang:kv_canary_contained_requests_total")
        if (set(verified) == set(RANKS) and found.get("1", 0) >= len(violations["1"])) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"kv_canary_e2e_dp_metrics slots_verified={verified} violations={found} contained={contained}")
    assert set(verified) == set(RANKS) and all(verified[r] > 0 for r in RANKS), verified
    assert found.get("0", 0) == 0 and found.get("1", 0) >= len(violations["1"]), found
    assert contained.get("0", 0) == 0 and contained.get("1", 0) == len(contains["1"]), contained


@pytest.mark.e2e
@pytest.mark.skipif(os.environ.get("KVC_E2E_DP_RAISE") != "1",
                    reason="a third server, run by hand (KVC_E2E_DP_RAISE=1) for CI time; recorded in docs/operations.md")
def test_dp2_raise_on_one_rank_stops_the_server(tmp_path_factory):
    srv = _server(tmp_path_factory, "raise", "dp-raise", env=PERTURB)
    srv.start(timeout=600)
    try:
        result = run_requests(srv.base_url, build_workload(24, seed=41, n_aborts=0), concurrency=6, timeout=300)
        code = srv.wait_exit(timeout=180)
        text = srv.log_text()
        violations = parse_lines(text, VIOLATION_PREFIX)
        print(f"kv_canary_e2e_dp_raise {result.summary()} exit={code} violations={len(violations)} "
              f"dp_ranks={sorted({v.get('dp_rank') for v in violations})}")
        assert code is not None and code != 0 and "CanaryViolationError" in text
        assert violations and all(v.get("dp_rank") == "1" and v["kind"] == "kv_hash" for v in violations)
        assert result.failed > 0  # in-flight requests on both ranks failed instead of hanging
    finally:
        srv.stop()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
