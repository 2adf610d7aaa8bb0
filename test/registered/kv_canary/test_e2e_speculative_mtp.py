"""An MTP draft (multi-token prediction) through sglang's EAGLE worker: sglang's own ``MiMoForCausalLM`` target
with its ``MiMoMTP`` draft, ``--speculative-algorithm NEXTN`` (sglang's alias of EAGLE), topk 1, spec v2,
CUDA graphs, ``--kv-canary raise``: the same ``EAGLEWorkerV2`` batches as EAGLE over two
``MHATokenToKVPool``s, so the target and the draft's pools are verified as for EAGLE
(``docs/history/speculative.md``, "EAGLE3 and MTP"). The mixed workload: every request succeeds, nothing is
reported, slots verified in both pools, graph replays counted.

GPU only: on CPU sglang 0.5.12 cannot build MiMo's Qwen2 layers (``get_rope`` -> ``RotaryEmbedding``
imports ``vllm._custom_ops`` on a device that is neither CUDA nor the CPU engine:
``sglang/srt/layers/rotary_embedding/base.py:90``), and the tiny external models are not MTP classes.
"""

import pytest

from kv_canary.draft_pool import DRAFT_INSTALLED_PREFIX, DRAFT_STATS_PREFIX
from kv_canary.violations import parse_lines
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cuda_ci
from kv_canary_testing.model_dir import write_mimo_model_dir
from kv_canary_testing.workload import build_workload, run_requests

register_cuda_ci(est_time=150, suite="kv-canary-cuda")

pytestmark = pytest.mark.skipif(
    e2e_device() != "cuda",
    reason="GPU only: on CPU sglang 0.5.12's MiMoForCausalLM/MiMoMTP (Qwen2 layers) cannot be built: their "
    "RotaryEmbedding imports vllm._custom_ops off CUDA (sglang/srt/layers/rotary_embedding/base.py:90)")

N_REQUESTS, N_ABORTS = 48, 3


def _mtp_server(tmp_path_factory, mode: str):
    model = write_mimo_model_dir(tmp_path_factory.mktemp("models") / "mimo")
    return canary_server(mode, log_path=tmp_path_factory.mktemp("logs") / f"server-{mode}.log", model_path=model,
                         extra_args=["--attention-backend", "triton", "--speculative-algorithm", "NEXTN",
                                     "--speculative-draft-model-path", str(model),
                                     "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "3",
                                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                                     "--max-running-requests", "8",
                                     *(["--kv-canary-sweep-interval", "4"] if mode != "none" else [])],
                         max_total_tokens=2048)


@pytest.fixture(scope="module")
def mtp_server(tmp_path_factory):
    with _mtp_server(tmp_path_factory, "raise") as srv:
        yield srv


@pytest.mark.e2e
def test_mtp_serves_with_the_canary_off(tmp_path_factory):
    """The control: the same NEXTN server with ``--kv-canary none`` serves the same workload, so a failure of the
    canary's run is the canary's (sglang 0.5.23's canary run died in its MiMo forward at warm-up: issue 57)."""
    with _mtp_server(tmp_path_factory, "none") as srv:
        specs = build_workload(N_REQUESTS, seed=41, n_aborts=N_ABORTS, long_len=(150, 260), max_new_tokens=(8, 24))
        result = run_requests(srv.base_url, specs, concurrency=8, timeout=600)
        print(f"kv_canary_e2e_mtp_control device={e2e_device()} {result.summary()}")
        assert result.failed == 0 and srv.is_running(), "\n".join(result.errors[:5]) + "\n" + srv.log_tail()
        assert "Spec v2 is enabled" in srv.log_text()


@pytest.mark.e2e
def test_mtp_draft_raise_mixed_workload_has_no_violation(mtp_server):
    srv = mtp_server
    specs = build_workload(N_REQUESTS, seed=41, n_aborts=N_ABORTS, long_len=(150, 260), max_new_tokens=(8, 24))
    result = run_requests(srv.base_url, specs, concurrency=8, timeout=600)
    log = CanaryLog.read_settled(srv)
    running = srv.is_running()
    draft = parse_lines(log.text, DRAFT_STATS_PREFIX)
    d = draft[-1] if draft else {}
    print(f"kv_canary_e2e_mtp device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"slots_swept={log.last_stat('slots_swept')} forwards={log.last_stat('forwards_host')} "
          f"graph_replays={log.last_stat('graph_forwards')} violations={log.last_stat('violations')} "
          f"draft_slots_verified={d.get('slots_verified')} draft_slots_written={d.get('slots_written')} "
          f"draft_forwards={d.get('forwards_host')} draft_graph_replays={d.get('graph_forwards')} "
          f"draft_violations={d.get('violations')}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5]) + "\n" + srv.log_tail()
    assert "Spec v2 is enabled" in log.text  # sglang's EAGLEWorkerV2
    assert result.cached_tokens > 0 and result.aborted == N_ABORTS
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("health_violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("graph_forwards") > 0
    installed = parse_lines(log.text, DRAFT_INSTALLED_PREFIX)
    assert installed and installed[0]["kv_token_id_vs_position_offset"] == "1", installed
    assert installed[0]["draft_model"] == "MiMoMTP" and installed[0]["pool"] == "MHATokenToKVPool", installed
    assert d.get("settled") == "1", draft[-3:]
    assert int(d["violations"]) == 0 and int(d["health_violations"]) == 0
    assert int(d["slots_verified"]) > 0 and int(d["graph_forwards"]) > 0
    assert "kv_canary_jit_after_startup" not in log.text and "Traceback" not in log.text


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
