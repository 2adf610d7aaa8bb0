"""Real sglang bugs put back on sglang 0.5.23 (issue 53; docs/real-bugs.md): the three runs per bug.

As test_e2e_real_bugs (0.5.12): a real fix reversed on a private copy of the venv's sglang
(``kv_canary_testing.real_bugs``), the same workload three times through ``real_bug_runs.three_runs``: (a) bug in,
``--kv-canary none``; (b) bug in, ``--kv-canary log``; (c) the fixed sglang, ``--kv-canary raise``. CPU, the hybrid-SWA
tiny model (window 24, ``--swa-full-tokens-ratio 1.0``), 0.5.23's UnifiedRadixCache (#27472: the plain tiny model
and ``/v1/score``).
"""

import random
import re
import threading
import time

import pytest

from kv_canary_testing.canary_e2e import register_cpu_ci
from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS, write_model_dir
from kv_canary_testing.real_bug_runs import pool_leaks, skip_unless_by_hand, summarize_violations, three_runs
from kv_canary_testing.score_overrides import (check_no_hit, check_read_override_kv, check_reported_at_the_reader,
                                                check_served, score_then_generate)
from kv_canary_testing.workload import RequestSpec, run_requests

register_cpu_ci(est_time=190, suite="kv-canary-cpu")

# ---- #29352: SWA tombstone recovery replaces and frees Full KV that a running request holds locked ---------------

LOCKED_BUG = "swa_recover_locked_full_pr29352"
# the fix lives in the Python TreeCore's SWA component; 0.5.23 runs a Rust TreeCore by default where it is built (it
# is here), which has the guard of its own: the Python core is the code the PR fixed. Decode-time SWA eviction every
# 2nd step (default 128) gives the tree a tombstone on a 40-token decode.
LOCKED_ENV = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", "SGLANG_SWA_EVICTION_INTERVAL": "2"}
TOMB = (40, 52)  # the tombstone R1's decode leaves: its prompt [0, 40) stays live, [40, 52) loses its SWA


def locked_tombstone_recovered(srv):
    """R1 (40 words, 40 decoded) leaves [0, 40) live, a tombstone [40, 52) and a live tail. A: R1's sequence (79
    tokens: >= a window of live SWA after the tombstone, so a 79-token hit that locks the tombstone's Full KV) and 4
    words, decoding 500 tokens. While A decodes, B = R1's first 60 tokens: B hits only [0, 40) (7 live after the
    tombstone), computes [40, 60) itself and finishes; its insert overlaps the tombstone with live SWA and recovers it:
    buggy, by replacing the node's Full KV with B's and freeing the old slots A still reads. Two 300-word requests
    and A's own decode then reuse them."""
    rng = random.Random(29)
    words = lambda n: tuple(rng.randrange(NUM_WORDS) for _ in range(n))  # noqa: E731
    one = lambda spec: run_requests(srv.base_url, [spec], concurrency=1, use_input_ids=True,  # noqa: E731
                                    timeout=600).outcomes[0]
    r1 = RequestSpec(0, "shared", words(40), 40)
    out = {0: one(r1)}
    seq1 = r1.words + tuple(t - FIRST_WORD_ID for t in out[0].output_ids)
    a = RequestSpec(1, "shared", seq1[:79] + words(4), 500)
    before = len(srv.log_text())
    worker = threading.Thread(target=lambda: out.setdefault(1, one(a)))
    worker.start()
    deadline = time.monotonic() + 120
    while not re.search(r"Prefill batch.*#cached-token: 79", srv.log_text()[before:]):  # A admitted, its lock held
        assert time.monotonic() < deadline and worker.is_alive(), "A was not admitted"
        time.sleep(0.05)
    out[2] = one(RequestSpec(2, "shared", seq1[:60], 1))
    out[3] = one(RequestSpec(3, "long", words(300), 2))
    out[4] = one(RequestSpec(4, "long", words(300), 2))
    worker.join()
    return out


@pytest.fixture(scope="module")
def locked_runs(tmp_path_factory):
    return three_runs(LOCKED_BUG, ["--page-size", "1"], LOCKED_ENV, locked_tombstone_recovered, 1024, tmp_path_factory,
                      describe=lambda run: "outputs=" + str({i: (o.status, o.cached_tokens, o.output_ids[:4])
                                                             for i, o in sorted(run.result.items())}))


def check_shape(out):
    """The workload built what the docstring says: A hit 79 tokens, B 40 (not past the tombstone)."""
    assert all(o.status == "ok" for o in out.values()), [o.error for o in out.values()]
    assert (out[1].cached_tokens, out[2].cached_tokens) == (79, 40), (out[1].cached_tokens, out[2].cached_tokens)


@pytest.mark.e2e
def test_swa_recover_locked_full_a_fires_without_the_canary(locked_runs):
    """sglang's own evidence: A's greedy output differs from the fixed run's (its full layers read [40, 52) from
    slots reused by other tokens), every other request's is the same."""
    out, log, running = locked_runs["a"]
    fixed = locked_runs["c"].result
    assert running
    check_shape(out)
    differ = [i for i in sorted(out) if out[i].output_ids != fixed[i].output_ids]
    first = next((k for k, (x, y) in enumerate(zip(out[1].output_ids, fixed[1].output_ids)) if x != y), None)
    print(f"kv_canary_real_bug {LOCKED_BUG} a: outputs differing from the fixed run: {differ}; A's first "
          f"differing token: {first}")
    assert differ == [1], differ


@pytest.mark.e2e
def test_swa_recover_locked_full_b_canary_reports_the_read(locked_runs):
    """A reads the tombstone's old full slots after they were reused (by A's own later decode tokens, on this
    workload): position/chain in the full group at positions inside the tombstone (and a chain violation at the
    position right after it, whose link names the changed predecessor), naming A, in the forward after each reuse."""
    out, log, running = locked_runs["b"]
    assert running and log.installed
    check_shape(out)
    assert log.violations, "the canary reported nothing"
    kinds, positions, _, line = summarize_violations(LOCKED_BUG, log)
    print(line)
    assert {v["group"] for v in log.violations} == {"full"}
    assert {v["rid"] for v in log.violations} == {out[1].rid}
    assert set(kinds) <= {"position", "position+chain", "chain", "kv_hash"}, kinds
    assert TOMB[0] <= positions[0] and positions[-1] <= TOMB[1], positions


@pytest.mark.e2e
def test_swa_recover_locked_full_c_fixed_has_no_violation(locked_runs):
    out, log, running = locked_runs["c"]
    assert running and log.installed
    check_shape(out)
    assert log.violations == [] and log.last_stat("violations") == 0


# ---- the 0.5.22 -> 0.5.23 repoint fix: an insert's re-match stops short of the path it inserted -----------------

REPOINT_BUG = "swa_repoint_short_match_0523"
# page 16 > window 24 % 16: 0.5.22 frees SWA up to floor16(pre_len - 24), so a leaf ending at floor16(seq) can keep
# 16 live SWA tokens, less than a window; its re-match stops short and the request protects less than the tree owns
REPOINT_ARGS = ["--page-size", "16"]
REPOINT_ENV = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", "SGLANG_SWA_EVICTION_INTERVAL": "2"}
FILLERS = 4  # 200-word requests after the short re-matches: 4 x 260 tokens > the free pool, so the tree evicts


def repoint_short_match(srv):
    """R1 (40 words, 20 decoded: 59 committed, a leaf to 48 whose live SWA may start at 32); R2 = R1's sequence and
    20 words (overlaps R1's path); then four 120-word requests at once (reuse freed slots), then R1's sequence and
    4 words again (reads R1's path if it is matched). Buggy, each of the four inserts 144 tokens, re-matches 112 and
    its release frees [112, 144) that the tree keeps (docs/real-bugs.md). Then four 200-word requests at once (60
    decoded each, FILLERS): more than the free pool, so the tree evicts, freeing those 4 x 32 slots a second time; the
    free list hands a slot to two of them."""
    rng = random.Random(53)
    words = lambda n: tuple(rng.randrange(NUM_WORDS) for _ in range(n))  # noqa: E731
    one = lambda spec: run_requests(srv.base_url, [spec], concurrency=1, use_input_ids=True,  # noqa: E731
                                    timeout=600).outcomes[0]
    r1 = RequestSpec(0, "shared", words(40), 20)
    out = {0: one(r1)}
    seq1 = r1.words + tuple(t - FIRST_WORD_ID for t in out[0].output_ids)
    out[1] = one(RequestSpec(1, "shared", seq1 + words(20), 20))
    many = run_requests(srv.base_url, [RequestSpec(2 + i, "long", words(120), 40) for i in range(4)],
                        concurrency=4, use_input_ids=True, timeout=600).outcomes
    out.update({2 + i: o for i, o in enumerate(many)})
    out[6] = one(RequestSpec(6, "shared", seq1 + words(4), 8))
    fill = run_requests(srv.base_url, [RequestSpec(7 + i, "long", words(200), 60) for i in range(FILLERS)],
                        concurrency=FILLERS, use_input_ids=True, timeout=600).outcomes
    out.update({7 + i: o for i, o in enumerate(fill)})
    return out


@pytest.fixture(scope="module")
def repoint_runs(tmp_path_factory):
    skip_unless_by_hand("the 0.5.23 repoint fix by hand (KVC_REAL_BUGS_TIMING=1): three more servers")
    return three_runs(REPOINT_BUG, REPOINT_ARGS, REPOINT_ENV, repoint_short_match, 1024, tmp_path_factory,
                      describe=lambda run: "outputs=" + str({i: (o.status, o.cached_tokens, o.output_ids[:4])
                                                             for i, o in sorted(run.result.items())}))


@pytest.mark.e2e
def test_swa_repoint_short_match_a_fires_without_the_canary(repoint_runs):
    """sglang's own evidence: its idle pool check (slots both free and owned by the tree), and greedy outputs that
    differ from the fixed run's (the fillers read KV that another filler overwrote)."""
    out, log, running = repoint_runs["a"]
    fixed = repoint_runs["c"].result
    differ = [i for i in sorted(out) if out[i].output_ids != fixed[i].output_ids]
    leaks = pool_leaks(log.text)
    print(f"kv_canary_real_bug {REPOINT_BUG} a: running={running} differing={differ} pool_leaks={leaks}")
    if not running:
        pytest.fail("the scheduler died: " + log.text[-1500:])
    if not (differ or leaks):
        pytest.fail("the bug did not fire on this workload (same outputs as the fixed run, no pool warning)")


@pytest.mark.e2e
def test_swa_repoint_short_match_b_canary_reports_the_shared_slots(repoint_runs):
    """The short re-matches' frees leave slots both free and tree-owned; the eviction under the fillers frees them
    again, and a slot goes to two fillers. The canary: ``position``/``chain`` in the full group naming a filler whose own
    earlier KV another filler overwrote, at its next read (and, on this workload, ``health:slots_written`` in the
    fillers' prefills: the device fingerprinted fewer slots than the host counted, as when one slot is stored twice)."""
    out, log, running = repoint_runs["b"]
    assert running and log.installed
    assert pool_leaks(log.text), "the bug did not fire in the log run"
    reads = [v for v in log.violations if not v["kind"].startswith("health:")]
    print(f"kv_canary_real_bug {REPOINT_BUG} b: {len(log.violations)} violations "
          f"kinds={sorted({v['kind'] for v in log.violations})} rids={sorted({v['rid'] for v in reads})} "
          f"forwards={sorted({int(v['forward']) for v in log.violations})[:6]} first={log.violations[:2]}")
    assert reads, "the canary reported no wrong read"
    assert {v["rid"] for v in reads} <= {o.rid for i, o in out.items() if i >= 7}, "a non-filler named"
    assert {v["kind"] for v in reads} <= {"position", "position+chain", "chain", "kv_hash", "slot"}


@pytest.mark.e2e
def test_swa_repoint_short_match_c_fixed_has_no_violation(repoint_runs):
    out, log, running = repoint_runs["c"]
    assert running and log.installed
    assert all(o.status == "ok" for o in out.values()), [o.error for o in out.values()]
    assert log.violations == [] and log.last_stat("violations") == 0
    assert pool_leaks(log.text) == []


# ---- #27472: /v1/score's embedding overrides cached under the plain token ids -------------------------------------

SCORE_BUG = "score_embed_override_radix_insert_0522"


def describe_score(run):
    res = run.result
    return (f"score={res['score'][0]} hit_cached={res['hit'].cached_tokens} fresh_cached={res['fresh'].cached_tokens} "
            f"hit_equals_fresh={res['hit'].output_ids == res['fresh'].output_ids}")


@pytest.fixture(scope="module")
def score_runs(tmp_path_factory):
    skip_unless_by_hand("#27472 by hand (KVC_REAL_BUGS_TIMING=1): three more servers")
    return three_runs(SCORE_BUG, [], {}, score_then_generate, 2048, tmp_path_factory, model_path=write_model_dir(),
                      describe=describe_score)


@pytest.mark.e2e
def test_score_embed_override_a_cached_ids_read_override_kv(score_runs):
    """sglang's own evidence: the /generate after the score request hits its 50 tokens in the radix cache, and its
    greedy output differs from the same request computed fresh (after /flush_cache)."""
    run = score_runs["a"]
    check_served(run.result, run.running)
    print(f"kv_canary_real_bug {SCORE_BUG} a: {describe_score(run)}")
    check_read_override_kv(run.result)


@pytest.mark.e2e
def test_score_embed_override_b_canary_reports_the_hit(score_runs):
    """The canary records the score request's override slots under a marker token (adapter/embed_overrides), so the
    /generate request that hits them with the plain placeholder ids fails the chain check at its first read:
    ``token`` in the full group, naming that request, and no other."""
    run = score_runs["b"]
    check_served(run.result, run.running)
    log = run.log
    print(f"kv_canary_real_bug {SCORE_BUG} b: {describe_score(run)} violations={len(log.violations)}")
    assert log.installed and log.violations, "the canary reported nothing"
    print(summarize_violations(SCORE_BUG, log).line)
    check_reported_at_the_reader(log.violations, run.result)


@pytest.mark.e2e
def test_score_embed_override_c_fixed_has_no_violation(score_runs):
    run = score_runs["c"]
    check_served(run.result, run.running)
    check_no_hit(run.result)
    assert run.log.installed and run.log.violations == [] and run.log.last_stat("violations") == 0

if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
