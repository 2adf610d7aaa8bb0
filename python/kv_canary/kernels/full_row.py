"""Whole-row (FULL_HASH) hashing split over (slot block, row chunk) programs: TAIL's store, the scrub, and
``--kv-canary-real-data all``'s first-read verification.

The FULL_HASH of a slot is ``mix64(SUM_w mix32(word_w ^ key_w) ^ HASH_SEED)`` over every int32 word ``w``
of every layer's K and V row in canonical order (``fingerprint.full_hash_from_words`` of
``CanaryBufferGroup.all_words``; the 32-bit term keeps the per-word work small enough for the loads to set
the pace). The sum is additive, so each program hashes a tile of
``SB`` slots x one chunk of rows (``WT`` words at a time) and adds its partial sums into ``acc[slot]``
(int64, one per slot, zero between launches) with an atomic add, then takes a ticket per slot
(``tickets[slot]``): the program whose ticket is the launch's last chunk for that slot mixes ``acc[slot]``,
stores or compares it, and zeroes ``acc[slot]`` and the ticket again, in the same launch (a finalize launch
per hash cost ~2-2.6 us on an H200, three a decode step under ``all``). Only a first-read list hashed in parts
(a HiCache load, layer by layer) keeps a finalize launch after its last part. Wrapping int64 addition is
associative and commutative, so the result is bit-equal to the torch reference whatever the split.

Lanes (which slots a launch hashes), by the ``MODE`` constexpr:

* ``TAIL``: the new tokens of a forward, ``out_cache_loc[new_starts[i] + k]`` for ``k < new_lens[i]``
  (translated through the group's slot map), as the write kernel maps them; grid ``(batch, chunks)``.
* ``SCRUB``: ``per_forward`` slots of a round-robin window ``1 + (forward index * per_forward + l) mod
  (num_slots - 1)``, skipping slots never written (chain 0); persistent grid ``(P, chunks)``.
* ``LIST``: the first-read work list (``FullRowState.work``, filled by HEAD's verify kernel with the read
  slots whose FULL_HASH was not verified since their record was written); persistent grid ``(P, chunks)``.

Every grid is fixed by host-known values (batch size, ``max_new_len``, capacities): graph-capturable,
no allocation per launch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Tuple

import triton
import triton.language as tl

from .. import fingerprint as fp
from .launch import BoundKernel, cdiv, next_power_of_2
from .slot_checks import (  # noqa: F401 - read as Triton globals
    _C_FORWARD_INDEX, _C_REPORT_ENABLED, _C_SLOTS_FIRST_READ, _C_SLOTS_SCRUBBED, _HASH_SEED, _R_KV_HASH, _RW,
    _append_violations, _mix64, _translate,
)

_KEY = tl.constexpr(fp.FULL_WORD_KEY)
_M32_1 = tl.constexpr(fp.MIX32_M1)
_M32_2 = tl.constexpr(fp.MIX32_M2)

TAIL, SCRUB, LIST = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """How the whole-row hash is cut into programs (any cut gives the same hash); per-mode tuples are
    indexed by TAIL, SCRUB, LIST."""

    tile_elements: int  # SB x WT words a program loads per step
    slot_tile: Tuple[int, int, int]  # SB floor (unless rows are short); a TAIL's SB is capped by its run
    rows_per_program: Tuple[int, int, int]  # a TAIL of <= 16 slots: one
    persistent_programs: Tuple[int, int, int]  # slot-block programs of a SCRUB / LIST launch (each loops)
    target_programs: int  # a TAIL over a long run splits its tokens until about this many programs; a LIST of
    # a few rows gets about this many programs
    warps: int
    finalize_block: int  # slots a finalize program mixes
    finalize_programs: int  # most finalize programs of a SCRUB / LIST launch (each loops)
    fused_list_programs: int  # programs of a LIST expected empty (HiCache outside a load), each over every row


# GPU: the best of a sweep on an H100 (scripts/sweep_full_row_tiles.py, at 686ff20: benchmarks/README.md;
# docs/history/performance.md issue 22); LIST's one row a program keeps a short list (a decode step's first reads)
# spread over the GPU.
GPU_SHAPE = LaunchShape(1024, (4, 8, 8), (4, 4, 1), (0, 128, 64), 4096, 8, 128, 64, 8)
# The Triton interpreter (CPU servers and tests) runs programs one after another, each step a numpy op: the
# fewest, largest programs (every row in one program; a tile still smaller than a wide row, so the word loop
# is exercised).
INTERPRETER_SHAPE = LaunchShape(8192, (64, 64, 64), (64, 64, 64), (0, 4, 4), 16, 4, 1024, 4, 2)
SHAPE = INTERPRETER_SHAPE if os.environ.get("TRITON_INTERPRET") == "1" else GPU_SHAPE


@triton.jit
def _mix32(x):
    """``fingerprint.mix32`` on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * _M32_1
    x = x ^ (x >> 15)
    x = x * _M32_2
    return x ^ (x >> 16)


@triton.jit
def _lane_slots(l, MODE: tl.constexpr, bound, records, work, num_slots, start_or_row):
    """(slot, valid) of lanes ``l`` in SCRUB or LIST mode (``bound``: lanes in use)."""
    m = l < bound
    if MODE == 1:  # SCRUB: never-written slots (chain 0) are skipped
        slot = 1 + (start_or_row + l) % (num_slots - 1)
        chain = tl.load(records + slot * _RW + 2, mask=m, other=0)
        m = m & (chain != 0)
    else:
        slot = tl.load(work + l * 3, mask=m, other=0)
        m = m & (slot > 0) & (slot < num_slots)
    return tl.where(m, slot, 0).to(tl.int64), m


@triton.jit
def _add_rows(acc, slot, m, base, table, r0, r1, SB: tl.constexpr, WT: tl.constexpr, ALIGN: tl.constexpr,
              EVEN: tl.constexpr):
    """acc[slot] += the partial word sums of rows [r0, r1) of lanes ``m`` (int64, wrapping).

    ``ALIGN`` (``CanaryBufferGroup.row_word_alignment``): the words every row's offset, stride and length are a
    multiple of. Told to the compiler, it loads ``ALIGN`` words per access (16 bytes) instead of one: the table's
    values are runtime loads, so without the hint every word was its own load and address (the bulk paths 12-27%
    slower on an H200). The terms add into a [SB, WT] int64 tile reduced once at the end: no reduction per loaded
    tile (reducing each step kept too few loads in flight: ~3x slower on an H100).

    ``EVEN``: every row's length is a multiple of WT, so no tile runs past a row: the loads and terms are not
    masked (a masked lane's slot is 0, a real slot, and its sum is dropped at the atomic add). With the keys
    advanced by one add a tile, the scrub's word loop is 58 sm90 instructions per 4 words instead of 71: a small
    launch's hashing is bound by its instructions (a lane that hashes nothing cost as much as one that does,
    results/gpu-h200-2026-11-30f-every-byte-kernels)."""
    tile = tl.zeros((SB, WT), dtype=tl.int64)
    cols = tl.arange(0, WT)
    for r in range(r0, r1):
        offset = tl.multiple_of(tl.load(table + r * 4 + 0), ALIGN)
        stride = tl.multiple_of(tl.load(table + r * 4 + 1), ALIGN)
        words = tl.multiple_of(tl.load(table + r * 4 + 2), ALIGN)
        first = tl.load(table + r * 4 + 3)
        row = base + offset + slot[:, None] * stride
        key = (first + cols + 1).to(tl.uint32) * _KEY  # [WT], shared by the SB slots: (first + w + 1) * _KEY
        for w0 in range(0, words, WT):
            w = w0 + cols
            if EVEN:
                word = tl.load(row + w[None, :]).to(tl.uint32, bitcast=True)
                tile += _mix32(word ^ key[None, :]).to(tl.int64)  # zero-extended: in [0, 2^32)
            else:
                m2 = m[:, None] & (w < words)[None, :]
                word = tl.load(row + w[None, :], mask=m2, other=0).to(tl.uint32, bitcast=True)
                tile += tl.where(m2, _mix32(word ^ key[None, :]).to(tl.int64), 0)
            key += (WT * _KEY) % 4294967296  # the next tile's keys, one add a word (mod 2^32)
    tl.atomic_add(acc + slot, tl.sum(tile, axis=1), mask=m & (r1 > r0), sem="relaxed")


@triton.jit
def _list_first_reads(records, slot, m, batch_index, row, tags, work, work_state, work_capacity):
    """HEAD (``all``): append read lanes ``m`` whose record's FULL_HASH differs from the slot's tag (not verified
    since written) to the work list, claiming each slot once (the tag is swapped in atomically); a slot past
    the list's capacity gets its old tag back and is listed by a later forward."""
    slot = tl.where(m, slot, 0)
    rec_full = tl.load(records + slot * _RW + 4, mask=m, other=0)
    tag = tl.load(tags + slot, mask=m, other=0)
    need = m & (tag != rec_full)
    if tl.sum(need.to(tl.int32), axis=0) > 0:
        old = tl.atomic_xchg(tags + slot, rec_full, mask=need, sem="relaxed")
        claim = need & (old != rec_full)
        ci = claim.to(tl.int64)
        first = tl.atomic_add(work_state, tl.sum(ci, axis=0), sem="relaxed")
        at = first + tl.cumsum(ci, axis=0) - 1
        fits = claim & (at < work_capacity)
        tl.store(work + at * 3 + 0, slot, mask=fits)
        tl.store(work + at * 3 + 1, tl.zeros_like(at) + batch_index, mask=fits)
        tl.store(work + at * 3 + 2, tl.zeros_like(at) + row, mask=fits)
        tl.store(tags + slot, old, mask=claim & ~fits)


@triton.jit
def _last_chunk(tickets, slot, m, chunks, ONE_CHUNK: tl.constexpr):
    """Lanes ``m`` whose slot's sums are complete once this program's have landed: a ticket per slot counts the
    launch's row chunks added so far, and the lane that takes the last one finalizes the slot (and zeroes its
    ticket). ``ONE_CHUNK`` (every row in one program): each lane completes its own slot."""
    if ONE_CHUNK:
        return m
    tl.debug_barrier()  # every thread's ``acc`` adds of this program precede its tickets (release)
    old = tl.atomic_add(tickets + slot, 1, mask=m, sem="acq_rel")
    done = m & (old == chunks - 1)
    tl.store(tickets + slot, tl.zeros_like(old), mask=done)
    return done


@triton.jit
def _store_lanes(acc, records, tags, slot, m, CLEAR_TAGS: tl.constexpr):
    """TAIL: the FULL_HASH of lanes ``m`` into their records, ``acc`` zeroed (read and zeroed in one atomic: other
    programs added to it); the first-read tag: 0 (``CLEAR_TAGS``: unverified again, ``all``) or the new hash
    (HiCache outside ``all``: only a load-back, which zeroes the tag, lists the slot)."""
    total = tl.atomic_xchg(acc + slot, tl.zeros_like(slot), mask=m, sem="relaxed")
    full = _mix64(total ^ _HASH_SEED)
    tl.store(records + slot * _RW + 4, full, mask=m)
    if CLEAR_TAGS:
        tl.store(tags + slot, tl.zeros_like(full), mask=m)
    else:
        tl.store(tags + slot, full, mask=m)


@triton.jit
def _compare_lanes(acc, records, counters, ring, ring_capacity, work, l, slot, m, report, forward_index,
                   MODE: tl.constexpr, GROUP_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """SCRUB / LIST: compare the mixed ``acc`` of lanes ``m`` (``l``: their lane indices, ``slot``: their slots)
    with their records' FULL_HASH (one ``kv_hash`` ring row per mismatch: SCRUB rows with batch index = row = -2,
    LIST rows with the reader's), zero ``acc``; returns the lanes checked (int64[BLOCK] of 0/1)."""
    total = tl.atomic_xchg(acc + slot, tl.zeros_like(slot), mask=m, sem="relaxed")
    live = _mix64(total ^ _HASH_SEED)
    rec_full = tl.load(records + slot * _RW + 4, mask=m, other=0)
    rec_pos = tl.load(records + slot * _RW + 1, mask=m, other=0)
    bad = m & (live != rec_full)
    if MODE == 1:
        batch_index = tl.full((BLOCK,), -2, tl.int64)
        row = batch_index
    else:
        batch_index = tl.load(work + l * 3 + 1, mask=m, other=-2)
        row = tl.load(work + l * 3 + 2, mask=m, other=-2)
    _append_violations(counters, ring, ring_capacity, bad & (report != 0),
                       tl.where(bad, _R_KV_HASH, 0).to(tl.int64) | GROUP_BITS, slot, rec_pos, batch_index,
                       row, rec_full, live, forward_index)
    return m.to(tl.int64)


@triton.jit
def _add_count(counter, checked):
    """``counter`` += the lanes ``checked`` (int64[BLOCK] of 0/1); a program that checked none adds nothing (most
    of a persistent grid: no same-address atomic each)."""
    n = tl.sum(checked, axis=0)
    if n > 0:
        tl.atomic_add(counter, n, sem="relaxed")


@triton.jit
def _close_list(counters, checked, finished, work_state, bound):
    """The end of a first-read LIST launch's program: count its checked lanes, and add the listed lanes it finished
    (``finished``: their slots compared, or never valid) to a ticket in ``work_state``; the program whose lanes
    complete the list's ``bound`` empties it. A program that finished none (most of the grid: a short list, and
    every row chunk but a slot's last) takes no ticket: it cannot be the last, and a program that has yet to
    read the list's length when it is emptied had no lane left in it."""
    _add_count(counters + _C_SLOTS_FIRST_READ, checked)
    if finished > 0:
        tl.debug_barrier()
        ticket = tl.atomic_add(work_state + 1, finished, sem="acq_rel")
        if ticket + finished == bound:
            tl.store(work_state, 0)
            tl.store(work_state + 1, 0)


@triton.jit(do_not_specialize=["num_rows", "rows_per_program", "chunks", "per_forward", "index_lag",
                               "num_slots"])
def row_hash_kernel(acc, tickets, chunks, base, table, num_rows, rows_per_program, records, num_slots, counters,
                    per_forward, index_lag, tags, work, work_state, work_capacity, out_cache_loc, new_starts,
                    new_lens, slot_map, map_len, ring, ring_capacity,
                    MODE: tl.constexpr, TRANSLATE: tl.constexpr, SB: tl.constexpr, WT: tl.constexpr,
                    ALIGN: tl.constexpr, EVEN: tl.constexpr, FINAL: tl.constexpr, ONE_CHUNK: tl.constexpr,
                    CLEAR_TAGS: tl.constexpr, GROUP_BITS: tl.constexpr):
    """Partial FULL_HASH sums of rows [c * rows_per_program, ...) (c = ``program_id(1)``, of ``chunks``) into
    ``acc[slot]``.

    TAIL: program (i, c, s) hashes request i's new tokens in blocks s, s + splits, ... (``program_id(2)``).
    ``FINAL``: the launch also finalizes: the program adding a slot's last chunk (``_last_chunk``) stores its
    FULL_HASH (TAIL) or compares it (SCRUB, LIST), and the program finishing a LIST's last listed lane empties the
    list (``_close_list``). Without ``FINAL`` (a HiCache load's first reads, hashed in parts as the
    layers land) ``row_finalize_kernel`` finishes them."""
    c = tl.program_id(1)
    r0 = c * rows_per_program
    r1 = tl.minimum(r0 + rows_per_program, num_rows)
    lanes = tl.arange(0, SB)
    if MODE == 0:
        i = tl.program_id(0)
        start = tl.load(new_starts + i).to(tl.int64)
        n = tl.load(new_lens + i).to(tl.int64)
        for k0 in range(tl.program_id(2) * SB, n, tl.num_programs(2) * SB):  # token splits of a long run
            k = k0 + lanes
            m = k < n
            slot = tl.load(out_cache_loc + start + k, mask=m, other=0).to(tl.int64)
            slot = _translate(slot_map, map_len, slot, m, TRANSLATE)
            m = m & (slot > 0) & (slot < num_slots)
            slot = tl.where(m, slot, 0)
            _add_rows(acc, slot, m, base, table, r0, r1, SB, WT, ALIGN, EVEN)
            if FINAL:
                _store_lanes(acc, records, tags, slot, _last_chunk(tickets, slot, m, chunks, ONE_CHUNK), CLEAR_TAGS)
    else:
        forward_index = tl.load(counters + _C_FORWARD_INDEX) - index_lag  # 1: a scrub after its forward's bump
        if MODE == 1:
            bound = per_forward
            start = (forward_index * per_forward) % (num_slots - 1)
        else:
            bound = tl.minimum(tl.load(work_state), work_capacity)
            start = 0
        report = tl.load(counters + _C_REPORT_ENABLED)
        checked = tl.zeros((SB,), dtype=tl.int64)
        finished = tl.zeros((SB,), dtype=tl.int64)  # LIST: lanes this program finished (an invalid one: chunk 0)
        for b in range(tl.program_id(0), tl.cdiv(bound, SB), tl.num_programs(0)):
            l = b * SB + lanes
            slot, m = _lane_slots(l, MODE, bound, records, work, num_slots, start)
            if tl.max(m.to(tl.int32), axis=0) > 0:  # a block of no live lane (the scrub over never-written slots)
                _add_rows(acc, slot, m, base, table, r0, r1, SB, WT, ALIGN, EVEN)  # would add nothing, at full cost
            if FINAL:
                done = _last_chunk(tickets, slot, m, chunks, ONE_CHUNK)
                checked += _compare_lanes(acc, records, counters, ring, ring_capacity, work, l, slot, done, report,
                                          forward_index, MODE, GROUP_BITS, SB)
                if MODE == 2:
                    finished += (done | ((l < bound) & ~m & (c == 0))).to(tl.int64)
        if FINAL:
            if MODE == 1:
                _add_count(counters + _C_SLOTS_SCRUBBED, checked)
            else:
                _close_list(counters, checked, tl.sum(finished, axis=0), work_state, bound)


@triton.jit(do_not_specialize=["num_slots"])
def row_finalize_kernel(acc, records, num_slots, counters, ring, ring_capacity, work, work_state, work_capacity,
                        GROUP_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """A first-read LIST hashed in parts (``row_hash_kernel`` without ``FINAL``: a HiCache load's layers as they
    land): mix every listed slot's ``acc``, compare it with the record's FULL_HASH (``kv_hash`` ring rows with the
    reader's batch index and row), zero ``acc``; the program finishing the last listed lane empties the list."""
    lanes = tl.arange(0, BLOCK)
    forward_index = tl.load(counters + _C_FORWARD_INDEX)
    bound = tl.minimum(tl.load(work_state), work_capacity)
    report = tl.load(counters + _C_REPORT_ENABLED)
    checked = tl.zeros((BLOCK,), dtype=tl.int64)
    finished = tl.zeros((BLOCK,), dtype=tl.int64)
    for b in range(tl.program_id(0), tl.cdiv(bound, BLOCK), tl.num_programs(0)):
        l = b * BLOCK + lanes
        finished += (l < bound).to(tl.int64)
        slot, m = _lane_slots(l, 2, bound, records, work, num_slots, 0)
        checked += _compare_lanes(acc, records, counters, ring, ring_capacity, work, l, slot, m, report,
                                  forward_index, 2, GROUP_BITS, BLOCK)
    _close_list(counters, checked, tl.sum(finished, axis=0), work_state, bound)


def tiles(group, mode: int, run: int = 0):
    """(SB, WT): slots x words per load of a group's rows, SB x WT <= ``SHAPE.tile_elements`` (powers of two).

    ``run``: a TAIL's longest new run; its SB is at most the run's next power of two (a decode TAIL, one
    new token per request, loads whole rows of one slot instead of masking all lanes but one)."""
    longest = next_power_of_2(max(1, group.longest_row_words))
    sb = max(SHAPE.slot_tile[mode], SHAPE.tile_elements // longest)
    if mode == TAIL:
        sb = min(sb, tail_tile(run))
    return sb, min(longest, SHAPE.tile_elements // sb)


TAIL_TILE_MAX = 1024  # the TAIL's SB cap stops growing here, where the write kernel's block does


def tail_tile(max_new_len: int) -> int:
    """The TAIL's SB cap for a longest new run (a step function of it: one compiled variant per step, and
    one precompile launch with a run that long: in the interpreter a run of thousands of tokens costs minutes)."""
    return min(TAIL_TILE_MAX, next_power_of_2(max(1, max_new_len)))


def _rows_per_program(mode: int, lanes: int) -> int:
    """Rows per program: the shape's, but one for a TAIL of a few slots (decode at a small batch: a
    handful of programs would each walk several rows)."""
    return 1 if mode == TAIL and lanes <= 16 else SHAPE.rows_per_program[mode]


def _map_args(group):
    if group.slot_map is None:
        return [group.records, 0]
    return [group.slot_map, int(group.slot_map.shape[0])]


def _launch(group, state, mode, counters, ring, group_index, *, lanes, grid0=0, per_forward=0, index_lag=0,
            view=None, rows=None, finalize=True, whole_rows=False):
    """grid0: TAIL's batch size (SCRUB / LIST: derived from ``lanes``). ``rows`` (LIST): (r0, r1), hash only rows
    [r0, r1) of ``group.rows`` (a part: its sums wait for the others); ``finalize``: then mix, compare and zero
    ``acc`` (after a LIST's last part: ``row_finalize_kernel``). Every row in one launch finalizes in it.
    ``whole_rows`` (LIST): ``SHAPE.fused_list_programs`` programs over every row (a list expected empty)."""
    if rows is None and finalize:
        _launch_hash(group, state, mode, counters, group.full_table, ring, group_index, lanes=lanes, grid0=grid0,
                     per_forward=per_forward, index_lag=index_lag, view=view, final=True, whole_rows=whole_rows)
        return
    if mode != LIST or whole_rows:
        raise ValueError("kv-canary: only a first-read LIST is hashed in parts (rows) or finalized apart")
    table = group.full_table if rows is None else group.full_table[rows[0]:rows[1]]
    if table.shape[0]:
        _launch_hash(group, state, mode, counters, table, ring, group_index, lanes=lanes, grid0=grid0,
                     view=view, final=False)
    if finalize:
        _row_finalize_kernel_bound[(min(SHAPE.finalize_programs, cdiv(max(1, lanes), SHAPE.finalize_block)),)](
            state.acc, group.records, group.num_slots, counters, ring, ring.shape[0], state.work, state.work_state,
            state.work.shape[0], GROUP_BITS=group_index << fp.GROUP_SHIFT, BLOCK=SHAPE.finalize_block)


def _launch_hash(group, state, mode, counters, table, ring, group_index, *, lanes, grid0, view, final, per_forward=0,
                 index_lag=0, whole_rows=False):
    """The partial sums of the rows ``table`` (int64[rows, 4], a slice of ``group.full_table``) into ``acc``, and
    with ``final`` (every row) each slot's FULL_HASH stored (TAIL) or compared (SCRUB, LIST) by the program that
    completes it."""
    num_rows = int(table.shape[0])
    rpp = min(num_rows, _rows_per_program(mode, lanes))
    sb, wt = tiles(group, mode, view.max_new_len if mode == TAIL else 0)
    chunks = cdiv(num_rows, rpp)
    if mode != TAIL:  # persistent slot-block programs, each looping over blocks; a LIST of a few rows (a load's
        # last layers) gets more of them, about ``target_programs`` in all (one layer of a 9.3k-slot load on an
        # H200: 199 us in 64 x 2 programs, the whole GPU's memory idle but for them)
        programs = SHAPE.persistent_programs[mode]
        if mode == LIST:
            programs = max(programs, SHAPE.target_programs // chunks)
        grid0 = min(programs, cdiv(max(1, lanes), sb))
    if whole_rows:
        grid0, rpp, chunks = SHAPE.fused_list_programs, num_rows, 1
    splits = 1
    if mode == TAIL:  # host-known: the batch size and the longest new run
        splits = max(1, min(cdiv(max(1, view.max_new_len), sb), SHAPE.target_programs // (grid0 * chunks)))
    loc = (view.out_cache_loc, view.new_starts, view.new_lens) if view is not None else (counters,) * 3
    _row_hash_kernel_bound[(grid0, chunks, splits)](
        state.acc, state.tickets, chunks, group.full_base, table, num_rows, rpp, group.records, group.num_slots,
        counters, per_forward, index_lag, state.tags, state.work, state.work_state, state.work.shape[0],
        *loc, *_map_args(group), ring, ring.shape[0],
        MODE=mode, TRANSLATE=group.slot_map is not None, SB=sb, WT=wt, ALIGN=group.row_word_alignment,
        EVEN=group.row_words_gcd % wt == 0, FINAL=final, ONE_CHUNK=chunks == 1, CLEAR_TAGS=state.clear_tags,
        GROUP_BITS=group_index << fp.GROUP_SHIFT, num_warps=SHAPE.warps)


def launch_tail_full_hash(group, view, counters, ring, group_index: int = 0) -> None:
    """FULL_HASH of every slot the forward wrote (after the write kernel's records; sets first-read tags)."""
    if view.batch_size:
        _launch(group, group.full_row, TAIL, counters, ring, group_index, grid0=view.batch_size,
                lanes=view.batch_size * max(1, view.max_new_len), view=view)


def launch_scrub(group, counters, ring, per_forward: int, group_index: int = 0, after_write: bool = False) -> None:
    """Check ``per_forward`` slots' every K/V byte against their FULL_HASH (round-robin window).
    ``after_write``: launched after the forward's write bumped the forward counter (a load-back forward's scrub):
    its window is still its forward's, not the next one's (which would be scrubbed twice and its own never)."""
    per_forward = min(per_forward, group.num_slots - 1)
    _launch(group, group.full_row, SCRUB, counters, ring, group_index, lanes=per_forward, per_forward=per_forward,
            index_lag=int(after_write))


def launch_first_read(group, counters, ring, group_index: int = 0, rows=None, finalize: bool = True,
                      expect_empty: bool = False) -> None:
    """Hash the full rows of the slots HEAD's verify listed (first reads since their write) and compare.

    ``rows`` (r0, r1): only rows [r0, r1) of ``group.rows`` (a HiCache load hashed layer by layer as the layers
    land); ``finalize``: compare and empty the list (after the last part: the sums are additive).
    ``expect_empty``: the HEAD of a HiCache forward that consumes no load (its list is empty unless a loaded slot
    is read first outside its load's forward): one launch of a few programs, each over whole rows."""
    state = group.full_row
    _launch(group, state, LIST, counters, ring, group_index, lanes=int(state.work.shape[0]), rows=rows,
            finalize=finalize, whole_rows=expect_empty)


# launched through their compiled launchers once Triton bound a variant (kernels/launch.py)
_row_hash_kernel_bound = BoundKernel(row_hash_kernel)
_row_finalize_kernel_bound = BoundKernel(row_finalize_kernel)
