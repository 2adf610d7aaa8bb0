"""Tensor parallel (``--tp-size 2``): each rank verifies its own KV shard, every line names its rank,
``contain`` aborts the same requests on both ranks, ``raise`` on one rank stops the whole server.

A ``real_kv_used`` perturbation runs on rank 1 only (``SGLANG_KV_CANARY_PERTURB_TP_RANK=1``): it flips a
hashed byte of rank 1's shard, which rank 0 never sees -- the case where the ranks must agree on what to abort.

* CUDA (two GPUs): sglang's own ``LlamaForCausalLM`` (its layers shard over the ranks), config only, dummy
  weights, CUDA graphs.
* CPU: two scheduler processes on the CPU, gloo collectives. sglang's Llama cannot be built off CUDA (its
  rotary embedding imports ``vllm`` custom ops), so the model is ``KvcTinyTpForCausalLM`` (the tiny model
  with its attention heads split over the ranks: each rank's KV pool holds its own KV heads). The server
  runs as on a CPU-only host: one core per rank (``SGLANG_CPU_OMP_THREADS_BIND``; sglang binds one rank per
  NUMA node otherwise) and no NCCL library (``SGLANG_NCCL_SO_PATH`` names none: the CUDA build of torch in
  the test venv ships one, and sglang's PyNccl communicator would take it and ask for a CUDA device).
"""

from __future__ import annotations

import pytest

from kv_canary.violations import CONTAIN_PREFIX, PERTURB_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import canary_server, e2e_device, register_cpu_ci, register_cuda_ci
from kv_canary_testing.model_dir import write_model_dir
from kv_canary_testing.ranks import by_rank, cpu_tp_env, retry_aborted, settled_by_rank
from kv_canary_testing.workload import build_workload, run_requests

register_cuda_ci(est_time=420, suite="kv-canary-cuda")
register_cpu_ci(est_time=420, suite="kv-canary-cpu")


def _skip_reason():
    if e2e_device() != "cuda":
        return None
    import torch

    if torch.cuda.device_count() < 2:
        return f"--tp-size 2 needs two GPUs; this host has {torch.cuda.device_count()}"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

INJECTIONS = 3
PERTURB = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.2",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "5",
    "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": str(INJECTIONS),
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
    "SGLANG_KV_CANARY_PERTURB_TP_RANK": "1",
}
MESSAGE = "kv-canary contain: aborted"


CPU = e2e_device() == "cpu"
# requests per test: fewer on CPU (two ranks share the machine's cores, Triton kernels interpreted)
N_CLEAN, N_CONTAIN, N_RAISE = (48, 32, 16) if CPU else (120, 48, 24)


def _tp_model(tmp_path_factory):
    if CPU:
        return write_model_dir(tmp_path_factory.mktemp("tp-tiny"), config_overrides={
            "architectures": ["KvcTinyTpForCausalLM"]})
    return write_model_dir(tmp_path_factory.mktemp("tp-llama"), config_overrides={
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"})


def _server(tmp_path_factory, mode, name, env=None, extra=()):
    device_args = [] if CPU else ["--dtype", "bfloat16", "--cuda-graph-max-bs", "16"]
    srv = canary_server(mode, log_path=tmp_path_factory.mktemp(name) / "server.log",
                        env={**(cpu_tp_env() if CPU else {}), **(env or {})},
                        extra_args=["--tp-size", "2", *device_args, "--model-path", str(_tp_model(tmp_path_factory)),
                                    "--kv-canary-real-data", "partial", *extra])  # 0.5.23's default is none
    return srv


def _by_rank(lines):
    return by_rank(lines, "tp_rank")


@pytest.fixture(scope="module")
def contain_tp(tmp_path_factory):
    srv = _server(tmp_path_factory, "contain", "tp-contain", env=PERTURB, extra=["--kv-canary-sweep-interval", "8"])
    srv.start(timeout=900)
    try:
        yield srv
    finally:
        srv.stop()


def _settled(srv):
    return settled_by_rank(srv, ("0", "1"), "tp_rank")


@pytest.mark.e2e
def test_tp2_raise_mixed_workload_has_no_violation_on_either_rank(tmp_path_factory):
    """Shared prefixes, chunked prefill, aborts, eviction (a small pool) under --tp-size 2 in raise mode."""
    srv = _server(tmp_path_factory, "raise", "tp-clean", extra=["--kv-canary-sweep-interval", "8",
                                                                "--max-total-tokens", "4096"])
    srv.start(timeout=900)
    try:
        specs = build_workload(N_CLEAN, seed=2027, n_aborts=6)
        result = run_requests(srv.base_url, specs, concurrency=16, abort_mode="disconnect", timeout=600)
        text, stats = _settled(srv)
        violations = parse_lines(text, VIOLATION_PREFIX)
        print(f"kv_canary_e2e_tp_clean device={e2e_device()} tp=2 {result.summary()} " + " ".join(
            f"rank{r}_slots_verified={stats[r][-1]['slots_verified']} rank{r}_slots_swept="
            f"{stats[r][-1]['slots_swept']} rank{r}_forwards={stats[r][-1]['forwards_host']}" for r in sorted(stats))
            + f" violations={len(violations)}")
        assert result.failed == 0, "\n".join(result.errors[:5])
        assert result.succeeded == len(specs) - 6 and result.cached_tokens > 0
        assert srv.is_running() and violations == [], violations[:3]
        assert set(stats) == {"0", "1"}
        for r in stats:
            last = stats[r][-1]
            assert int(last["slots_verified"]) > 0 and int(last["slots_swept"]) > 0
            assert int(last["violations"]) == 0 and int(last["health_violations"]) == 0
        # the ranks ran the same forwards over the same slots (one schedule, two shards)
        assert stats["0"][-1]["slots_verified"] == stats["1"][-1]["slots_verified"]
    finally:
        srv.stop()


@pytest.mark.e2e
def test_tp2_contain_aborts_the_same_requests_on_both_ranks(contain_tp):
    srv = contain_tp
    specs = build_workload(N_CONTAIN, seed=31, n_aborts=0)
    result = run_requests(srv.base_url, specs, concurrency=8, timeout=300)
    text, stats = _settled(srv)
    injections = _by_rank(parse_lines(text, PERTURB_PREFIX))
    violations = _by_rank(parse_lines(text, VIOLATION_PREFIX))
    contains = _by_rank([c for c in parse_lines(text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"])
    failed = [o for o in result.outcomes if o.status != "ok"]
    print(f"kv_canary_e2e_tp_contain device={e2e_device()} tp=2 {result.summary()} "
          f"injections_rank1={len(injections.get('1', []))} violations_rank0={len(violations.get('0', []))} "
          f"violations_rank1={len(violations.get('1', []))} "
          f"slots_verified_rank0={stats['0'][-1]['slots_verified']} "
          f"slots_verified_rank1={stats['1'][-1]['slots_verified']} "
          f"aborts_rank0={len(contains.get('0', []))} aborts_rank1={len(contains.get('1', []))} "
          f"aborted_by_canary={len(failed)}")
    # each rank verified its own shard, and every canary line names its rank
    assert set(stats) == {"0", "1"} and all(int(stats[r][-1]["slots_verified"]) > 0 for r in stats)
    assert set(injections) == {"1"} and len(injections["1"]) == INJECTIONS  # rank 1's shard only
    # rank 0's shard is intact: it sees nothing; rank 1 sees exactly the flipped slots
    assert "0" not in violations and violations.get("1"), text[-3000:]
    flipped = {p["slot"] for p in injections["1"]}
    assert all(v["kind"] == "kv_hash" and v["slot"] in flipped for v in violations["1"])
    # contain: both ranks abort the same requests (rank 1's findings, agreed at the scheduler's safe point)
    rids = {r: {c["rid"]: c["state"] for c in contains.get(r, [])} for r in ("0", "1")}
    assert rids["0"] and rids["0"] == rids["1"], rids
    assert {v["rid"] for v in violations["1"]} <= set(rids["1"])
    assert failed and all(MESSAGE in o.error and "kind=kv_hash" in o.error for o in failed)
    assert {o.rid for o in failed} == {rid for rid, st in rids["0"].items() if st == "aborted"}
    assert result.succeeded == len(specs) - len(failed) and srv.is_running()
    # retries of the aborted prompts are computed fresh on both ranks: no new violation
    before = len(parse_lines(text, VIOLATION_PREFIX))
    retry_aborted(srv, specs, failed)
    text2, _ = _settled(srv)
    assert len(parse_lines(text2, VIOLATION_PREFIX)) == before and srv.is_running()


@pytest.mark.e2e
def test_tp2_raise_on_one_rank_stops_the_server(tmp_path_factory):
    srv = _server(tmp_path_factory, "raise", "tp-raise", env=PERTURB)
    srv.start(timeout=900)
    try:
        result = run_requests(srv.base_url, build_workload(N_RAISE, seed=41, n_aborts=0), concurrency=6, timeout=300)
        code = srv.wait_exit(timeout=180)
        text = srv.log_text()
        violations = parse_lines(text, VIOLATION_PREFIX)
        print(f"kv_canary_e2e_tp_raise {result.summary()} exit={code} violations={len(violations)} "
              f"ranks={sorted({v.get('tp_rank') for v in violations})}")
        assert code != 0 and "CanaryViolationError" in text
        assert violations and all(v.get("tp_rank") == "1" and v["kind"] == "kv_hash" for v in violations)
        assert result.failed > 0  # in-flight requests failed instead of hanging
    finally:
        srv.stop()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
