"""What the model was fed: a decode forward run at shifted positions, and a request fed a token
that is not its own, are caught by that forward's TAIL on a real sglang server.

* ``position_shift``: one decode forward runs at ``positions + 1`` (RoPE rotates K for the wrong
  position); every slot it writes records the position it ran with and is flagged at once
  (``kind=position``, stored = expected + 1). Latency 0 forwards.
* ``next_token_swap``: two requests of a decode forward are fed each other's token (a
  future-token resolution bug); TAIL compares the fed token with the token oracle (the
  scheduler's prompt ids + sampled ids, never ``input_ids``): ``kind=token`` naming the request,
  the position, the fed and the expected token, in that forward.

``log`` keeps serving and every violation is explained by an injection; ``raise`` stops.
"""

import pytest

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci, register_cuda_ci
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=200, suite="kv-canary-cpu")
register_cuda_ci(est_time=200, suite="kv-canary-cuda")

ENV = {
    "SGLANG_KV_CANARY_PERTURB_POSITION_SHIFT_PROB": "0.04",
    "SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "0.04",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "5",
}


def explains(injection, violation) -> bool:
    kinds = violation["kind"].split("+")
    if injection["kv_canary_perturb"] == "position_shift":
        # the slots that forward wrote (and any later read of them: the same slot, position and values)
        return "position" in kinds and int(violation["stored"]) - int(violation["expected"]) == 1 and int(
            violation["forward"]) >= int(injection["forward"])
    return ("token" in kinds and violation["position"] == injection["position"]
            and violation["stored"] == injection["fed"] and violation["expected"] == injection["own"])


@pytest.mark.e2e
def test_log_mode_catches_shifted_positions_and_wrong_tokens_in_the_forward_that_fed_them(tmp_path):
    srv = canary_server("log", log_path=tmp_path / "server.log", env=ENV)
    with srv:
        result = run_requests(srv.base_url, build_workload(50, seed=31, n_aborts=0), concurrency=8, timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    injections = log.perturbations
    by_mode = {m: [p for p in injections if p["kv_canary_perturb"] == m] for m in ("position_shift", "next_token_swap")}
    first_hits = {}
    for p in injections:
        hits = [v for v in log.violations if explains(p, v) and v["forward"] == p["forward"]]
        first_hits[id(p)] = hits
    missed = [p for p in injections if not first_hits[id(p)]]
    unexplained = [v for v in log.violations if not any(explains(p, v) for p in injections)]
    print(f"kv_canary_e2e_fed position_shift={len(by_mode['position_shift'])} "
          f"next_token_swap={len(by_mode['next_token_swap'])} detected_in_same_forward="
          f"{len(injections) - len(missed)} violations={len(log.violations)} unexplained={len(unexplained)}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5]) + srv.log_tail()
    assert by_mode["position_shift"] and by_mode["next_token_swap"], "no injection of each mode happened"
    assert missed == [], missed[:3]
    assert unexplained == [], unexplained[:3]
    for p in by_mode["next_token_swap"]:  # the violation names the request that was fed the wrong token
        assert any(v["rid"] == p["rid"] and v["kind"] == "token" for v in first_hits[id(p)]), first_hits[id(p)]
    for p in by_mode["position_shift"]:  # every request of that decode forward
        assert len(first_hits[id(p)]) == int(p["requests"]), (p, first_hits[id(p)])


@pytest.mark.e2e
def test_raise_mode_stops_on_a_shifted_position(tmp_path):
    env = {k: v for k, v in ENV.items() if "NEXT_TOKEN" not in k}
    srv = canary_server("raise", log_path=tmp_path / "server.log", env=env)
    srv.start(timeout=600)
    try:
        result = run_requests(srv.base_url, build_workload(50, seed=31, n_aborts=0), concurrency=8, timeout=120)
        code = srv.wait_exit(timeout=120)
        log = CanaryLog.read_settled(srv)
    finally:
        srv.stop()
    assert log.perturbations and log.perturbations[0]["kv_canary_perturb"] == "position_shift", srv.log_tail()
    assert code != 0 and "CanaryViolationError" in log.text
    assert any(explains(log.perturbations[0], v) for v in log.violations), log.violations[:3]
    assert result.failed > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
