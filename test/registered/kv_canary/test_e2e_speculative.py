"""EAGLE speculative decoding (spec v2, topk 1) with ``--kv-canary raise``: the target model's
TARGET_VERIFY forwards are verified and fingerprinted, drafts are accepted and rejected, and
nothing is reported. One server per configuration, shared by the tests of this module.

On a GPU the target's TARGET_VERIFY forwards replay from sglang's CUDA graphs (the canary's
HEAD/TAIL captured inside them), at page size 1 and 16. On CPU, stock sglang 0.5.12 cannot
serve EAGLE (docs/history/speculative.md): the server loads ``kv_canary_testing.spec_cpu``, which gives
sglang's four CUDA-only EAGLE helpers a CPU implementation (topk 1) and runs everything else --
scheduler, EAGLE worker, pools, Triton attention under the interpreter, the canary --
unchanged; there are no CUDA graphs on CPU, and one server (page size 1) keeps CI time down.
The draft model's own KV pool is verified too (its own ``draft`` group and manager,
``kv_canary_draft_stats=`` lines): eagerly on CPU; on the GPU under CUDA graphs (the draft decode
phase replayed from ``EAGLEDraftCudaGraphRunner``, the draft extend from
``EAGLEDraftExtendCudaGraphRunner``, HEAD/TAIL captured inside, every replay counted).
"""

import pytest
import requests

from kv_canary_testing.canary_e2e import (
    CHUNKED_PREFILL_SIZE,
    CanaryLog,
    canary_server,
    e2e_device,
    register_cpu_ci,
    register_cuda_ci,
)
from kv_canary.draft_pool import DRAFT_INSTALLED_PREFIX, DRAFT_STATS_PREFIX
from kv_canary.violations import parse_lines
from kv_canary_testing.model_dir import write_eagle_model_dirs
from kv_canary_testing.server import installed_sglang_version
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=260, suite="kv-canary-cpu")
register_cuda_ci(est_time=240, suite="kv-canary-cuda")

NUM_STEPS, NUM_DRAFT_TOKENS = 3, 4  # 2 draft decode steps per round: two single-forward managers
DRAFT_SKIPPED = "the speculative draft model's KV pool is not verified"
CUDA = e2e_device() == "cuda"
# (page size, synchronous): on a GPU sglang runs spec v2 with the overlap scheduler; 0.5.23 also runs it synchronously
# with --disable-overlap-schedule (0.5.12 then runs spec v1: test_e2e_speculative_v1). CPU is synchronous anyway.
CONFIGS = [(1, False), (16, False)] if CUDA else [(1, False)]
if CUDA and installed_sglang_version() != "0.5.12":
    CONFIGS.append((1, True))
MAX_TOTAL_TOKENS = 2048 if CUDA else 1024  # the target's pool: the uncached prompt tokens exceed it (eviction)
N_REQUESTS, N_ABORTS = (64, 4) if CUDA else (16, 1)
# CPU: shorter generations (CI time: each verify round is several forwards under the Triton interpreter); the
# prompts -- prefix hits, chunked prefill, eviction -- are the same (build_workload draws them independently)
NEW_TOKENS = (8, 24) if CUDA else (4, 12)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"page{c[0]}" + ("-sync" if c[1] else ""))
def eagle_server(request, tmp_path_factory):
    page, sync = request.param
    target, draft = write_eagle_model_dirs(tmp_path_factory.mktemp("models"))
    extra = [
        "--model-path", str(target), "--attention-backend", "triton",
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(NUM_DRAFT_TOKENS), "--speculative-draft-load-format", "dummy",
        "--max-running-requests", "8", "--kv-canary-sweep-interval", "4", "--page-size", str(page),
    ] + (["--disable-overlap-schedule"] if sync else [])
    srv = canary_server("raise", log_path=tmp_path_factory.mktemp("logs") / "server.log", extra_args=extra,
                        max_total_tokens=MAX_TOTAL_TOKENS,
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


def check_drafts_accepted_and_rejected(srv, label: str) -> None:
    """Three greedy requests: some drafts accepted, some rejected (every verify outcome happens)."""
    outs = [_generate(srv, " ".join(f"w{i + j}" for j in range(6)), 24) for i in (1, 40, 200)]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    print(f"{label} completion_tokens={tokens} verify_forwards={verifies}")
    # one token per request comes from the prefill; a verify appends 1..NUM_DRAFT_TOKENS
    assert verifies < tokens - len(outs), "no draft was ever accepted"
    assert verifies * NUM_DRAFT_TOKENS > tokens - len(outs), "every draft was accepted"


def draft_summary(d: dict) -> str:
    """The draft pool's numbers of its last stats line ``d``, for the e2e result line."""
    return " ".join(f"draft_{name}={d.get(key)}" for name, key in (
        ("slots_verified", "slots_verified"), ("slots_written", "slots_written"), ("forwards", "forwards_host"),
        ("outer_steps", "outer_steps"), ("graph_replays", "graph_forwards"), ("violations", "violations"),
        ("health_violations", "health_violations")))


def check_draft_pool(text: str, draft: list) -> None:
    """The draft pool verified (CPU: eager; GPU: under CUDA graphs): installed with the token offset 1, settled, no
    violation, its prefill/draft-extend forwards and each draft decode step counted (``draft``: its stats lines)."""
    d = draft[-1] if draft else {}
    installed = parse_lines(text, DRAFT_INSTALLED_PREFIX)
    assert installed and installed[0]["kv_token_id_vs_position_offset"] == "1", installed
    # read through the allocator the draft shares with the target (SpecFacts.target_pool_name)
    assert installed[0]["target_pool"] == "MHATokenToKVPool", installed
    assert DRAFT_SKIPPED not in text
    assert d.get("settled") == "1", draft[-3:]
    assert int(d["violations"]) == 0 and int(d["health_violations"]) == 0
    assert int(d["slots_verified"]) > 0 and int(d["slots_written"]) > 0
    # prefills, draft extends and NUM_STEPS - 1 decode steps per draft phase: more forwards than outer steps
    assert int(d["forwards_host"]) > int(d["outer_steps"])
    # every forward the device ran (HEAD and TAIL, eager or inside a replayed graph) was counted on the host
    assert int(d["verify_launches"]) == int(d["write_launches"]) == int(d["forwards_host"])
    if CUDA:  # the draft decode phases and draft extends replayed from the draft's CUDA graphs
        assert int(d["graph_forwards"]) > 0, draft[-3:]


@pytest.mark.e2e
def test_eagle_drafts_are_accepted_and_rejected(eagle_server):
    """The workload below exercises every verify outcome: some drafts accepted, some rejected."""
    check_drafts_accepted_and_rejected(eagle_server, "kv_canary_e2e_eagle_accept")


@pytest.mark.e2e
def test_eagle_raise_mixed_workload_has_no_violation(eagle_server):
    specs = build_workload(N_REQUESTS, seed=8, n_aborts=N_ABORTS, long_len=(150, 260), max_new_tokens=NEW_TOKENS)
    result = run_requests(eagle_server.base_url, specs, concurrency=8 if CUDA else 4, timeout=600)
    log = CanaryLog.read_settled(eagle_server)
    running = eagle_server.is_running()
    draft = parse_lines(log.text, DRAFT_STATS_PREFIX)  # the draft pool's own manager (CPU: eager; GPU: graphs)
    d = draft[-1] if draft else {}
    print(f"kv_canary_e2e_eagle device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"slots_swept={log.last_stat('slots_swept')} forwards={log.last_stat('forwards_host')} "
          f"graph_replays={log.last_stat('graph_forwards')} violations={log.last_stat('violations')} "
          f"{draft_summary(d)}")
    assert result.failed == 0 and running, "\n".join(result.errors[:5]) + "\n" + eagle_server.log_tail()
    # the workload exercised what the canary must survive: prefix hits, chunked prefill, an abort, eviction
    assert result.cached_tokens > 0
    assert max(o.prompt_tokens for o in result.outcomes) > CHUNKED_PREFILL_SIZE
    assert result.aborted == N_ABORTS
    assert result.uncached_prompt_tokens > MAX_TOTAL_TOKENS
    assert log.violations == [] and log.last_stat("violations") == 0
    assert log.last_stat("health_violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_swept") > 0
    assert log.last_stat("verify_launches") == log.last_stat("write_launches") == log.last_stat("forwards_host")
    check_draft_pool(log.text, draft)
    assert "kv_canary_jit_after_startup" not in log.text and "Traceback" not in log.text
    if CUDA:  # the target's verify forwards ran inside replayed CUDA graphs
        assert "cuda graph: True" in log.text
        assert log.last_stat("graph_forwards") > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
