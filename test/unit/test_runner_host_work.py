"""The canary's host work around an eager step (an extend), on real sglang ForwardBatch objects
(``kv_canary_testing.runner_harness``): the token oracle's fed tokens staged by the TAIL, the bookkeeping an eager
step leaves for the next graph replay, and HiCache's batched host-copy records flushed at idle."""

from __future__ import annotations

import logging

import pytest
import torch

from kv_canary.config import CanaryMode
from kv_canary.runner import CanaryBracketError
from kv_canary.violations import VIOLATION_PREFIX, parse_lines

pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
from kv_canary_testing.runner_harness import Harness  # noqa: E402 - needs sglang


def test_an_eager_extend_stages_its_fed_tokens_at_its_tail_and_a_wrong_one_is_caught(caplog):
    """The token oracle stages an extend's fed tokens where its TAIL runs (past the model's layer launches); a fed
    token that is not the request's own is reported by that TAIL. A decode step stages nothing."""
    h = Harness(mode=CanaryMode.LOG, anchor=True)
    h.manager.mark_init_finished()
    oracle = h.manager.token_oracle
    stage_fed = oracle.stage_fed

    def spied():
        if oracle.fed_unstaged:
            h.events.append("stage_fed")
        stage_fed()

    oracle.stage_fed = spied
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    assert h.events == ["stamp", "forward", "stage_fed", "verify", "check", "write", "logits"]
    h.step(h.batch({1: [10], 2: [11]}, decode=True))
    assert "stage_fed" not in h.events[7:]
    fb = h.batch({3: [20, 21, 22]})
    fb.input_ids[1] = 99  # fed a token the scheduler's record does not hold
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(fb)
        h.manager.poll(drain=True)
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [(v["kind"], v["rid"], v["position"]) for v in found] == [("token", "r3", "1")]


def _spy_admissions(h):
    oracle = h.manager.token_oracle
    stage_admissions = oracle.stage_admissions

    def spied():
        if oracle._admit_pending is not None:
            h.events.append("admit")
        stage_admissions()

    oracle.stage_admissions = spied


def _radix_hit(h, row, prefix_row, prefix_tokens, new_tokens):
    """A new request in ``row`` whose first ``len(prefix_tokens)`` positions are ``prefix_row``'s cached slots (a
    radix match); the scheduler records ``prefix_tokens`` as its prompt's start."""
    n = len(prefix_tokens)
    h.r2t[row, :n] = h.r2t[prefix_row, :n]
    h.lens[row], h.own[row] = n, list(prefix_tokens)
    return h.batch({row: new_tokens})


@pytest.mark.parametrize("anchor", [True, False])
def test_an_eager_extend_admits_its_cached_prefixes_where_its_verify_runs(anchor, caplog):
    """An admitted request's chain over its cached prefix is computed where the verify that reads it runs: with an
    anchor, at the TAIL (past the model's layer launches, off the extend's launch path), else in HEAD. A prefix whose
    tokens are not the request's own is caught either way."""
    h = Harness(mode=CanaryMode.LOG, anchor=anchor)
    h.manager.mark_init_finished()
    _spy_admissions(h)
    h.step(h.batch({1: [5, 6, 7]}))
    assert "admit" not in h.events  # nothing cached: nothing to admit
    h.events.clear()
    h.step(_radix_hit(h, 3, 1, [5, 6, 7], [8]))
    if anchor:
        assert h.events == ["stamp", "forward", "admit", "verify", "check", "write", "logits"]
    else:
        assert h.events == ["admit", "verify", "stamp", "forward", "check", "write"]
    h.step(_radix_hit(h, 4, 1, [5, 6, 99], [8]))  # matched slots holding another prompt's tokens
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.manager.poll(drain=True)
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [(v["kind"], v["rid"], v["position"]) for v in found] == [("token", "r4", "2")]


def test_an_extend_that_raises_before_its_anchor_still_admits_and_verifies(caplog):
    """The verify left for the anchor runs when the forward raises before it (``verify_deferred_on_error``), with the
    admissions it reads, and what it found is reported before the error propagates."""
    h = Harness(mode=CanaryMode.LOG, anchor=True)
    h.manager.mark_init_finished()
    _spy_admissions(h)
    h.step(h.batch({1: [5, 6, 7]}))
    h.model.raise_before_logits = True
    for row, prefix, want in ((3, [5, 6, 7], []), (4, [5, 6, 99], [("token", "r4")])):
        h.events.clear()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kv_canary"):
            with pytest.raises(RuntimeError, match="before the logits") as error:
                h.step(_radix_hit(h, row, 1, prefix, [8]))
            h.manager.report_before_engine_error(error.value)  # what the engine hook does with the step's error
        assert h.events == ["stamp", "forward", "admit", "verify"]  # no TAIL: its stores may have stopped part-way
        assert [(v["kind"], v["rid"]) for v in parse_lines(caplog.text, VIOLATION_PREFIX)] == want


def test_an_eager_extend_whose_tail_never_ran_on_the_host_is_an_error():
    """Its fed tokens were left for the TAIL: a forward that ran without it (a replayed graph) must not pass."""
    h = Harness()
    h.manager.mark_init_finished()
    fb = h.batch({1: [5, 6]})
    original = h.model.forward.__kv_canary_original__
    with pytest.raises(CanaryBracketError, match="fed tokens were left for its TAIL"):
        with h.manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
            original(fb.input_ids, fb.positions, fb)  # no HEAD, no TAIL
    assert not h.manager.token_oracle.fed_unstaged


def test_idle_flushes_the_batched_host_copy_records():
    """HiCache's batched backups and frees wait for an ack check or a load, but no longer than idle (sglang's
    ``--sleep-on-idle`` checks acks only when the next batch arrives: the flush would land on its boundary)."""
    from kv_canary.host_records import HostRecordStore

    h = Harness()
    h.manager.attach_host_records(HostRecordStore(64))
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7]}))
    store = h.manager.host_records.records
    h.manager.backup_records(torch.tensor([1, 2, 3]), torch.tensor([40, 41, 42]))
    assert h.manager.defer_host_ops and not bool(store[40:43].any())  # batched
    h.manager.poll()  # a forward's poll leaves them
    assert not bool(store[40:43].any())
    h.manager.poll(drain=True)
    assert torch.equal(store[40:43], h.manager.groups[0].records[1:4]) and store[40:43, 0].tolist() == [5, 6, 7]


def test_eager_steps_leave_their_bookkeeping_for_a_bounded_number_of_steps_or_idle(caplog):
    """On CUDA an eager step (an extend) leaves the oracle's remembered chains and the counter poll to the next graph
    replay; at most ``eager_steps_waiting`` eager steps in a row wait, and idle (``poll(drain=True)``) catches up."""
    h = Harness(mode=CanaryMode.LOG)
    m = h.manager
    m.eager_steps_waiting = 2  # as on CUDA (CPU: 0, every step does its own)
    m.mark_init_finished()
    prompt = list(range(100, 140))  # 40 fed tokens: an admission the oracle remembers after the forward
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(h.batch({1: prompt}))
        assert m.token_oracle._fed_pending and m.last_counters is None  # waiting: nothing remembered, nothing read
        h.k[int(h.r2t[1, 3]), 0, 0] += 1.0  # a corrupted slot, read by every later step of request 1
        h.step(h.batch({1: [7]}))  # the next extend's admission remembers what waited before it stages
        assert m.token_oracle._row_fed[1][1] == 40 and not m.token_oracle._fed_pending
        assert m.violations_reported == 0  # the second eager step waits too
        h.step(h.batch({1: [8]}))  # the third: past the bound, the steps' bookkeeping runs
        assert m.violations_reported == 2  # both steps that read the slot
        h.step(h.batch({1: [9]}))
        assert m.violations_reported == 2  # its violation waits for a catch-up
        m.poll(drain=True)  # idle
    assert m.violations_reported == 3 and m._wait_steps == 0
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [v["forward"] for v in found] == ["1"]  # the first forward that read it, not the poll's (logged once)


def test_waiting_eager_steps_never_make_the_counter_copies_wait():
    """The counter copies' ring holds delay + 2 copies: eager steps that leave their poll for later read the landed
    copies before the ring fills, so a snapshot never waits for the device (a host sync on an extend's path)."""
    h = Harness(mode=CanaryMode.LOG, delay=2)
    m = h.manager
    m.eager_steps_waiting = 4
    m.mark_init_finished()

    def never(idx, serial):
        raise AssertionError("a counter snapshot waited for the device")

    m._d2h._wait = never
    for t in range(12):  # a long run of eager extends (a prefill burst): no replay to catch up at
        h.step(h.batch({1 + t % 3: [5 + t]}))
    for t in range(4):  # runs of two waiting steps, each followed by one that does its own bookkeeping (on CUDA: a
        m.eager_steps_waiting = 4  # graph replay; here a step that may not wait)
        h.step(h.batch({1: [30 + t]}))
        h.step(h.batch({2: [40 + t]}))
        m.eager_steps_waiting = 0
        h.step(h.batch({3: [50 + t]}))
    m.poll(drain=False)
    assert m.health_violations == 0 and m.forwards == 24
