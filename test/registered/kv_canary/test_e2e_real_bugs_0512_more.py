"""More real sglang bugs on sglang 0.5.12 (issue 53; docs/real-bugs.md): the three runs per bug.

As test_e2e_real_bugs (its file is full): one workload three times through ``real_bug_runs.three_runs``. The bugs
here are ones 0.5.12 *ships* (a later release fixed them): their patches apply the fix forward
(``real_bugs.APPLIES_ON``), so (a) and (b) run the venv's sglang as installed and (c) the copy with the fix applied.
CPU: #29352's legacy half on the hybrid-SWA tiny model (window 24, ``--swa-full-tokens-ratio 1.0``, 0.5.12's default
``SWARadixCache``); the HiCache load-back one on the plain tiny model through the HiCache test shim.
"""

import random
import re
import threading
import time

import pytest

from kv_canary_testing.canary_e2e import e2e_device, register_cpu_ci
from kv_canary_testing.hicache_cpu import ENV as SHIM_ENV
from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS, write_model_dir
from kv_canary_testing.real_bug_runs import summarize_violations, three_runs
from kv_canary_testing.workload import RequestSpec, run_requests

# CI runs both bugs' three servers: the HiCache load-back (149-171 s on the 2-core machine: its own mechanism) and,
# since the test servers' start got cheap (kv_canary_testing.fast_launch, 2026-12-02), #29352's SWARadixCache half
# (131 s alone on an idle 2-core machine; 167-212 s before; its UnifiedRadixCache half runs on 0.5.23)
register_cpu_ci(est_time=300, suite="kv-canary-cpu")

# ---- #29352's SWARadixCache half (fixed in 0.5.15): tombstone recovery frees Full KV a running request holds ------

LEGACY_BUG = "swa_recover_locked_full_legacy_0512"
# 0.5.12 inserts a prompt into the tree after its prefill (its SWA then protected) and evicts a decoding request's SWA
# every max(page, window) = 24 steps up to seqlen - 1 - window - page: R1 (40 words, 64 decoded) finishes with [0, 40)
# live, [40, 63) tombstoned (its decode step 49 freed that SWA) and [63, 103) live
R1_DECODE = 64
TOMB = (40, 63)
A_HIT = 103  # R1's whole sequence: 39 live tokens after the tombstone, >= a window
B_LEN = 80  # 16 live after the tombstone, < a window: B hits the 40-token live prompt only


def locked_tombstone_recovered(srv):
    """R1 (40 words, 64 decoded) leaves [0, 40) live, a tombstone [40, 63) and live SWA [63, 103). A = R1's 103
    tokens + 4 words: a 103-token hit that locks the tombstone's Full KV; A decodes 500. While A decodes, B = R1's
    first 80 tokens: only 16 live after the tombstone (< a window), so B hits the 40-token prompt, computes [40, 80)
    itself; its insert after that prefill overlaps the tombstone with live SWA (its swa_evicted_seqlen is 0) and
    recovers it (Branch 1): buggy, by freeing the node's Full KV, the slots A still reads as its prefix, and taking
    B's. Two 300-word requests and A's own decode then reuse them."""
    rng = random.Random(29)
    words = lambda n: tuple(rng.randrange(NUM_WORDS) for _ in range(n))  # noqa: E731
    one = lambda spec: run_requests(srv.base_url, [spec], concurrency=1, use_input_ids=True,  # noqa: E731
                                    timeout=600).outcomes[0]
    r1 = RequestSpec(0, "shared", words(40), R1_DECODE)
    out = {0: one(r1)}
    seq1 = r1.words + tuple(t - FIRST_WORD_ID for t in out[0].output_ids)
    a = RequestSpec(1, "shared", seq1[:A_HIT] + words(4), 500)
    before = len(srv.log_text())
    worker = threading.Thread(target=lambda: out.setdefault(1, one(a)))
    worker.start()
    deadline = time.monotonic() + 120
    while not re.search(rf"Prefill batch.*#cached-token: {A_HIT}", srv.log_text()[before:]):  # A admitted, locked
        assert time.monotonic() < deadline and worker.is_alive(), f"A was not admitted with a {A_HIT}-token hit"
        time.sleep(0.05)
    out[2] = one(RequestSpec(2, "shared", seq1[:B_LEN], 1))
    out[3] = one(RequestSpec(3, "long", words(300), 2))
    out[4] = one(RequestSpec(4, "long", words(300), 2))
    worker.join()
    return out


@pytest.fixture(scope="module")
def legacy_runs(tmp_path_factory):
    return three_runs(LEGACY_BUG, ["--page-size", "1"], {}, locked_tombstone_recovered, 1024, tmp_path_factory,
                      describe=lambda run: "outputs=" + str({i: (o.status, o.cached_tokens, o.output_ids[:4])
                                                             for i, o in sorted(run.result.items())}))


def check_shape(out):
    """The workload built what the docstring says: A hit R1's whole sequence, B only up to the tombstone."""
    assert all(o.status == "ok" for o in out.values()), [o.error for o in out.values()]
    assert (out[1].cached_tokens, out[2].cached_tokens) == (A_HIT, TOMB[0]), (out[1].cached_tokens,
                                                                             out[2].cached_tokens)


@pytest.mark.e2e
def test_swa_recover_locked_full_legacy_a_fires_without_the_canary(legacy_runs):
    """sglang's own evidence: A's greedy output differs from the fixed run's (its full layers read [40, 63) from
    slots reused by other tokens)."""
    out, log, running = legacy_runs["a"]
    fixed = legacy_runs["c"].result
    assert running
    check_shape(out)
    differ = [i for i in sorted(out) if out[i].output_ids != fixed[i].output_ids]
    first = next((k for k, (x, y) in enumerate(zip(out[1].output_ids, fixed[1].output_ids)) if x != y), None)
    print(f"kv_canary_real_bug {LEGACY_BUG} a: outputs differing from the fixed run: {differ}; A's first "
          f"differing token: {first}")
    assert 1 in differ, differ


@pytest.mark.e2e
def test_swa_recover_locked_full_legacy_b_canary_reports_the_read(legacy_runs):
    """A reads the tombstone's old full slots after they were reused (on this workload by A's own later decode
    tokens): kv_hash/position/chain in the full group naming A, at positions inside the tombstone (or the position
    right after it, by its chain link), each in the forward right after that slot was rewritten."""
    out, log, running = legacy_runs["b"]
    assert running and log.installed
    check_shape(out)
    assert log.violations, "the canary reported nothing"
    kinds, positions, _, line = summarize_violations(LEGACY_BUG, log)
    print(line)
    assert {v["group"] for v in log.violations} == {"full"}
    assert {v["rid"] for v in log.violations} == {out[1].rid}
    assert all(set(k.split("+")) <= {"position", "chain", "kv_hash"} for k in kinds), kinds
    assert TOMB[0] <= positions[0] and positions[-1] <= TOMB[1], positions


@pytest.mark.e2e
def test_swa_recover_locked_full_legacy_c_fixed_has_no_violation(legacy_runs):
    out, log, running = legacy_runs["c"]
    assert running and log.installed
    check_shape(out)
    assert log.violations == [] and log.last_stat("violations") == 0


# ---- HiRadixCache load-back over host pages its own eviction frees (write_back; fixed in 0.5.15, #28614) ----------

LOADBACK_BUG = "hicache_loadback_protect_host_0512"
# the plain tiny model, HiCache write_back, a host pool just over the device pool (0.5.12 requires host > device), no
# chunking (each prompt one tree node), CPU through the HiCache test shim
LOADBACK_ARGS = ["--enable-hierarchical-cache", "--hicache-ratio", "1.2", "--hicache-write-policy", "write_back",
                 "--hicache-io-backend", "kernel", "--hicache-mem-layout", "layer_first", "--page-size", "1",
                 "--kv-canary-real-data", "partial", "--chunked-prefill-size", "2048"]
P_WORDS, X_WORDS = 600, 900
FULL_LEAK = re.compile(r"pool memory leak detected! \[full\] total=(\d+), available=(\d+), evictable=(\d+)")


def loadback_over_evicted_host(srv):
    """Device 1,024 slots, host 1,229. P1 (600 words, 2 decoded) leaves P on the device, not backed up (write_back);
    X1 (900 words) needs the room: the device evicts P, backing it up to the host (601 of 1,229). P2 = P + 4 words hits
    P on the host (600): load_back's first load finds 123 free device slots and evicts X1, whose write-back (900) does
    not fit the host's 628 free slots, so write_backup calls evict_host, which frees P's host pages (the only host
    leaves, unprotected) and hands them to X1's copy; the second load then copies them into P2's prefix. P3 = P + 4
    other words comes after."""
    rng = random.Random(28614)
    words = lambda n: tuple(rng.randrange(NUM_WORDS) for _ in range(n))  # noqa: E731
    one = lambda spec: run_requests(srv.base_url, [spec], concurrency=1, use_input_ids=True,  # noqa: E731
                                    timeout=600).outcomes[0]
    p = words(P_WORDS)
    out = {0: one(RequestSpec(0, "p", p, 2))}
    out[1] = one(RequestSpec(1, "x", words(X_WORDS), 2))
    out[2] = one(RequestSpec(2, "p", p + words(4), 40))
    out[3] = one(RequestSpec(3, "p", p + words(4), 40))
    return out


@pytest.fixture(scope="module")
def loadback_runs(tmp_path_factory):
    if e2e_device() != "cpu":
        pytest.skip("CPU through the HiCache shim")
    return three_runs(LOADBACK_BUG, LOADBACK_ARGS, {SHIM_ENV: "1"}, loadback_over_evicted_host, 1024,
                      tmp_path_factory, model_path=write_model_dir(),
                      describe=lambda run: "outputs=" + str({i: (o.status, o.cached_tokens, o.output_ids[:4])
                                                             for i, o in sorted(run.result.items())})
                      + f" full_leaks={FULL_LEAK.findall(run.log.text)}")


@pytest.mark.e2e
def test_hicache_loadback_protect_host_a_fires_without_the_canary(loadback_runs):
    """sglang's own evidence: its idle pool check (the tree counts more evictable slots than the pool has: P's nodes,
    detached from the tree by evict_host, were given device slots anyway), and P2's greedy output against the fixed
    run's."""
    out, log, running = loadback_runs["a"]
    fixed = loadback_runs["c"].result
    assert running and all(o.status == "ok" for o in out.values()), [o.error for o in out.values()]
    leaks = FULL_LEAK.findall(log.text)
    differ = [i for i in sorted(out) if out[i].output_ids != fixed[i].output_ids]
    print(f"kv_canary_real_bug {LOADBACK_BUG} a: pool_leaks={leaks} differing={differ} "
          f"hits={[out[i].cached_tokens for i in sorted(out)]} fixed_hits={[fixed[i].cached_tokens for i in sorted(fixed)]}")
    assert leaks and any(int(a) + int(e) > int(t) for t, a, e in leaks), leaks
    assert out[2].cached_tokens == P_WORDS  # P2 loaded P back from the host


@pytest.mark.e2e
def test_hicache_loadback_protect_host_b_canary_reports_the_load(loadback_runs):
    """The loaded-back slots carry X1's records (its positions) where P2 expects P's: the canary reports them at P2's
    prefill, the first forward that reads the load (``hicache=load``), naming P2."""
    out, log, running = loadback_runs["b"]
    assert running and log.installed
    assert log.violations, "the canary reported nothing"
    kinds, positions, forwards, line = summarize_violations(LOADBACK_BUG, log)
    print(line)
    assert {v["rid"] for v in log.violations} == {out[2].rid}
    assert forwards[0] == min(int(v["forward"]) for v in log.violations if v.get("hicache") == "load")
    assert {v["group"] for v in log.violations} == {"full"}
    assert all(set(k.split("+")) <= {"position", "chain", "kv_hash", "token"} for k in kinds), kinds
    assert positions[-1] < P_WORDS  # inside the loaded-back prefix


@pytest.mark.e2e
def test_hicache_loadback_protect_host_c_fixed_has_no_violation(loadback_runs):
    out, log, running = loadback_runs["c"]
    assert running and log.installed
    assert all(o.status == "ok" for o in out.values()), [o.error for o in out.values()]
    assert log.violations == [] and log.last_stat("violations") == 0
    assert not FULL_LEAK.findall(log.text)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
