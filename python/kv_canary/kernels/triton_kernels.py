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
from . import full_row
from .slot_checks import (  # noqa: F401 - the kernels below read these as Triton globals
    _ANCHOR, _C_CURRENT_FORWARD, _C_FORWARD_INDEX, _C_REPORT_ENABLED, _C_SLOTS_SCRUBBED, _C_SLOTS_VERIFIED,
    _C_SLOTS_WRITTEN, _C_SWA_DIVERGENCE, _C_SWA_OUT_OF_WINDOW, _C_SWA_VERIFIED, _C_VERIFY_LAUNCHES,
    _C_WRITE_LAUNCHES, _RW, _R_CHAIN, _R_KV_HASH, _R_POSITION, _R_SLOT, _R_TOKEN, _append_violations, _chain_term,
    _check_slots, _kv_hash, _live_hash, _source_tuple, _translate,
)
from .full_row import _list_first_reads
from .launch import BoundKernel, cdiv, next_power_of_2


@triton.jit
def _verify_block(b, i, row, prefix, lo, lanes, records, req_to_token, r2t_stride, base, sources, num_sources, table,
                  counters, ring, ring_capacity, num_slots, slot_map, map_len, report, forward_index, own_chain,
                  CHECK_TOKENS: tl.constexpr, GROUP_BITS: tl.constexpr, WT: tl.constexpr, BLOCK: tl.constexpr,
                  TRANSLATE: tl.constexpr, CHECK_CHAIN: tl.constexpr, NSRC: tl.constexpr, first_read,
                  FIRST_READ: tl.constexpr, prev_row, prev_lo, prev_prefix):
    """HEAD for block ``b`` of request ``i``'s read positions [lo, prefix) (see ``verify_kernel``): append a
    ring row per failing slot; returns (verified, diverged) per lane (0 past ``prefix``: a block past the
    end does nothing). A lane whose position the batch's previous request reads from the same slot after the
    same predecessor slot (``prev_*``: its row and read range; an empty range for request 0) is that lane's
    check exactly: it is counted verified and not checked again (a shared prefix's slots are checked once a
    forward, by the first of each run of its readers in batch order)."""
    pos = lo + b * BLOCK + lanes
    m = pos < prefix
    raw_slot = tl.load(req_to_token + row * r2t_stride + pos, mask=m, other=0).to(tl.int64)
    raw_pred = tl.load(req_to_token + row * r2t_stride + pos - 1, mask=m & (pos > 0), other=0).to(tl.int64)
    pm = m & (pos >= prev_lo) & (pos < prev_prefix)
    prev_slot = tl.load(req_to_token + prev_row * r2t_stride + pos, mask=pm, other=-1).to(tl.int64)
    prev_pred = tl.load(req_to_token + prev_row * r2t_stride + pos - 1, mask=pm & (pos > 0), other=0).to(tl.int64)
    same = pm & (prev_slot == raw_slot) & (prev_pred == raw_pred)
    check = m & ~same
    full_slot = raw_slot
    raw_slot = _translate(slot_map, map_len, raw_slot, m, TRANSLATE)
    raw_pred = tl.where(pos > 0, _translate(slot_map, map_len, raw_pred, m & (pos > 0), TRANSLATE), 0)
    if TRANSLATE:  # a released predecessor (mapping 0, outside the window): its record is gone
        pred_known = (pos == 0) | (raw_pred > 0)
    else:
        pred_known = pos >= 0
    if not CHECK_CHAIN:  # the group's chain links are not checked (BufferGroup.check_chain)
        pred_known = pos < 0
    if CHECK_TOKENS:  # loaded before the checks: in flight with their loads
        last = m & (pos == prefix - 1) & (raw_slot > 0) & (raw_slot < num_slots)
        last_chain = tl.load(records + raw_slot * _RW + 2, mask=last, other=0)
    reason, stored, expected = _check_slots(
        records, raw_slot, raw_pred, pos, raw_slot, check, num_slots, base, sources, num_sources, False, WT,
        pred_known, table, NSRC)
    if CHECK_TOKENS:
        bad_tok = last & (last_chain != own_chain)
        first = bad_tok & ((reason & (_R_SLOT | _R_POSITION | _R_CHAIN)) == 0)
        stored = tl.where(first, last_chain, stored)
        expected = tl.where(first, own_chain, expected)
        reason = reason | tl.where(bad_tok, _R_TOKEN, 0)
    bad = (reason != 0) & (report != 0)
    _append_violations(counters, ring, ring_capacity, bad, reason.to(tl.int64) | GROUP_BITS, raw_slot, pos,
                       i, row, stored, expected, forward_index)
    if FIRST_READ:
        _list_first_reads(records, raw_slot, check & (raw_slot > 0) & (raw_slot < num_slots), i, row,
                          first_read[0], first_read[1], first_read[2], first_read[3])
    return m.to(tl.int64), (m & (raw_slot != full_slot)).to(tl.int64)


@triton.jit
def verify_kernel(
    records, req_to_token, r2t_stride, req_pool_indices, seq_lens, new_lens,
    base, sources, num_sources,
    counters, ring, ring_capacity, num_slots, programs_per_req,
    row_chain, next_token, next_rows, sampled, pending,
    slot_map, map_len, window, tags, work, work_state, work_capacity,
    CHECK_TOKENS: tl.constexpr, SCATTER: tl.constexpr, GROUP_BITS: tl.constexpr, WT: tl.constexpr,
    BLOCK: tl.constexpr, TRANSLATE: tl.constexpr, CHECK_CHAIN: tl.constexpr = True, NSRC: tl.constexpr = 0,
    FIRST_READ: tl.constexpr = False,
):
    """HEAD: verify slots [0, seq_len - new_len) of request ``program_id(0)``.

    A windowed group (``window`` > 0: sliding-window layers) verifies only the last
    ``window`` positions of that prefix, what its attention reads. With TRANSLATE
    the slot of position p is ``slot_map[req_to_token[row, p]]`` (hybrid SWA: the
    full -> swa mapping); a predecessor outside the window whose mapping was
    released (0) leaves that lane's chain link unchecked.

    Program (i, j) checks blocks j, j + programs_per_req, ... of request i's
    prefix. Each failing slot appends one ring row; the counters get the number
    of slots checked. With CHECK_TOKENS (the token oracle) the last read slot's
    chain must equal ``row_chain[row]``, the chain of the request's own tokens
    (``token``: stored/expected are the two chains). With SCATTER, program (0, 0)
    first lands the previous forward's sampled ids in the token oracle
    (``next_token[next_rows[e]] = sampled[e]`` for the ``pending`` entries; idempotent:
    only this forward's TAIL announces new ones; nothing here reads ``next_token``, so its
    first BLOCK entries are loaded up front and stored after the checks, off the critical path).
    NSRC > 0: the group's few single-tile sources (``few_sources``), their table loaded once here.
    FIRST_READ (``all``): read slots whose full row is unverified go to the group's work list (``full_row``).
    """
    i = tl.program_id(0)
    first_read = (tags, work, work_state, work_capacity)
    j = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    table = _source_tuple(sources, NSRC)
    if SCATTER:  # count is 0 outside program (0, 0)
        count = tl.load(pending, mask=(i == 0) & (j == 0), other=0)
        me0 = lanes < count
        srow0 = tl.load(next_rows + lanes, mask=me0, other=-1)
        stok0 = tl.load(sampled + lanes, mask=me0, other=-1)
    row, prefix, lo = _read_range(req_pool_indices, seq_lens, new_lens, i, window, True)
    # the batch's previous request: its row and read range (empty for request 0)
    prev_row, prev_prefix, prev_lo = _read_range(req_pool_indices, seq_lens, new_lens, i - 1, window, i > 0)
    report = tl.load(counters + _C_REPORT_ENABLED)
    forward_index = tl.load(counters + _C_FORWARD_INDEX)
    own_chain = 0
    if CHECK_TOKENS:
        own_chain = tl.load(row_chain + row)
    num_blocks = tl.cdiv(prefix - lo, BLOCK)
    if NSRC > 0:  # block j in straight-line code, not the loop (the compiler then keeps all its loads in
        # flight together); with j >= num_blocks every lane is past the prefix and it does nothing
        verified, diverged = _verify_block(
            j, i, row, prefix, lo, lanes, records, req_to_token, r2t_stride, base, sources, num_sources, table,
            counters, ring, ring_capacity, num_slots, slot_map, map_len, report, forward_index, own_chain,
            CHECK_TOKENS, GROUP_BITS, WT, BLOCK, TRANSLATE, CHECK_CHAIN, NSRC, first_read, FIRST_READ,
            prev_row, prev_lo, prev_prefix)
        first_in_loop = j + programs_per_req
    else:  # the looping hash: one copy of the block (a second would only add register spills)
        verified = tl.zeros((BLOCK,), dtype=tl.int64)
        diverged = tl.zeros((BLOCK,), dtype=tl.int64)
        first_in_loop = j
    for b in range(first_in_loop, num_blocks, programs_per_req):
        more_verified, more_diverged = _verify_block(
            b, i, row, prefix, lo, lanes, records, req_to_token, r2t_stride, base, sources, num_sources, table,
            counters, ring, ring_capacity, num_slots, slot_map, map_len, report, forward_index, own_chain,
            CHECK_TOKENS, GROUP_BITS, WT, BLOCK, TRANSLATE, CHECK_CHAIN, NSRC, first_read, FIRST_READ,
            prev_row, prev_lo, prev_prefix)
        verified += more_verified
        diverged += more_diverged
    if SCATTER:  # the pending samples: the first BLOCK loaded above, the rest (count > BLOCK) here
        tl.store(next_token + srow0, stok0, mask=me0 & (srow0 >= 0) & (stok0 >= 0))
        for e0 in range(BLOCK, count, BLOCK):
            e = e0 + lanes
            me = e < count
            srow = tl.load(next_rows + e, mask=me, other=-1)
            stok = tl.load(sampled + e, mask=me, other=-1)
            tl.store(next_token + srow, stok, mask=me & (srow >= 0) & (stok >= 0))
    tl.atomic_add(counters + _C_SLOTS_VERIFIED, tl.sum(verified, axis=0), sem="relaxed")
    if TRANSLATE:  # the SWA divergence reporter's counts
        tl.atomic_add(counters + _C_SWA_VERIFIED, tl.sum(verified, axis=0), sem="relaxed")
        tl.atomic_add(counters + _C_SWA_DIVERGENCE, tl.sum(diverged, axis=0), sem="relaxed")
        if j == 0:
            tl.atomic_add(counters + _C_SWA_OUT_OF_WINDOW, lo, sem="relaxed")
    if (i == 0) & (j == 0):
        tl.atomic_add(counters + _C_VERIFY_LAUNCHES, 1, sem="relaxed")
        tl.store(counters + _C_CURRENT_FORWARD, forward_index)  # for this forward's TAIL rows


@triton.jit
def _read_range(req_pool_indices, seq_lens, new_lens, k, window, present):
    """Batch request k's req_to_token row (int64) and the positions [lo, prefix) its forward reads: the
    prefix before its new tokens, of a windowed group (``window`` > 0) only the last ``window``. All 0 where
    ``present`` is false (no such request)."""
    row = tl.load(req_pool_indices + k, mask=present, other=0).to(tl.int64)
    prefix = tl.load(seq_lens + k, mask=present, other=0).to(tl.int64) - tl.load(
        new_lens + k, mask=present, other=0).to(tl.int64)
    prefix = tl.maximum(prefix, 0)
    lo = tl.where(window > 0, tl.maximum(prefix - window, 0), 0)
    return row, prefix, lo


@triton.jit
def _own_tokens(staged, nt, start, i, k, m, STAGED: tl.constexpr):
    """The request's own tokens at new-token indices k (token oracle): staged by the host for an extend
    forward (-1 where its record had none yet: then, like a decode forward, ``nt`` = ``next_token[row]``)."""
    if STAGED:
        want = tl.load(staged + start + i + k, mask=m, other=-1)
        want = tl.where(want >= 0, want, nt)
    else:
        want = tl.zeros(k.shape, dtype=tl.int64) + nt
    return want.to(tl.int64)


@triton.jit
def write_kernel(
    records, req_to_token, r2t_stride, req_pool_indices, seq_lens, new_lens, new_starts,
    input_ids, positions, out_cache_loc,
    base, sources, num_sources,
    counters, ring, ring_capacity, num_slots,
    staged, next_token, next_rows, sampled, pending, row_chain,
    slot_map, map_len,
    BUMP_FORWARD: tl.constexpr, CHECK_FED: tl.constexpr, ORACLE: tl.constexpr, STAGED: tl.constexpr,
    GROUP_BITS: tl.constexpr, WT: tl.constexpr,
    BLOCK: tl.constexpr, TRANSLATE: tl.constexpr, NSRC: tl.constexpr = 0,
):
    """TAIL: fingerprint the new tokens of request ``program_id(0)``, block ``program_id(1)``.

    Each record stores the token the model was fed and the position it ran with
    (``positions``, what RoPE used); the chain links the sequence index. A fed
    position that is not the slot's index in the sequence (``position``) or a
    fed token that is not the request's own token there (``token``; with ORACLE:
    the token oracle's staged tokens for an extend forward (STAGED), else
    ``next_token[row]``, never ``input_ids``) is appended to the ring right away
    (CHECK_FED: the first group's launch only). The chain of the k-th new
    token is the predecessor slot's chain plus the prefix sum of g over new
    tokens 0..k: earlier blocks are summed first, so every block of a long chunk
    is written in parallel. With ORACLE, program (i, 0) also announces request
    i's next sampled token (``next_rows[i]``: its row, or -1 when the chunk is
    unfinished or the request is padding; ``sampled[i] = -1``; ``pending`` = batch
    size), and the program holding the last new token advances ``row_chain[row]``
    to the chain written there (CHECK_FED: every fed token was checked) or, without
    CHECK_FED, to the chain of the request's own tokens.
    The FULL_HASH of every byte (the scrub, ``all``) is ``full_row``'s launch right after this one.
    With TRANSLATE the group's slots (new ones and the predecessor) are ``slot_map[engine slot]``.
    NSRC > 0: the group's few single-tile sources (``few_sources``). Loads are issued in dependency
    rounds (request -> its slots and tokens -> records and K/V words), each before any use.
    """
    i = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    n = tl.load(new_lens + i).to(tl.int64)
    start = tl.load(new_starts + i).to(tl.int64)
    seq_len = tl.load(seq_lens + i).to(tl.int64)
    table = _source_tuple(sources, NSRC)
    report = tl.load(counters + _C_REPORT_ENABLED)
    forward_index = tl.load(counters + _C_CURRENT_FORWARD)  # not _C_FORWARD_INDEX: this launch bumps it
    p0 = seq_len - n
    lanes = tl.arange(0, BLOCK)
    if ORACLE:
        nt = tl.load(next_token + row)  # this kernel never writes next_token
    pred = tl.load(req_to_token + row * r2t_stride + tl.maximum(p0 - 1, 0), mask=p0 > 0, other=0).to(tl.int64)
    k = b * BLOCK + lanes
    m = (k < n) & (p0 >= 0)
    tok = tl.load(input_ids + start + k, mask=m, other=0).to(tl.int64)
    fed_pos = tl.load(positions + start + k, mask=m, other=0).to(tl.int64)
    slot = tl.load(out_cache_loc + start + k, mask=m, other=0).to(tl.int64)
    pred = _translate(slot_map, map_len, pred, p0 > 0, TRANSLATE)
    pred = tl.where((pred > 0) & (pred < num_slots), pred, 0)
    pred_chain = tl.load(records + pred * _RW + 2, mask=p0 > 0, other=0)
    slot = tl.where(m, _translate(slot_map, map_len, slot, m, TRANSLATE), 0)
    # wm, not m: a CUDA-graph padding request has slot 0 and a stale row that must not be touched
    wm = m & (slot > 0) & (slot < num_slots)
    live_hash = _live_hash(slot, wm, base, sources, num_sources, table, NSRC, WT)
    carry = tl.where(p0 > 0, pred_chain, _ANCHOR)
    anchor = carry
    for bb in range(0, b):  # kb, btok: not k, tok (compiled Triton types a loop-carried name once)
        kb = bb * BLOCK + lanes
        mk = kb < n
        btok = tl.load(input_ids + start + kb, mask=mk, other=0)
        carry += tl.sum(tl.where(mk, _chain_term(btok, p0 + kb), 0), axis=0)
    pos = p0 + k
    g = tl.where(m, _chain_term(tok, pos), 0)
    chain = carry + tl.cumsum(g, axis=0)
    tl.store(records + slot * _RW + 0, tok, mask=wm)
    tl.store(records + slot * _RW + 1, fed_pos, mask=wm)
    tl.store(records + slot * _RW + 2, chain, mask=wm)
    tl.store(records + slot * _RW + 3, live_hash, mask=wm)
    if ORACLE:
        if b == 0:  # where request i's next sampled token goes (the next HEAD scatters it)
            keep = tl.sum(tl.where((k == 0) & wm, 1, 0), axis=0) > 0
            if STAGED:  # the record already has the token after this chunk: an unfinished chunk
                keep = keep & (tl.load(staged + start + i + n) < 0)
            tl.store(next_rows + i, tl.where(keep, row, -1))
            tl.store(sampled + i, -1)
            if i == 0:
                tl.store(pending, tl.num_programs(0).to(tl.int64))
        last = wm & (k == n - 1)
        has_last = tl.sum(last.to(tl.int32), axis=0) > 0
        if CHECK_FED:
            tl.store(row_chain + row, tl.sum(tl.where(last, chain, 0), axis=0), mask=has_last)
        else:  # the chain of the request's own tokens (a wrong fed token then fails the next HEAD)
            if has_last:
                own = anchor
                for cc in range(0, tl.cdiv(n, BLOCK)):  # not `bb`: compiled Triton types a loop variable once
                    kk = cc * BLOCK + lanes
                    mk = kk < n
                    w = _own_tokens(staged, nt, start, i, kk, mk, STAGED)
                    own += tl.sum(tl.where(mk, _chain_term(w, p0 + kk), 0), axis=0)
                tl.store(row_chain + row, own)
    if CHECK_FED:  # once per forward (first group): what the model was fed is group-independent
        bad_pos = wm & (fed_pos != pos)
        reason = tl.where(bad_pos, _R_POSITION, 0)
        stored = fed_pos
        expected = pos
        if ORACLE:
            want = _own_tokens(staged, nt, start, i, k, wm, STAGED)
            bad_tok = wm & (tok != want)
            reason = reason | tl.where(bad_tok, _R_TOKEN, 0)
            stored = tl.where(bad_pos, fed_pos, tok)
            expected = tl.where(bad_pos, pos, want)
        _append_violations(counters, ring, ring_capacity, (reason != 0) & (report != 0),
                           reason.to(tl.int64) | GROUP_BITS, slot, pos, i, row, stored, expected, forward_index)
    tl.atomic_add(counters + _C_SLOTS_WRITTEN, tl.sum(wm.to(tl.int64), axis=0), sem="relaxed")
    if (i == 0) & (b == 0):
        tl.atomic_add(counters + _C_WRITE_LAUNCHES, 1, sem="relaxed")
        if BUMP_FORWARD:
            tl.atomic_add(counters + _C_FORWARD_INDEX, 1, sem="relaxed")


def _oracle_args(token_oracle, fallback):
    """The token oracle's tensors a kernel takes (``fallback`` stands in for each when there is none)."""
    o = token_oracle
    if o is None:
        return [fallback] * 6
    return [o.staged, o.next_token, o.next_rows, o.sampled, o.pending, o.row_chain]


def launch_verify(group, view, req_to_token, counters, ring, programs_per_req: int, block: int = 256,
                  group_index: int = 0, token_oracle=None, defer_first_read: bool = False) -> None:
    """token_oracle: the first group's launch only (the read tokens' chain, the pending samples).
    defer_first_read: list the first reads but leave their hashing to ``launch_first_read`` after the forward (a
    HiCache load-back forward: every loaded layer has landed by then)."""
    staged, next_token, next_rows, sampled, pending, row_chain = _oracle_args(token_oracle, counters)
    del staged
    _verify_kernel_bound[(view.batch_size, programs_per_req)](
        group.records, req_to_token, req_to_token.stride(0), view.req_pool_indices, view.seq_lens, view.new_lens,
        *_hash_args(group), counters, ring, ring.shape[0], group.num_slots, programs_per_req,
        row_chain, next_token, next_rows, sampled, pending, *_map_args(group), group.window, *_first_read_args(group),
        CHECK_TOKENS=token_oracle is not None and token_oracle.verify_reads, SCATTER=token_oracle is not None,
        GROUP_BITS=group_index << fp.GROUP_SHIFT, WT=hash_word_tile(group), BLOCK=block,
        TRANSLATE=group.slot_map is not None, CHECK_CHAIN=group.check_chain, NSRC=few_sources(group),
        num_warps=verify_warps(group, block), FIRST_READ=_first_read(group),
    )
    if _first_read(group) and not defer_first_read:  # the listed slots' every byte, over (slot block, row)
        # HiCache outside all (TAIL sets the tags): only loaded slots are listed, by their load's forward (whose
        # LIST is deferred); here the list is empty but for a loaded slot read first elsewhere: one small launch
        full_row.launch_first_read(group, counters, ring, group_index, expect_empty=not group.full_row.clear_tags)


def launch_first_read(group, counters, ring, group_index: int = 0, rows=None, finalize: bool = True) -> None:
    """A deferred first-read LIST launch (``launch_verify(defer_first_read=True)`` listed the slots); ``rows`` /
    ``finalize``: one part of it (``full_row.launch_first_read``)."""
    if _first_read(group):
        full_row.launch_first_read(group, counters, ring, group_index, rows=rows, finalize=finalize)


def _first_read(group) -> bool:
    return group.full_row is not None and group.full_row.first_read


def _first_read_args(group):
    st = group.full_row
    if not _first_read(group):
        return [group.records, group.records, group.records, 0]
    return [st.tags, st.work, st.work_state, int(st.work.shape[0])]


def verify_warps(group, block: int) -> int:
    """Warps per HEAD program: with the straight-line hash (``few_sources``) one lane per thread, up to
    8 warps (ptxas interleaves a two-lane thread's loads with its arithmetic instead of keeping them
    in flight together); the looping hash keeps 4 (its registers would halve the programs per SM)."""
    return max(4, min(8, block // 32)) if few_sources(group) else 4


def launch_write(group, view, req_to_token, counters, ring, bump_forward: bool, block: int = 0,
                 group_index: int = 0, check_fed: bool = True, token_oracle=None) -> None:
    """check_fed: check the fed positions (and tokens, given a ``TokenOracle``); once per forward, as is
    ``token_oracle`` (it also announces each request's next sampled token and advances the row chains)."""
    block = block or write_block(view.max_new_len)
    _write_kernel_bound[(view.batch_size, max(1, cdiv(view.max_new_len, block)))](
        group.records, req_to_token, req_to_token.stride(0), view.req_pool_indices, view.seq_lens,
        view.new_lens, view.new_starts, view.input_ids, view.positions, view.out_cache_loc,
        *_hash_args(group), counters, ring, ring.shape[0], group.num_slots,
        *_oracle_args(token_oracle, counters), *_map_args(group),
        BUMP_FORWARD=bump_forward, CHECK_FED=check_fed, ORACLE=token_oracle is not None,
        STAGED=token_oracle is not None and view.staged,
        GROUP_BITS=group_index << fp.GROUP_SHIFT,
        WT=hash_word_tile(group), BLOCK=block,
        TRANSLATE=group.slot_map is not None, NSRC=few_sources(group),
    )
    if group.full_row is not None:  # the group keeps FULL_HASH (the scrub, all): split over (slot block, row)
        full_row.launch_tail_full_hash(group, view, counters, ring, group_index)


def launch_scrub(group, counters, ring, per_forward: int, group_index: int = 0, after_write: bool = False) -> None:
    """Check ``per_forward`` slots' every K/V byte (grid fixed by ``per_forward``: graph-safe); ``after_write``:
    launched after the forward's bump."""
    if group.full_row is None:
        raise ValueError(f"kv-canary: group '{group.name}' keeps no FULL_HASH (built without the scrub or all)")
    full_row.launch_scrub(group, counters, ring, per_forward, group_index, after_write)


def write_block(max_new_len: int) -> int:
    """Lanes per TAIL program: the next power of two of the longest new run, in [16, 1024]."""
    return min(1024, max(16, next_power_of_2(max(1, max_new_len))))


def tail_variant(max_new_len: int):
    """What a TAIL's compiled variants depend on in its longest new run: the write kernel's block and the
    whole-row hash's slot tile (both step at powers of two)."""
    return write_block(max_new_len), full_row.tail_tile(max_new_len)


HASH_WORD_TILE = 16  # most words of one row a kernel loads per step (whole-row hashing loops over tiles)


def hash_word_tile(group) -> int:
    """Words per hash tile: the next power of two of the longest hashed run, at most HASH_WORD_TILE."""
    return min(HASH_WORD_TILE, next_power_of_2(max(1, group.longest_source_words)))


FEW_SOURCES_MAX = 4  # most sources the straight-line hash unrolls (default partial hashing: 2, K and V)
FEW_SOURCES_WORDS = 8  # most words per lane it keeps in flight (sources x word tile; more costs occupancy)


def few_sources(group) -> int:
    """NSRC for HEAD/TAIL: the number of hashed sources when the straight-line hash takes them (at most
    FEW_SOURCES_MAX, each one word tile, FEW_SOURCES_WORDS words in all), else 0 (the runtime loops:
    ``--kv-canary-real-data all``, many layers, long runs). A function of the group: no extra variant."""
    n = len(group.sources)
    if 0 < n <= FEW_SOURCES_MAX and n * hash_word_tile(group) <= FEW_SOURCES_WORDS \
            and group.longest_source_words <= HASH_WORD_TILE:
        return n
    return 0


def _hash_args(group):
    """base, source table, number of sources (see ``CanaryBufferGroup``)."""
    return [group.base, group.source_table, len(group.sources)]


def _map_args(group):
    """slot map, its length (the records stand in when the group has no translation)."""
    if group.slot_map is None:
        return [group.records, 0]
    return [group.slot_map, int(group.slot_map.shape[0])]


# launched through their compiled launchers once Triton bound a variant (kernels/launch.py)
_verify_kernel_bound = BoundKernel(verify_kernel)
_write_kernel_bound = BoundKernel(write_kernel)
