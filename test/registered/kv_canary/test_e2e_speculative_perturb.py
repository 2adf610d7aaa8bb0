"""EAGLE (spec v2, topk 1; and spec v1, topk 2) with perturbations in the target model's pool, or in
the draft model's own
pool (``SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=draft``), ``--kv-canary log``: every
``real_kv_used`` flip (a K/V byte of a slot the forward reads) and every ``req_to_token`` redirect
(a read entry pointing at another slot of the same request) injected into a TARGET_VERIFY or
prefill forward (or, in the draft pool, a draft prefill, draft decode phase or draft extend) is
reported by that forward's HEAD in that pool, nothing else is reported, and the server keeps serving.
On the GPU the verify forwards, the draft decode phases and the draft extends replay from CUDA graphs
(the draft pool's HEAD/TAIL captured inside the draft's graphs).

On sglang 0.5.12, GPU only in CI: the CPU suite runs one EAGLE server (``test_e2e_speculative``), and a
second one under the Triton interpreter costs minutes of CI time; the same run on CPU is recorded in
docs/history/speculative.md (``run_perturbed`` with ``device="cpu"``). On sglang 0.5.23 (which the GPU host cannot
load; its canary verifies synchronous spec v2 on CPU) the two spec v2 tests run in the CPU suite, 12 requests
each; spec v1 is gone there (topk > 1 is refused at startup).
"""

import pytest

from kv_canary.draft_pool import DRAFT_GROUP, DRAFT_STATS_PREFIX
from kv_canary.violations import parse_lines
from kv_canary_testing.canary_e2e import (
    CanaryLog, canary_server, cuda_skip_reason, e2e_device, register_cpu_ci, register_cuda_ci,
)
from kv_canary_testing.line_suites import installed_sglang
from kv_canary_testing.model_dir import write_eagle_model_dirs
from kv_canary_testing.workload import build_workload, run_requests

register_cuda_ci(est_time=420, suite="kv-canary-cuda")
register_cpu_ci(est_time=420, suite="kv-canary-cpu")  # sglang 0.5.23 only (the 0.5.12 CPU run skips)

CPU_LINE = "0.5.23"  # the line whose speculative path is verified on CPU only (docs/compatibility.md)
SPEC_V1_GONE = "sglang 0.5.23 has no spec v1 (EAGLEWorker); topk > 1 is refused at startup there"


def spec_v2_device() -> str:
    """Where the spec v2 perturbation tests run ('' : skipped here): the GPU suite; on sglang 0.5.23, the CPU one too."""
    if e2e_device() == "cuda" and not cuda_skip_reason():
        return "cuda"
    return "cpu" if installed_sglang() == CPU_LINE and e2e_device() == "cpu" else ""

MODES = {"real_kv_used": "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB",
         "req_to_token": "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB"}


def explains(injection, violation) -> bool:
    """Does this injection account for this violation? (as in test_e2e_perturb_modes)"""
    if injection["kv_canary_perturb"] == "req_to_token":
        return (violation["group"] == injection["group"] and violation["rid"] == injection["rid"]
                and violation["forward"] == injection["forward"]
                and int(violation["position"]) - int(injection["position"]) in (0, 1))
    return (violation["group"], violation["slot"]) == (injection["group"], injection["slot"]) and int(
        violation["forward"]) >= int(injection["forward"])


def run_perturbed(tmp_path, device: str, n_requests: int, target_group: str = "", spec_v1: bool = False,
                  perturb_seed: int = 3):
    """(workload result, canary log, still running) of an EAGLE server with both perturbations on, in the
    target's pool (``target_group`` '') or the draft's (``'draft'``); ``spec_v1``: topk 2 with the overlap
    scheduler off (sglang's EAGLEWorker: tree verifies; its draft pool's phases and extends replayed from the
    draft's CUDA graphs as for spec v2)."""
    target, draft = write_eagle_model_dirs(tmp_path / "models")
    env = {name: "0.15" for name in MODES.values()}
    if target_group:
        env["SGLANG_KV_CANARY_PERTURB_TARGET_GROUP"] = target_group
    env.update({"SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "5", "SGLANG_KV_CANARY_PERTURB_SEED": str(perturb_seed),
                "SGLANG_EXTERNAL_MODEL_PACKAGE": "kv_canary_testing.spec_cpu",
                # all: a flip in a slot already read is the scrub's: every slot within 4 forwards of this pool
                "SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "4096"})
    extra = [
        "--model-path", str(target), "--attention-backend", "triton",
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
        *(("--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4",
           "--disable-overlap-schedule") if spec_v1 else
          ("--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")),
        "--speculative-draft-load-format", "dummy", "--max-running-requests", "8", "--kv-canary-real-data", "all",
    ]
    srv = canary_server("log", log_path=tmp_path / "server.log", env=env, extra_args=extra, device=device,
                        max_total_tokens=16384)
    with srv:
        # no aborts: an aborted request's fresh slots are freed unread (a flip there is harmless, never reported)
        result = run_requests(srv.base_url, build_workload(n_requests, seed=21, n_aborts=0, max_new_tokens=(8, 24)),
                              concurrency=8, timeout=600)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    return result, log, running


@pytest.mark.e2e
def test_eagle_target_pool_perturbations_are_each_detected(tmp_path):
    device = spec_v2_device()
    if not device:
        pytest.skip("sglang 0.5.12: GPU suite only (CI time): on CPU the EAGLE server runs under the Triton "
                    "interpreter and test_e2e_speculative already holds the one CPU EAGLE server; the CPU run is in "
                    "docs/history/speculative.md")
    result, log, running = run_perturbed(tmp_path, device, 64 if device == "cuda" else 12)
    check(result, log, running, "full")


@pytest.mark.e2e
def test_eagle_draft_pool_perturbations_are_each_detected(tmp_path):
    device = spec_v2_device()
    if not device:
        pytest.skip("sglang 0.5.12: GPU suite only (CI time): on CPU the EAGLE server runs under the Triton "
                    "interpreter and test_e2e_speculative already holds the one CPU EAGLE server (whose draft pool "
                    "is verified); the CPU run is in docs/history/speculative.md")
    result, log, running = run_perturbed(tmp_path, device, 64 if device == "cuda" else 12, target_group=DRAFT_GROUP)
    check(result, log, running, DRAFT_GROUP)


@pytest.mark.e2e
def test_eagle_spec_v1_target_pool_perturbations_are_each_detected(tmp_path):
    if installed_sglang() == CPU_LINE:
        pytest.skip(SPEC_V1_GONE)
    if e2e_device() != "cuda" or cuda_skip_reason():
        pytest.skip("GPU suite only (CI time): on CPU the EAGLE server runs under the Triton interpreter and "
                    "test_e2e_speculative_v1 already holds the one CPU spec v1 server; the CPU run is in "
                    "docs/history/speculative.md")
    result, log, running = run_perturbed(tmp_path, "cuda", 64, spec_v1=True)
    check(result, log, running, "full")


@pytest.mark.e2e
def test_eagle_spec_v1_draft_pool_perturbations_are_each_detected(tmp_path):
    if installed_sglang() == CPU_LINE:
        pytest.skip(SPEC_V1_GONE)
    if e2e_device() != "cuda" or cuda_skip_reason():
        pytest.skip("GPU suite only (CI time): on CPU the EAGLE server runs under the Triton interpreter and "
                    "test_e2e_speculative_v1 already holds the one CPU spec v1 server (whose draft pool is "
                    "verified); the CPU run is in docs/history/speculative.md")
    result, log, running = run_perturbed(tmp_path, "cuda", 64, target_group=DRAFT_GROUP, spec_v1=True)
    check(result, log, running, DRAFT_GROUP)


def check(result, log, running, group: str) -> None:
    injections = [p for p in log.perturbations if p["kv_canary_perturb"] in MODES]
    assert {p["group"] for p in injections} <= {group}, "an injection outside the targeted pool"
    missed = [p for p in injections if not any(explains(p, v) for v in log.violations)]
    unexplained = [v for v in log.violations if not any(explains(p, v) for p in injections)]
    by_kind = {m: sum(p["kv_canary_perturb"] == m for p in injections) for m in MODES}
    draft = parse_lines(log.text, DRAFT_STATS_PREFIX)
    print(f"kv_canary_e2e_eagle_perturb group={group} {result.summary()} injections={by_kind} "
          f"detected={len(injections) - len(missed)} violations={len(log.violations)} "
          f"slots_verified={log.last_stat('slots_verified')} graph_replays={log.last_stat('graph_forwards')} "
          f"draft_slots_verified={draft[-1]['slots_verified'] if draft else None} "
          f"draft_graph_replays={draft[-1]['graph_forwards'] if draft else None}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5])
    assert all(by_kind.values()), f"not every perturbation kind was injected: {by_kind}"
    assert missed == [], missed[:3]
    assert unexplained == [], unexplained[:3]
    if group == DRAFT_GROUP and e2e_device() == "cuda":  # the draft's forwards replayed from its CUDA graphs
        assert draft and int(draft[-1]["graph_forwards"]) > 0, draft[-3:]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
