"""``--kv-canary contain`` on a real sglang server, a corrupt slot of a shared system prompt: HEAD checks it once a
forward (one violation row, naming the first of its readers in batch order), and contain aborts every request that
holds it, not only the one the row names; the server keeps serving.

One warm-up request caches the system prompt; pad requests (nothing shared) bring the forward counter near a known
value; then four requests with that system prompt and short suffixes run together (sampled at temperature 0.8). The
``real_kv_used`` perturbation (probability 1 from ``WARMUP`` forwards on, one injection) flips a byte of a slot the
4th-6th forward of that batch reads; the long shared prompt makes it a shared slot, and the test asserts so.

The flip lands in the window HEAD hashes at every read (``SGLANG_KV_CANARY_PERTURB_KV_BYTES=hashed``, ``partial``):
the shared prompt's slots had their first read (``all``'s every-byte check) during the warm-up, so a flip elsewhere
in the row is the scrub's to find (rows ``rid=scrub``: ``test_e2e_contain``'s scrub test), with no reader to name.
"""

from __future__ import annotations

import random
import pytest

from kv_canary.violations import CONTAIN_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import (
    CanaryLog, canary_server, contain_evictor_gap, register_cpu_ci, register_cuda_ci,
)
from kv_canary_testing.model_dir import NUM_WORDS
from kv_canary_testing.workload import RequestSpec, run_requests

GAP = contain_evictor_gap()
needs_contain = pytest.mark.skipif(bool(GAP), reason=f"--kv-canary contain is refused on this release ({GAP})")

register_cpu_ci(est_time=90, suite="kv-canary-cpu")
register_cuda_ci(est_time=90, suite="kv-canary-cuda")

SHARED_TOKENS = 900  # the system prompt: ~99% of the shared batch's reads at the injection
SUFFIX_TOKENS = 3
SHARERS = 4
NEW_TOKENS = 24  # the sharers still run when the order arrives (D2H delay: 2 forwards)
WARMUP = 48  # forwards before the perturbation: past the server's warm-up, the prompt's and the pad's
LEAD = 3  # at least the shared batch's forwards before the injection (its prefills, then decodes of all four)
TEMPERATURE = 0.8
ENV = {
    "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "1",
    "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": str(WARMUP),
    "SGLANG_KV_CANARY_PERTURB_SEED": "3",
    "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": "1",
    "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
}
MESSAGE = "kv-canary contain: aborted"


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    srv = canary_server("contain", log_path=tmp_path_factory.mktemp("shared_contain") / "server.log", env=ENV,
                        extra_args=["--kv-canary-real-data", "partial"])
    srv.start(timeout=600)
    try:
        yield srv
    finally:
        srv.stop()


def _words(rng: random.Random, n: int):
    return tuple(rng.randrange(NUM_WORDS) for _ in range(n))


def _run(srv, specs, concurrency=1):
    return run_requests(srv.base_url, specs, concurrency=concurrency, use_input_ids=True, timeout=300,
                        temperature=TEMPERATURE)


def _forwards(srv) -> int:
    """Forwards the canary counted so far (the settled stats line): the next forward's index."""
    return CanaryLog.read_settled(srv).last_stat("forwards_host")


def _pad_to(srv, target: int, rng: random.Random) -> int:
    """Run forwards with nothing shared until ``target - 2`` .. ``target`` ran. A request of n new tokens runs
    about n forwards (its prefill, n - 1 decodes, and what the line adds: measured by the first pad, half the
    gap). The perturbation's gate is shut before ``WARMUP``: none of these draws."""
    done, extra = _forwards(srv), 0
    for i in range(4):
        gap = target - done
        if gap <= 2:
            break
        n = max(1, gap // 2 if i == 0 else gap - extra - 1)
        assert _run(srv, [RequestSpec(100 + i, "short", _words(rng, 5), max_new_tokens=n)]).failed == 0
        now = _forwards(srv)
        extra, done = max(extra, now - done - n), now
    return done


@pytest.mark.e2e
@needs_contain
def test_corrupt_shared_slot_gives_one_row_a_forward_and_contain_aborts_every_holder(shared_server):
    srv = shared_server
    rng = random.Random(17)
    system = _words(rng, SHARED_TOKENS)
    warm = _run(srv, [RequestSpec(0, "shared", system, max_new_tokens=2)])
    assert warm.failed == 0, warm.errors
    start = _pad_to(srv, WARMUP - LEAD, rng)
    before = CanaryLog.read_settled(srv)
    # premises: no injection yet, no false alarm, and the shared batch starts LEAD .. LEAD + 2 forwards before WARMUP
    assert before.perturbations == [] and before.violations == [], before.text[-3000:]
    assert WARMUP - LEAD - 2 <= start <= WARMUP - LEAD, f"the pad ran the forward counter to {start}"

    specs = [RequestSpec(i + 1, "shared", system + _words(rng, SUFFIX_TOKENS), max_new_tokens=NEW_TOKENS)
             for i in range(SHARERS)]
    result = _run(srv, specs, concurrency=SHARERS)
    log = CanaryLog.read_settled(srv)
    sharers = {o.rid for o in result.outcomes}
    failed = {o.rid: o.error or "" for o in result.outcomes if o.status != "ok"}
    contained = {c["rid"]: c["state"] for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"}
    assert len(log.perturbations) == 1, log.text[-3000:]
    p = log.perturbations[0]
    slot, position, forward = p["slot"], int(p["position"]), int(p["forward"])
    rows = [v for v in log.violations if v["slot"] == slot]
    # only the sharers ran from the injection's forward to the settled stats line: every forward read the slot
    ran, counted = log.last_stat("forwards_host") - forward, log.last_stat("violations")
    print(f"kv_canary_e2e_shared_prefix_contain {result.summary()} injection=slot:{slot},position:{position},"
          f"forward:{forward},rid:{p['rid']} forwards_after={ran} rows_counted={counted} "
          f"rows_logged={[(v['rid'], v['forward']) for v in rows]} aborted={len(failed)} contained={contained} "
          f"evictions={log.text.count('kv_canary_contain=evict')}")

    # the injection: while the shared batch ran, into the shared system prompt (the test's premise)
    assert forward == WARMUP and p["rid"] in sharers, p
    assert position < SHARED_TOKENS, f"the flip hit position {position}, past the shared prompt: change the seed"
    # every violation is the flip's, none before it: one logged row (repeats are counted, not logged), in the
    # forward the flip preceded, naming one of the sharers at the flipped position
    assert len(rows) == 1 and len(log.violations) == 1, log.violations
    row = rows[0]
    assert row["kind"] == "kv_hash" and int(row["position"]) == position and int(row["forward"]) == forward, row
    readers = {row["rid"]}
    assert readers <= sharers, readers
    # one row a forward, not one per reader: the counter counts every row, repeats included (four readers each
    # checking the slot would count SHARERS a forward)
    assert 1 <= counted <= ran < SHARERS * ran, (counted, ran)
    assert log.last_stat("violations_repeated") == counted - 1

    # contain aborted every sharer that held the slot: the rows' readers for their read, the others as holders. A
    # sharer served to the end must not have held it: its radix hit stopped before the flipped position (its own
    # prefill wrote that position into another slot; seen once on 0.5.12, a 384-token hit)
    served = [o for o in result.outcomes if o.status == "ok"]
    assert all(o.cached_tokens <= position for o in served), [(o.rid, o.cached_tokens) for o in served]
    assert set(failed) == sharers - {o.rid for o in served} and len(failed) >= 2, (result.summary(), result.errors)
    for rid, error in failed.items():
        assert MESSAGE in error and "'type': 'abort'" in error and "kind=kv_hash" in error, error
        assert f"slot={slot} position={position}" in error, error
        if rid not in readers:
            assert "this request holds failed verification, found by a read by request " in error, error
            assert error.split("found by a read by request ")[1].split()[0] in readers, error
    assert any(rid not in readers for rid in failed), "no holder: every sharer was named by a row"
    assert {rid for rid, st in contained.items() if st == "aborted"} == set(failed), contained
    assert log.last_stat("contained_requests") == len(failed)
    assert f"kv_canary_contain=evict slot={slot} " in log.text, log.text[-3000:]

    # the server keeps serving: the same prompts again, computed fresh (the bad slot was evicted), no new row
    again = _run(srv, [RequestSpec(10 + s.index, s.kind, s.words, s.max_new_tokens) for s in specs],
                 concurrency=SHARERS)
    log2 = CanaryLog.read_settled(srv)
    assert again.failed == 0 and srv.is_running(), again.errors
    assert len(log2.violations) == len(log.violations), log2.violations[len(log.violations):]
    assert len(log2.perturbations) == 1


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
