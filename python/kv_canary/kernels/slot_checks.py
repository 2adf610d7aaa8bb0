"""Device building blocks of the Triton kernels: the hash and chain mixes, the live K/V hash, the per-slot
check and the violation ring append (``triton_kernels``, ``index_sweep`` and ``accept`` launch kernels made of
them). The formulas mirror ``kv_canary.fingerprint`` bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import fingerprint as fp

_M1 = tl.constexpr(fp.MIX_M1)
_M2 = tl.constexpr(fp.MIX_M2)
_MASK31 = tl.constexpr(fp.MASK_31)
_MASK32 = tl.constexpr(fp.MASK_32)
_MASK35 = tl.constexpr(fp.MASK_35)
_G_TOK = tl.constexpr(fp.G_TOKEN_MUL)
_G_POS = tl.constexpr(fp.G_POS_MUL)
_G_ADD = tl.constexpr(fp.G_ADD)
_WORD_MUL = tl.constexpr(fp.WORD_MUL)
_HASH_SEED = tl.constexpr(fp.HASH_SEED)
_ANCHOR = tl.constexpr(fp.CHAIN_ANCHOR)
_RW = tl.constexpr(fp.RECORD_WIDTH)
_VW = tl.constexpr(fp.RING_WIDTH)
_R_POSITION = tl.constexpr(fp.R_POSITION)
_R_CHAIN = tl.constexpr(fp.R_CHAIN)
_R_KV_HASH = tl.constexpr(fp.R_KV_HASH)
_R_TOKEN = tl.constexpr(fp.R_TOKEN)
_R_SLOT = tl.constexpr(fp.R_SLOT)
_C_VIOLATIONS = tl.constexpr(fp.C_VIOLATIONS)
_C_SLOTS_VERIFIED = tl.constexpr(fp.C_SLOTS_VERIFIED)
_C_SLOTS_WRITTEN = tl.constexpr(fp.C_SLOTS_WRITTEN)
_C_VERIFY_LAUNCHES = tl.constexpr(fp.C_VERIFY_LAUNCHES)
_C_WRITE_LAUNCHES = tl.constexpr(fp.C_WRITE_LAUNCHES)
_C_FORWARD_INDEX = tl.constexpr(fp.C_FORWARD_INDEX)
_C_REPORT_ENABLED = tl.constexpr(fp.C_REPORT_ENABLED)
_C_SLOTS_SWEPT = tl.constexpr(fp.C_SLOTS_SWEPT)
_C_CURRENT_FORWARD = tl.constexpr(fp.C_CURRENT_FORWARD)
_C_SLOTS_SCRUBBED = tl.constexpr(fp.C_SLOTS_SCRUBBED)
_C_SLOTS_FIRST_READ = tl.constexpr(fp.C_SLOTS_FIRST_READ)
_C_SWA_VERIFIED = tl.constexpr(fp.C_SWA_VERIFIED)
_C_SWA_DIVERGENCE = tl.constexpr(fp.C_SWA_DIVERGENCE)
_C_SWA_OUT_OF_WINDOW = tl.constexpr(fp.C_SWA_OUT_OF_WINDOW)


@triton.jit
def _mix64(x):
    x = x ^ ((x >> 29) & _MASK35)
    x = x * _M1
    x = x ^ ((x >> 32) & _MASK32)
    x = x * _M2
    x = x ^ ((x >> 33) & _MASK31)
    return x


@triton.jit
def _chain_term(token, position):
    return _mix64(token.to(tl.int64) * _G_TOK + position.to(tl.int64) * _G_POS + _G_ADD)


@triton.jit
def _kv_hash(slot, mask, base, sources, num_sources, WT: tl.constexpr):
    """int64 hash of the hashed words of K/V rows of ``slot`` (one lane per slot).

    ``sources`` is the group's source table (int64[n, 4]: int32 offset from
    ``base``, row stride, words hashed, canonical index of the first word);
    each source's words are loaded ``WT`` at a time as a [lanes, WT] tile.
    """
    acc = tl.zeros(slot.shape, dtype=tl.int64)
    cols = tl.arange(0, WT)
    slot64 = slot.to(tl.int64)
    for s in range(num_sources):
        offset = tl.load(sources + s * 4 + 0)
        stride = tl.load(sources + s * 4 + 1)
        words = tl.load(sources + s * 4 + 2)
        first = tl.load(sources + s * 4 + 3)
        row = base + offset + slot64[:, None] * stride
        for w0 in range(0, words, WT):
            w = w0 + cols
            m2 = mask[:, None] & (w < words)[None, :]
            word = tl.load(row + w[None, :], mask=m2, other=0).to(tl.int64) & _MASK32
            index = (first + w + 1).to(tl.int64)  # a tensor: the product wraps
            acc += tl.sum(tl.where(m2, _mix64(word + index[None, :] * _WORD_MUL), 0), axis=1)
    return _mix64(acc ^ _HASH_SEED)


@triton.jit
def _source_tuple(sources, NSRC: tl.constexpr):
    """The first ``NSRC`` rows of a source table as a tuple of (offset, stride, words, first) scalars.

    Loaded once at kernel start (independent of every slot load), for ``_kv_hash_few``.
    """
    table = ()
    for s in tl.static_range(NSRC):
        table = table + ((tl.load(sources + s * 4 + 0), tl.load(sources + s * 4 + 1),
                          tl.load(sources + s * 4 + 2), tl.load(sources + s * 4 + 3)),)
    return table


@triton.jit
def _kv_hash_few(slot, mask, base, table, NSRC: tl.constexpr, WT: tl.constexpr):
    """``_kv_hash`` for ``NSRC`` sources of at most ``WT`` words each (``few_sources``), bit for bit.

    Straight-line code on [lanes] tensors (the slot's own layout: no layout conversion): every
    word of every source is loaded before any is used, so all are in flight together. The loads
    share one predicate (the lane mask; a word past a source's ``words`` re-reads its last hashed
    word and adds nothing), so the compiler can keep them all outstanding.
    """
    slot64 = slot.to(tl.int64)
    loaded = ()
    for s in tl.static_range(NSRC):
        row = base + table[s][0] + slot64 * table[s][1]
        for w in tl.static_range(WT):
            at = tl.maximum(tl.minimum(table[s][2] - 1, w), 0)  # a scalar: inside the hashed words
            loaded = loaded + (tl.load(row + at, mask=mask, other=0),)
    acc = tl.zeros(slot.shape, dtype=tl.int64)
    for s in tl.static_range(NSRC):
        for w in tl.static_range(WT):
            word = loaded[s * WT + w].to(tl.int64) & _MASK32
            index = table[s][3] + (w + 1)  # an int64 tensor: the product wraps
            acc += tl.where(w < table[s][2], _mix64(word + index * _WORD_MUL), 0)
    return _mix64(tl.where(mask, acc, 0) ^ _HASH_SEED)


@triton.jit
def _live_hash(slot, mask, base, sources, num_sources, table, NSRC: tl.constexpr, WT: tl.constexpr):
    """``_kv_hash`` of the group's hashed words: the straight-line path when NSRC > 0, else the loops."""
    if NSRC > 0:
        return _kv_hash_few(slot, mask, base, table, NSRC, WT)
    else:
        return _kv_hash(slot, mask, base, sources, num_sources, WT)


@triton.jit
def _translate(slot_map, map_len, full_slot, m, TRANSLATE: tl.constexpr):
    """A group's slot for engine (full) slot ``full_slot``: ``slot_map[full_slot]`` (-1 out of range).

    Without TRANSLATE the group's slots are the engine's slots.
    """
    if TRANSLATE:
        ok = m & (full_slot >= 0) & (full_slot < map_len)
        return tl.where(ok, tl.load(slot_map + full_slot, mask=ok, other=-1).to(tl.int64), -1)
    else:
        return full_slot


@triton.jit
def _check_slots(records, raw_slot, raw_pred, pos, want_token, m, num_slots, base, sources, num_sources,
                 CHECK_TOKENS: tl.constexpr, WT: tl.constexpr, pred_known=True, table=0, NSRC: tl.constexpr = 0):
    """Check lanes ``m`` of (slot, predecessor slot, position, expected token) against the records.

    raw_pred must be 0 where pos == 0. ``pred_known``: lanes whose predecessor's record can be
    read (False where a translated group released it: the chain link is then not checked). Returns (reason bits, stored, expected) per lane;
    stored/expected describe the first failing check in the order slot, position,
    chain, token, kv_hash. ``table``/NSRC: see ``_live_hash`` (the K/V loads are issued
    before any record value is used, so they overlap the record loads).
    """
    slot_ok = (raw_slot > 0) & (raw_slot < num_slots)
    slot = tl.where(slot_ok, raw_slot, 0)
    has_pred = m & (pos > 0)
    pred = tl.where((raw_pred > 0) & (raw_pred < num_slots), raw_pred, 0)
    rec_token = tl.load(records + slot * _RW + 0, mask=m, other=0)
    rec_pos = tl.load(records + slot * _RW + 1, mask=m, other=0)
    rec_chain = tl.load(records + slot * _RW + 2, mask=m, other=0)
    rec_hash = tl.load(records + slot * _RW + 3, mask=m, other=0)
    pred_chain = tl.load(records + pred * _RW + 2, mask=has_pred, other=0)
    live_hash = _live_hash(slot, m & slot_ok, base, sources, num_sources, table, NSRC, WT)
    pred_chain = tl.where(pos > 0, pred_chain, _ANCHOR)
    want_chain = pred_chain + _chain_term(rec_token, pos)
    if not CHECK_TOKENS:
        want_token = rec_token
    bad_slot = ~slot_ok
    bad_pos = slot_ok & (rec_pos != pos)
    bad_chain = slot_ok & pred_known & (rec_chain != want_chain)
    bad_token = slot_ok & (rec_token != want_token)
    bad_hash = slot_ok & (live_hash != rec_hash)
    reason = (tl.where(bad_slot, _R_SLOT, 0) | tl.where(bad_pos, _R_POSITION, 0) | tl.where(bad_chain, _R_CHAIN, 0)
              | tl.where(bad_token, _R_TOKEN, 0) | tl.where(bad_hash, _R_KV_HASH, 0))
    stored = tl.where(bad_slot, raw_slot, tl.where(bad_pos, rec_pos, tl.where(
        bad_chain, rec_chain, tl.where(bad_token, rec_token, rec_hash))))
    expected = tl.where(bad_slot, 0, tl.where(bad_pos, pos, tl.where(
        bad_chain, want_chain, tl.where(bad_token, want_token, live_hash))))
    return tl.where(m, reason, 0), stored, expected


@triton.jit
def _append_violations(counters, ring, ring_capacity, bad, reason_bits, slot, pos, batch_index, row, stored,
                       expected, forward_index):
    """Append one ring row per ``bad`` lane at an atomically reserved offset."""
    bad_i = bad.to(tl.int64)
    n_bad = tl.sum(bad_i, axis=0)
    if n_bad > 0:
        base = tl.atomic_add(counters + _C_VIOLATIONS, n_bad, sem="relaxed")
        at = ((base + tl.cumsum(bad_i, axis=0) - 1) % ring_capacity) * _VW
        zero = tl.zeros_like(pos)
        tl.store(ring + at + 0, reason_bits, mask=bad)
        tl.store(ring + at + 1, slot, mask=bad)
        tl.store(ring + at + 2, pos, mask=bad)
        tl.store(ring + at + 3, zero + batch_index, mask=bad)
        tl.store(ring + at + 4, zero + row, mask=bad)
        tl.store(ring + at + 5, stored, mask=bad)
        tl.store(ring + at + 6, expected, mask=bad)
        tl.store(ring + at + 7, zero + forward_index, mask=bad)
