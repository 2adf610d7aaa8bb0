"""EAGLE spec v1 (sglang's ``EAGLEWorker``: ``--speculative-eagle-topk`` > 1, ``--disable-overlap-schedule``) with
``--kv-canary raise`` and ``--kv-canary-real-data`` unset (``all``: the scrub on): the target model's tree verifies
read the committed prefix (HEAD) and their kept drafts are written after sglang's verify (the deferred TAIL); drafts
are accepted and rejected, nothing is reported (the scrub included: the slots spec v1 stores into without a TAIL are
forgotten first), and the greedy outputs equal the target's without speculative decoding. One EAGLE server per
configuration, shared by the module's tests (plus a short-lived reference server without speculative decoding, canary
off, for the greedy check).

CPU: one server (page size 1, topk 2, eager), the tiny target + tiny EAGLE draft through
``kv_canary_testing.spec_cpu`` (CPU stand-ins for sglang's CUDA-only EAGLE ops, any topk). GPU: CUDA graphs on
(the target's TARGET_VERIFY graphs captured with the canary's HEAD/TAIL), page size 1 with topk 2 (Triton
attention), and page size 16 with topk 2 over fa3 (sglang serves page size > 1 with topk > 1 on the
flashinfer/fa3 backends only; there the kept K/V is moved by ``move_kv_cache`` before the deferred write hashes it).
The draft model's own pool is verified too (its draft decode steps read each request's committed prefix, its draft
extends over the kept tokens are written and verified; ``kv_canary_draft_stats=`` lines): eagerly on CPU, and on the
GPU replayed from sglang's draft graph runners (EAGLEDraftCudaGraphRunner over ``bs * topk`` lanes,
EAGLEDraftExtendCudaGraphRunner over the packed kept tokens).
"""

import os

import pytest
import requests

from kv_canary.draft_pool import DRAFT_STATS_PREFIX
from kv_canary.violations import parse_lines
from kv_canary_testing.canary_e2e import (
    CHUNKED_PREFILL_SIZE,
    CanaryLog,
    canary_server,
    e2e_device,
    register_cpu_ci,
    register_cuda_ci,
)
from kv_canary_testing.model_dir import word_token_id, write_eagle_model_dirs
from kv_canary_testing.workload import build_workload, run_requests
from test_e2e_speculative import NEW_TOKENS, check_draft_pool, draft_summary

register_cpu_ci(est_time=420, suite="kv-canary-cpu")  # the EAGLE server + a short reference one
register_cuda_ci(est_time=300, suite="kv-canary-cuda")

NUM_STEPS, TOPK, NUM_DRAFT_TOKENS = 3, 2, 4  # a tree: 3 of the 2 + 4 + 4 candidate drafts, siblings included
CUDA = e2e_device() == "cuda"
# (page size, attention backend): sglang serves page size > 1 with topk > 1 on fa3/flashinfer only (GPU)
PAGED_BACKEND = os.environ.get("KVC_SPEC_V1_PAGED_BACKEND", "flashinfer")  # or fa3 (needs sgl_kernel's FA3 ops)
CONFIGS = [(1, "triton"), (16, PAGED_BACKEND)] if CUDA else [(1, "triton")]
MAX_TOTAL_TOKENS = 2048 if CUDA else 1024  # the target's pool: the uncached prompt tokens exceed it (eviction)
N_REQUESTS, N_ABORTS = (64, 4) if CUDA else (16, 1)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"page{c[0]}-{c[1]}")
def eagle_v1_server(request, tmp_path_factory):
    page_size, backend = request.param
    # fa3/flashinfer take head_dim 64/96/128/192/256 (the tiny models' default is 16)
    target, draft = write_eagle_model_dirs(tmp_path_factory.mktemp("models"),
                                           overrides={"head_dim": 64} if backend != "triton" else None)
    extra = [
        "--model-path", str(target), "--attention-backend", backend,
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", str(TOPK),
        "--speculative-num-draft-tokens", str(NUM_DRAFT_TOKENS), "--speculative-draft-load-format", "dummy",
        "--disable-overlap-schedule", "--max-running-requests", "8", "--kv-canary-sweep-interval", "4",
        "--page-size", str(page_size),
    ]
    srv = canary_server("raise", log_path=tmp_path_factory.mktemp("logs") / "server.log", extra_args=extra,
                        max_total_tokens=MAX_TOTAL_TOKENS,
                        env={"SGLANG_EXTERNAL_MODEL_PACKAGE": "kv_canary_testing.spec_cpu"})
    srv.kvc_target, srv.kvc_config = target, request.param  # the greedy check's reference server serves the target
    with srv:
        yield srv


def _post(srv, body):
    s = requests.Session()
    s.trust_env = False
    r = s.post(srv.base_url + "/generate", timeout=600, json=body)
    r.raise_for_status()
    return r.json()


PROMPTS = [[word_token_id(i + j) for j in range(6)] for i in (1, 40, 200)]


def _greedy(srv, prompt, n=24):
    return _post(srv, {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}})


@pytest.mark.e2e
def test_spec_v1_drafts_accepted_and_rejected_and_greedy_outputs_equal_the_non_speculative_target(eagle_v1_server,
                                                                                                 tmp_path):
    """Three greedy requests through the tree verifies equal those of the same target served without speculative
    decoding (a reference server, canary off: sglang's input logprobs, which would let the EAGLE server check
    itself, need CUDA in 0.5.12's LogitsProcessor), and some drafts are accepted, some rejected.

    The equality is the proof that the CPU stand-ins (``kv_canary_testing.spec_cpu``: the draft tree, the greedy
    walk) compute what sglang's CUDA ops do, so it runs on CPU (float32); on a GPU sglang's own ops run, in the
    models' half precision, where a verify kernel and a decode kernel may break a near-tie differently."""
    srv = eagle_v1_server
    outs = [_greedy(srv, p) for p in PROMPTS]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    print(f"kv_canary_e2e_eagle_v1_accept completion_tokens={tokens} verify_forwards={verifies}")
    # one token per request comes from the prefill; a verify appends 1..NUM_STEPS + 1
    assert verifies < tokens - len(PROMPTS), "no draft was ever accepted"
    assert verifies * (NUM_STEPS + 1) > tokens - len(PROMPTS), "every draft was accepted"
    if CUDA:
        return
    page_size, backend = srv.kvc_config
    ref_srv = canary_server("none", log_path=tmp_path / "reference.log", max_total_tokens=MAX_TOTAL_TOKENS,
                            extra_args=["--model-path", str(srv.kvc_target), "--attention-backend", backend,
                                        "--page-size", str(page_size), "--max-running-requests", "8"],
                            env={"SGLANG_EXTERNAL_MODEL_PACKAGE": "kv_canary_testing.spec_cpu"})
    with ref_srv:
        refs = [_greedy(ref_srv, p) for p in PROMPTS]
    equal = sum(o["output_ids"] == r["output_ids"] for o, r in zip(outs, refs))
    print(f"kv_canary_e2e_eagle_v1_greedy greedy_equal_to_non_speculative={equal}/{len(PROMPTS)} "
          f"tokens_each={[len(o['output_ids']) for o in outs]}")
    assert equal == len(PROMPTS), [(o["output_ids"], r["output_ids"]) for o, r in zip(outs, refs)]


@pytest.mark.e2e
def test_spec_v1_raise_mixed_workload_has_no_violation(eagle_v1_server):
    srv = eagle_v1_server
    specs = build_workload(N_REQUESTS, seed=8, n_aborts=N_ABORTS, long_len=(150, 260), max_new_tokens=NEW_TOKENS)
    result = run_requests(srv.base_url, specs, concurrency=8 if CUDA else 4, timeout=600)
    log = CanaryLog.read_settled(srv)
    running = srv.is_running()
    forwards, writes = log.last_stat("forwards_host"), log.last_stat("write_launches")
    draft = parse_lines(log.text, DRAFT_STATS_PREFIX)  # the draft pool's own manager
    print(f"kv_canary_e2e_eagle_v1 device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"slots_swept={log.last_stat('slots_swept')} forwards={forwards} deferred_writes={writes - forwards} "
          f"graph_replays={log.last_stat('graph_forwards')} slots_scrubbed={log.last_stat('slots_scrubbed')} "
          f"violations={log.last_stat('violations')} "
          f"health_violations={log.last_stat('health_violations')} "
          f"{draft_summary(draft[-1] if draft else {})}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5]) + "\n" + srv.log_tail()
    # the workload exercised what the canary must survive: prefix hits, chunked prefill, an abort, eviction
    assert result.cached_tokens > 0
    assert max(o.prompt_tokens for o in result.outcomes) > CHUNKED_PREFILL_SIZE
    assert result.aborted == N_ABORTS
    assert result.uncached_prompt_tokens > MAX_TOTAL_TOKENS
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("health_violations") == 0
    # --kv-canary-real-data unset is all with spec v1 too, its scrub over both pools: the slots the draft decode steps
    # (scratch) and the tree verifies (every node) store into without a TAIL -- freed slots that held earlier owners'
    # records, under this eviction -- are forgotten first, so the scrub reports none of them
    assert "kv_canary_real_data_default=all" in log.text and "real_data=all" in log.text
    assert log.last_stat("slots_scrubbed") > 0 and int(draft[-1]["slots_scrubbed"]) > 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_swept") > 0
    # every forward ran HEAD and TAIL; each tree verify's deferred TAIL is one more write launch (counted)
    assert log.last_stat("verify_launches") == forwards and writes > forwards
    # the draft pool verified, eager and under CUDA graphs alike -- draft prefills, draft decode steps (reading the
    # committed prefix, writing nothing: scratch slots) and draft extends over the kept tokens
    check_draft_pool(log.text, draft)
    assert "kv_canary_jit_after_startup" not in log.text and "Traceback" not in log.text
    if CUDA:  # the target's verify forwards ran inside replayed CUDA graphs
        assert "cuda graph: True" in log.text
        assert log.last_stat("graph_forwards") > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
