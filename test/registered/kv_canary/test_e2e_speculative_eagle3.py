"""EAGLE3 speculative decoding (spec v2, topk 1) with ``--kv-canary raise``: the same ``EAGLEWorkerV2``
batches as EAGLE (TARGET_VERIFY, draft decode steps, DRAFT_EXTEND_V2, the draft's prefill extend with
shifted ids), with EAGLE3's models: the tiny target captures hidden states at two layers
(``set_eagle3_layers_to_capture``, called by sglang's ``ModelRunner`` from the draft's
``eagle_config``) and the tiny EAGLE3 draft (``KvcTinyForCausalLMEagle3``) maps their concatenation
through its ``fc``. Target and draft pools verified, drafts accepted and rejected, nothing reported.

One server, a small workload (CPU CI time: the EAGLE module already runs the larger one); the
server flags, CPU stand-ins and request helper are ``test_e2e_speculative``'s. The draft pool is
verified eagerly on CPU and, on a GPU, under CUDA graphs (target verify, draft decode phase and
draft extend replayed), as for EAGLE.
"""

import pytest

from kv_canary.draft_pool import DRAFT_STATS_PREFIX
from kv_canary.violations import parse_lines
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cpu_ci, register_cuda_ci
from kv_canary_testing.model_dir import write_eagle3_model_dirs, write_eagle_model_dirs, write_mla_model_dir
from kv_canary_testing.server import ServerError
from kv_canary_testing.workload import build_workload, run_requests
from test_e2e_speculative import (MAX_TOTAL_TOKENS, NEW_TOKENS, NUM_DRAFT_TOKENS, NUM_STEPS, check_draft_pool,
                                  check_drafts_accepted_and_rejected, draft_summary)

register_cpu_ci(est_time=290, suite="kv-canary-cpu")
register_cuda_ci(est_time=120, suite="kv-canary-cuda")

CUDA = e2e_device() == "cuda"
N_REQUESTS, N_ABORTS = (32, 2) if CUDA else (12, 1)


def eagle3_server_args(target, draft, page_size: int = 1):
    return [
        "--model-path", str(target), "--attention-backend", "triton",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(NUM_DRAFT_TOKENS), "--speculative-draft-load-format", "dummy",
        "--max-running-requests", "8", "--kv-canary-sweep-interval", "4", "--page-size", str(page_size),
    ]


@pytest.fixture(scope="module")
def eagle3_server(tmp_path_factory):
    target, draft = write_eagle3_model_dirs(tmp_path_factory.mktemp("models"))
    srv = canary_server("raise", log_path=tmp_path_factory.mktemp("logs") / "server.log",
                        extra_args=eagle3_server_args(target, draft), max_total_tokens=MAX_TOTAL_TOKENS,
                        env={"SGLANG_EXTERNAL_MODEL_PACKAGE": "kv_canary_testing.spec_cpu"})
    with srv:
        yield srv


@pytest.mark.e2e
def test_eagle3_drafts_are_accepted_and_rejected(eagle3_server):
    check_drafts_accepted_and_rejected(eagle3_server, "kv_canary_e2e_eagle3_accept")


@pytest.mark.e2e
def test_eagle3_raise_mixed_workload_has_no_violation(eagle3_server):
    srv = eagle3_server
    specs = build_workload(N_REQUESTS, seed=33, n_aborts=N_ABORTS, long_len=(150, 260), max_new_tokens=NEW_TOKENS)
    result = run_requests(srv.base_url, specs, concurrency=8 if CUDA else 4, timeout=600)
    log = CanaryLog.read_settled(srv)
    running = srv.is_running()
    draft = parse_lines(log.text, DRAFT_STATS_PREFIX)
    print(f"kv_canary_e2e_eagle3 device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"slots_swept={log.last_stat('slots_swept')} forwards={log.last_stat('forwards_host')} "
          f"graph_replays={log.last_stat('graph_forwards')} violations={log.last_stat('violations')} "
          f"{draft_summary(draft[-1] if draft else {})}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5]) + "\n" + srv.log_tail()
    # sglang's EAGLEWorkerV2 served EAGLE3 (0.5.12 logs "Spec v2 is enabled"; 0.5.23, with the overlap scheduler off
    # as on CPU, "Non-overlap (synchronous) spec v2 is used"; 0.5.23 on the GPU, overlap on, names no mode: its draft
    # captures its decode graphs)
    assert "algorithm=EAGLE3" in log.text and ("spec v2 is enabled" in log.text.lower() or "spec v2 is used" in log.text
                                               or (CUDA and "Capture draft decode CUDA graph" in log.text))
    assert result.cached_tokens > 0 and result.aborted == N_ABORTS
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("health_violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_swept") > 0
    assert log.last_stat("verify_launches") == log.last_stat("write_launches") == log.last_stat("forwards_host")
    check_draft_pool(log.text, draft)  # the draft pool verified (CPU: eager; GPU: its phases and extends replayed)
    if CUDA:  # the target's verify forwards replayed from CUDA graphs
        assert log.last_stat("graph_forwards") > 0
    assert "kv_canary_jit_after_startup" not in log.text and "Traceback" not in log.text


@pytest.mark.e2e
def test_speculative_decoding_over_an_mla_target_is_refused_at_startup(tmp_path):
    """MTP drafts of MLA models (DeepSeek/GLM NextN) run through the same worker over MLA pools, which were never
    run with speculative decoding: the target's install refuses, naming the flag and value (docs/speculative.md)."""
    if CUDA:
        pytest.skip("the refusal is device-independent; CPU CI runs it")
    _, draft = write_eagle_model_dirs(tmp_path / "models")
    srv = canary_server("raise", log_path=tmp_path / "server.log", model_path=write_mla_model_dir(),
                        extra_args=["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
                                    "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                                    "--speculative-num-draft-tokens", "3", "--speculative-draft-load-format", "dummy"])
    with pytest.raises(ServerError):
        srv.start(timeout=600)
    text = srv.log_text()
    assert "CanaryConfigError" in text, text[-3000:]
    assert ("--kv-canary raise cannot verify --speculative-algorithm EAGLE with the target model's KV pool "
            "MLATokenToKVPool") in text, text[-3000:]
    assert "--kv-canary none" in text and "Uvicorn running" not in text


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
