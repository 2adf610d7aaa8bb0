"""Real sglang speculative-decoding bugs put back on sglang 0.5.23 (issue 53, the PD/speculative pass;
docs/real-bugs.md): the three runs per bug, by hand (``KVC_REAL_BUGS_TIMING=1``), not in CI (CI time).

As test_e2e_real_bugs_0523: a real fix reversed on a private copy of the venv's sglang (``kv_canary_testing.real_bugs``),
the same workload three times through ``real_bug_runs.three_runs``: (a) bug in, ``--kv-canary none``; (b) bug in,
``--kv-canary log``; (c) the fixed sglang, ``--kv-canary raise``. CPU, EAGLE spec v2 with topk 1 on the tiny target
and draft (``kv_canary_testing.spec_cpu``, as test_e2e_speculative; synchronous: sglang turns the overlap scheduler off
on CPU), page size 1; #34870 over the hybrid-SWA tiny target instead (``spec_cpu.swa``: page 16, UnifiedRadixCache).
"""

import random
import re

import pytest

from kv_canary_testing.canary_e2e import register_cpu_ci
from kv_canary_testing.model_dir import NUM_WORDS, write_eagle_model_dirs
from kv_canary_testing.real_bug_runs import pool_leaks, skip_unless_by_hand, summarize_violations, three_runs
from kv_canary_testing.spec_cpu.client import SPEC_ENV, Out, generate as spec_generate
from kv_canary_testing.spec_cpu.swa import greedy_workload, spec_swa_args, write_swa_eagle_model_dirs
from kv_canary_testing.workload import RequestSpec

register_cpu_ci(est_time=10, suite="kv-canary-cpu")  # CI: the skip only (the servers run by hand)

BY_HAND = "by hand (KVC_REAL_BUGS_TIMING=1): three more EAGLE servers (CI time)"
NUM_STEPS, NUM_DRAFT_TOKENS = 3, 4  # test_e2e_speculative's: 2 draft decode steps per round


def spec_args(target, draft):
    return ["--attention-backend", "triton", "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", str(draft), "--speculative-num-steps", str(NUM_STEPS),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(NUM_DRAFT_TOKENS),
            "--speculative-draft-load-format", "dummy", "--max-running-requests", "8", "--page-size", "1"]


def generate(srv, spec: RequestSpec) -> Out:
    return spec_generate(srv, spec.input_ids(), spec.max_new_tokens)


def describe(run):
    return "outputs=" + str({i: (o.status, o.output_ids[:6], o.verify_ct) for i, o in sorted(run.result.items())})


def check_fixed_run(run):
    """(c): the fixed sglang served every request, ``raise`` installed, 0 violations."""
    out, log, running = run
    assert running and log.installed
    assert all(o.status == "ok" for o in out.values())
    assert log.violations == [] and log.last_stat("violations") == 0


def check_nothing_reported(bug: str, run):
    """(b) of a bug the canary does not report here: ``log`` installed and serving, 0 violations (the line printed)."""
    out, log, running = run
    assert running and log.installed
    line = summarize_violations(bug, log).line if log.violations else f"kv_canary_real_bug {bug} b: 0"
    print(line)
    assert log.violations == [], line


def eagle_three_runs(pr: str, bug: str, workload, tmp_path_factory):
    """The three runs of ``bug`` (by hand) on fresh EAGLE target and draft dirs, a 1,024-slot pool."""
    skip_unless_by_hand(f"{pr} {BY_HAND}")
    target, draft = write_eagle_model_dirs(tmp_path_factory.mktemp("models"))
    return three_runs(bug, spec_args(target, draft), SPEC_ENV, workload, 1024, tmp_path_factory,
                      model_path=target, describe=describe)


# ---- #25015: EAGLE draft decode steps run one position ahead -----------------------------------------------------

POS_BUG = "eagle_draft_decode_positions_pr25015"


def draft_decodes(srv):
    """Four greedy requests one after the other (40, 60, 20, 80 words; 24 decoded each): every verify round runs
    two draft decode steps, which the bug runs at c + 1 and c + 2 instead of c and c + 1."""
    rng = random.Random(25015)
    out = {}
    for i, n in enumerate((40, 60, 20, 80)):
        spec = RequestSpec(i, "eagle", tuple(rng.randrange(NUM_WORDS) for _ in range(n)), 24)
        out[i] = generate(srv, spec)
    return out


@pytest.fixture(scope="module")
def pos_runs(tmp_path_factory):
    return eagle_three_runs("#25015", POS_BUG, draft_decodes, tmp_path_factory)


def verifies(out):
    return sum(o.verify_ct for o in out.values())


@pytest.mark.e2e
def test_eagle_draft_decode_positions_a_fires_without_the_canary(pos_runs):
    """sglang's own evidence: none on this workload (recorded, 2026-11-30): the greedy outputs equal the fixed run's
    (the target verifies every token) and so does the number of verify rounds (36 and 36: the tiny draft's argmax
    did not change with RoPE one position off). The bug runs all the same (the draft decode steps' positions are
    shifted by code, not by chance: run b's stored positions say so)."""
    out, log, running = pos_runs["a"]
    fixed = pos_runs["c"].result
    assert running and all(o.status == "ok" for o in out.values())
    same = [i for i in sorted(out) if out[i].output_ids == fixed[i].output_ids]
    print(f"kv_canary_real_bug {POS_BUG} a: verify rounds {verifies(out)} (fixed {verifies(fixed)}); outputs equal "
          f"to the fixed run's: {same} of {sorted(out)}")
    assert same == sorted(out)


@pytest.mark.e2e
def test_eagle_draft_decode_positions_b_canary_reports(pos_runs):
    """The draft pool's HEAD reads each draft decode step's slot in the next step: ``position`` violations in the
    draft group, stored = expected + 1 (the slot at position p was written by a forward run at p + 1), for every
    request (the server's startup probe included), from the first draft forward that reads such a slot; the target
    pool clean (the target verifies with the right positions)."""
    out, log, running = pos_runs["b"]
    assert running and log.installed
    assert log.violations, "the canary reported nothing"
    kinds, positions, forwards, line = summarize_violations(POS_BUG, log)
    print(line)
    assert {v["group"] for v in log.violations} == {"draft"}, line
    assert kinds == ["position"], kinds
    assert {int(v["stored"]) - int(v["expected"]) for v in log.violations} == {1}
    assert len({v["rid"] for v in log.violations}) >= len(out)
    assert log.last_stat("violations") == 0  # kv_canary_stats= is the target pool's line


@pytest.mark.e2e
def test_eagle_draft_decode_positions_c_fixed_has_no_violation(pos_runs):
    check_fixed_run(pos_runs["c"])


# ---- #26800 (#26329): a non-final chunk's last draft slot computed from the thrown-away sample -------------------

TAIL_BUG = "eagle_chunked_tail_token_pr26800"


def chunked_prompts(srv):
    """Three 300-word prompts (chunked prefill at 128: two non-final chunk ends each, positions 127 and 255), 24
    decoded, then each prompt again with 8 new words (a 300-token radix hit: the draft slots of the first run are read
    again). Buggy, the draft slot at each chunk end holds the KV of the target's discarded sample instead of the
    prompt's next token."""
    rng = random.Random(26800)
    prompts = [tuple(rng.randrange(NUM_WORDS) for _ in range(300)) for _ in range(3)]
    out = {}
    for i, p in enumerate(prompts):
        out[i] = generate(srv, RequestSpec(i, "eagle", p, 24))
    for i, p in enumerate(prompts):
        out[3 + i] = generate(srv, RequestSpec(3 + i, "eagle", p + tuple(rng.randrange(NUM_WORDS) for _ in range(8)),
                                               24))
    return out


@pytest.fixture(scope="module")
def tail_runs(tmp_path_factory):
    return eagle_three_runs("#26800", TAIL_BUG, chunked_prompts, tmp_path_factory)


CHUNK_END = re.compile(r"Prefill batch, #new-seq: 1, #new-token: 128, #cached-token: 0")


@pytest.mark.e2e
def test_eagle_chunked_tail_token_a_fires_without_the_canary(tail_runs):
    """The bug's path runs (each 300-word prompt is prefilled in chunks of 128, 128 and 44: two non-final chunk ends,
    whose draft slot is fed the target's discarded sample), but sglang shows nothing on this workload (recorded,
    2026-11-30): the greedy outputs and every request's verify rounds equal the fixed run's (67 and 67)."""
    out, log, running = tail_runs["a"]
    fixed = tail_runs["c"].result
    assert running and all(o.status == "ok" for o in out.values())
    assert len(CHUNK_END.findall(log.text)) >= 6, "no chunked prefill: the bug's path did not run"
    same = [i for i in sorted(out) if out[i].output_ids == fixed[i].output_ids]
    per = {i: (out[i].verify_ct, fixed[i].verify_ct) for i in sorted(out)}
    print(f"kv_canary_real_bug {TAIL_BUG} a: verify rounds {verifies(out)} (fixed {verifies(fixed)}), per request "
          f"(bug, fixed) {per}; outputs equal to the fixed run's: {same} of {sorted(out)}")
    assert same == sorted(out)


@pytest.mark.e2e
def test_eagle_chunked_tail_token_b_canary_misses_it(tail_runs):
    """The canary MISSES it, by design (recorded, 2026-11-30: 0 violations). The wrong draft KV is written by a draft
    forward like any other (its K/V hash, position and slot are consistent, and HEAD checks only those in the draft
    pool); what is wrong is the token it was computed from, and the draft pool has no token oracle: kv_canary's
    draft_pool.py lists "the last slot of an unfinished prefill chunk [holding] the KV of the thrown-away sample" as
    what sglang does by design, which is this bug (fixed in 0.5.13)."""
    check_nothing_reported(TAIL_BUG, tail_runs["b"])


@pytest.mark.e2e
def test_eagle_chunked_tail_token_c_fixed_has_no_violation(tail_runs):
    check_fixed_run(tail_runs["c"])


# ---- #34870: hybrid SWA + EAGLE, the out-of-window frontier measured on the tokens, not the bigram key ----------

FRONTIER_BUG = "swa_bigram_evict_frontier_pr34870"
FRONTIER_POOL = 512  # a small pool: the slots the bug frees under the tree are handed out again


@pytest.fixture(scope="module")
def frontier_runs(tmp_path_factory):
    """The hybrid-SWA tiny target with the tiny EAGLE draft (``spec_cpu.swa``: page 16, UnifiedRadixCache, chunked
    prefill at 128), prompts of 16k + 1 tokens (49, 97, 161: EAGLE's bigram key a whole number of pages, where the
    buggy frontier lands a page past the insert's end), each decoded past the window, then each again with 16 new
    words (radix hits on the first run's pages)."""
    skip_unless_by_hand(f"#34870 {BY_HAND}")
    target, draft = write_swa_eagle_model_dirs(tmp_path_factory.mktemp("models"))
    return three_runs(FRONTIER_BUG, spec_swa_args(draft), SPEC_ENV, greedy_workload, FRONTIER_POOL,
                      tmp_path_factory, model_path=target, describe=describe)


def _differ(out, fixed):
    return [i for i in sorted(out) if out[i].output_ids != fixed[i].output_ids]


@pytest.mark.e2e
def test_swa_bigram_frontier_a_did_not_fire_here(frontier_runs):
    """sglang's own evidence would be its idle pool check (a leak warning: SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0)
    or greedy outputs that differ from the fixed run's. None on this workload (recorded, 2026-11-30): no pool warning,
    the outputs and verify rounds equal to the fixed run's. The buggy frontier is a page further than the fixed one at
    these prompts' prefill checkpoints (by the code), but the leaf the insert makes still keeps 32 tokens of live SWA,
    at least the window of 24 (a reading: docs/real-bugs.md)."""
    out, log, running = frontier_runs["a"]
    fixed = frontier_runs["c"].result
    leaks, differ = pool_leaks(log.text), _differ(out, fixed)
    print(f"kv_canary_real_bug {FRONTIER_BUG} a: running={running} pool_leaks={leaks} statuses="
          f"{ {i: o.status for i, o in sorted(out.items())} } outputs differing from the fixed run's: {differ}")
    assert running and all(o.status == "ok" for o in out.values())
    assert leaks == [] and differ == []
    assert [o.verify_ct for _, o in sorted(out.items())] == [o.verify_ct for _, o in sorted(fixed.items())]


@pytest.mark.e2e
def test_swa_bigram_frontier_b_nothing_reported(frontier_runs):
    """Nothing to report (recorded, 2026-11-30: 0 violations): the bug did not make sglang read wrong KV here (run a)."""
    check_nothing_reported(FRONTIER_BUG, frontier_runs["b"])


@pytest.mark.e2e
def test_swa_bigram_frontier_c_fixed_has_no_violation(frontier_runs):
    assert pool_leaks(frontier_runs["c"].log.text) == []
    check_fixed_run(frontier_runs["c"])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
