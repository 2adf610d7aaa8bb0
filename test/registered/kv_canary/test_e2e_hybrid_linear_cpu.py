"""Hybrid linear attention on CPU (sglang 0.5.12 and 0.5.23): ``HybridLinearKVPool``'s full-attention KV
verified, the mamba-aware radix cache swept, injections caught, no false alarm.

sglang's own ``Qwen3NextForCausalLM`` cannot be built on CPU (CUDA device calls and kernels; the GPU file
``test_e2e_hybrid_linear.py`` runs it, on 0.5.12), so the model is ``KvcTinyHybridLinearForCausalLM``
(``kv_canary_testing.tiny_model.kvc_tiny_hybrid_linear``) on the tiny Qwen3-Next config: sglang picks the
pool, the mamba state pool, the radix cache (0.5.12: ``MambaRadixCache``; 0.5.23: the FULL + MAMBA
``UnifiedRadixCache``) and the hybrid linear attention backend from the config class, as for the real
model; the full-attention layer is the tiny model's (its K/V through sglang's inner ``MHATokenToKVPool``),
the linear-attention layers a torch stand-in that does not touch the mamba state (which the canary does
not cover). sglang 0.5.23 on CPU needs ``--mamba-radix-cache-strategy no_buffer`` (``extra_buffer``
snapshots need a GPU platform), which needs ``--disable-overlap-schedule``; a small mamba state pool
(``--max-mamba-cache-size``) makes sglang evict states (tombstones keep their KV, which the sweep verifies).

One ``log`` server (mixed workload: shared prefixes, chunked prefill, aborts, eviction; ``real_kv_used``,
``real_kv_post_forward`` and ``real_kv_unused_cache`` flips, the sweep every 4 forwards) and one ``raise``
server with the sweep after every forward and no injection.
"""

import pytest

from kv_canary_testing import hybrid_linear_checks as checks
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cpu_ci
from kv_canary_testing.model_dir import write_tiny_hybrid_linear_model_dir
from kv_canary_testing.server import installed_sglang_version
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=300, suite="kv-canary-cpu")

pytestmark = pytest.mark.skipif(e2e_device() != "cpu", reason="the CPU stand-in; test_e2e_hybrid_linear.py on GPU")

POOL_TOKENS = 1024  # small: the mixed workload forces radix-cache eviction
MAMBA_STATES = 32  # small: mamba eviction tombstones cached nodes
NEWEST = installed_sglang_version() != "0.5.12"
ARGS = (("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule") if NEWEST else ()) + (
    "--max-mamba-cache-size", str(MAMBA_STATES), "--kv-canary-real-data", "partial")
ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.05",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "0.05",
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "13",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "0.05",
}


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("hybrid_linear_cpu") / "server.log"
    srv = canary_server("log", log_path=log_path, env=ENV, model_path=write_tiny_hybrid_linear_model_dir(),
                        extra_args=["--kv-canary-sweep-interval", "4", *ARGS], max_total_tokens=POOL_TOKENS)
    with srv:
        result = run_requests(srv.base_url, build_workload(40, seed=21, n_aborts=3), concurrency=8,
                              abort_mode="mixed", timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    by_mode, unexplained = log.injections_by_mode()
    print(f"kv_canary_e2e_hybrid_linear_cpu {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"sweeps={log.last_stat('sweeps')} slots_swept={log.last_stat('slots_swept')} "
          f"violations={len(log.violations)} unexplained={len(unexplained)} "
          + " ".join(f"{m}={d}/{n}" for m, (n, d) in sorted(by_mode.items())))
    return dict(result=result, log=log, running=running, by_mode=by_mode, unexplained=unexplained)


@pytest.mark.e2e
def test_hybrid_linear_pool_serves_with_the_full_group(hybrid_run):
    log, result = hybrid_run["log"], hybrid_run["result"]
    assert "pool=HybridLinearKVPool groups=full" in log.text, log.text[-3000:]
    if NEWEST:  # 0.5.12 logs no tree name (its MambaRadixCache)
        assert "Components: (<ComponentType.FULL: 0>, <ComponentType.MAMBA: 2>)" in log.text  # sglang's own tree
    assert result.failed == 0 and hybrid_run["running"], "\n".join(result.errors[:5])
    assert result.uncached_prompt_tokens > POOL_TOKENS, "no eviction forced"
    assert log.last_stat("health_violations") == 0 and log.last_stat("slots_verified") > 0


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
    log_path = tmp_path_factory.mktemp("hybrid_linear_cpu_raise") / "server.log"
    srv = canary_server("raise", log_path=log_path, model_path=write_tiny_hybrid_linear_model_dir(),
                        extra_args=["--kv-canary-sweep-interval", "1", *ARGS], max_total_tokens=POOL_TOKENS)
    with srv:
        result = run_requests(srv.base_url, build_workload(24, seed=23, n_aborts=2), concurrency=8,
                              abort_mode="mixed", timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    print(f"kv_canary_e2e_hybrid_linear_cpu_raise {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} sweeps={log.last_stat('sweeps')} "
          f"slots_swept={log.last_stat('slots_swept')} violations={log.last_stat('violations')}")
    assert running and result.failed == 0, "\n".join(result.errors[:5])
    assert log.violations == [] and log.last_stat("violations") == 0, log.violations[:3]
    assert log.last_stat("health_violations") == 0 and log.last_stat("slots_verified") > 0
    assert log.last_stat("sweeps") > 0 and log.last_stat("slots_swept") > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
