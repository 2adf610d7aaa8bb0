"""Baseline: a real sglang 0.5.12 server with ``--kv-canary raise`` serves a hard mixed
workload (concurrency, radix prefix hits, chunked prefill, aborts, eviction) with zero
violations, and the canary demonstrably verified slots."""

import pytest

from kv_canary_testing.canary_e2e import (
    CHUNKED_PREFILL_SIZE,
    MAX_TOTAL_TOKENS,
    CanaryLog,
    canary_server,
    e2e_device,
    register_cpu_ci,
    register_cuda_ci,
)
from kv_canary_testing.line_suites import installed_line, installed_sglang
from kv_canary_testing.workload import RequestSpec, abort_mode_for, build_workload, run_requests

register_cpu_ci(est_time=240, suite="kv-canary-cpu")
register_cuda_ci(est_time=240, suite="kv-canary-cuda")

SWEEP_INTERVAL = 8
# On CPU the newest line's run drives the Triton kernels (the interpreter): the default configuration's launches,
# precompile included; the kernels are the same code on every line, so 0.5.12's run takes the torch reference
# (CI time: the interpreter costs ~13x per forward)
CPU_KERNELS = "torch" if installed_line() == "0.5.12" else "triton"
# CI time: under the interpreter 200 requests took 172-198 s of serving (0.5 s a forward, ~85% of it in the
# interpreter); 64 still evict (~5,000 uncached prompt tokens against the 2,048-token pool), chunk long prompts,
# hit cached prefixes and abort 12, in a third of the time. The torch reference (0.5.12, GPU: compiled) runs 200.
N_REQUESTS = 64 if e2e_device() == "cpu" and CPU_KERNELS == "triton" else 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # sglang's own spawned children, as operators run it (the other CPU e2e servers fork theirs: fast_launch)
    srv = canary_server("raise", log_path=tmp_path_factory.mktemp("baseline") / "server.log",
                        extra_args=["--kv-canary-sweep-interval", str(SWEEP_INTERVAL)], cpu_kernels=CPU_KERNELS,
                        spawn_children=True)
    srv.start(timeout=600)
    yield srv
    srv.stop()


@pytest.mark.e2e
def test_mixed_workload_has_no_violation(server):
    specs = build_workload(N_REQUESTS, seed=2026, n_aborts=12)
    # mixed: half disconnect, half /abort_request (API only where sglang loses a disconnect's abort)
    result = run_requests(server.base_url, specs, concurrency=16, abort_mode=abort_mode_for(installed_sglang()),
                          timeout=300)
    log = CanaryLog.read_settled(server)
    print(f"kv_canary_e2e_baseline device={e2e_device()} {result.summary()} "
          f"slots_verified={log.last_stat('slots_verified')} slots_written={log.last_stat('slots_written')} "
          f"slots_witnessed={log.last_stat('slots_witnessed')} "
          f"sweeps={log.last_stat('sweeps')} slots_swept={log.last_stat('slots_swept')} "
          f"violations={len(log.violations)} graph_forwards={log.last_stat('graph_forwards')} "
          f"forwards={log.last_stat('forwards_host')} "
          f"host_us_per_step={log.stats[-1].get('host_us_per_step') if log.stats else None} index_walks={log.stats[-1].get('index_walks') if log.stats else None} "
          f"index_walks_skipped={log.stats[-1].get('index_walks_skipped') if log.stats else None}")

    assert log.installed, server.log_tail()
    assert result.sent >= N_REQUESTS
    assert result.failed == 0, "\n".join(result.errors[:10]) + "\n" + server.log_tail()
    assert result.aborted == 12 and result.succeeded == N_REQUESTS - 12
    # The workload really exercised what the canary must survive:
    assert result.cached_tokens > 0, "no radix-cache prefix hits"
    assert max(o.prompt_tokens for o in result.outcomes) > CHUNKED_PREFILL_SIZE, "no chunked prefill"
    assert result.uncached_prompt_tokens > MAX_TOTAL_TOKENS[e2e_device()], "no eviction forced"
    # ... and verified everything with zero violations.
    assert server.is_running(), server.log_tail()
    assert log.violations == [], log.violations[:5]
    assert log.last_stat("violations") == 0
    assert log.last_stat("slots_verified") > 0 and log.last_stat("slots_written") > 0
    # the write witness (on by default) proved every new slot of every forward written: none unwritten
    assert log.last_stat("slots_witnessed") == log.last_stat("slots_written")
    assert log.last_stat("sweeps") > 0 and log.last_stat("slots_swept") > 0  # the cache sweep found nothing
    if installed_line() == "0.5.23":  # the UnifiedRadixCache was walked (its stats field: that line only)
        assert log.last_stat("index_walks") > 0
    assert log.last_stat("health_violations") == 0
    # the canary's own host time per outer step, measured around every outside pre- and post-op (stats line)
    assert float(log.stats[-1]["host_us_per_step"]) > 0
    # Every forward the host counted ran HEAD and TAIL on the device (graph replays included).
    assert log.last_stat("verify_launches") == log.last_stat("write_launches") == log.last_stat("forwards_host")
    # Each eager forward's TAIL ran at the model's logits processor, beside the LM head (runner/early_tail.py;
    # a replayed graph holds the same fork and join, and runs no Python hook to count)
    assert log.last_stat("tails_at_anchor") == log.last_stat("forwards_host") - log.last_stat("graph_forwards") > 0
    if e2e_device() == "cuda":
        # Verification ran inside replayed CUDA graphs, not only in eager forwards.
        assert "cuda graph: True" in log.text
        assert log.last_stat("graph_forwards") > 0
        if installed_line() == "0.5.23":
            # 0.5.23 replays prefill forwards from its prefill CUDA graphs (breakable by default): the captured
            # transformer body inside the outer forward, whose HEAD/TAIL run eagerly around it
            prefill = [line for line in log.text.splitlines() if "Prefill batch" in line]
            assert any("cuda graph: True" in line for line in prefill), prefill[:3]
    assert "Traceback" not in log.text
    # The canary's bytes were held back before sglang sized the KV pool, and cover what it allocated.
    reserved = [ln for ln in log.text.splitlines() if "kv_canary_reserved_bytes=" in ln]
    installed = [ln for ln in log.text.splitlines() if "kv_canary_installed=1" in ln]
    assert reserved and installed, "no memory reservation / install line"
    assert f"release={installed_sglang()}" in installed[-1] and "untested_release" not in installed[-1]
    fields = dict(item.split("=", 1) for item in installed[-1].split() if "=" in item)
    print(f"kv_canary_e2e_memory canary_bytes={fields['canary_bytes']} reserved={fields['reserved_before_kv_pool']} "
          f"kv_pool_bytes={fields['kv_pool_bytes']} pct={fields['canary_pct_of_kv_pool']}")
    assert 0 < int(fields["canary_bytes"]) <= int(fields["reserved_before_kv_pool"])
    # What a read hashes, said at startup. The default: every byte where the plugin owns the flag (0.5.12: all, and
    # the line saying it was not given); sglang's own default elsewhere (0.5.23: none), and then the flag that gets
    # every byte is named
    from kv_canary.adapter.lines import current_line

    coverage = [ln for ln in log.text.splitlines() if "kv_canary_coverage=" in ln]
    assert coverage and f"kv_canary_coverage={fields['real_data']}" in coverage[-1], coverage
    cov = dict(item.split("=", 1) for item in coverage[-1].split() if "=" in item)
    assert int(cov["window_bytes_per_read"]) < int(cov["slot_bytes"]), cov
    if current_line().flags_declared_by_sglang:
        assert fields["real_data"] == "none" and cov["every_byte"] == "0", cov
        assert int(cov["window_bytes_per_read"]) == 0, cov
        assert "--kv-canary-real-data all hashes every byte" in log.text
    else:
        assert fields["real_data"] == "all" and cov["every_byte"] == "1", cov
        assert "kv_canary_real_data_default=all" in log.text and "hashes every byte" not in log.text
        assert int(fields["scrub_slots_per_forward"]) > 0 and log.last_stat("slots_scrubbed") > 0
    # Every kernel variant was compiled at install (precompile) or capture: none on the serving path.
    if e2e_device() == "cuda" or CPU_KERNELS == "triton":
        assert "kv_canary_precompiled=1" in log.text and "kv_canary_jit_after_startup" not in log.text


@pytest.mark.e2e
@pytest.mark.skipif(installed_line() != "0.5.23", reason="the UnifiedRadixCache (0.5.23's tree) is the one walked "
                    "only after it changed (adapter/unified_radix); older lines' trees are read in place")
def test_unchanged_tree_is_not_walked_again(server):
    """One request decoding alone: no insert, evict or split between its sweeps, so after the first walk the
    cached index is reused (``index_walks_skipped`` grows) and the sweeps still run and find nothing.

    Its own phase: in the mixed workload a request finishes (an insert) between most sweeps, so how many walks
    are skipped there depends on the machine's timing (a 2-core CI host skipped none)."""
    before = CanaryLog.read_settled(server)
    spec = RequestSpec(index=0, kind="short", words=tuple(range(3, 40)), max_new_tokens=5 * SWEEP_INTERVAL)
    result = run_requests(server.base_url, [spec], concurrency=1, timeout=300)
    after = CanaryLog.read_settled(server)
    assert result.succeeded == 1, "\n".join(result.errors) + "\n" + server.log_tail()
    grew = {k: after.last_stat(k) - before.last_stat(k) for k in ("sweeps", "index_walks", "index_walks_skipped")}
    print(f"kv_canary_e2e_lone_decode {grew}")
    assert grew["sweeps"] >= 4, grew  # 40 decode forwards at one sweep every 8
    assert grew["index_walks_skipped"] >= 2, grew
    assert after.violations == [] and after.last_stat("violations") == 0


@pytest.mark.e2e
@pytest.mark.skipif(installed_line() != "0.5.23", reason="the UnifiedRadixCache (0.5.23's tree) is the one walked "
                    "only after it changed (adapter/unified_radix); older lines' trees are read in place")
def test_decode_evicting_from_a_full_pool_is_not_walked_again(server):
    """Several requests decoding together while the pool, full of cached leaves, evicts one every few steps (issue
    57: on the GPU host every sweep walked): the sweeps drop the evicted slots from the index instead of walking."""
    # 64 cached leaves of ~30 slots, each its own first word: ~1,920 of the 2,048 slots (CPU)
    fill = [RequestSpec(index=i, kind="short", words=(i,) + tuple((i * 29 + j) % 480 for j in range(29)),
                        max_new_tokens=1) for i in range(64)]
    filled = run_requests(server.base_url, fill, concurrency=16, timeout=300)
    assert filled.succeeded == len(fill), "\n".join(filled.errors[:5]) + "\n" + server.log_tail()
    before = CanaryLog.read_settled(server)
    # 16 requests, 16 new slots a decode step: a leaf evicted every ~2 steps, several in every sweep's interval
    specs = [RequestSpec(index=100 + k, kind="short", words=(480 + k, k, k + 1, k + 2, k + 3, k + 4),
                         max_new_tokens=8 * SWEEP_INTERVAL) for k in range(16)]
    result = run_requests(server.base_url, specs, concurrency=len(specs), timeout=300)
    after = CanaryLog.read_settled(server)
    assert result.succeeded == len(specs), "\n".join(result.errors) + "\n" + server.log_tail()
    grew = {k: after.last_stat(k) - before.last_stat(k)
            for k in ("sweeps", "index_walks", "index_walks_skipped", "index_slots_evicted")}
    print(f"kv_canary_e2e_evicting_decode {grew}")
    assert grew["sweeps"] >= 6, grew  # 64 decode forwards at one sweep every 8
    assert grew["index_walks"] <= 3, grew  # the admissions' (their prefill batches), none while decoding
    assert grew["index_slots_evicted"] >= 300, grew  # the pool did evict between the sweeps
    assert after.violations == [] and after.last_stat("violations") == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
