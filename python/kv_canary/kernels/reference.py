"""Torch reference of the HEAD-verify, TAIL-write and SWEEP kernels.

Same inputs, same outputs, same formulas as ``triton_kernels``; ring rows may
be in a different order (the Triton kernels append them atomically). Not
graph-safe (it reads lengths on the host): it is the oracle for tests and the
``SGLANG_KV_CANARY_KERNEL_BACKEND=torch`` fallback on CPU.
"""

from __future__ import annotations

from typing import List

import torch

from .. import fingerprint as fp
from ..fingerprint import chain_term, full_hash_from_words, kv_hash_from_words
from ..witness_stamp import STAMP_WORDS


def _live_hash(group, slots: torch.Tensor) -> torch.Tensor:
    return kv_hash_from_words(group.hashed_words(slots))


def _full_hash(group, slots: torch.Tensor) -> torch.Tensor:
    return full_hash_from_words(group.all_words(slots))


def translate(group, full_slots: torch.Tensor) -> torch.Tensor:
    """The group's slots for engine slots (``group.slot_map``; -1 out of its range; identity without one)."""
    full_slots = full_slots.to(torch.int64)
    if group.slot_map is None:
        return full_slots
    n = group.slot_map.shape[0]
    ok = (full_slots >= 0) & (full_slots < n)
    return torch.where(ok, group.slot_map[full_slots.clamp(0, n - 1)].to(torch.int64), -1)


def _check_slots(group, raw_slot, raw_pred, pos, want_token, pred_known=None):
    """Tensors of any equal shape -> (reason bits, stored, expected); raw_pred is 0 where pos == 0.

    pred_known: lanes whose predecessor's record is readable (None: all); elsewhere the chain is not checked.
    """
    slot_ok = (raw_slot > 0) & (raw_slot < group.num_slots)
    slot = torch.where(slot_ok, raw_slot, 0)
    pred = torch.where((raw_pred > 0) & (raw_pred < group.num_slots), raw_pred, 0)
    rec = group.records[slot]
    rec_token, rec_pos = rec[..., fp.F_TOKEN], rec[..., fp.F_POSITION]
    rec_chain, rec_hash = rec[..., fp.F_CHAIN], rec[..., fp.F_KV_HASH]
    pred_chain = torch.where(pos > 0, group.records[pred][..., fp.F_CHAIN], fp.CHAIN_ANCHOR)
    want_chain = pred_chain + chain_term(rec_token, pos)
    live_hash = _live_hash(group, slot.reshape(-1)).reshape(slot.shape)
    if want_token is None:
        want_token = rec_token
    bad_slot = ~slot_ok
    bad_pos = slot_ok & (rec_pos != pos)
    bad_chain = slot_ok & (rec_chain != want_chain)
    if pred_known is not None:
        bad_chain = bad_chain & pred_known
    bad_token = slot_ok & (rec_token != want_token)
    bad_hash = slot_ok & (live_hash != rec_hash)
    reason = ((bad_slot * fp.R_SLOT) | (bad_pos * fp.R_POSITION) | (bad_chain * fp.R_CHAIN)
              | (bad_token * fp.R_TOKEN) | (bad_hash * fp.R_KV_HASH))
    stored = torch.where(bad_slot, raw_slot, torch.where(bad_pos, rec_pos, torch.where(
        bad_chain, rec_chain, torch.where(bad_token, rec_token, rec_hash))))
    expected = torch.where(bad_slot, torch.zeros_like(pos), torch.where(bad_pos, pos, torch.where(
        bad_chain, want_chain, torch.where(bad_token, want_token, live_hash))))
    return reason.to(torch.int64), stored, expected


def _append_violations(counters, ring, bad, fields) -> None:
    """fields: the RING_WIDTH per-lane tensors; appends rows where ``bad``, in lane order."""
    if counters[fp.C_REPORT_ENABLED] == 0:
        return
    table = torch.stack([f.expand(bad.shape)[bad] for f in fields], dim=1)
    n_bad = table.shape[0]
    if n_bad:
        base = int(counters[fp.C_VIOLATIONS].item())
        at = (base + torch.arange(n_bad, device=ring.device)) % ring.shape[0]
        ring[at] = table
        counters[fp.C_VIOLATIONS] += n_bad


def _scatter_pending(o) -> None:
    """HEAD's first step with a token oracle: the previous forward's sampled ids land in ``next_token``."""
    count = int(o.pending.item())
    rows, toks = o.next_rows[:count], o.sampled[:count]
    ok = (rows >= 0) & (toks >= 0)
    o.next_token[rows[ok]] = toks[ok]


def launch_verify(group, view, req_to_token, counters, ring, programs_per_req: int = 1, block: int = 0,
                  group_index: int = 0, token_oracle=None, defer_first_read: bool = False) -> None:
    del programs_per_req, block  # grid shape is a Triton concern
    if token_oracle is not None:
        _scatter_pending(token_oracle)
    bs = view.batch_size
    device = group.records.device
    rows = view.req_pool_indices[:bs].to(torch.int64)
    prefix = (view.seq_lens[:bs].to(torch.int64) - view.new_lens[:bs].to(torch.int64)).clamp(min=0)
    width = int(prefix.max().item()) if bs else 0
    if width > 0:
        pos = torch.arange(width, device=device, dtype=torch.int64).expand(bs, width)
        lo = (prefix - group.window).clamp(min=0) if group.window > 0 else torch.zeros_like(prefix)
        m = (pos < prefix[:, None]) & (pos >= lo[:, None])
        full_slot = req_to_token[rows][:, :width].to(torch.int64)
        raw_slot = translate(group, full_slot)
        raw_pred = torch.zeros_like(raw_slot)
        raw_pred[:, 1:] = raw_slot[:, :-1]
        pred_known = (pos == 0) | (raw_pred > 0) if group.slot_map is not None else None
        if not group.check_chain:
            pred_known = torch.zeros_like(m)
        reason, stored, expected = _check_slots(group, raw_slot, raw_pred, pos, None, pred_known)
        # a lane the batch's previous request reads from the same slot after the same predecessor is its check
        full_pred = torch.zeros_like(full_slot)
        full_pred[:, 1:] = full_slot[:, :-1]
        same = torch.zeros_like(m)
        same[1:] = m[1:] & m[:-1] & (full_slot[1:] == full_slot[:-1]) & (full_pred[1:] == full_pred[:-1])
        check = m & ~same
        reason = torch.where(check, reason, torch.zeros_like(reason))
        if token_oracle is not None and token_oracle.verify_reads:
            slot_ok = (raw_slot > 0) & (raw_slot < group.num_slots)
            last = m & (pos == prefix[:, None] - 1) & slot_ok
            last_chain = group.records[torch.where(slot_ok, raw_slot, 0)][..., fp.F_CHAIN]
            own = token_oracle.row_chain[rows][:, None].expand(bs, width)
            bad_tok = last & (last_chain != own)
            first = bad_tok & ((reason & (fp.R_SLOT | fp.R_POSITION | fp.R_CHAIN)) == 0)
            stored = torch.where(first, last_chain, stored)
            expected = torch.where(first, own, expected)
            reason = reason | (bad_tok * fp.R_TOKEN)
        batch_index = torch.arange(bs, device=device, dtype=torch.int64)[:, None]
        _append_violations(counters, ring, m & (reason != 0), [
            reason | (group_index << fp.GROUP_SHIFT), raw_slot, pos, batch_index, rows[:, None], stored, expected,
            counters[fp.C_FORWARD_INDEX],
        ])
        counters[fp.C_SLOTS_VERIFIED] += m.sum()
        if group.full_row is not None and group.full_row.first_read:
            _list_first_reads(group, raw_slot, check, rows)
            if not defer_first_read:
                launch_first_read(group, counters, ring, group_index)
        if group.slot_map is not None:
            counters[fp.C_SWA_VERIFIED] += m.sum()
            counters[fp.C_SWA_DIVERGENCE] += (m & (raw_slot != full_slot)).sum()
            counters[fp.C_SWA_OUT_OF_WINDOW] += lo.sum()
    counters[fp.C_VERIFY_LAUNCHES] += 1
    counters[fp.C_CURRENT_FORWARD] = counters[fp.C_FORWARD_INDEX]


def _list_first_reads(group, raw_slot, m, rows) -> None:
    """``all`` / HiCache: append each read slot not verified since its write (tag != FULL_HASH) to the work list
    once, tag it verified (``full_row._list_first_reads``' twin; a slot past the capacity keeps its old tag and is
    listed by a later forward)."""
    st = group.full_row
    ok = m & (raw_slot > 0) & (raw_slot < group.num_slots)
    bs_index = torch.arange(raw_slot.shape[0], device=raw_slot.device)[:, None].expand_as(raw_slot)
    slot, bi, row = raw_slot[ok], bs_index[ok], rows[:, None].expand_as(raw_slot)[ok]
    need = st.tags[slot] != group.records[slot, fp.F_FULL_HASH]
    slot, bi, row = slot[need], bi[need], row[need]
    uniq, first = _first_of_each(slot)
    listed = int(st.work_state[0])
    room = max(0, int(st.work.shape[0]) - listed)
    uniq, first = uniq[:room], first[:room]
    n = int(uniq.numel())
    st.work[listed:listed + n] = torch.stack([uniq, bi[first].to(torch.int64), row[first]], dim=1)
    st.work_state[0] += n
    st.tags[uniq] = group.records[uniq, fp.F_FULL_HASH]


def launch_first_read(group, counters, ring, group_index: int = 0, rows=None, finalize: bool = True) -> None:
    """Hash the full rows of the listed slots, compare with their FULL_HASH, empty the list. In parts (``rows``,
    ``finalize``: the Triton launch's split): every row is hashed at the finalize, a part alone does nothing."""
    st = group.full_row
    if st is None or not st.first_read or not finalize:
        return
    n = int(st.work_state[0])
    st.work_state.zero_()
    if n == 0:
        return
    slot, bi, row = st.work[:n].unbind(1)
    rec = group.records[slot]
    live = _full_hash(group, slot)
    bad = live != rec[:, fp.F_FULL_HASH]
    _append_violations(counters, ring, bad, [
        bad.to(torch.int64) * fp.R_KV_HASH | (group_index << fp.GROUP_SHIFT), slot, rec[:, fp.F_POSITION],
        bi, row, rec[:, fp.F_FULL_HASH], live, counters[fp.C_FORWARD_INDEX],
    ])
    counters[fp.C_SLOTS_FIRST_READ] += n


def _first_of_each(values: torch.Tensor):
    """(unique values, index of each one's first occurrence)."""
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full_like(uniq, values.numel()).scatter_reduce_(
        0, inverse, torch.arange(values.numel(), device=values.device), "amin")
    return uniq, first


def _sweep_entries(group, entries, counters, ring, group_index: int = 0, pred_known=None) -> None:
    """Check a flat list of cached (slot, predecessor, position, token) entries (``SweepEntries``).

    pred_known: entries whose predecessor's record is readable (None: all; see ``_check_slots``).
    """
    if entries.slots.numel() == 0:
        return
    slots, preds = entries.slots.to(torch.int64), entries.preds.to(torch.int64)
    pos, tokens = entries.positions.to(torch.int64), entries.tokens.to(torch.int64)
    reason, stored, expected = _check_slots(group, slots, preds, pos, tokens, pred_known)
    minus_one = torch.full_like(pos, -1)
    _append_violations(counters, ring, reason != 0, [
        reason | (group_index << fp.GROUP_SHIFT), slots, pos, minus_one, minus_one, stored, expected,
        counters[fp.C_FORWARD_INDEX],
    ])
    counters[fp.C_SLOTS_SWEPT] += slots.numel()


def launch_write(group, view, req_to_token, counters, ring, bump_forward: bool, block: int = 0,
                 group_index: int = 0, check_fed: bool = True, token_oracle=None) -> None:
    del block  # grid shape is a Triton concern
    bs = view.batch_size
    device = group.records.device
    if bs:
        rows = view.req_pool_indices[:bs].to(torch.int64)
        n = view.new_lens[:bs].to(torch.int64)
        starts = view.new_starts[:bs].to(torch.int64)
        seq = view.seq_lens[:bs].to(torch.int64)
        p0 = seq - n
        req_of = torch.repeat_interleave(torch.arange(bs, device=device), n.clamp(min=0))
        k = torch.arange(req_of.numel(), device=device) - (torch.cumsum(n.clamp(min=0), 0) - n.clamp(min=0))[req_of]
        tok_index = starts[req_of] + k
        tok = view.input_ids[tok_index].to(torch.int64)
        pos = p0[req_of] + k
        fed_pos = view.positions[tok_index].to(torch.int64)
        g = chain_term(tok, pos)
        # Segmented inclusive prefix sum of g per request.
        csum = torch.cumsum(g, 0)
        seg_start = torch.cumsum(n.clamp(min=0), 0) - n.clamp(min=0)
        if csum.numel():
            before = torch.where(seg_start > 0, csum[(seg_start - 1).clamp(min=0)], torch.zeros_like(seg_start))
        else:  # no new token in the batch (a speculative tree verify: its TAIL is deferred)
            before = torch.zeros_like(seg_start)
        raw_pred = translate(group, req_to_token[rows, (p0 - 1).clamp(min=0)])
        pred = torch.where((raw_pred > 0) & (raw_pred < group.num_slots), raw_pred, 0)
        carry = torch.where(p0 > 0, group.records[pred, fp.F_CHAIN], fp.CHAIN_ANCHOR)
        chain = carry[req_of] + (csum - before[req_of])
        slot = translate(group, view.out_cache_loc[tok_index])
        wm = (slot > 0) & (slot < group.num_slots) & (p0[req_of] >= 0)
        o = token_oracle
        want = None
        if o is not None:  # the request's own tokens (see triton_kernels._own_tokens)
            nt = o.next_token[rows[req_of]]
            if view.staged:
                staged = o.staged[tok_index + req_of]
                want = torch.where(staged >= 0, staged, nt)
            else:
                want = nt
        if check_fed:
            bad_pos = wm & (fed_pos != pos)
            reason = bad_pos * fp.R_POSITION
            stored, expected = fed_pos, pos
            if o is not None:
                bad_tok = wm & (tok != want)
                reason = reason | (bad_tok * fp.R_TOKEN)
                stored = torch.where(bad_pos, fed_pos, tok)
                expected = torch.where(bad_pos, pos, want)
            _append_violations(counters, ring, reason != 0, [
                reason.to(torch.int64) | (group_index << fp.GROUP_SHIFT), slot, pos, req_of.to(torch.int64),
                rows[req_of], stored, expected, counters[fp.C_CURRENT_FORWARD],
            ])
        if o is not None:
            first = wm & (k == 0)
            keep = torch.zeros(bs, dtype=torch.bool, device=device)
            keep[req_of[first]] = True
            if view.staged:
                after = (starts + torch.arange(bs, device=device) + n).clamp(max=o.staged.numel() - 1)
                keep &= o.staged[after] < 0
            o.next_rows[:bs] = torch.where(keep, rows, torch.full_like(rows, -1))
            o.sampled[:bs] = -1
            o.pending.fill_(bs)
            last = wm & (k == n[req_of] - 1)
            if check_fed:
                o.row_chain[rows[req_of[last]]] = chain[last]
            else:
                g_own = chain_term(want, pos)
                own_sum = torch.zeros(bs, dtype=torch.int64, device=device).index_add_(0, req_of, g_own)
                own = carry + own_sum
                o.row_chain[rows[req_of[last]]] = own[req_of[last]]
        slot, tok, fed_pos, chain = slot[wm], tok[wm], fed_pos[wm], chain[wm]
        live_hash = _live_hash(group, slot)
        group.records[slot, : fp.F_FULL_HASH] = torch.stack([tok, fed_pos, chain, live_hash], dim=1)
        if group.full_row is not None:  # the group keeps FULL_HASH (the scrub, all)
            group.records[slot, fp.F_FULL_HASH] = _full_hash(group, slot)
            # ``all``: unverified again (listed at its next read); else verified (HiCache: only loaded slots)
            group.full_row.tags[slot] = 0 if group.full_row.clear_tags else group.records[slot, fp.F_FULL_HASH]
        counters[fp.C_SLOTS_WRITTEN] += wm.sum()
    counters[fp.C_WRITE_LAUNCHES] += 1
    if bump_forward:
        counters[fp.C_FORWARD_INDEX] += 1


def launch_scrub(group, counters, ring, per_forward: int, group_index: int = 0, after_write: bool = False) -> None:
    span = group.num_slots - 1
    per_forward = min(per_forward, span) if group.full_row is not None else per_forward
    start = (int(counters[fp.C_FORWARD_INDEX]) - int(after_write)) * per_forward % span
    slots = 1 + (start + torch.arange(per_forward, device=group.records.device)) % span
    slots = slots[group.records[slots, fp.F_CHAIN] != 0]
    rec = group.records[slots]
    live = _full_hash(group, slots)
    bad = live != rec[:, fp.F_FULL_HASH]
    minus_two = torch.full_like(slots, -2)
    _append_violations(counters, ring, bad, [
        bad.to(torch.int64) * fp.R_KV_HASH | (group_index << fp.GROUP_SHIFT), slots, rec[:, fp.F_POSITION],
        minus_two, minus_two, rec[:, fp.F_FULL_HASH], live, counters[fp.C_FORWARD_INDEX] - int(after_write),
    ])
    counters[fp.C_SLOTS_SCRUBBED] += slots.numel()


def launch_index_sweep(group, index, counters, ring, group_index: int = 0) -> None:
    """The cached-slot index sweep (``index_sweep.launch_index_sweep``'s twin): compacts the held slots (syncs)."""
    from ..views import SweepEntries

    slots = index.held.nonzero().flatten().to(torch.int64)
    preds = index.pred[slots].to(torch.int64)
    positions = index.position[slots].to(torch.int64)
    tokens = index.token[slots].to(torch.int64)
    if group.slot_map is not None:  # engine slots -> the group's; only where the mapping is live
        group_slots = translate(group, slots)
        live = group_slots > 0
        group_slots, preds, positions, tokens = group_slots[live], preds[live], positions[live], tokens[live]
        preds = torch.where(positions > 0, translate(group, preds), 0)
        _sweep_entries(group, SweepEntries(slots=group_slots, preds=preds, positions=positions, tokens=tokens),
                       counters, ring, group_index=group_index, pred_known=(positions == 0) | (preds > 0))
        return
    entries = SweepEntries(slots=slots, preds=preds, positions=positions, tokens=tokens)
    _sweep_entries(group, entries, counters, ring, group_index=group_index)


def _witness_targets(group, view):
    """(lane index, group slot) of every stamped lane of ``view.out_cache_loc`` (``witness`` module)."""
    slots = translate(group, view.out_cache_loc[: view.store_lanes])
    lanes = ((slots > 0) & (slots < group.num_slots)).nonzero().flatten()
    return lanes, slots[lanes]


def _stamp_words(row) -> List[int]:
    """The words of a row the stamp covers: ``STAMP_WORDS`` at each end (the ends overlap in rows of < 4 words)."""
    return sorted({*range(STAMP_WORDS), *range(row.words - STAMP_WORDS, row.words)})


def launch_witness_stamp(group, view, group_index: int = 0) -> None:
    """The write witness's HEAD stamp (``witness.launch_stamp``'s twin)."""
    del group_index
    _, slots = _witness_targets(group, view)
    for r in group.rows:
        for w in _stamp_words(r):
            r.view[slots, w] = group.witness_stamp


def launch_witness_check(group, view, counters, ring, group_index: int = 0) -> None:
    """The write witness's TAIL check (``witness.launch_check``'s twin): one ``unwritten`` row per stamped slot."""
    lanes, slots = _witness_targets(group, view)
    if group.rows:
        stamp = group.witness_stamp
        stamped = torch.stack([(r.view[:, :STAMP_WORDS][slots] == stamp).all(dim=1)
                               | (r.view[:, r.words - STAMP_WORDS: r.words][slots] == stamp).all(dim=1)
                               for r in group.rows], dim=1)
    else:
        stamped = torch.zeros((slots.numel(), 1), dtype=torch.bool, device=slots.device)
    n_bad = stamped.sum(dim=1).to(torch.int64)
    bad = n_bad > 0
    first_bad = torch.where(bad, stamped.to(torch.int64).argmax(dim=1), 1 << 30)
    bs = view.batch_size
    which = torch.full_like(lanes, -1)
    bs = min(bs, int(view.new_starts.shape[0]), int(view.new_lens.shape[0]))
    for i in range(bs if bool(bad.any()) else 0):  # the request whose new run holds each lane
        s, n = int(view.new_starts[i]), int(view.new_lens[i])
        which = torch.where((lanes >= s) & (lanes < s + n), i, which)
    found = which >= 0
    i_safe = which.clamp(min=0)
    row = torch.where(found, view.req_pool_indices[i_safe].to(torch.int64), -1)
    p0 = view.seq_lens[i_safe].to(torch.int64) - view.new_lens[i_safe].to(torch.int64)
    pos = torch.where(found, p0 + lanes - view.new_starts[i_safe].to(torch.int64),
                      view.positions[lanes].to(torch.int64))
    _append_violations(counters, ring, bad, [
        torch.full_like(slots, fp.R_UNWRITTEN | (group_index << fp.GROUP_SHIFT)), slots, pos, which, row,
        first_bad, n_bad, counters[fp.C_CURRENT_FORWARD],
    ])
    counters[fp.C_SLOTS_WITNESSED] += slots.numel()
