"""Triton HEAD-verify and TAIL-write kernels.

Both are parallel over slots and graph-safe: grids depend only on the batch size
and host-known bounds, loop trip counts come from device tensors, and all
output goes to preallocated buffers (records, counters, violation ring). The
formulas mirror ``kv_canary.fingerprint`` bit for bit; ``reference.py`` is the
torch twin the tests compare against.
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
def _row_terms(view, stride, slot, mask, first_index, NW: tl.constexpr):
    acc = tl.zeros(slot.shape, dtype=tl.int64)
    for j in tl.static_range(NW):
        w = tl.load(view + slot * stride + j, mask=mask, other=0).to(tl.int64) & _MASK32
        index = tl.full(slot.shape, first_index + j + 1, tl.int64)  # a tensor: the product wraps
        acc += _mix64(w + index * _WORD_MUL)
    return acc


@triton.jit
def _kv_hash(slot, mask, k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
             NUM_LAYERS: tl.constexpr, HAS_V: tl.constexpr, NW: tl.constexpr):
    """int64 hash of the first NW words of K (and V) rows of ``slot`` in each hashed layer."""
    PER_LAYER: tl.constexpr = NW * 2 if HAS_V else NW
    acc = _row_terms(k0, k_stride, slot, mask, 0, NW)
    if HAS_V:
        acc += _row_terms(v0, v_stride, slot, mask, NW, NW)
    if NUM_LAYERS > 1:
        acc += _row_terms(k1, k_stride, slot, mask, PER_LAYER, NW)
        if HAS_V:
            acc += _row_terms(v1, v_stride, slot, mask, PER_LAYER + NW, NW)
    if NUM_LAYERS > 2:
        acc += _row_terms(k2, k_stride, slot, mask, 2 * PER_LAYER, NW)
        if HAS_V:
            acc += _row_terms(v2, v_stride, slot, mask, 2 * PER_LAYER + NW, NW)
    if NUM_LAYERS > 3:
        acc += _row_terms(k3, k_stride, slot, mask, 3 * PER_LAYER, NW)
        if HAS_V:
            acc += _row_terms(v3, v_stride, slot, mask, 3 * PER_LAYER + NW, NW)
    return _mix64(acc ^ _HASH_SEED)


@triton.jit
def _check_slots(records, raw_slot, raw_pred, pos, want_token, m, num_slots,
                 k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
                 CHECK_TOKENS: tl.constexpr, NUM_LAYERS: tl.constexpr, HAS_V: tl.constexpr, NW: tl.constexpr):
    """Check lanes ``m`` of (slot, predecessor slot, position, expected token) against the records.

    raw_pred must be 0 where pos == 0. Returns (reason bits, stored, expected) per lane;
    stored/expected describe the first failing check in the order slot, position,
    chain, token, kv_hash.
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
    pred_chain = tl.where(pos > 0, pred_chain, _ANCHOR)
    want_chain = pred_chain + _chain_term(rec_token, pos)
    live_hash = _kv_hash(slot, m & slot_ok, k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride, NUM_LAYERS, HAS_V, NW)
    if not CHECK_TOKENS:
        want_token = rec_token
    bad_slot = ~slot_ok
    bad_pos = slot_ok & (rec_pos != pos)
    bad_chain = slot_ok & (rec_chain != want_chain)
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
        base = tl.atomic_add(counters + _C_VIOLATIONS, n_bad)
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


@triton.jit
def verify_kernel(
    records, req_to_token, r2t_stride, req_pool_indices, seq_lens, new_lens,
    k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
    counters, ring, ring_capacity, num_slots, programs_per_req, expected_tokens, et_stride,
    CHECK_TOKENS: tl.constexpr, GROUP_BITS: tl.constexpr,
    NUM_LAYERS: tl.constexpr, HAS_V: tl.constexpr, NW: tl.constexpr, BLOCK: tl.constexpr,
):
    """HEAD: verify slots [0, seq_len - new_len) of request ``program_id(0)``.

    Program (i, j) checks blocks j, j + programs_per_req, ... of request i's
    prefix. Each failing slot appends one ring row; the counters get the number
    of slots checked.
    """
    i = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    prefix = tl.load(seq_lens + i).to(tl.int64) - tl.load(new_lens + i).to(tl.int64)
    prefix = tl.maximum(prefix, 0)
    report = tl.load(counters + _C_REPORT_ENABLED)
    forward_index = tl.load(counters + _C_FORWARD_INDEX)
    num_blocks = tl.cdiv(prefix, BLOCK)
    lanes = tl.arange(0, BLOCK)
    verified = tl.zeros((BLOCK,), dtype=tl.int64)
    for b in range(j, num_blocks, programs_per_req):
        pos = b * BLOCK + lanes
        m = pos < prefix
        raw_slot = tl.load(req_to_token + row * r2t_stride + pos, mask=m, other=0).to(tl.int64)
        raw_pred = tl.load(req_to_token + row * r2t_stride + pos - 1, mask=m & (pos > 0), other=0).to(tl.int64)
        want_token = tl.load(expected_tokens + row * et_stride + pos, mask=m, other=0).to(tl.int64)
        reason, stored, expected = _check_slots(
            records, raw_slot, raw_pred, pos, want_token, m, num_slots,
            k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride, CHECK_TOKENS, NUM_LAYERS, HAS_V, NW)
        bad = (reason != 0) & (report != 0)
        _append_violations(counters, ring, ring_capacity, bad, reason.to(tl.int64) | GROUP_BITS, raw_slot, pos,
                           i, row, stored, expected, forward_index)
        verified += m.to(tl.int64)
    tl.atomic_add(counters + _C_SLOTS_VERIFIED, tl.sum(verified, axis=0))
    if (i == 0) & (j == 0):
        tl.atomic_add(counters + _C_VERIFY_LAUNCHES, 1)


@triton.jit
def sweep_kernel(
    records, slots, preds, positions, tokens, num_entries,
    k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
    counters, ring, ring_capacity, num_slots,
    GROUP_BITS: tl.constexpr, NUM_LAYERS: tl.constexpr, HAS_V: tl.constexpr, NW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """SWEEP: verify a flat list of cached slots (slot, predecessor slot, position, token).

    Ring rows get batch_index = row = -1 (held by the cache, not by a request).
    """
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    m = idx < num_entries
    raw_slot = tl.load(slots + idx, mask=m, other=0).to(tl.int64)
    raw_pred = tl.load(preds + idx, mask=m, other=0).to(tl.int64)
    pos = tl.load(positions + idx, mask=m, other=0).to(tl.int64)
    want_token = tl.load(tokens + idx, mask=m, other=0).to(tl.int64)
    reason, stored, expected = _check_slots(
        records, raw_slot, raw_pred, pos, want_token, m, num_slots,
        k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride, True, NUM_LAYERS, HAS_V, NW)
    report = tl.load(counters + _C_REPORT_ENABLED)
    forward_index = tl.load(counters + _C_FORWARD_INDEX)
    _append_violations(counters, ring, ring_capacity, (reason != 0) & (report != 0),
                       reason.to(tl.int64) | GROUP_BITS, raw_slot, pos, -1, -1, stored, expected, forward_index)
    tl.atomic_add(counters + _C_SLOTS_SWEPT, tl.sum(m.to(tl.int64), axis=0))


@triton.jit
def write_kernel(
    records, req_to_token, r2t_stride, req_pool_indices, seq_lens, new_lens, new_starts,
    input_ids, out_cache_loc,
    k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
    counters, num_slots, expected_tokens, et_stride,
    BUMP_FORWARD: tl.constexpr, STORE_TOKENS: tl.constexpr,
    NUM_LAYERS: tl.constexpr, HAS_V: tl.constexpr, NW: tl.constexpr, BLOCK: tl.constexpr,
):
    """TAIL: fingerprint the new tokens of request ``program_id(0)``, block ``program_id(1)``.

    The chain of the k-th new token is the predecessor slot's chain plus the
    prefix sum of g over new tokens 0..k: earlier blocks are summed first, so
    every block of a long chunk is written in parallel.
    """
    i = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    n = tl.load(new_lens + i).to(tl.int64)
    start = tl.load(new_starts + i).to(tl.int64)
    p0 = tl.load(seq_lens + i).to(tl.int64) - n
    lanes = tl.arange(0, BLOCK)
    pred = tl.load(req_to_token + row * r2t_stride + tl.maximum(p0 - 1, 0), mask=p0 > 0, other=0).to(tl.int64)
    pred = tl.where((pred > 0) & (pred < num_slots), pred, 0)
    pred_chain = tl.load(records + pred * _RW + 2, mask=p0 > 0, other=0)
    carry = tl.where(p0 > 0, pred_chain, _ANCHOR)
    for bb in range(0, b):
        k = bb * BLOCK + lanes
        mk = k < n
        tok = tl.load(input_ids + start + k, mask=mk, other=0)
        carry += tl.sum(tl.where(mk, _chain_term(tok, p0 + k), 0), axis=0)
    k = b * BLOCK + lanes
    m = (k < n) & (p0 >= 0)
    tok = tl.load(input_ids + start + k, mask=m, other=0).to(tl.int64)
    pos = p0 + k
    g = tl.where(m, _chain_term(tok, pos), 0)
    chain = carry + tl.cumsum(g, axis=0)
    slot = tl.load(out_cache_loc + start + k, mask=m, other=0).to(tl.int64)
    wm = m & (slot > 0) & (slot < num_slots)
    live_hash = _kv_hash(slot, wm, k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride, NUM_LAYERS, HAS_V, NW)
    tl.store(records + slot * _RW + 0, tok, mask=wm)
    tl.store(records + slot * _RW + 1, pos, mask=wm)
    tl.store(records + slot * _RW + 2, chain, mask=wm)
    tl.store(records + slot * _RW + 3, live_hash, mask=wm)
    if STORE_TOKENS:  # the request's own token at each new position, for HEAD's token check
        # wm, not m: a CUDA-graph padding request has slot 0 and a stale row that must not be touched
        tl.store(expected_tokens + row * et_stride + pos, tok.to(tl.int32), mask=wm)
    tl.atomic_add(counters + _C_SLOTS_WRITTEN, tl.sum(wm.to(tl.int64), axis=0))
    if (i == 0) & (b == 0):
        tl.atomic_add(counters + _C_WRITE_LAUNCHES, 1)
        if BUMP_FORWARD:
            tl.atomic_add(counters + _C_FORWARD_INDEX, 1)


def launch_verify(group, view, req_to_token, counters, ring, programs_per_req: int, block: int = 256,
                  group_index: int = 0, expected_tokens=None) -> None:
    tokens = req_to_token if expected_tokens is None else expected_tokens
    verify_kernel[(view.batch_size, programs_per_req)](
        group.records, req_to_token, req_to_token.stride(0), view.req_pool_indices, view.seq_lens, view.new_lens,
        *_hash_args(group), counters, ring, ring.shape[0], group.num_slots, programs_per_req,
        tokens, tokens.stride(0),
        CHECK_TOKENS=expected_tokens is not None, GROUP_BITS=group_index << fp.GROUP_SHIFT,
        **_hash_meta(group), BLOCK=block,
    )


def launch_write(group, view, req_to_token, counters, bump_forward: bool, block: int = 0,
                 expected_tokens=None) -> None:
    block = block or write_block(view.max_new_len)
    tokens = req_to_token if expected_tokens is None else expected_tokens
    write_kernel[(view.batch_size, max(1, triton.cdiv(view.max_new_len, block)))](
        group.records, req_to_token, req_to_token.stride(0), view.req_pool_indices, view.seq_lens,
        view.new_lens, view.new_starts, view.input_ids, view.out_cache_loc,
        *_hash_args(group), counters, group.num_slots, tokens, tokens.stride(0),
        BUMP_FORWARD=bump_forward, STORE_TOKENS=expected_tokens is not None,
        **_hash_meta(group), BLOCK=block,
    )


def launch_sweep(group, entries, counters, ring, group_index: int = 0, block: int = 256) -> None:
    """entries: ``SweepEntries`` (flat int64 device tensors of equal length)."""
    n = int(entries.slots.shape[0])
    if n == 0:
        return
    sweep_kernel[(triton.cdiv(n, block),)](
        group.records, entries.slots, entries.preds, entries.positions, entries.tokens, n,
        *_hash_args(group), counters, ring, ring.shape[0], group.num_slots,
        GROUP_BITS=group_index << fp.GROUP_SHIFT, **_hash_meta(group), BLOCK=block,
    )


def write_block(max_new_len: int) -> int:
    """Lanes per TAIL program: the next power of two of the longest new run, in [16, 1024]."""
    return min(1024, max(16, triton.next_power_of_2(max(1, max_new_len))))


def _hash_args(group):
    """k0, v0, ..., k3, v3, k_stride, v_stride (unused layers repeat the last; MLA passes K as V)."""
    k = list(group.k_views)
    v = list(group.v_views) if group.has_v else list(group.k_views)
    out = []
    for idx in range(4):
        src = min(idx, len(k) - 1)
        out += [k[src], v[src]]
    return out + [k[0].stride(0), v[0].stride(0)]


def _hash_meta(group):
    return dict(NUM_LAYERS=len(group.k_views), HAS_V=group.has_v, NW=group.hash_words)
