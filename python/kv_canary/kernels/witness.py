"""The write witness: proof that a forward filled every K/V row of every slot it was meant to fill.

TAIL fingerprints whatever bytes sit in a slot after the forward, so by itself it cannot tell a slot that
was written from one that kept its previous owner's bytes (a store that never happened, or went to another
slot or layer). The witness closes that gap:

* STAMP (HEAD, after the verify and scrub launches, inside the CUDA graph): for every engine slot of the
  forward's ``out_cache_loc`` (slot 0, the padding slot CUDA-graph padding lanes write, excepted; through the
  group's slot map for translated groups), write the group's ``witness_stamp`` (finite subnormals no correct
  write stores, per element type: ``witness_stamp.py``) into the first two and the last two 32-bit words
  of every layer's K and V row (the group's ``full_table``: MLA's single latent row has no V half).
* CHECK (TAIL, before the write launches): load the same words; a row whose first two or last two words still
  hold the stamp was not (fully) written by this forward. One ring row per slot: reason ``unwritten``, ``stored`` = the
  first unwritten row's index in the group's ``rows`` (layer-major, K before V), ``expected`` = how many
  rows were left unwritten; batch index, req_to_token row and sequence position of the slot's request
  (-1 and the fed position when no request's new run holds the lane).

Lanes are the flat ``out_cache_loc`` entries (grid ``ceil(num_tokens / BLOCK)``, BLOCK 8 on a GPU),
each program covering RT rows per step as one [BLOCK, RT] gather (RT: every row of the group, up to 128); the
request of a failing lane is looked up only when a lane failed. A correct forward writes each row whole before
attention reads it (sglang stores a layer's K/V before that layer's attention), so the stamp never changes what
it computes; a forward whose store was dropped reads the stamp's near-zero finite elements (``witness_stamp.py``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .. import fingerprint as fp
from .launch import BoundKernel, cdiv, next_power_of_2
from .slot_checks import (  # noqa: F401 - read as Triton globals
    _C_CURRENT_FORWARD, _C_REPORT_ENABLED, _append_violations, _translate,
)

_R_UNWRITTEN = tl.constexpr(fp.R_UNWRITTEN)
_C_SLOTS_WITNESSED = tl.constexpr(fp.C_SLOTS_WITNESSED)
# lanes (slots) per program: on a GPU a decode batch spread over several SMs (32 lanes: 2 programs at bs 48, the
# stamp's stores and the check's loads queued on 2 SMs); the interpreter runs programs one by one: fewer, larger
WITNESS_BLOCK = 32 if os.environ.get("TRITON_INTERPRET") == "1" else 8
# K/V rows per gather step: every row of a group up to this many (one step, the loads of all rows in flight at
# once: the check is latency-bound; 32 rows a step took two dependent steps for a 32-layer model's 64 rows)
WITNESS_ROWS_MAX = 128


def witness_rows(group) -> int:
    """Rows per gather step of a group (a power of two, one compiled variant per group)."""
    return min(WITNESS_ROWS_MAX, next_power_of_2(max(1, len(group.rows))))


@triton.jit
def _lane_slots(out_cache_loc, loc_stride, n_tokens, num_slots, slot_map, map_len, TRANSLATE: tl.constexpr,
                BLOCK: tl.constexpr):
    """(lane index, group slot, stamped-lane mask) of this program's lanes, loaded once per program
    (``out_cache_loc`` may be strided: a draft step's column)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n_tokens
    slot = tl.load(out_cache_loc + t * loc_stride, mask=m, other=0).to(tl.int64)
    slot = tl.where(m, _translate(slot_map, map_len, slot, m, TRANSLATE), 0)
    return t, slot, m & (slot > 0) & (slot < num_slots)


@triton.jit
def _row_words(slot, wm, base, table, r0, num_rows, RT: tl.constexpr):
    """(first-word pointers [BLOCK, RT], offsets [RT] of the last end's first word, row indices, mask) of rows
    [r0, r0 + RT) (every row has at least two words: ``witness_stamp.witness_stamp``)."""
    r = r0 + tl.arange(0, RT)
    mr = r < num_rows
    off = tl.load(table + r * 4 + 0, mask=mr, other=0)
    stride = tl.load(table + r * 4 + 1, mask=mr, other=0)
    words = tl.load(table + r * 4 + 2, mask=mr, other=2)
    first = base + off[None, :] + slot[:, None] * stride[None, :]
    return first, words - 2, r, wm[:, None] & mr[None, :]


@triton.jit(do_not_specialize=["loc_stride", "n_tokens", "stamp_value"])
def stamp_kernel(out_cache_loc, loc_stride, n_tokens, base, table, num_rows, num_slots, slot_map, map_len,
                 stamp_value,                 TRANSLATE: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr):
    """HEAD: stamp the first two and last two words of every K/V row of each slot about to be written."""
    stamp = tl.zeros((BLOCK, RT), dtype=tl.int32) + stamp_value
    t, slot, wm = _lane_slots(out_cache_loc, loc_stride, n_tokens, num_slots, slot_map, map_len, TRANSLATE, BLOCK)
    for r0 in range(0, num_rows, RT):
        first, last, r, mm = _row_words(slot, wm, base, table, r0, num_rows, RT)
        tl.store(first, stamp, mask=mm)
        tl.store(first + 1, stamp, mask=mm)
        tl.store(first + last[None, :], stamp, mask=mm)
        tl.store(first + last[None, :] + 1, stamp, mask=mm)


@triton.jit(do_not_specialize=["loc_stride", "pos_stride", "n_tokens", "batch_size", "stamp_value"])
def check_kernel(out_cache_loc, loc_stride, positions, pos_stride, n_tokens, req_pool_indices, seq_lens, new_starts,
                 new_lens, batch_size, base, table, num_rows, num_slots, slot_map, map_len, stamp_value, counters, ring,
                 ring_capacity,                 GROUP_BITS: tl.constexpr, TRANSLATE: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr):
    """TAIL: every stamp must be gone; one ``unwritten`` ring row per slot that kept one (see the module)."""
    first_bad = tl.full((BLOCK,), 1 << 30, tl.int64)
    n_bad = tl.zeros((BLOCK,), dtype=tl.int64)
    t, slot, wm = _lane_slots(out_cache_loc, loc_stride, n_tokens, num_slots, slot_map, map_len, TRANSLATE, BLOCK)
    for r0 in range(0, num_rows, RT):
        first, last, r, mm = _row_words(slot, wm, base, table, r0, num_rows, RT)
        head = (tl.load(first, mask=mm, other=0) == stamp_value) & (tl.load(first + 1, mask=mm, other=0) == stamp_value)
        tail = ((tl.load(first + last[None, :], mask=mm, other=0) == stamp_value)
                & (tl.load(first + last[None, :] + 1, mask=mm, other=0) == stamp_value))
        bad = mm & (head | tail)
        n_bad += tl.sum(bad.to(tl.int64), axis=1)
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad, r[None, :].to(tl.int64), 1 << 30), axis=1))
    lane_bad = n_bad > 0
    any_bad = tl.sum(lane_bad.to(tl.int32), axis=0) > 0
    # the request whose new run holds each lane: looked up only when a lane failed (the loop runs 0 times else)
    which = tl.full((BLOCK,), -1, tl.int64)
    for i in range(0, batch_size * any_bad.to(tl.int32)):
        s = tl.load(new_starts + i).to(tl.int64)
        n = tl.load(new_lens + i).to(tl.int64)
        which = tl.where((t >= s) & (t < s + n), i, which)
    found = lane_bad & (which >= 0)
    i_safe = tl.where(found, which, 0)
    row = tl.load(req_pool_indices + i_safe, mask=found, other=-1).to(tl.int64)
    p0 = tl.load(seq_lens + i_safe, mask=found, other=0).to(tl.int64) - tl.load(
        new_lens + i_safe, mask=found, other=0).to(tl.int64)
    start = tl.load(new_starts + i_safe, mask=found, other=0).to(tl.int64)
    fed = tl.load(positions + t * pos_stride, mask=lane_bad, other=-1).to(tl.int64)
    pos = tl.where(found, p0 + t - start, fed)
    report = tl.load(counters + _C_REPORT_ENABLED)
    forward_index = tl.load(counters + _C_CURRENT_FORWARD)
    reason = tl.zeros((BLOCK,), dtype=tl.int64) + (_R_UNWRITTEN | GROUP_BITS)
    _append_violations(counters, ring, ring_capacity, lane_bad & (report != 0), reason, slot, pos, which, row,
                       first_bad, n_bad, forward_index)
    tl.atomic_add(counters + _C_SLOTS_WITNESSED, tl.sum(wm.to(tl.int64), axis=0), sem="relaxed")


def _grid(view):
    return (max(1, cdiv(view.store_lanes, WITNESS_BLOCK)),)


def _map_args(group):
    if group.slot_map is None:
        return [group.records, 0]
    return [group.slot_map, int(group.slot_map.shape[0])]


def launch_stamp(group, view, group_index: int = 0) -> None:
    """HEAD: stamp the rows of every slot of ``view.out_cache_loc`` (graph-safe: grid from its length)."""
    del group_index
    _stamp_kernel_bound[_grid(view)](
        view.out_cache_loc, view.out_cache_loc.stride(0), view.store_lanes, group.full_base, group.full_table,
        len(group.rows), group.num_slots, *_map_args(group), group.witness_stamp,
        TRANSLATE=group.slot_map is not None, BLOCK=WITNESS_BLOCK, RT=witness_rows(group),
    )


def launch_check(group, view, counters, ring, group_index: int = 0) -> None:
    """TAIL: report every slot of ``view.out_cache_loc`` with a row its forward left unwritten."""
    _check_kernel_bound[_grid(view)](
        view.out_cache_loc, view.out_cache_loc.stride(0), view.positions, view.positions.stride(0),
        view.store_lanes, view.req_pool_indices, view.seq_lens, view.new_starts, view.new_lens,
        min(view.batch_size, int(view.new_starts.shape[0]), int(view.new_lens.shape[0])),
        group.full_base, group.full_table, len(group.rows),
        group.num_slots, *_map_args(group), group.witness_stamp, counters, ring, ring.shape[0],
        GROUP_BITS=group_index << fp.GROUP_SHIFT, TRANSLATE=group.slot_map is not None, BLOCK=WITNESS_BLOCK,
        RT=witness_rows(group),
    )


# launched through their compiled launchers once Triton bound a variant (kernels/launch.py)
_stamp_kernel_bound = BoundKernel(stamp_kernel)
_check_kernel_bound = BoundKernel(check_kernel)
