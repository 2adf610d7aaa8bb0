"""The per-forward flow of CanaryManager on real sglang ForwardBatch objects (``kv_canary_testing.runner_harness``:
the torch reference kernels wrapped by spies that record the call order; a "model" that writes K/V at
out_cache_loc the way attention does). The host work around an eager step: ``test_runner_host_work.py``.
"""

from __future__ import annotations

import logging

import pytest

from kv_canary import fingerprint as fp
from kv_canary.config import CanaryMode
from kv_canary.runner import CanaryBracketError
from kv_canary.violations import STATS_PREFIX, VIOLATION_PREFIX, CanaryViolationError, parse_lines

pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
from kv_canary_testing.runner_harness import CTX, Harness  # noqa: E402 - needs sglang


def test_per_forward_orchestrates_plan_head_forward_tail():
    h = Harness()
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    h.step(h.batch({1: [10], 2: [11]}, decode=True))
    assert h.events == ["verify", "stamp", "forward", "check", "write"] * 2
    c = h.manager.last_counters
    assert int(c[fp.C_SLOTS_WRITTEN]) == 7 and int(c[fp.C_SLOTS_VERIFIED]) == 5
    assert h.manager.forwards == 2 and int(c[fp.C_FORWARD_INDEX]) == 2


def test_the_stats_line_gives_the_canarys_host_time_per_outer_step():
    """``host_us_per_step``: the outside pre- and post-ops' host time per outer step, mean since init finished."""
    h = Harness()
    h.step(h.batch({1: [5, 6]}))  # before init finished: not counted
    h.manager.mark_init_finished()
    assert parse_lines(h.manager.stats_line(), STATS_PREFIX)[0]["host_us_per_step"] == "0.0"
    h.step(h.batch({1: [7, 8, 9]}))
    h.step(h.batch({1: [10]}, decode=True))
    stats = parse_lines(h.manager.stats_line(), STATS_PREFIX)[0]
    assert stats["outer_steps"] == "2" and h.manager.outside_host_ns > 0
    assert float(stats["host_us_per_step"]) == round(h.manager.outside_host_ns / 2e3, 1)


def test_a_dropped_kv_store_is_reported_unwritten_by_the_tail_of_its_forward(caplog):
    h = Harness(mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    h.model.drop_lane = 1  # request r2's first decode token: its slot keeps the bytes it held before
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(h.batch({1: [10], 2: [11]}, decode=True))
        h.manager.poll(drain=True)
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [(v["kind"], v["rid"], v["slot"], v["position"], v["layer"], v["half"], v["rows_unwritten"], v["forward"])
            for v in found] == [("unwritten", "r2", "7", "2", "0", "k", "2", "1")]
    assert int(h.manager.last_counters[fp.C_SLOTS_WITNESSED]) == 7


def test_the_write_witness_off_leaves_a_dropped_store_unseen():
    h = Harness(write_witness=False)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6]}))
    h.model.drop_lane = 0
    h.step(h.batch({1: [7]}, decode=True))  # raise mode: nothing to report without the witness
    h.manager.poll(drain=True)
    assert "stamp" not in h.events and int(h.manager.last_counters[fp.C_SLOTS_WITNESSED]) == 0


def test_the_verify_and_tail_run_at_the_anchor_before_the_last_stage_or_after_a_forward_that_skips_it():
    h = Harness(anchor=True)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    h.model.skip_logits = True
    h.step(h.batch({1: [10], 2: [11]}, decode=True))
    # anchored: HEAD stamps, the verify runs with the TAIL (the forward writes none of the slots it reads)
    assert h.events == ["stamp", "forward", "verify", "check", "write", "logits",
                        "stamp", "forward", "verify", "check", "write"]
    assert int(h.manager.last_counters[fp.C_SLOTS_VERIFIED]) == 5
    h.manager.poll(drain=True)
    c = h.manager.last_counters
    assert int(c[fp.C_SLOTS_WRITTEN]) == 7 and h.manager.forwards == 2 and int(c[fp.C_FORWARD_INDEX]) == 2
    assert "tails_at_anchor=1 " in h.manager.stats_line() + " "


def test_the_scrub_runs_in_head_before_the_stamp_with_or_without_an_anchor(caplog):
    """The scrub checks its window in HEAD, before the stamp changes the slots to fill, also when the verify and the
    TAIL run at the anchor (moving it after the TAIL's write, beside the LM head, measured no faster on an H200:
    docs/results/gpu-h200-2026-11-30g-host-time); no false alarm over the windows, and a byte flipped in a held
    slot no forward reads is reported within the bound (rid=scrub)."""
    h = Harness(mode=CanaryMode.LOG, anchor=True, scrub_slots_per_forward=64)  # 255 slots: every one in 4 forwards
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    assert h.events == ["scrub", "stamp", "forward", "verify", "check", "write", "logits"]
    for t in range(8):  # slots 6..13, one a forward (forwards 2..9)
        h.step(h.batch({1: [10 + t]}, decode=True))
    h.manager.poll(drain=True)
    c = h.manager.last_counters
    assert int(c[fp.C_VIOLATIONS]) == 0 and int(c[fp.C_SLOTS_SCRUBBED]) > 0
    held = int(h.r2t[2, 1])  # request r2's last slot: held, no longer read
    h.v[held, 0, 3] = -h.v[held, 0, 3] - 1.0
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        for t in range(4):
            h.step(h.batch({1: [30 + t]}, decode=True))
        h.manager.poll(drain=True)
    found = [(v["kind"], v["rid"], v["slot"]) for v in parse_lines(caplog.text, VIOLATION_PREFIX)]
    assert found == [("kv_hash", "scrub", str(held))]

    plain = Harness(scrub_slots_per_forward=64)  # no anchor: the verify in HEAD too, the TAIL after the forward
    plain.manager.mark_init_finished()
    plain.step(plain.batch({1: [5, 6]}))
    assert plain.events == ["scrub", "verify", "stamp", "forward", "check", "write"]


def test_a_dropped_kv_store_is_reported_unwritten_by_a_tail_at_the_anchor(caplog):
    h = Harness(mode=CanaryMode.LOG, anchor=True)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [8, 9]}))
    h.model.drop_lane = 1
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(h.batch({1: [10], 2: [11]}, decode=True))
        h.manager.poll(drain=True)
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [(v["kind"], v["rid"], v["slot"], v["forward"]) for v in found] == [("unwritten", "r2", "7", "1")]
    assert h.events.count("logits") == 2 and h.events[-2:] == ["write", "logits"]


def test_nested_model_forward_shares_the_outer_bracket():
    h = Harness()
    h.manager.mark_init_finished()
    h.model.nested = True
    h.step(h.batch({1: [5, 6]}))
    assert h.events == ["verify", "stamp", "forward", "forward", "check", "write"]


def test_forward_without_active_manager_after_init_is_an_error():
    h = Harness()
    fb = h.batch({1: [5]})
    h.model(fb.input_ids, fb.positions, fb)  # before init finished: warmup forwards pass through
    h.manager.mark_init_finished()
    with pytest.raises(CanaryBracketError, match="no active single-forward manager"):
        h.model(fb.input_ids, fb.positions, fb)


def test_bracket_misuse_errors():
    h = Harness()
    h.manager.mark_init_finished()
    fb = h.batch({1: [5]})
    with pytest.raises(CanaryBracketError, match="out of range"):
        with h.manager.with_active_single_forward_manager(3):
            pass
    with h.manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
        with pytest.raises(CanaryBracketError, match="entered twice"):
            with h.manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
                pass
        with h.manager.with_active_single_forward_manager(0):
            h.model(fb.input_ids, fb.positions, fb)


def test_a_forward_that_skipped_the_canary_is_a_health_violation(caplog):
    """Like a CUDA graph replayed without the canary's kernels: the host counted it, the device did not."""
    h = Harness(mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6]}))
    fb = h.batch({1: [7]}, decode=True)
    original = h.model.forward.__kv_canary_original__
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        with h.manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
            original(fb.input_ids, fb.positions, fb)  # no HEAD, no TAIL
        h.step(h.batch({1: [8]}, decode=True))
    kinds = {v["kind"] for v in parse_lines(caplog.text, VIOLATION_PREFIX)}
    assert {"health:forwards", "health:verify_launches", "health:write_launches", "health:slots_written"} <= kinds
    assert h.manager.health_violations == 4
    # reported once: the next clean forwards add no new health violation
    h.step(h.batch({1: [9]}, decode=True))
    assert h.manager.health_violations == 4


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_raise_mode_stops_within_the_stated_delay(interval):
    """The host reads the copy after the first forward count that is a multiple of the copy interval (2 with 1 or
    2, 3 with 3), ``delay`` forwards later: at most delay + interval - 1 forwards after the detecting one."""
    delay = 2
    h = Harness(mode=CanaryMode.RAISE, delay=delay, d2h_interval=interval)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7, 8]}))
    h.k[int(h.r2t[1, 2]), 0, 0] += 1.0  # corrupt a hashed byte of position 2
    h.step(h.batch({1: [9]}, decode=True))  # forward 1 detects it on the device (2 forwards counted)
    copied = -(-2 // interval) * interval  # the first copy holding it
    for _ in range(copied + delay - 2 - 1):
        h.step(h.batch({1: [9]}, decode=True))  # the host has not read a copy holding it yet
    with pytest.raises(CanaryViolationError) as info:
        h.step(h.batch({1: [9]}, decode=True))
    lines = parse_lines(str(info.value), VIOLATION_PREFIX)
    assert lines and lines[0]["kind"] == "kv_hash" and lines[0]["position"] == "2"
    assert lines[0]["rid"] == "r1" and lines[0]["forward"] == "1"


def test_an_idle_drain_reads_the_last_forward_whatever_the_copy_interval(caplog):
    """SGLANG_KV_CANARY_D2H_INTERVAL=8: no copy is due after forward 2, the idle drain copies it and reports."""
    h = Harness(mode=CanaryMode.LOG, d2h_interval=8)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7, 8]}))
    h.k[int(h.r2t[1, 2]), 0, 0] += 1.0
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(h.batch({1: [9]}, decode=True))
        assert parse_lines(caplog.text, VIOLATION_PREFIX) == []
        h.manager.poll(drain=True)
    assert [v["kind"] for v in parse_lines(caplog.text, VIOLATION_PREFIX)] == ["kv_hash"]
    assert h.manager.last_counters[fp.C_FORWARD_INDEX] == 2 and h.manager.health_violations == 0


def test_log_mode_logs_each_violation_and_keeps_serving(caplog):
    h = Harness(mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [1, 2, 3]}))
    h.r2t[2, 1] = h.r2t[1, 1]  # request 2 now reads request 1's slot at position 1
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(h.batch({1: [8], 2: [4]}, decode=True))
        h.step(h.batch({1: [9], 2: [5]}, decode=True))
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert {(v["rid"], v["position"], v["kind"]) for v in found} == {
        ("r2", "1", "chain"),  # a foreign slot: another prefix
        ("r2", "2", "chain"),  # request 2's own slot, but its link now points at the foreign one
    }
    assert h.manager.violations_reported == 4  # both decode forwards read the bad slots


def test_a_whole_foreign_prefix_fails_the_token_check_once(caplog):
    """Request 2's row points at request 1's self-consistent slots (a radix match to another prompt): every
    link checks out; the chain of the read tokens is not the chain of request 2's own tokens."""
    h = Harness(mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7], 2: [1, 2, 3]}))
    h.r2t[2, :3] = h.r2t[1, :3]
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        for t in range(3):
            h.step(h.batch({1: [8 + t], 2: [4 + t]}, decode=True))
        h.manager.poll(drain=True)
    found = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert [(v["rid"], v["position"], v["kind"]) for v in found] == [("r2", "2", "token")]
    assert h.manager.violations_reported == 1  # the next TAIL continues from what request 2 read


def test_chunks_continue_and_a_retracted_request_is_admitted_again(caplog):
    """A continuation chunk keeps the device's row chain; a retracted request re-admitted with fewer cached
    positions gets its chain from the host again (else its HEAD would compare a longer prefix's chain)."""
    h = Harness(mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        h.step(h.batch({1: [5, 6, 7], 2: [1]}))
        h.step(h.batch({1: [8, 9]}))  # the next chunk of request 1
        h.step(h.batch({1: [10]}, decode=True))
        h.reqs[1].retraction_count += 1  # retracted; back with 3 of its 6 positions cached
        h.lens[1], h.own[1] = 3, h.own[1][:3]
        h.step(h.batch({1: [8, 9, 10]}))
        h.step(h.batch({1: [11]}, decode=True))
        h.manager.poll(drain=True)
    assert parse_lines(caplog.text, VIOLATION_PREFIX) == []
    assert h.manager.last_counters[fp.C_SLOTS_VERIFIED] == 3 + 5 + 3 + 6


def test_a_cuda_graph_recapture_after_init_raises_no_health_violation(caplog):
    """sglang recaptures graphs after init (capture-hidden-mode change, weight update): its warmup
    forwards run HEAD/TAIL inside the canary's capture bracket, within a forward's outside bracket."""
    h = Harness(mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7]}))
    fb = h.batch({1: [8]}, decode=True)
    m = h.manager
    with caplog.at_level(logging.ERROR, logger="kv_canary"):
        with m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
            with m.with_active_single_forward_manager(0):
                with m.capturing(), m.with_active_single_forward_manager(0):  # the recapture's warmup runs
                    for _ in range(2):
                        warm = h.batch({3: [1, 2]}, decode=False)
                        h.model(warm.input_ids, warm.positions, warm)
                h.model(fb.input_ids, fb.positions, fb)  # the real forward
        for t in range(3):
            h.step(h.batch({1: [9 + t]}, decode=True))
        m.poll(drain=True)
    assert m.health_violations == 0, caplog.text
    assert parse_lines(caplog.text, VIOLATION_PREFIX) == []
    assert m.forwards == 5 and int(m.last_counters[fp.C_FORWARD_INDEX]) == 5


def test_log_mode_storm_reads_only_new_rows_and_logs_each_violation_once(caplog):
    """One corrupt slot read by every later forward: host work per poll stays O(new rows), one line in total. Its
    three readers share the slot after the same predecessor, so HEAD checks it once a forward (the first reader's
    row; the next test has many rows a forward)."""
    h = Harness(mode=CanaryMode.LOG, delay=1)
    h.manager.mark_init_finished()
    h.step(h.batch({r: [5, 6, 7, 8] for r in (1, 2, 3)}))
    for r in (2, 3):  # two more requests share request 1's prefix slots (a radix hit)
        h.r2t[r, :4] = h.r2t[1, :4]
    h.k[int(h.r2t[1, 2]), 0, 0] += 1.0  # one persistent corruption, read by all three each forward
    reader = h.manager._ring_reader
    per_poll = []
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        for _ in range(40):
            before = reader.rows_read
            h.step(h.batch({r: [9] for r in (1, 2, 3)}, decode=True))
            per_poll.append(reader.rows_read - before)
        h.manager.poll(drain=True)
    rows_on_device = int(h.manager.counters[fp.C_VIOLATIONS])
    assert rows_on_device == 40 and reader.rows_read == rows_on_device  # every row read exactly once
    assert max(per_poll) == 1  # only the newest forward's row, never the ring (capacity 4096)
    lines = parse_lines(caplog.text, VIOLATION_PREFIX)
    assert len(lines) == 1 and lines[0]["kind"] == "kv_hash" and lines[0]["position"] == "2"
    assert h.manager.violations_repeated == rows_on_device - 1
    assert h.manager.violations_reported == rows_on_device
    stats = parse_lines(caplog.text, "kv_canary_stats")
    assert len(stats) == 2  # one with the new violation, one settled line: not one per forward


def test_contain_mode_sees_a_repeat_row_that_names_a_later_reader(caplog):
    """contain: a row that repeats a reported violation (same slot, position and bytes) in a later poll still goes
    to the containment order (it names the request that read the bad slot in that forward): only its line is
    left out. Here a later reader of the slot, admitted after the first order, is aborted by name."""
    orders = []

    class Target:
        def submit(self, order):
            orders.append(order)

    h = Harness(mode=CanaryMode.CONTAIN, delay=0)
    h.manager.attach_containment(Target())
    h.manager.mark_init_finished()
    h.step(h.batch({1: [5, 6, 7, 8]}))
    h.k[int(h.r2t[1, 2]), 0, 0] += 1.0  # one persistent corruption
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        h.step(h.batch({1: [9]}, decode=True))  # request 1 reads it
        h.manager.poll(drain=True)
        assert [set(o.aborts) for o in orders] == [{"r1"}]
        # request 2 is admitted after the order with a radix hit on request 1's prefix: it reads the slot in its
        # extend, the same row as request 1's but another reader
        h.r2t[2, :4] = h.r2t[1, :4]
        h.lens[2], h.own[2] = 4, [5, 6, 7, 8]
        h.step(h.batch({2: [10]}))
        h.manager.poll(drain=True)
    assert [set(o.aborts) for o in orders] == [{"r1"}, {"r2"}], orders
    assert "found by a read by request r2" in orders[1].held_slots[0][2]
    assert len(parse_lines(caplog.text, VIOLATION_PREFIX)) == 1  # the repeat is counted, not logged again
    assert h.manager.violations_repeated == 1 and h.manager.violations_reported == 2
    assert h.manager.contained_requests == 2


def test_ring_reads_are_budgeted_and_overwritten_rows_are_counted_lost():
    """More rows per forward than the ring holds: each poll reads at most the budget, the rest is counted lost."""
    h = Harness(mode=CanaryMode.LOG, delay=0, ring_capacity=16, max_logged_violations=1)
    h.manager.mark_init_finished()
    h.step(h.batch({r: list(range(5, 15)) for r in (1, 2, 3)}))
    for r in (1, 2, 3):
        h.k[h.r2t[r, :10].long(), 0, 0] += 1.0  # 30 corrupt slots, each read every forward
    reader = h.manager._ring_reader
    assert reader.budget == 16
    for _ in range(5):
        before = reader.rows_read
        h.step(h.batch({r: [9] for r in (1, 2, 3)}, decode=True))
        assert reader.rows_read - before <= 16
    m = h.manager
    read_or_lost = reader.rows_read + m.violations_lost
    assert int(m.counters[fp.C_VIOLATIONS]) == 5 * 30 and read_or_lost == 5 * 30
    assert m.violations_lost > 0 and m.violations_reported == 5 * 30


def test_precompile_covers_every_variant_a_workload_launches(caplog):
    """After install-time precompile + seal, real extend and decode forwards of any length launch no new variant."""
    from kv_canary.kernels.variants import VariantTracker, programs_classes, track, write_block_lengths

    h = Harness(mode=CanaryMode.LOG, scrub_slots_per_forward=4)  # FULL_HASH kept: the whole-row TAIL's tiles too
    m = h.manager
    tracker = VariantTracker()
    from kv_canary.kernels.triton_kernels import tail_variant
    m.kernels = track(m.kernels, tracker, tail_variant)
    for sfm in m.single_forward_managers:
        sfm._kernels = m.kernels
    m.variant_tracker = tracker
    lengths = sorted(write_block_lengths(tail_variant, CTX).values())
    # CTX = 64: write blocks 16..64, whole-row slot tiles 1..64
    assert [tail_variant(n) for n in lengths] == [(16, 1), (16, 2), (16, 4), (16, 8), (16, 16), (32, 32), (64, 64)]
    sizes = sorted(programs_classes(lambda bs: m.capacities.verify_programs_per_request(bs, 256), 9).values())
    m.precompile(lengths, sizes)
    precompiled = set(tracker.seen)
    assert precompiled and int(m.counters[fp.C_SLOTS_WRITTEN]) == 0  # inert: slot 0 only
    m.mark_init_finished()
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        h.step(h.batch({1: list(range(5, 45)), 2: [3, 4, 5]}))  # extend, longest run 40 -> block 64
        h.step(h.batch({1: [7], 2: [8]}, decode=True))
        h.step(h.batch({3: list(range(10, 20))}))  # block 16
        wide = h.batch({5: list(range(30, 50))})  # an extend batch whose index tensors came as int64
        wide.extend_seq_lens, wide.extend_start_loc = wide.extend_seq_lens.long(), wide.extend_start_loc.long()
        h.step(wide)
    assert tracker.after_startup == {} and "kv_canary_jit_after_startup" not in caplog.text
    assert tracker.seen == precompiled
    # A variant precompile did not launch (here: a decode-dtype batch of a block never precompiled) is reported.
    tracker.seen.clear()
    tracker.seen.update(k for k in precompiled if not (k[0] == "write" and k[-8][0] == 64))
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        h.step(h.batch({4: list(range(5, 45))}))
    assert tracker.after_startup and "kv_canary_jit_after_startup=1 kernel=write" in caplog.text


