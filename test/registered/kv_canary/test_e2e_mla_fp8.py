"""MLA KV pool (sglang 0.5.12 ``MLATokenToKVPool``) with an fp8 KV cache: verified, injections caught, no false alarm.

One server (module-scoped; one CPU server start): the MLA tiny model
(``MiniCPM3ForCausalLM`` name: one latent row of ``kv_lora_rank + qk_rope_head_dim``
= 32 + 16 values per layer and slot on CPU, 512 + 64 on the GPU host, no V half;
``kv_canary_testing.tiny_model.kvc_tiny_mla``) with ``--kv-cache-dtype fp8_e4m3``
(the pool stores uint8; one byte per value: 48-byte rows on CPU) and ``--kv-canary-real-data all`` (every stored
byte of every layer hashed at a slot's first read, and by the scrub), in ``log`` mode under the mixed workload (shared
prefixes, chunked prefill, aborts, eviction), with K/V flips anywhere in a slot
before forwards (``real_kv_used``) and after them (``real_kv_post_forward``).
Asserted: the pool is ``MLATokenToKVPool`` with fp8 storage, no request fails,
every violation is explained by an injection, every ``real_kv_used`` flip is
caught, at least one post-forward flip is caught.

MHA with fp8 is covered at the pool level by ``test/unit/test_pools.py`` (sglang's
own ``MHATokenToKVPool`` in fp8_e4m3/e5m2, written by its ``set_kv_buffer``).
"""

import pytest

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cpu_ci, register_cuda_ci
from kv_canary_testing.model_dir import write_mla_model_dir
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=90, suite="kv-canary-cpu")
register_cuda_ci(est_time=200, suite="kv-canary-cuda")

# On the GPU host the tiny model takes DeepSeek's MLA widths (kv_lora_rank 512 + qk_rope_head_dim 64): sglang
# 0.5.12's Triton MLA decode kernel does not compile for the narrow CPU row (kv_lora_rank 32: "Cannot
# make_shape_compatible ... 32 and 64" at ``acc += tl.dot(p.to(v.dtype), v)``, seen on an H200), while
# Lk = 576 takes its split latent/rotary path (decode_attention.py / extend_attention.py). CPU keeps the
# narrow row (CI time).
WIDE = e2e_device() == "cuda"

ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.05",
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB": "0.05",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10",
    "SGLANG_KV_CANARY_PERTURB_SEED": "5",
    # all: a flip in a slot already read is its scrub's; the whole pool each forward, so none waits past the
    # workload's end (the default 256 slots per forward covers this pool in ceil(pool / 256) forwards)
    "SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "8192",
}


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("mla") / "server.log"
    srv = canary_server("log", log_path=log_path, env=ENV, model_path=write_mla_model_dir(wide=WIDE),
                        extra_args=["--kv-cache-dtype", "fp8_e4m3", "--kv-canary-real-data", "all"])
    with srv:
        result = run_requests(srv.base_url, build_workload(40, seed=9, n_aborts=3), concurrency=8,
                              abort_mode="mixed", timeout=300)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    by_mode, unexplained = log.injections_by_mode()
    print(f"kv_canary_e2e_mla_fp8 device={e2e_device()} wide={int(WIDE)} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"violations={len(log.violations)} unexplained={len(unexplained)} "
          + " ".join(f"{m}={d}/{n}" for m, (n, d) in sorted(by_mode.items())))
    return dict(result=result, log=log, running=running, by_mode=by_mode, unexplained=unexplained)


@pytest.mark.e2e
def test_mla_fp8_pool_serves(mla_run):
    log, result = mla_run["log"], mla_run["result"]
    assert "pool=MLATokenToKVPool groups=full" in log.text, log.text[-3000:]
    assert "real_data=all" in log.text
    assert result.failed == 0 and mla_run["running"], "\n".join(result.errors[:5])
    assert result.cached_tokens > 0, "no radix-cache prefix hits"
    assert log.last_stat("health_violations") == 0 and log.last_stat("slots_verified") > 0
    assert "kv_canary_jit_after_startup" not in log.text


@pytest.mark.e2e
def test_mla_fp8_no_false_alarm(mla_run):
    assert mla_run["unexplained"] == [], mla_run["unexplained"][:3]


@pytest.mark.e2e
def test_mla_fp8_injections_caught(mla_run):
    injected, detected = mla_run["by_mode"].get("real_kv_used", (0, 0))
    assert injected > 0 and detected == injected, mla_run["by_mode"]
    injected, detected = mla_run["by_mode"].get("real_kv_post_forward", (0, 0))
    assert injected > 0 and detected > 0, mla_run["by_mode"]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
