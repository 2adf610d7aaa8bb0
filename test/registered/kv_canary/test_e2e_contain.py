"""``--kv-canary contain`` against a real sglang server: corrupt K/V aborts exactly the requests that read
it, evicts it from the radix cache, and the server keeps serving.

A ``real_kv_used`` perturbation flips hashed bytes of slots a forward reads (three
injections, then none). Every request a violation names fails with finish reason
abort and the canary's message; every other request of the concurrent workload
succeeds; each aborted prompt, retried, succeeds with zero new violations.

Runs on both sglang lines: 0.5.12 evicts from ``RadixCache`` (``adapter/contain``), 0.5.23 from
``UnifiedRadixCache`` through its tree core (``adapter/contain_unified``). ``--kv-canary-real-data partial``
is passed explicitly (0.5.12's default; 0.5.23's upstream default is ``none``).
"""

from __future__ import annotations

import pytest
import requests

from kv_canary.violations import CONTAIN_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import (
    MAX_TOTAL_TOKENS, CanaryLog, canary_server, contain_evictor_gap, e2e_device, register_cpu_ci, register_cuda_ci,
)
from kv_canary_testing.server import ServerError
from kv_canary_testing.workload import build_workload, run_requests

GAP = contain_evictor_gap()
needs_contain = pytest.mark.skipif(bool(GAP), reason=f"--kv-canary contain is refused on this release ({GAP}): "
                                   "test_contain_is_refused_where_the_evictor_interface_is_missing runs instead")

register_cpu_ci(est_time=300, suite="kv-canary-cpu")
register_cuda_ci(est_time=300, suite="kv-canary-cuda")

INJECTIONS = 3
ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.2",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "5",
    "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": str(INJECTIONS),
    # inside the window --kv-canary-real-data partial hashes: every injection is detected
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
}
MESSAGE = "kv-canary contain: aborted"


@pytest.fixture(scope="module")
def contain_server(tmp_path_factory):
    srv = canary_server("contain", log_path=tmp_path_factory.mktemp("contain") / "server.log", env=ENV,
                        extra_args=["--kv-canary-real-data", "partial", "--kv-canary-sweep-interval", "8",
                                    "--enable-metrics"])
    srv.start(timeout=600)
    try:
        yield srv
    finally:
        srv.stop()


def _generate(base_url, spec, rid):
    r = requests.post(base_url + "/generate", timeout=300, json={
        "text": spec.text(), "rid": rid,
        "sampling_params": {"max_new_tokens": spec.max_new_tokens, "temperature": 0.0, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["meta_info"]


@pytest.mark.e2e
@needs_contain
def test_contain_aborts_exactly_the_readers_and_keeps_serving(contain_server):
    srv = contain_server
    specs = build_workload(48, seed=31, n_aborts=0)
    result = run_requests(srv.base_url, specs, concurrency=8, timeout=300)
    log = CanaryLog.read_settled(srv)
    failed = [o for o in result.outcomes if o.status != "ok"]
    violated_rids = {v["rid"] for v in log.violations if v["rid"] not in ("cache", "?")}
    contained = {c["rid"]: c["state"] for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"}
    print(f"kv_canary_e2e_contain {result.summary()} injections={len(log.perturbations)} "
          f"violations={len(log.violations)} contained_requests={log.last_stat('contained_requests')} "
          f"aborted_by_canary={len(failed)} finished_within_delay="
          f"{sum(1 for st in contained.values() if st != 'aborted')} "
          f"evictions={log.text.count('kv_canary_contain=evict')}")
    assert len(log.perturbations) == INJECTIONS, log.text[-3000:]
    assert log.violations and all(v["kind"] == "kv_hash" for v in log.violations)
    assert failed, "no request was aborted"
    for o in failed:  # the canary's abort, naming the kind and the slot
        assert MESSAGE in o.error and "'type': 'abort'" in o.error and "kind=kv_hash" in o.error, o.error
        assert "slot=" in o.error
    # Exactly the requests whose forward read a bad slot (every violation row, repeats included, names
    # one) are contained; those still running are aborted, the rest had finished within the delay.
    assert violated_rids <= set(contained) and log.last_stat("contained_requests") == len(contained)
    assert {o.rid for o in failed} == {rid for rid, st in contained.items() if st == "aborted"}
    assert result.succeeded == len(specs) - len(failed) and srv.is_running()

    # Retry each aborted prompt: computed fresh (the bad slots are gone from the cache), no new violation.
    before = len(log.violations)
    by_index = {s.index: s for s in specs}
    for o in failed:
        meta = _generate(srv.base_url, by_index[o.index], f"retry-{o.rid}")
        assert meta["finish_reason"]["type"] == "length", meta
    again = run_requests(srv.base_url, build_workload(8, seed=32, n_aborts=0), concurrency=4, timeout=300)
    log2 = CanaryLog.read_settled(srv)
    assert again.failed == 0 and srv.is_running()
    assert len(log2.violations) == before, log2.violations[before:]
    assert log2.last_stat("violations") == log.last_stat("violations")


def _scrape(base_url):
    """{(name, frozenset(labels)): value} of the sglang:kv_canary_* samples on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    s = requests.Session()
    s.trust_env = False
    text = s.get(base_url + "/metrics", timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("sglang:kv_canary_"):
                out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _total(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


@pytest.mark.e2e
@needs_contain
def test_metrics_endpoint_exports_the_canary_counters(contain_server):
    """``--enable-metrics``: /metrics carries sglang:kv_canary_* with sglang's labels, and they move."""
    srv = contain_server
    before = _scrape(srv.base_url)
    result = run_requests(srv.base_url, build_workload(12, seed=33, n_aborts=0), concurrency=4, timeout=300)
    log = CanaryLog.read_settled(srv)
    after = _scrape(srv.base_url)
    names = {n for n, _ in after}
    print(f"kv_canary_e2e_metrics {result.summary()} series={len(after)} "
          f"slots_verified={_total(after, 'sglang:kv_canary_slots_verified_total')} "
          f"violations={_total(after, 'sglang:kv_canary_violations_total')} "
          f"contained={_total(after, 'sglang:kv_canary_contained_requests_total')}")
    for name in ("forwards", "slots_verified", "slots_written", "slots_swept", "sweeps", "health_violations",
                 "perturbations", "contained_requests", "contain_evicted_tokens"):
        assert f"sglang:kv_canary_{name}_total" in names, sorted(names)
    assert all(dict(ls).get("tp_rank") == "0" for _, ls in after)  # sglang's scheduler labels
    for name in ("forwards", "slots_verified", "slots_written"):
        metric = f"sglang:kv_canary_{name}_total"
        assert _total(after, metric) > _total(before, metric), metric
    # the exported counts are the canary's own (log stats line of the same settled state)
    assert _total(after, "sglang:kv_canary_slots_verified_total") == log.last_stat("slots_verified")
    assert _total(after, "sglang:kv_canary_perturbations_total") == log.last_stat("perturbations")
    assert _total(after, "sglang:kv_canary_contained_requests_total") == log.last_stat("contained_requests")
    if log.violations:
        assert _total(after, "sglang:kv_canary_violations_total", kind="kv_hash") >= len(log.violations)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))


# Flips anywhere in the slot under --kv-canary-real-data all: a slot already read once is hashed in full only by
# the scrub (every slot of the pool each forward here), which has no reader to name; contain must abort the running
# requests that hold it and evict it, and name no pseudo-request (issue 60).
SCRUB_ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.1",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "9",
    "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": "6",
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "anywhere",
    # every slot of the pool in one forward, whatever the device's test pool (MAX_TOTAL_TOKENS): the bound is 1
    "SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": str(2 * MAX_TOTAL_TOKENS[e2e_device()]),
}
HELD = "found by the scrub"


@pytest.mark.e2e
@needs_contain
def test_contain_aborts_the_holders_of_a_slot_the_scrub_finds(tmp_path):
    srv = canary_server("contain", log_path=tmp_path / "server.log", env=SCRUB_ENV,
                        extra_args=["--kv-canary-real-data", "all"])
    with srv:
        # long generations, sampled at 0.8: a flipped slot's holders are still running when the scrub finds it
        specs = build_workload(24, seed=41, n_aborts=0, max_new_tokens=(24, 48))
        result = run_requests(srv.base_url, specs, concurrency=8, timeout=600, temperature=0.8)
        log = CanaryLog.read_settled(srv)
        failed = [o for o in result.outcomes if o.status != "ok"]
        by_index = {s.index: s for s in specs}
        retried = [_generate(srv.base_url, by_index[o.index], f"retry-{o.rid}") for o in failed]
        log2 = CanaryLog.read_settled(srv)
        running = srv.is_running()
    contained = {c["rid"]: c["state"] for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"}
    scrub_rows = [v for v in log.violations if v["rid"] == "scrub"]
    injected = {p["slot"] for p in log.perturbations}
    print(f"kv_canary_e2e_contain_scrub {result.summary()} injections={len(log.perturbations)} "
          f"violations={len(log.violations)} scrub_rows={len(scrub_rows)} aborted={len(failed)} "
          f"held_aborts={sum(HELD in o.error for o in failed)} contained={log.last_stat('contained_requests')} "
          f"latencies={log.detection_latencies()} bound={log.scrub_bound()}")
    assert log.perturbations and log.unmatched_injections() == []
    assert max(log.detection_latencies()) <= log.scrub_bound() == 1  # every flip within the stated bound
    assert scrub_rows, "no flip was left to the scrub: the test proves nothing (change the seed)"
    # no pseudo-request: nothing aborted or counted for the scrub or the sweep
    assert not set(contained) & {"scrub", "cache", "?"}
    assert log.last_stat("contained_requests") == len(contained)
    # the holders of the slots the scrub found were aborted with the canary's message, naming an injected slot
    assert any(HELD in o.error for o in failed), [o.error for o in failed]
    for o in failed:
        assert MESSAGE in o.error and "'type': 'abort'" in o.error and "kind=kv_hash" in o.error, o.error
        assert o.error.split("slot=")[1].split()[0] in injected, o.error
    assert {o.rid for o in failed} == {rid for rid, st in contained.items() if st == "aborted"}
    # evicted: each aborted prompt, retried, is computed fresh with no new violation; the server keeps serving
    assert all(meta["finish_reason"]["type"] == "length" for meta in retried)
    assert len(log2.violations) == len(log.violations) and running


@pytest.mark.e2e
@pytest.mark.skipif(not GAP, reason="contain runs on this release (its tree interface is there)")
def test_contain_is_refused_where_the_evictor_interface_is_missing(tmp_path):
    """sglang 0.5.22 (the 0.5.23 line's other release) lacks the tree interface contain evicts through: the server
    refuses --kv-canary contain at startup, naming the flag and what is missing, instead of failing at its first
    eviction. Runs in the release matrix (scripts/release_matrix.py), not on the CI's lines, where contain runs."""
    srv = canary_server("contain", log_path=tmp_path / "server.log", env=ENV)
    with pytest.raises(ServerError):
        srv.start(timeout=600)
    text = srv.log_text()
    assert "CanaryConfigError" in text and "--kv-canary contain" in text and GAP in text, text[-3000:]
