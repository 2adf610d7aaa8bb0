"""Real sglang bugs put back (issue 53; docs/real-bugs.md): does the canary catch what sglang shipped?

Each bug is a real sglang fix reversed on a private copy of the venv's sglang 0.5.12
(``kv_canary_testing.real_bugs``), used by that test's server only. Per bug, one workload shaped to trip it
runs three times: (a) bug in, ``--kv-canary none``: sglang's own evidence that it fired (its idle pool
check, greedy outputs against the fixed run); (b) bug in, ``--kv-canary log``: what the canary reported;
(c) the fixed sglang (the venv as is), ``--kv-canary raise``: no violation. sglang's idle pool check
warns instead of raising (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0``) in all three, so a run that
trips it keeps serving and logs it.

On CPU, torch_native attention reads the SWA layers through untranslated slots (test_e2e_swa's docstring):
greedy outputs then follow the SWA allocator's order, not the stale KV a GPU backend would read, so an
output difference is evidence that the bug changed sglang's state, not of what the model read.
"""

import re

import pytest

from kv_canary_testing.canary_e2e import register_cpu_ci
from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS, SWA_WINDOW
from kv_canary_testing.real_bug_runs import pool_leaks, skip_unless_by_hand, three_runs
from kv_canary_testing.workload import RequestSpec, run_requests

# #22470's three servers in CI (~240 s); by hand (KVC_REAL_BUGS_TIMING=1, the by-hand flag): #24318's three, whose
# outcome depends on the scheduler's timing (a crash in most runs, silent or not firing in others: docs/real-bugs.md),
# and #18694's three (deterministic, ~110 s: left out for CI time; it crashes at sglang's own guard, no wrong KV read)
register_cpu_ci(est_time=240, suite="kv-canary-cpu")

# ---- #22470: SWA eviction up to the radix insert boundary ---------------------------------------------------------

EVICT_BUG = "swa_evict_boundary_pr22470"
EVICT_PAGE = 32  # larger than the window (24): the frontier can reach the insert boundary
EVICT_PROMPTS = (56, 58)


def multi_turn(srv):
    """Per prompt length p: turn 1 (p words, 36 decoded: past the window; for p=56 decode step 33 evicts SWA up to
    64 of a 91-token sequence, exactly the page its finish inserts), then turn 2 = turn 1's prompt + 12 of its outputs + 30 new words (a 64-token prefix hit)."""
    import random

    rng = random.Random(5)
    base_url = srv.base_url
    out = {}
    for i, p in enumerate(EVICT_PROMPTS):
        first = RequestSpec(2 * i, "shared", tuple(rng.randrange(NUM_WORDS) for _ in range(p)), 36)
        r1 = run_requests(base_url, [first], concurrency=1, use_input_ids=True)
        ids = r1.outcomes[0].output_ids
        second = RequestSpec(2 * i + 1, "shared", first.words + tuple(t - FIRST_WORD_ID for t in ids[:12])
                             + tuple(rng.randrange(NUM_WORDS) for _ in range(30)), 8)
        r2 = run_requests(base_url, [second], concurrency=1, use_input_ids=True)
        for o in r1.outcomes + r2.outcomes:
            out[o.index] = o
    return out


@pytest.fixture(scope="module")
def evict_runs(tmp_path_factory):
    return three_runs(EVICT_BUG, ["--page-size", str(EVICT_PAGE)], {}, multi_turn, 2048, tmp_path_factory,
                      describe=lambda run: "outputs=" + str({i: (o.status, o.cached_tokens, o.output_ids[:6])
                                                             for i, o in sorted(run.result.items())}))


@pytest.mark.e2e
def test_swa_evict_boundary_a_fires_without_the_canary(evict_runs):
    """sglang's own idle check: the SWA pool over-counted by one page (a tree leaf over freed SWA slots)."""
    out, log, running = evict_runs["a"]
    assert running and all(o.status == "ok" for o in out.values()), [o.error for o in out.values()]
    leaks = pool_leaks(log.text)
    assert leaks, "no 'pool memory leak detected' warning: the bug did not fire"
    full_total, full_avail, full_evict, swa_total, swa_avail, swa_evict = leaks[0]
    assert full_avail + full_evict == full_total  # the full pool is sound
    assert swa_avail + swa_evict == swa_total + EVICT_PAGE  # a leaf of one page counted evictable, yet free
    assert out[1].cached_tokens == 64 and out[3].cached_tokens == 64  # turn 2 reused the prefix both times
    # greedy outputs against the fixed run: the first pair (p=56) trips it; its turn 2, which reads the bad leaf, is
    # unchanged on CPU, and the next request differs (on CPU through the SWA allocator's order, see the module doc)
    fixed = evict_runs["c"][0]
    same = [i for i in sorted(out) if out[i].output_ids == fixed[i].output_ids]
    print(f"kv_canary_real_bug {EVICT_BUG} a: leak={leaks[0]} same_outputs_as_fixed={same}")
    assert same == [0, 1], same


@pytest.mark.e2e
def test_swa_evict_boundary_b_canary_reports_the_read(evict_runs):
    """The turn that hits the bad leaf reads its window's SWA slots through mapping 0: ``slot`` at slot 0."""
    out, log, running = evict_runs["b"]
    assert running and log.installed
    assert log.violations, "the canary reported nothing"
    kinds = {(v["kind"], v["group"], v["slot"]) for v in log.violations}
    assert kinds == {("slot", "swa", "0")}, kinds
    rids = {v["rid"] for v in log.violations}
    assert rids == {out[1].rid}, rids  # turn 2 of the p=56 pair
    positions = sorted(int(v["position"]) for v in log.violations)
    assert positions == list(range(64 - SWA_WINDOW, 64)), positions  # the window of the 64-token prefix
    forwards = {int(v["forward"]) for v in log.violations}
    assert len(forwards) == 1  # one forward: turn 2's prefill, before its attention
    assert pool_leaks(log.text)  # sglang saw it too, at the next idle
    print(f"kv_canary_real_bug {EVICT_BUG} b: {len(log.violations)} violations kind=slot group=swa slot=0 "
          f"positions={positions[0]}..{positions[-1]} rid={rids} forward={forwards}")


@pytest.mark.e2e
def test_swa_evict_boundary_c_fixed_has_no_violation(evict_runs):
    out, log, running = evict_runs["c"]
    assert running and log.installed and all(o.status == "ok" for o in out.values())
    assert log.violations == [] and log.last_stat("violations") == 0
    assert pool_leaks(log.text) == [] and "memory leak detected" not in log.text
    assert out[1].cached_tokens == 64 and out[3].cached_tokens == 64


# ---- #24318: a chunked request parked under hybrid-SWA pressure is still stashed ----------------------------------

STASH_BUG = "hybrid_swa_chunked_stash_pr24318"
# sglang's own retraction test knobs: no prefill while more than 3 requests run (so decodes run between two chunks of
# a long prompt), and no forced retraction (only the real one, when the pool is full)
STASH_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "1000000",
             "SGLANG_TEST_RETRACT_NO_PREFILL_BS": "3"}
STASH_ARGS = ["--page-size", "16", "--chunked-prefill-size", "64", "--schedule-conservativeness", "0.1"]


def park_a_chunked_request(srv):
    """Four decodes (600, 600, 600 and 40 tokens: 4 running stop prefill); a 16-token request X (250 tokens) and then
    a 261-token prompt L queue behind them. When the 40-token decode finishes, one prefill admits X and L's first
    64-token chunk: 4 running again, prefill stops, the decodes fill the 1024-token pool, sglang retracts one and
    raises its new-token ratio, and L's next chunk finds no budget (rem_total_tokens < 0): the hybrid-SWA branch of
    add_chunked_req parks it with its fill_ids already reset to the whole prompt."""
    import random
    import threading
    import time

    import requests

    from kv_canary_testing.model_dir import word_token_id

    rng = random.Random(8)
    decodes = [RequestSpec(i, "short", tuple(rng.randrange(NUM_WORDS) for _ in range(16)), n)
               for i, n in enumerate((600, 600, 600, 40))]
    x, long = ([word_token_id(rng.randrange(NUM_WORDS)) for _ in range(n)] for n in (16, 261))
    out = {}
    admitted = lambda: sum(int(n) for n in re.findall(r"Prefill batch, #new-seq: (\d+)", srv.log_text()))  # noqa
    before = admitted()  # the startup's own /health_generate requests
    worker = threading.Thread(target=lambda: out.setdefault("decodes", run_requests(srv.base_url, decodes, 4,
                                                                                     timeout=300)))
    worker.start()
    deadline = time.monotonic() + 120
    while admitted() < before + 4:
        assert time.monotonic() < deadline, "the four decodes were not admitted"
        time.sleep(0.1)
    session = requests.Session()
    session.trust_env = False

    def send(key, ids, n):
        try:
            r = session.post(srv.base_url + "/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=300)
            out[key] = (r.status_code, len(r.json().get("output_ids") or []) if r.ok else r.text[:300])
        except requests.RequestException as e:
            out[key] = (None, f"{type(e).__name__}: {e}")

    first = threading.Thread(target=send, args=("x", x, 250))
    first.start()
    time.sleep(0.5)  # X queues first (prefill is stopped while 4 run)
    send("long", long, 2)
    first.join()
    worker.join()
    return out


@pytest.fixture(scope="module")
def stash_runs(tmp_path_factory):
    skip_unless_by_hand("#24318 by hand (KVC_REAL_BUGS_TIMING=1): whether it crashes, stays silent or does not "
                        "fire depends on the scheduler's timing (docs/real-bugs.md); CI time: three more servers")
    return three_runs(STASH_BUG, STASH_ARGS, STASH_ENV, park_a_chunked_request, 1024, tmp_path_factory,
                      describe=lambda run: f"decodes={run.result['decodes'].summary()} x={run.result['x']} "
                      f"long={run.result['long']} retractions={run.log.text.count('KV cache pool is full. Retract')} "
                      f"crash={EMPTY_EXTEND in run.log.text}")


EMPTY_EXTEND = "cannot reshape tensor of 0 elements"  # the tiny model's rotary on a 0-token extend


def crash_of(log):
    """The scheduler's exception traceback in the server log ('' if none)."""
    start = log.text.find("Scheduler hit an exception")
    return log.text[start:start + 6000] if start >= 0 else ""


def stash_outcome(log, running):
    """How the bug showed: ``crash`` (the parked request resumed with a 0-token extend, #24252's empty extend, and the
    scheduler died in the model), ``silent`` (it resumed reading the stale prefix and sglang's idle check found the
    full pool over-counted), or ``none``. Which one depends on the scheduler's timing (both seen on this workload)."""
    crash = crash_of(log)
    if not running and "forward_extend" in crash and EMPTY_EXTEND in crash:
        return "crash"
    leaks = pool_leaks(log.text)
    if running and leaks and leaks[0][1] + leaks[0][2] > leaks[0][0]:
        return "silent"
    return "none"


@pytest.mark.e2e
def test_hybrid_swa_chunked_stash_a_fires_without_the_canary(stash_runs):
    """sglang's own evidence: its scheduler dies on the 0-token extend, or its idle check counts the full pool over."""
    out, log, running = stash_runs["a"]
    assert "KV cache pool is full. Retract" in log.text
    outcome = stash_outcome(log, running)
    print(f"kv_canary_real_bug {STASH_BUG} a: outcome={outcome} leaks={pool_leaks(log.text)}")
    assert outcome != "none", "the bug did not fire: " + crash_of(log)[-1500:]


@pytest.mark.e2e
def test_hybrid_swa_chunked_stash_b_canary_log(stash_runs):
    """Both paths: the canary reports the stale prefix (``slot`` at slot 0 in the full group; on the silent path then
    token/position/chain/kv_hash). Crash path: in the crashing forward itself, reported before the engine's error
    propagates: its verify, deferred to the model's last stage, runs when the forward raises before it."""
    out, log, running = stash_runs["b"]
    assert log.installed
    outcome = stash_outcome(log, running)
    kinds = sorted({v["kind"] for v in log.violations})
    print(f"kv_canary_real_bug {STASH_BUG} b: outcome={outcome} violations={len(log.violations)} kinds={kinds} "
          f"first={[(v['kind'], v['group'], v['slot'], v['position'], v['forward']) for v in log.violations[:2]]}")
    assert outcome != "none", "the bug did not fire"
    if outcome == "crash":
        assert "kv_canary_engine_error=" in log.text  # the canary read its counters before the error propagated
    assert any((v["kind"], v["group"], v["slot"]) == ("slot", "full", "0") for v in log.violations), kinds


@pytest.mark.e2e
def test_hybrid_swa_chunked_stash_c_fixed_has_no_violation(stash_runs):
    out, log, running = stash_runs["c"]
    assert running and log.installed and not crash_of(log)
    assert "KV cache pool is full. Retract" in log.text  # the same pressure: the fixed scheduler parks, not stashes
    assert out["decodes"].failed == 0 and out["x"] == (200, 250) and out["long"] == (200, 2), (
        out["decodes"].errors, out["x"], out["long"])
    assert log.violations == [] and log.last_stat("violations") == 0
    assert "memory leak detected" not in log.text


# ---- #18694: priority preemption picks a request that finished in the last decode step ----------------------------

PREEMPT_BUG = "priority_preempt_finished_pr18694"
# the plain tiny model (full attention); two running at most, so a waiting request preempts; a 1024-token pool
PREEMPT_ARGS = ["--enable-priority-scheduling", "--max-running-requests", "2", "--page-size", "1"]
# the scheduler's reservation per running request is its remaining new tokens times new_token_ratio, which decays
# from 0.7 step by step; held at 1.0 the arithmetic below is exact whatever the server did before
PREEMPT_ENV = {"SGLANG_INIT_NEW_TOKEN_RATIO": "1.0", "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "1.0"}
PREEMPT_TIMEOUT_S = 90  # a request not answered by then is lost (the workload takes seconds when it is not)


def preempt_at_a_finish(srv):
    """L2 (120 words, 400 decoded, priority 95) and then L1 (120 words, 120 decoded, priority 0) fill the two running
    slots; H (10 words, 450 decoded, priority 100) queues behind them. H may preempt L1 (100 - 0 > the threshold 10),
    never L2 (100 - 95 = 5). A waiting request's preemption check counts its max_new_tokens (its extend length is 0 until
    it is matched), and preempting L1 gives back only L1's reservation: H's 450 is more than free minus L2's
    reservation while L1 decodes (385 - s at L1's step s; the ratio held at 1.0), less once L1 has finished (its 240
    tokens evictable, its reservation 0: 504). So H's first preemption that commits is in the step right after L1
    finished, while L1 is still in running_batch (filtered after the prefill is scheduled): buggy, it takes L1 and
    releases it a second time; fixed, L1 is skipped, nothing is preempted, and H runs once L1 is filtered out. Token
    arithmetic, not timing: H only has to arrive before L1's 120 steps end."""
    import random
    import threading
    import time

    import requests

    from kv_canary_testing.model_dir import word_token_id

    rng = random.Random(18)
    ids = lambda n: [word_token_id(rng.randrange(NUM_WORDS)) for _ in range(n)]  # noqa: E731
    plan = {"L2": (ids(120), 400, 95), "L1": (ids(120), 120, 0), "H": (ids(10), 450, 100)}
    out, workers = {}, []

    def send(key):
        prompt, n, priority = plan[key]
        session = requests.Session()
        session.trust_env = False
        try:
            r = session.post(srv.base_url + "/generate", json={"input_ids": prompt, "priority": priority,
                             "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
                             timeout=PREEMPT_TIMEOUT_S)
            out[key] = (r.status_code, r.json().get("output_ids") if r.ok else r.text[:300])
        except requests.RequestException as e:
            out[key] = (None, f"{type(e).__name__}: {e}")

    admitted = lambda: len(re.findall(r"Prefill batch, #new-seq: \d+, #new-token: 120,", srv.log_text()))  # noqa
    for key, wait_for in (("L2", 1), ("L1", 2), ("H", None)):
        workers.append(threading.Thread(target=send, args=(key,)))
        workers[-1].start()
        deadline = time.monotonic() + 60
        while wait_for and admitted() < wait_for:  # L2 runs before L1 is sent, L1 before H
            assert time.monotonic() < deadline, f"{key} was not admitted"
            time.sleep(0.02)
    for w in workers:
        w.join()
    return out


@pytest.fixture(scope="module")
def preempt_runs(tmp_path_factory):
    from kv_canary_testing.model_dir import write_model_dir

    skip_unless_by_hand("#18694 by hand (KVC_REAL_BUGS_TIMING=1): three more servers (~110 s) for a bug that "
                        "crashes at sglang's own guard with no wrong KV read (docs/real-bugs.md)")

    return three_runs(PREEMPT_BUG, PREEMPT_ARGS, PREEMPT_ENV, preempt_at_a_finish, 1024, tmp_path_factory,
                      model_path=write_model_dir(), describe=preempt_outputs)


def preempt_outputs(run):
    return "outputs=" + str({k: (c, len(v) if isinstance(v, list) else v) for k, (c, v) in sorted(run.result.items())})


PREEMPT_CRASH = "Only MambaRadixCache allow freeing before alloc"  # release_kv_cache, on a request already released


@pytest.mark.e2e
def test_priority_preempt_finished_a_fires_without_the_canary(preempt_runs):
    """sglang's own evidence: the scheduler dies in release_req on the finished L1 (its row was released when it
    finished: release_kv_cache's guard for a request without a row asserts); L1 was answered, L2 and H never."""
    out, log, running = preempt_runs["a"]
    print(f"kv_canary_real_bug {PREEMPT_BUG} a: running={running} crash={PREEMPT_CRASH in crash_of(log)} "
          f"{preempt_outputs(preempt_runs['a'])}")
    assert not running and PREEMPT_CRASH in crash_of(log) and "release_req" in crash_of(log), crash_of(log)[-1500:]
    assert out["L1"][0] == 200 and len(out["L1"][1]) == 120
    assert out["L2"][0] is None and out["H"][0] is None


@pytest.mark.e2e
def test_priority_preempt_finished_b_canary_log(preempt_runs):
    """The same crash with the canary on. Nothing wrong was read: the second release dies at sglang's guard before
    it frees anything, between forwards, so the canary has nothing to report (0 violations)."""
    out, log, running = preempt_runs["b"]
    print(f"kv_canary_real_bug {PREEMPT_BUG} b: running={running} violations={len(log.violations)}")
    assert log.installed and not running and PREEMPT_CRASH in crash_of(log)
    assert log.violations == []


@pytest.mark.e2e
def test_priority_preempt_finished_c_fixed_has_no_violation(preempt_runs):
    """Fixed: L1 is skipped, nothing is preempted (L2 is above the threshold), H runs once L1 is filtered out."""
    out, log, running = preempt_runs["c"]
    assert running and log.installed and not crash_of(log)
    assert {k: (c, len(v)) for k, (c, v) in out.items()} == {"L1": (200, 120), "L2": (200, 400), "H": (200, 450)}
    assert log.violations == [] and log.last_stat("violations") == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
