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

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci
from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS, SWA_WINDOW, write_swa_model_dir
from kv_canary_testing.real_bugs import buggy_env
from kv_canary_testing.workload import RequestSpec, run_requests

register_cpu_ci(est_time=240, suite="kv-canary-cpu")

QUIET_IDLE_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}
LEAK = re.compile(r"pool memory leak detected! \[full\] total=(\d+), available=(\d+), evictable=(\d+).*?\n"
                  r"\[swa\] total=(\d+), available=(\d+), evictable=(\d+)")


def pool_leaks(text):
    """sglang's idle pool-check warnings: [(full total, available, evictable, swa total, available, evictable)]."""
    return [tuple(int(x) for x in m.groups()) for m in LEAK.finditer(text)]


def serve(mode, bug, tmp_path_factory, extra_args, env, workload, max_total_tokens):
    """Run ``workload(base_url)`` on a SWA tiny-model server (bug ``bug`` in, or None); (its result, the log)."""
    full_env = {**QUIET_IDLE_CHECK, **env, **(buggy_env(bug) if bug else {})}
    log_path = tmp_path_factory.mktemp(f"{mode}-{'bug' if bug else 'fixed'}") / "server.log"
    srv = canary_server(mode, log_path=log_path, env=full_env, model_path=write_swa_model_dir(),
                        extra_args=["--swa-full-tokens-ratio", "1.0", *extra_args], max_total_tokens=max_total_tokens)
    with srv:
        result = workload(srv.base_url)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    return result, log, running


# ---- #22470: SWA eviction up to the radix insert boundary ---------------------------------------------------------

EVICT_BUG = "swa_evict_boundary_pr22470"
EVICT_PAGE = 32  # larger than the window (24): the frontier can reach the insert boundary
EVICT_PROMPTS = (56, 58)


def multi_turn(base_url):
    """Per prompt length p: turn 1 (p words, 36 decoded: past the window; for p=56 decode step 33 evicts SWA up to
    64 of a 91-token sequence, exactly the page its finish inserts), then turn 2 = turn 1's prompt + 12 of its outputs + 30 new words (a 64-token prefix hit)."""
    import random

    rng = random.Random(5)
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
    args = ["--page-size", str(EVICT_PAGE)]
    runs = {name: serve(mode, bug, tmp_path_factory, args, {}, multi_turn, 2048)
            for name, mode, bug in (("a", "none", EVICT_BUG), ("b", "log", EVICT_BUG), ("c", "raise", None))}
    for name, (out, log, running) in runs.items():
        print(f"kv_canary_real_bug {EVICT_BUG} run={name} running={running} "
              f"outputs={ {i: (o.status, o.cached_tokens, o.output_ids[:6]) for i, o in sorted(out.items())} } "
              f"pool_leaks={pool_leaks(log.text)} violations={len(log.violations)}")
    return runs


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


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
