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
def verify_kernel(
    records, req_to_token, r2t_stride, req_pool_indices, seq_lens, new_lens,
    k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
    counters, ring, ring_capacity, num_slots, programs_per_req, expected_tokens, et_stride,
    C_VIOLATIONS: tl.constexpr, C_SLOTS_VERIFIED: tl.constexpr, C_VERIFY_LAUNCHES: tl.constexpr,
    C_FORWARD_INDEX: tl.constexpr, C_REPORT_ENABLED: tl.constexpr,
    R_POSITION: tl.constexpr, R_CHAIN: tl.constexpr, R_KV_HASH: tl.constexpr, R_SLOT: tl.constexpr,
    R_TOKEN: tl.constexpr, CHECK_TOKENS: tl.constexpr, GROUP_BITS: tl.constexpr,
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
    report = tl.load(counters + C_REPORT_ENABLED)
    forward_index = tl.load(counters + C_FORWARD_INDEX)
    num_blocks = tl.cdiv(prefix, BLOCK)
    lanes = tl.arange(0, BLOCK)
    verified = tl.zeros((BLOCK,), dtype=tl.int64)
    for b in range(j, num_blocks, programs_per_req):
        pos = b * BLOCK + lanes
        m = pos < prefix
        slot = tl.load(req_to_token + row * r2t_stride + pos, mask=m, other=0).to(tl.int64)
        slot_ok = (slot > 0) & (slot < num_slots)
        slot = tl.where(slot_ok, slot, 0)
        has_pred = m & (pos > 0)
        pred = tl.load(req_to_token + row * r2t_stride + pos - 1, mask=has_pred, other=0).to(tl.int64)
        pred = tl.where((pred > 0) & (pred < num_slots), pred, 0)
        rec_token = tl.load(records + slot * _RW + 0, mask=m, other=0)
        rec_pos = tl.load(records + slot * _RW + 1, mask=m, other=0)
        rec_chain = tl.load(records + slot * _RW + 2, mask=m, other=0)
        rec_hash = tl.load(records + slot * _RW + 3, mask=m, other=0)
        pred_chain = tl.load(records + pred * _RW + 2, mask=has_pred, other=0)
        pred_chain = tl.where(pos > 0, pred_chain, _ANCHOR)
        want_chain = pred_chain + _chain_term(rec_token, pos)
        live_hash = _kv_hash(slot, m & slot_ok, k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
                             NUM_LAYERS, HAS_V, NW)
        bad_slot = ~slot_ok
        bad_pos = slot_ok & (rec_pos != pos)
        bad_chain = slot_ok & (rec_chain != want_chain)
        bad_hash = slot_ok & (live_hash != rec_hash)
        if CHECK_TOKENS:
            want_token = tl.load(expected_tokens + row * et_stride + pos, mask=m, other=0).to(tl.int64)
        else:
            want_token = rec_token
        bad_token = slot_ok & (rec_token != want_token)
        reason = (tl.where(bad_slot, R_SLOT, 0) | tl.where(bad_pos, R_POSITION, 0)
                  | tl.where(bad_chain, R_CHAIN, 0) | tl.where(bad_token, R_TOKEN, 0)
                  | tl.where(bad_hash, R_KV_HASH, 0))
        bad = m & (reason != 0) & (report != 0)
        stored = tl.where(bad_slot, slot, tl.where(bad_pos, rec_pos, tl.where(
            bad_chain, rec_chain, tl.where(bad_token, rec_token, rec_hash))))
        expected = tl.where(bad_slot, 0, tl.where(bad_pos, pos, tl.where(
            bad_chain, want_chain, tl.where(bad_token, want_token, live_hash))))
        bad_i = bad.to(tl.int64)
        n_bad = tl.sum(bad_i, axis=0)
        if n_bad > 0:
            base = tl.atomic_add(counters + C_VIOLATIONS, n_bad)
            at = ((base + tl.cumsum(bad_i, axis=0) - 1) % ring_capacity) * _VW
            tl.store(ring + at + 0, reason.to(tl.int64) | GROUP_BITS, mask=bad)
            tl.store(ring + at + 1, tl.load(req_to_token + row * r2t_stride + pos, mask=m, other=0).to(tl.int64),
                     mask=bad)
            tl.store(ring + at + 2, pos, mask=bad)
            tl.store(ring + at + 3, tl.zeros_like(pos) + i, mask=bad)
            tl.store(ring + at + 4, tl.zeros_like(pos) + row, mask=bad)
            tl.store(ring + at + 5, stored, mask=bad)
            tl.store(ring + at + 6, expected, mask=bad)
            tl.store(ring + at + 7, tl.zeros_like(pos) + forward_index, mask=bad)
        verified += m.to(tl.int64)
    tl.atomic_add(counters + C_SLOTS_VERIFIED, tl.sum(verified, axis=0))
    if (i == 0) & (j == 0):
        tl.atomic_add(counters + C_VERIFY_LAUNCHES, 1)


@triton.jit
def write_kernel(
    records, req_to_token, r2t_stride, req_pool_indices, seq_lens, new_lens, new_starts,
    input_ids, out_cache_loc,
    k0, v0, k1, v1, k2, v2, k3, v3, k_stride, v_stride,
    counters, num_slots, expected_tokens, et_stride,
    C_SLOTS_WRITTEN: tl.constexpr, C_WRITE_LAUNCHES: tl.constexpr, C_FORWARD_INDEX: tl.constexpr,
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
    tl.atomic_add(counters + C_SLOTS_WRITTEN, tl.sum(wm.to(tl.int64), axis=0))
    if (i == 0) & (b == 0):
        tl.atomic_add(counters + C_WRITE_LAUNCHES, 1)
        if BUMP_FORWARD:
            tl.atomic_add(counters + C_FORWARD_INDEX, 1)


def launch_verify(group, view, req_to_token, counters, ring, programs_per_req: int, block: int = 256,
                  group_index: int = 0, expected_tokens=None) -> None:
    k, v, nl = _hash_args(group)
    tokens = req_to_token if expected_tokens is None else expected_tokens
    verify_kernel[(view.batch_size, programs_per_req)](
        group.records, req_to_token, req_to_token.stride(0), view.req_pool_indices, view.seq_lens, view.new_lens,
        *_interleave(k, v), k[0].stride(0), v[0].stride(0),
        counters, ring, ring.shape[0], group.num_slots, programs_per_req, tokens, tokens.stride(0),
        C_VIOLATIONS=fp.C_VIOLATIONS, C_SLOTS_VERIFIED=fp.C_SLOTS_VERIFIED,
        C_VERIFY_LAUNCHES=fp.C_VERIFY_LAUNCHES, C_FORWARD_INDEX=fp.C_FORWARD_INDEX,
        C_REPORT_ENABLED=fp.C_REPORT_ENABLED,
        R_POSITION=fp.R_POSITION, R_CHAIN=fp.R_CHAIN, R_KV_HASH=fp.R_KV_HASH, R_SLOT=fp.R_SLOT,
        R_TOKEN=fp.R_TOKEN, CHECK_TOKENS=expected_tokens is not None, GROUP_BITS=group_index << fp.GROUP_SHIFT,
        NUM_LAYERS=nl, HAS_V=group.has_v, NW=group.hash_words, BLOCK=block,
    )


def launch_write(group, view, req_to_token, counters, bump_forward: bool, block: int = 0,
                 expected_tokens=None) -> None:
    block = block or write_block(view.max_new_len)
    k, v, nl = _hash_args(group)
    tokens = req_to_token if expected_tokens is None else expected_tokens
    write_kernel[(view.batch_size, max(1, triton.cdiv(view.max_new_len, block)))](
        group.records, req_to_token, req_to_token.stride(0), view.req_pool_indices, view.seq_lens,
        view.new_lens, view.new_starts, view.input_ids, view.out_cache_loc,
        *_interleave(k, v), k[0].stride(0), v[0].stride(0),
        counters, group.num_slots, tokens, tokens.stride(0),
        C_SLOTS_WRITTEN=fp.C_SLOTS_WRITTEN, C_WRITE_LAUNCHES=fp.C_WRITE_LAUNCHES,
        C_FORWARD_INDEX=fp.C_FORWARD_INDEX, BUMP_FORWARD=bump_forward, STORE_TOKENS=expected_tokens is not None,
        NUM_LAYERS=nl, HAS_V=group.has_v, NW=group.hash_words, BLOCK=block,
    )


def write_block(max_new_len: int) -> int:
    """Lanes per TAIL program: the next power of two of the longest new run, in [16, 1024]."""
    return min(1024, max(16, triton.next_power_of_2(max(1, max_new_len))))


def _hash_args(group):
    k = list(group.k_views)
    v = list(group.v_views) if group.has_v else list(group.k_views)
    return k, v, len(k)


def _interleave(k, v):
    out = []
    for idx in range(4):
        src = min(idx, len(k) - 1)
        out += [k[src], v[src]]
    return out
