"""Every other perturbation mode, in ``log`` and ``raise`` mode, against a real sglang server.

* req_to_token: a read req_to_token entry points at another slot of the same
  request for one forward -> caught by that forward's HEAD (position/chain).
* real_kv_unused_cache: a byte of a slot only the radix cache holds -> caught by
  the sweep (``--kv-canary-sweep-interval``).
* real_kv_post_forward: a byte of a slot the forward just wrote, after TAIL ->
  caught by the next read (HEAD or sweep).

All three modes inject on one server (their ``kv_canary_perturb=`` lines tell them
apart). Each injection line is matched to a violation; in log mode every violation
must be explained by an injection (no false positives) and the server keeps serving.
K/V flips land anywhere in the slot: with ``--kv-canary-real-data all`` every one
must be caught (at the slot's first read after its write, by the sweep's window, or by all's scrub within
its bound); with ``partial`` the test prints how many were (the detection
matrix in docs/detection.md) and still insists on no false positive.
"""

import pytest

from kv_canary_testing.canary_e2e import canary_server, register_cpu_ci, register_cuda_ci, serve_requests
from kv_canary_testing.workload import build_workload

register_cpu_ci(est_time=240, suite="kv-canary-cpu")
register_cuda_ci(est_time=240, suite="kv-canary-cuda")

SWEEP_INTERVAL = 4
# A pool big enough that cached slots are not evicted and recycled between an injection and
# the next sweep: a corrupted slot that is freed and rewritten before anything reads it is
# harmless and, by design, never reported (test_e2e_baseline covers eviction).
ROOMY_POOL_TOKENS = 32768
MODES = {
    "req_to_token": "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB",
    "real_kv_unused_cache": "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB",
    "real_kv_post_forward": "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB",
}


def _env():
    env = {var: "0.1" for var in MODES.values()}  # every mode at once: injections are told apart by their lines
    # req_to_token draws a read entry that is not a request's last (the TAIL links onto that one): some draws inject
    # nothing, and at 0.1 the 24-request run's ~45 forwards past the warmup left it with no injection at all once
    # (CI, 0.5.23, partial); at 0.25 that is below 1e-4
    env[MODES["req_to_token"]] = "0.25"
    # past every line's startup forwards (sglang 0.5.17 on a GPU: 11 with its health-check generate; an injection
    # there makes `raise` stop the server before it is up)
    env.update({"SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "24", "SGLANG_KV_CANARY_PERTURB_SEED": "3"})
    return env


def explains(injection, violation) -> bool:
    """Does this injection account for this violation?"""
    if injection["kv_canary_perturb"] == "req_to_token":
        # the redirected position (position/chain/token) and its successor's chain link, in that forward
        return (violation["rid"] == injection["rid"] and violation["forward"] == injection["forward"]
                and int(violation["position"]) - int(injection["position"]) in (0, 1))
    return (violation["group"], violation["slot"]) == (injection["group"], injection["slot"]) and int(
        violation["forward"]) >= int(injection["forward"])


ALL_SCRUB_SLOTS = 4096  # all's scrub on the roomy pool: every slot within ceil(32768 / 4096) = 8 forwards


def run_modes(tmp_path, canary_mode, n_requests=40, real_data="all", cpu_kernels="torch"):
    """One server with every mode of MODES injecting; the mixed workload without aborts."""
    env = _env()
    if real_data == "all":
        env["SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD"] = str(ALL_SCRUB_SLOTS)
    srv = canary_server(canary_mode, log_path=tmp_path / "server.log", env=env,
                        extra_args=["--kv-canary-sweep-interval", str(SWEEP_INTERVAL),
                                    "--kv-canary-real-data", real_data],
                        max_total_tokens=ROOMY_POOL_TOKENS,
                        cpu_kernels=cpu_kernels)
    # no aborts: an aborted request's freshly written slots are freed unread, so a
    # post-forward flip there is harmless and (by design) never reported
    return serve_requests(srv, build_workload(n_requests, seed=21, n_aborts=0))


@pytest.mark.e2e
@pytest.mark.parametrize("real_data", ["all", "partial"])
def test_log_mode_detects_every_injection(tmp_path, real_data):
    # 24 requests: each mode still injects several times. On CPU the canary's torch kernels run (the reference
    # every Triton kernel, the whole-row ones of `all` included, is unit-tested bit-equal to under the interpreter,
    # test_full_row); the compiled Triton path of `all` runs under CUDA graphs on the GPU host (docs/results)
    result, log, running, _ = run_modes(tmp_path, "log", n_requests=24, real_data=real_data)
    injections = [p for p in log.perturbations if p["kv_canary_perturb"] in MODES]
    unexplained = [v for v in log.violations if not any(explains(p, v) for p in injections)]
    missed_by_mode = {}
    for mode in sorted(MODES):
        mine = [p for p in injections if p["kv_canary_perturb"] == mode]
        missed = [p for p in mine if not any(explains(p, v) for v in log.violations)]
        latencies = [min(int(v["forward"]) - int(p["forward"]) for v in log.violations if explains(p, v))
                     for p in mine if p not in missed]
        missed_by_mode[mode] = (mine, missed, latencies)
        print(f"kv_canary_e2e_mode mode={mode} real_data={real_data} injections={len(mine)} "
              f"in_hashed_window={sum(p.get('hashed') == '1' for p in mine)} "
              f"detected={len(mine) - len(missed)} violations={len(log.violations)} "
              f"latency_forwards={sorted(latencies)} sweeps={log.last_stat('sweeps')}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5])
    assert unexplained == [], unexplained[:3]
    for mode, (mine, missed, latencies) in missed_by_mode.items():
        assert mine, f"no {mode} injection happened"
        if real_data == "partial" and mode != "req_to_token":
            # Only flips inside the hashed window can be seen; every one of those is.
            assert all(p.get("hashed") == "0" for p in missed), missed[:3]
            continue
        if mode == "real_kv_post_forward":
            # A flip into a slot that is freed before anything reads it again (with the overlap scheduler,
            # the extra decode of a request that already finished) is harmless and, by design, not
            # reported (docs/detection.md); the CI run of 2026-11-23 drew one such slot of 18. Every
            # other one must be caught.
            assert len(missed) <= max(1, len(mine) // 10), missed[:3]
            continue
        # all: a flip outside the window in a slot already read is the scrub's (within its bound)
        within = max(SWEEP_INTERVAL, log.scrub_bound()) if real_data == "all" else SWEEP_INTERVAL
        if mode == "real_kv_unused_cache":
            # the sweep finds a flip within SWEEP_INTERVAL forwards; one made in the workload's last forwards has
            # no sweep after it (an idle server runs none) and is not due yet. Every due one must be caught.
            last = log.last_stat("forwards_host")
            due = [p for p in mine if int(p["forward"]) + within <= last]
            assert due, f"no {mode} injection had a sweep after it ({len(mine)} injected, last forward {last})"
            missed = [p for p in missed if p in due]
        assert missed == [], missed[:3]
        if mode == "req_to_token":
            assert max(latencies) == 0
        if mode == "real_kv_unused_cache":
            assert log.last_stat("sweeps") > 0 and max(latencies) <= within
            assert any(v["rid"] in ("cache", "scrub") and any(explains(p, v) for p in mine) for v in log.violations)


@pytest.mark.e2e
def test_raise_mode_stops_on_the_first_detection(tmp_path):
    result, log, running, code = run_modes(tmp_path, "raise")
    injections = [p for p in log.perturbations if p["kv_canary_perturb"] in MODES]
    assert injections, log.text[-3000:]
    assert not running and code != 0
    assert "CanaryViolationError" in log.text
    assert log.violations and all(any(explains(p, v) for p in injections) for v in log.violations), \
        log.violations[:3]
    assert result.failed > 0  # in-flight requests failed instead of hanging


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
