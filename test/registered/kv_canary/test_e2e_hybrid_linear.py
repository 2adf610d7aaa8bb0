"""Hybrid linear attention (sglang 0.5.12 ``HybridLinearKVPool``, Qwen3-Next class): the full-attention layers'
KV verified, injections caught, no false alarm.

One server: sglang's own ``Qwen3NextForCausalLM`` (config only, dummy weights; ``kv_canary_testing.model_dir.
write_qwen3_next_model_dir``: 3 Gated DeltaNet layers + 1 full-attention layer) in ``log`` mode under the mixed
workload (shared prefixes -> MambaRadixCache hits, chunked prefill, aborts, eviction) with K/V flips before
forwards (``real_kv_used``; ``real_kv_unused_cache``: a slot only the MambaRadixCache holds, tombstoned nodes
included, found by the sweep) and after them (``real_kv_post_forward``), the cache sweep
(``--kv-canary-sweep-interval``, ``adapter/mamba_radix``) on, CUDA graphs on. The canary's one group ``full`` is
the pool's inner ``MHATokenToKVPool`` (the full-attention layer, engine slots). The linear layers' conv/ssm state
(``MambaPool``: one state per request, updated in place every forward) is not covered.
Asserted: pool ``HybridLinearKVPool`` with groups ``full``; no request fails; every violation explained by an
injection; every ``real_kv_used`` flip caught; at least one post-forward flip caught; the sweep ran and found
at least one unused-cache flip (one whose node is evicted before the next sweep is freed unread: printed).

A second server runs the mixed workload in ``raise`` mode with the sweep after every forward and no
injection: zero violations, slots verified and swept (the MambaRadixCache index never claims a slot the tree
does not hold: mamba eviction tombstones keep their KV, and it is swept).

GPU only. On CPU sglang 0.5.12 cannot build this model: its full-attention layer's ``get_rope`` ->
``RotaryEmbedding.__init__`` imports ``vllm._custom_ops.rotary_embedding`` on any device that is neither CUDA
nor ``SGLANG_USE_CPU_ENGINE`` (sglang/srt/layers/rotary_embedding/base.py:90; seen: "No module named 'vllm'"),
and ``SGLANG_USE_CPU_ENGINE=1`` needs a CPU build of sgl_kernel (``sgl_kernel.mamba.causal_conv1d_fn_cpu``,
layers/attention/linear/gdn_backend.py:46) that is not on the package index. The tiny external models cannot
stand in: the Gated DeltaNet layers need sglang's own ``RadixLinearAttention`` model code.
"""

import pytest

from kv_canary_testing import hybrid_linear_checks as checks
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cuda_ci
from kv_canary_testing.line_suites import installed_line
from kv_canary_testing.model_dir import write_qwen3_next_model_dir
from kv_canary_testing.workload import build_workload, run_requests

register_cuda_ci(est_time=360, suite="kv-canary-cuda")  # two servers; one took 158 s on an H200

pytestmark = pytest.mark.skipif(
    e2e_device() != "cuda",
    reason="GPU only: on CPU sglang 0.5.12's Qwen3NextForCausalLM cannot be built (its full-attention layer's "
    "RotaryEmbedding imports vllm._custom_ops off CUDA: sglang/srt/layers/rotary_embedding/base.py:90; "
    "SGLANG_USE_CPU_ENGINE=1 needs sgl_kernel's CPU mamba ops, gdn_backend.py:46, not on the package index)")

# sglang 0.5.23 defaults to --mamba-radix-cache-strategy extra_buffer on the GPU, which the canary refuses there (not
# verified: adapter/lines/v0_5_23.refuse_unverified_pool); no_buffer is verified, and sglang runs it only with the
# overlap scheduler off
# overlap scheduler off; and its --kv-canary-real-data defaults to none (upstream's default), where the byte flips below
# need hashed bytes
LINE_ARGS = (["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule", "--kv-canary-real-data", "partial"]
             if installed_line() == "0.5.23" else [])
POOL_TOKENS = 4096  # small: the mixed workload forces radix-cache eviction
ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.05",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "0.05",
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "13",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "0.05",
}
SWEEP_INTERVAL = 4


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("hybrid_linear") / "server.log"
    srv = canary_server("log", log_path=log_path, env=ENV, model_path=write_qwen3_next_model_dir(),
                        extra_args=["--kv-canary-sweep-interval", str(SWEEP_INTERVAL), *LINE_ARGS], max_total_tokens=POOL_TOKENS)
    with srv:
        result = run_requests(srv.base_url, build_workload(60, seed=21, n_aborts=4), concurrency=8,
                              abort_mode="mixed", timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    by_mode, unexplained = log.injections_by_mode()
    print(f"kv_canary_e2e_hybrid_linear device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"graph_forwards={log.last_stat('graph_forwards')} sweeps={log.last_stat('sweeps')} "
          f"slots_swept={log.last_stat('slots_swept')} violations={len(log.violations)} "
          f"unexplained={len(unexplained)} " + " ".join(f"{m}={d}/{n}" for m, (n, d) in sorted(by_mode.items())))
    return dict(result=result, log=log, running=running, by_mode=by_mode, unexplained=unexplained)


@pytest.mark.e2e
def test_hybrid_linear_pool_serves_with_the_full_group(hybrid_run):
    log, result = hybrid_run["log"], hybrid_run["result"]
    assert "pool=HybridLinearKVPool groups=full" in log.text, log.text[-3000:]
    assert result.failed == 0 and hybrid_run["running"], "\n".join(result.errors[:5])
    # MambaRadixCache hits only where a mamba state was cached (not asserted; printed as cached_tokens=)
    assert log.last_stat("health_violations") == 0 and log.last_stat("slots_verified") > 0
    assert log.last_stat("graph_forwards") > 0  # verified inside replayed CUDA graphs too
    assert "kv_canary_jit_after_startup" not in log.text


@pytest.mark.e2e
def test_hybrid_linear_no_false_alarm(hybrid_run):
    checks.assert_no_false_alarm(hybrid_run)


@pytest.mark.e2e
def test_hybrid_linear_injections_caught(hybrid_run):
    checks.assert_injections_caught(hybrid_run)


@pytest.mark.e2e
def test_hybrid_linear_sweep_finds_unused_cache_flips(hybrid_run):
    checks.assert_sweep_finds_unused_cache_flips(hybrid_run)


@pytest.mark.e2e
def test_hybrid_linear_raise_mode_with_the_sweep_every_forward_has_no_violation(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("hybrid_linear_raise") / "server.log"
    srv = canary_server("raise", log_path=log_path, model_path=write_qwen3_next_model_dir(),
                        extra_args=["--kv-canary-sweep-interval", "1", *LINE_ARGS], max_total_tokens=POOL_TOKENS)
    with srv:
        result = run_requests(srv.base_url, build_workload(40, seed=23, n_aborts=3), concurrency=8,
                              abort_mode="mixed", timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    print(f"kv_canary_e2e_hybrid_linear_raise device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} sweeps={log.last_stat('sweeps')} "
          f"slots_swept={log.last_stat('slots_swept')} violations={log.last_stat('violations')}")
    assert running and result.failed == 0, "\n".join(result.errors[:5])
    assert log.violations == [] and log.last_stat("violations") == 0, log.violations[:3]
    assert log.last_stat("health_violations") == 0 and log.last_stat("slots_verified") > 0
    assert log.last_stat("sweeps") > 0 and log.last_stat("slots_swept") > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
