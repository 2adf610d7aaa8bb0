"""With the canary on, sglang serves what it serves with the canary off: sampling at temperature 0.8, seeded.

Three servers of one configuration run the same clean workload (shared prefixes, chunked prefill, a pool small
enough to evict): two with ``--kv-canary none`` and one with ``--kv-canary log`` (defaults: write witness, token
oracle, real-data hash, sweep). Every server runs ``--random-seed 7``: sglang's sampler draws from that seeded
generator (per-request ``sampling_seed`` needs ``--enable-deterministic-inference``, which refuses the CPU
attention backend), so what a request samples depends on the requests sampled before it.

* Sequential (one request at a time): every batch is the same on every server, so the two off servers agree token
  for token; the canary server must then equal them token for token, request by request.
* Concurrent (8 at a time): which requests share a batch depends on timing, so sglang itself varies between two
  off runs. The canary server must differ from each off server no more than the off servers differ from each
  other (requests whose outputs differ), within the spread two off runs show.
"""

from __future__ import annotations

import pytest

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci, register_cuda_ci, serve_requests
from kv_canary_testing.workload import build_workload

register_cpu_ci(est_time=360, suite="kv-canary-cpu")
register_cuda_ci(est_time=300, suite="kv-canary-cuda")

TEMPERATURE = 0.8
SEQUENTIAL = build_workload(16, seed=41, n_aborts=0)
CONCURRENT = build_workload(32, seed=42, n_aborts=0)


def _serve(tmp_path, name: str, mode: str):
    """{phase: {request index: output ids}} of one server over both phases, and its canary log."""
    srv = canary_server(mode, log_path=tmp_path / f"{name}.log", extra_args=["--random-seed", "7"])
    srv.start(timeout=600)
    try:
        from kv_canary_testing.workload import run_requests

        outputs = {}
        for phase, specs, concurrency in (("sequential", SEQUENTIAL, 1), ("concurrent", CONCURRENT, 8)):
            result = run_requests(srv.base_url, specs, concurrency=concurrency, timeout=300, temperature=TEMPERATURE)
            assert result.failed == 0 and result.succeeded == len(specs), (name, result.errors[:3])
            outputs[phase] = result.outputs()
        log = CanaryLog.read_settled(srv) if mode != "none" else None
    finally:
        srv.stop()
    return outputs, log


def _differing(a, b):
    return sorted(i for i in a if a[i] != b[i])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("same_outputs")
    return {name: _serve(tmp, name, mode) for name, mode in (("off1", "none"), ("on", "log"), ("off2", "none"))}


@pytest.mark.e2e
def test_sequential_requests_sample_the_same_tokens_with_the_canary_on(runs):
    off1, off2, on = (runs[n][0]["sequential"] for n in ("off1", "off2", "on"))
    log = runs["on"][1]
    agree = [i for i in off1 if off1[i] == off2[i]]
    print(f"kv_canary_e2e_same_outputs phase=sequential requests={len(off1)} off_vs_off_agree={len(agree)} "
          f"on_vs_off_differ={_differing(on, off1)} slots_witnessed={log.last_stat('slots_witnessed')} "
          f"slots_verified={log.last_stat('slots_verified')} violations={len(log.violations)}")
    assert len(agree) == len(off1), f"sglang varies between two off runs of sequential requests: {agree}"
    assert _differing(on, off1) == [], "the canary changed what sglang sampled"
    assert log.violations == [] and log.last_stat("slots_witnessed") > 0 and log.last_stat("slots_verified") > 0
    assert len({tuple(v) for v in off1.values()}) > 1  # sampling, not one fixed output


@pytest.mark.e2e
def test_concurrent_requests_differ_with_the_canary_no_more_than_between_two_off_runs(runs):
    off1, off2, on = (runs[n][0]["concurrent"] for n in ("off1", "off2", "on"))
    off_off, on_off1, on_off2 = _differing(off1, off2), _differing(on, off1), _differing(on, off2)
    print(f"kv_canary_e2e_same_outputs phase=concurrent requests={len(off1)} off_vs_off_differ={len(off_off)} "
          f"on_vs_off1_differ={len(on_off1)} on_vs_off2_differ={len(on_off2)} "
          f"violations={len(runs['on'][1].violations)}")
    # requests sglang itself serves the same in both off runs: batches that formed alike
    agree = set(off1) - set(off_off)
    assert agree, "no request agreed between the two off runs: the comparison says nothing"
    # the canary server against the closer off run: no more requests differ than between the two off runs
    assert min(len(on_off1), len(on_off2)) <= len(off_off), (off_off, on_off1, on_off2)
    assert runs["on"][1].violations == []


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
