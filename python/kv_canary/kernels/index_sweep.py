"""SWEEP over the device-resident cached-slot index (``kv_canary.cache_index``): one Triton launch per group.

Lane ``s`` of ``num_slots`` checks slot ``s`` if ``held[s]``: its record against the
cache's claim (position, predecessor's chain, token) and its live K/V bytes, with the
same check as HEAD (``slot_checks._check_slots``). Ring rows get batch_index = row = -1.
Device work: one pass over the index (13 bytes per slot) plus ~100 bytes per held slot;
the grid depends only on the pool size. The torch twin is ``reference.launch_index_sweep``.

A translated group (hybrid SWA: ``group.slot_map`` = the full -> swa mapping) is swept
from the same index, whose lanes are engine (full) slots: lane ``s`` checks the
group's slot ``slot_map[s]`` only where that mapping is live (> 0). sglang zeroes the
mapping when it releases a slot's swa KV (``free_swa``: SWARadixCache tombstones,
SWA eviction), so a tombstoned node's slots are never verified in that group. The
predecessor is ``slot_map[pred]``; a released one (0) leaves the chain link unchecked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import fingerprint as fp
from .launch import BoundKernel, cdiv
from .slot_checks import _append_violations, _check_slots, _translate
from .triton_kernels import _hash_args, _map_args, hash_word_tile

SWEEP_BLOCK = 256
_C_REPORT_ENABLED = tl.constexpr(fp.C_REPORT_ENABLED)
_C_FORWARD_INDEX = tl.constexpr(fp.C_FORWARD_INDEX)
_C_SLOTS_SWEPT = tl.constexpr(fp.C_SLOTS_SWEPT)


@triton.jit
def index_sweep_kernel(
    records, held, positions, preds, tokens, num_entries,
    base, sources, num_sources,
    counters, ring, ring_capacity, num_slots, slot_map, map_len,
    GROUP_BITS: tl.constexpr, WT: tl.constexpr, BLOCK: tl.constexpr, TRANSLATE: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = idx < num_entries
    m = in_range & (tl.load(held + idx, mask=in_range, other=0) != 0)
    raw_slot = idx.to(tl.int64)
    raw_pred = tl.load(preds + idx, mask=m, other=0).to(tl.int64)
    pos = tl.load(positions + idx, mask=m, other=0).to(tl.int64)
    want_token = tl.load(tokens + idx, mask=m, other=0).to(tl.int64)
    if TRANSLATE:  # engine slot -> the group's slot; a released mapping (0): the group holds nothing there
        raw_slot = _translate(slot_map, map_len, raw_slot, m, TRANSLATE)
        m = m & (raw_slot > 0)
        raw_pred = tl.where(pos > 0, _translate(slot_map, map_len, raw_pred, m & (pos > 0), TRANSLATE), 0)
        pred_known = (pos == 0) | (raw_pred > 0)
    else:
        pred_known = pos >= 0
    reason, stored, expected = _check_slots(
        records, raw_slot, raw_pred, pos, want_token, m, num_slots, base, sources, num_sources, True, WT,
        pred_known)
    report = tl.load(counters + _C_REPORT_ENABLED)
    forward_index = tl.load(counters + _C_FORWARD_INDEX)
    _append_violations(counters, ring, ring_capacity, (reason != 0) & (report != 0) & m,
                       reason.to(tl.int64) | GROUP_BITS, raw_slot, pos, -1, -1, stored, expected, forward_index)
    tl.atomic_add(counters + _C_SLOTS_SWEPT, tl.sum(m.to(tl.int64), axis=0))


def launch_index_sweep(group, index, counters, ring, group_index: int = 0) -> None:
    """index: ``CachedSlotIndex`` over engine slots (its pending changes already applied)."""
    _index_sweep_kernel_bound[(cdiv(index.num_slots, SWEEP_BLOCK),)](
        group.records, index.held, index.position, index.pred, index.token, index.num_slots,
        *_hash_args(group), counters, ring, ring.shape[0], group.num_slots, *_map_args(group),
        GROUP_BITS=group_index << fp.GROUP_SHIFT, WT=hash_word_tile(group), BLOCK=SWEEP_BLOCK,
        TRANSLATE=group.slot_map is not None,
    )


# launched through their compiled launchers once Triton bound a variant (kernels/launch.py)
_index_sweep_kernel_bound = BoundKernel(index_sweep_kernel)
