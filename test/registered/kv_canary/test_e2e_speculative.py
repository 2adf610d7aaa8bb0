"""EAGLE speculative decoding (spec v2, topk 1) with ``--kv-canary raise``: the target model's
TARGET_VERIFY forwards are verified and fingerprinted, drafts are accepted and rejected, and
nothing is reported. One server, shared by the tests of this module.

On CPU, stock sglang 0.5.12 cannot serve EAGLE (docs/speculative.md): the server loads
``kv_canary_testing.spec_cpu``, which gives sglang's four CUDA-only EAGLE helpers a CPU
implementation (topk 1) and runs everything else -- scheduler, EAGLE worker, pools, Triton
attention under the interpreter, the canary -- unchanged. The draft model's own KV pool is not
verified yet (logged at startup). CUDA graphs stay off (the allow-list refuses EAGLE inside them
until a GPU run proves it).
"""

import pytest
import requests

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cpu_ci, register_cuda_ci
from kv_canary_testing.model_dir import write_eagle_model_dirs
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=500, suite="kv-canary-cpu")
register_cuda_ci(est_time=180, suite="kv-canary-cuda")

NUM_STEPS, NUM_DRAFT_TOKENS = 2, 3
DRAFT_SKIPPED = "the speculative draft model's KV pool is not verified yet"


@pytest.fixture(scope="module")
def eagle_server(tmp_path_factory):
    target, draft = write_eagle_model_dirs(tmp_path_factory.mktemp("models"))
    extra = [
        "--model-path", str(target), "--attention-backend", "triton",
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(NUM_DRAFT_TOKENS), "--speculative-draft-load-format", "dummy",
        "--max-running-requests", "8", "--kv-canary-sweep-interval", "4",
    ]
    if e2e_device() == "cuda":
        extra.append("--disable-cuda-graph")
    srv = canary_server("raise", log_path=tmp_path_factory.mktemp("logs") / "server.log", extra_args=extra,
                        env={"SGLANG_EXTERNAL_MODEL_PACKAGE": "kv_canary_testing.spec_cpu"})
    with srv:
        yield srv


def _generate(srv, text, n):
    s = requests.Session()
    s.trust_env = False
    r = s.post(srv.base_url + "/generate", timeout=600,
               json={"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    r.raise_for_status()
    return r.json()


@pytest.mark.e2e
def test_eagle_drafts_are_accepted_and_rejected(eagle_server):
    """The workload below exercises every verify outcome: some drafts accepted, some rejected."""
    outs = [_generate(eagle_server, " ".join(f"w{i + j}" for j in range(6)), 24) for i in (1, 40, 200)]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    print(f"kv_canary_e2e_eagle_accept completion_tokens={tokens} verify_forwards={verifies}")
    # one token per request comes from the prefill; a verify appends 1..NUM_DRAFT_TOKENS
    assert verifies < tokens - len(outs), "no draft was ever accepted"
    assert verifies * NUM_DRAFT_TOKENS > tokens - len(outs), "every draft was accepted"


@pytest.mark.e2e
def test_eagle_raise_mixed_workload_has_no_violation(eagle_server):
    specs = build_workload(16, seed=8, n_aborts=1, long_len=(150, 260), max_new_tokens=(8, 24))
    result = run_requests(eagle_server.base_url, specs, concurrency=4, timeout=600)
    log = CanaryLog.read_settled(eagle_server)
    running = eagle_server.is_running()
    print(f"kv_canary_e2e_eagle {result.summary()} slots_verified={log.last_stat('slots_verified')} "
          f"slots_written={log.last_stat('slots_written')} slots_swept={log.last_stat('slots_swept')} "
          f"violations={log.last_stat('violations')}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5])
    assert result.cached_tokens > 0
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_swept") > 0
    assert DRAFT_SKIPPED in log.text


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
