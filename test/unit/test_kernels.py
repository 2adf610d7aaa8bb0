"""Triton kernels against the torch reference on random pools.

On CPU the Triton kernels run under TRITON_INTERPRET=1; on a GPU host (CUDA
available and TRITON_INTERPRET unset or 0) the same tests run compiled kernels on
CUDA tensors, plus a CUDA-graph capture/replay test. The scenario drives real forwards through both backends on identical pools:
chunked prefill of several requests, two of which share a prefix (the second
reuses the first's slots, as the radix cache does), then decode steps; then
corruptions of each kind, and checks both backends report the same violations.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

import pytest  # noqa: E402

from kv_canary import fingerprint as fp
from kv_canary.config import CanaryConfig, RealData
from kv_canary.token_oracle import TokenOracle
from kv_canary.kernels import reference as ref
from kv_canary.kernels import triton_kernels as tk
from kv_canary.views import CanaryCapacityError, ForwardView
from kv_canary.buffer_groups import PoolLayout, build_group

NUM_SLOTS = 600
CTX = 160
LAYERS = 3


class Sim:
    """A tiny KV pool + req_to_token + a slot allocator, driven like sglang does."""

    def __init__(self, backend, seed=0, hash_layers=(0,), hash_bytes=16, with_v=True, real_data=RealData.PARTIAL,
                 full_hash=False, check_fed=True):
        self.check_fed = check_fed
        g = torch.Generator().manual_seed(seed)
        self.backend = backend
        self.k = [torch.randn(NUM_SLOTS, 2, 8, generator=g).to(DEVICE) for _ in range(LAYERS)]
        self.v = [torch.randn(NUM_SLOTS, 2, 8, generator=g).to(DEVICE) for _ in range(LAYERS)] if with_v else None
        config = CanaryConfig(kv_hash_layers=hash_layers, kv_hash_bytes=hash_bytes, real_data=real_data,
                              scrub_slots_per_forward=64 if full_hash else 0)  # full_hash: TAIL keeps FULL_HASH
        self.group = build_group(PoolLayout("full", self.k, self.v), config, DEVICE)
        self.r2t = torch.zeros(8, CTX, dtype=torch.int32, device=DEVICE)
        self.oracle = TokenOracle(rows=8, max_batch_size=8, max_tokens_per_forward=2 * CTX, device=DEVICE,
                                  check_fed=check_fed)
        self.own = {}  # row -> the request's own tokens (the scheduler's record: prompt + sampled ids)
        self.keys = {}  # row -> admission key (a new one: a new request in the row)
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
        self.counters[fp.C_REPORT_ENABLED] = 1
        self.ring = torch.zeros(256, fp.RING_WIDTH, dtype=torch.int64, device=DEVICE)
        self.next_slot = 1
        self.rng = torch.Generator().manual_seed(seed + 1)

    def alloc(self, n):
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return slots

    def admit(self, row, tokens=()):
        """A new request in ``row`` whose own tokens start with ``tokens`` (its cached prefix, say)."""
        self.own[row] = list(tokens)
        self.keys[row] = (row, self.keys.get(row, (row, 0))[1] + 1)

    def sample(self, toks):
        """The engine sampled ``toks`` (batch order of the last forward): the sample hook's copy."""
        self.oracle.record_sampled(torch.tensor(toks, dtype=torch.int32, device=DEVICE))

    def forward(self, reqs, position_shift=0, fed=None, decode=False, unfinished=()):
        """reqs: list of (row, prefix_len, new_token_ids). Fills KV for new tokens, then TAIL-writes.

        The new tokens are the requests' own (the scheduler's record) unless ``fed`` gives other ids
        to feed; the model runs at positions + ``position_shift``. An extend forward (default) stages
        the record in the token oracle; a ``decode`` one expects each request's sampled token (``sample``
        after the previous forward). Rows in ``unfinished`` have more prompt after this chunk.
        """
        ids, locs, rows, seqs, starts, lens, pos = [], [], [], [], [], [], []
        fed_requests = []
        for row, prefix, toks in reqs:
            if row not in self.keys:
                self.admit(row)
            own = self.own[row]
            del own[prefix:]
            own += list(toks)
            if row in unfinished:
                own.append(1)  # the record already holds the next prompt token
            fed_requests.append((row, self.keys[row], prefix, len(toks),
                                 lambda o=list(own): (o, [])))
            slots = self.alloc(len(toks))
            self.r2t[row, prefix : prefix + len(toks)] = slots.to(torch.int32).to(DEVICE)
            starts.append(len(ids))
            pos += [prefix + k + position_shift for k in range(len(toks))]
            ids += toks
            locs += slots.tolist()
            rows.append(row)
            seqs.append(prefix + len(toks))
            lens.append(len(toks))
        view = ForwardView(
            input_ids=torch.tensor(fed if fed is not None else ids, dtype=torch.int64, device=DEVICE),
            positions=torch.tensor(pos, dtype=torch.int64, device=DEVICE),
            out_cache_loc=torch.tensor(locs, dtype=torch.int64, device=DEVICE),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
            seq_lens=torch.tensor(seqs, dtype=torch.int64, device=DEVICE),
            new_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            new_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            batch_size=len(reqs),
            max_new_len=max(lens),
            staged=not decode,
        )
        if not decode:
            self.oracle.stage(fed_requests)
        self.backend.launch_verify(self.group, view, self.r2t, self.counters, self.ring, 2, 16,
                                   token_oracle=self.oracle)
        # "attention" writes K/V of the new slots
        for layer in range(LAYERS):
            loc = view.out_cache_loc
            self.k[layer][loc] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
            if self.v is not None:
                self.v[layer][loc] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
        self.backend.launch_write(self.group, view, self.r2t, self.counters, self.ring, True, block=16,
                                  check_fed=self.check_fed, token_oracle=self.oracle)
        for row in unfinished:
            self.own[row].pop()
        return view

    def new_violations(self, before):
        n = int(self.counters[fp.C_VIOLATIONS]) - before
        return sorted(tuple(self.ring[(before + i) % self.ring.shape[0]].tolist()) for i in range(n))

    def verify_all(self, reqs):
        """reqs: list of (row, length): HEAD-verify positions [0, length) (as a decode forward would)."""
        view = ForwardView(
            input_ids=torch.zeros(len(reqs), dtype=torch.int64, device=DEVICE),
            positions=torch.tensor([n for _, n in reqs], dtype=torch.int64, device=DEVICE),
            out_cache_loc=torch.zeros(len(reqs), dtype=torch.int64, device=DEVICE),
            req_pool_indices=torch.tensor([r for r, _ in reqs], dtype=torch.int64, device=DEVICE),
            seq_lens=torch.tensor([n + 1 for _, n in reqs], dtype=torch.int64, device=DEVICE),
            new_starts=torch.arange(len(reqs), dtype=torch.int64, device=DEVICE),
            new_lens=torch.ones(len(reqs), dtype=torch.int64, device=DEVICE),
            batch_size=len(reqs),
            max_new_len=1,
        )
        before = int(self.counters[fp.C_VIOLATIONS])
        self.backend.launch_verify(self.group, view, self.r2t, self.counters, self.ring, 3, 16,
                                   token_oracle=self.oracle)
        return self.new_violations(before)


def _scenario(sim: Sim):
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(1, 500, (n,), generator=g).tolist()  # noqa: E731
    shared = tok(40)
    # chunked prefill: row 1 gets 40 + 50 tokens in two chunks, row 2 a 70-token prompt in one
    sim.forward([(1, 0, shared), (2, 0, tok(70))])
    sim.forward([(1, 40, tok(50)), (3, 0, tok(33))])
    # row 4 shares row 1's first 40 slots (a radix hit), then extends with its own tokens
    sim.r2t[4, :40] = sim.r2t[1, :40]
    sim.admit(4, sim.own[1][:40])  # the new request's own prompt starts like row 1's (admission: the chain)
    sim.forward([(4, 40, tok(37))])
    # decode steps for everybody: a mixed batch (staged), then decode forwards fed the sampled tokens
    toks = [tok(1) for _ in range(3)]
    sim.forward([(1, 90, toks[0]), (2, 70, toks[1]), (4, 77, toks[2])])
    for step in range(1, 3):
        toks = [tok(1) for _ in range(3)]
        sim.sample([t[0] for t in toks])
        sim.forward([(1, 90 + step, toks[0]), (2, 70 + step, toks[1]), (4, 77 + step, toks[2])], decode=True)
    return {1: 93, 2: 73, 3: 33, 4: 80}


# the straight-line hash (few_sources > 0): (0,) 16 (the default: K and V, 4 words), (0, 1) 8 (4 sources),
# (1,) 12 (3 words in a 4-word tile); the looping hash: (0, 2) 32, (1,) 64
@pytest.mark.parametrize("hash_layers,hash_bytes,with_v", [((0,), 16, True), ((0, 2), 32, True), ((1,), 64, False),
                                                           ((0, 1), 8, True), ((1,), 12, False)])
def test_triton_matches_reference_clean_then_corrupted(hash_layers, hash_bytes, with_v):
    sims = [Sim(tk, hash_layers=hash_layers, hash_bytes=hash_bytes, with_v=with_v),
            Sim(ref, hash_layers=hash_layers, hash_bytes=hash_bytes, with_v=with_v)]
    lengths = [_scenario(s) for s in sims][0]
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    assert int(sims[0].counters[fp.C_SLOTS_WRITTEN]) == int(sims[1].counters[fp.C_SLOTS_WRITTEN]) > 0
    everyone = list(lengths.items())
    assert [s.verify_all(everyone) for s in sims] == [[], []]
    assert int(sims[0].counters[fp.C_SLOTS_VERIFIED]) == int(sims[1].counters[fp.C_SLOTS_VERIFIED])

    layer = hash_layers[0]
    for s in sims:
        # kv_hash: flip one bit in the hashed bytes of row 2, position 10
        s.group.sources[0].view[int(s.r2t[2, 10]), 0] ^= 1 << 5
        # chain/position: row 3 position 5 now points at row 2's slot of position 5
        s.r2t[3, 5] = s.r2t[2, 5]
        # slot: row 1 position 60 points at the padding slot
        s.r2t[1, 60] = 0
    found = [s.verify_all(everyone) for s in sims]
    assert found[0] == found[1]
    by_reason = {}
    for row in found[0]:
        by_reason.setdefault((row[fp.V_ROW], row[fp.V_POSITION]), 0)
        by_reason[(row[fp.V_ROW], row[fp.V_POSITION])] |= row[fp.V_REASON]
    assert by_reason[(2, 10)] == fp.R_KV_HASH
    assert by_reason[(3, 5)] & fp.R_CHAIN  # same position, foreign prefix
    assert by_reason[(3, 6)] == fp.R_CHAIN  # successor's link to the foreign slot
    assert by_reason[(1, 60)] == fp.R_SLOT
    assert by_reason[(1, 61)] == fp.R_CHAIN
    # row 4 shares row 1's prefix slots, but not position 60: clean
    assert all(r != 4 for r, _ in by_reason)
    assert layer in hash_layers


def test_few_sources_picks_the_straight_line_hash_only_for_few_short_sources():
    def group(layers=(0,), hash_bytes=16, with_v=True, real_data=RealData.PARTIAL):
        return Sim(tk, hash_layers=layers, hash_bytes=hash_bytes, with_v=with_v, real_data=real_data).group

    assert tk.few_sources(group()) == 2 and tk.verify_warps(group(), 256) == 8  # the default: K and V of layer 0
    assert tk.few_sources(group((0, 1), 8)) == 4 and tk.hash_word_tile(group((0, 1), 8)) == 2
    assert tk.few_sources(group((1,), 12, with_v=False)) == 1 and tk.hash_word_tile(group((1,), 12, False)) == 4
    assert tk.few_sources(group((0, 2), 32)) == 0  # 4 sources x 8 words: the loops
    assert tk.few_sources(group((1,), 64, with_v=False)) == 0  # 16 words
    # all: every read checks the window the straight-line way; every byte goes through kernels/full_row.py
    assert tk.few_sources(group(real_data=RealData.ALL)) == 2 and tk.verify_warps(group(real_data=RealData.ALL), 256) == 8
    assert tk.few_sources(group(real_data=RealData.NONE)) == 0  # nothing hashed
    assert tk.verify_warps(group(), 16) == 4


@pytest.mark.parametrize("backend", [tk, ref], ids=["triton", "torch"])
def test_head_scatters_more_pending_samples_than_one_block(backend):
    """HEAD lands the first block of pending samples and then the rest (40 entries, 16 lanes a block)."""
    o = TokenOracle(rows=64, max_batch_size=40, max_tokens_per_forward=40, device=DEVICE)
    sim = Sim(backend)
    sim.oracle = o
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:40].to(DEVICE)
    o.next_rows[:] = torch.where(torch.arange(40, device=DEVICE) % 7 == 3, -1, rows)  # some padding rows
    o.sampled[:] = torch.arange(1000, 1040, device=DEVICE)
    o.sampled[17] = -1  # a request that sampled nothing
    o.pending[0] = 40
    before = o.next_token.clone()
    view = ForwardView(
        input_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE), positions=torch.zeros(1, dtype=torch.int64,
                                                                                         device=DEVICE),
        out_cache_loc=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.ones(1, dtype=torch.int64, device=DEVICE), new_starts=torch.zeros(1, dtype=torch.int64,
                                                                                          device=DEVICE),
        new_lens=torch.ones(1, dtype=torch.int64, device=DEVICE), batch_size=1, max_new_len=1)
    backend.launch_verify(sim.group, view, sim.r2t, sim.counters, sim.ring, 2, 16, token_oracle=o)
    want = before.clone()
    for e in range(40):
        r, t = int(o.next_rows[e]), int(o.sampled[e])
        if r >= 0 and t >= 0:
            want[r] = t
    assert torch.equal(o.next_token, want) and int((o.next_token != before).sum()) == 34


def test_shared_prefix_verifies_for_every_sharer():
    sim = Sim(tk)
    lengths = _scenario(sim)
    assert torch.equal(sim.r2t[4, :40], sim.r2t[1, :40])
    assert sim.verify_all([(4, lengths[4]), (1, lengths[1])]) == []


def test_position_shift_is_detected():
    sim = Sim(tk)
    _scenario(sim)
    # row 2 reads its slots shifted by one position (positions 20..29 point one slot later)
    sim.r2t[2, 20:30] = sim.r2t[2, 21:31].clone()
    found = sim.verify_all([(2, 73)])
    positions = sorted({r[fp.V_POSITION] for r in found})
    assert positions[:10] == list(range(20, 30))
    assert all(r[fp.V_REASON] & fp.R_POSITION for r in found if 20 <= r[fp.V_POSITION] < 30)


def test_foreign_prefix_with_consistent_chain_fails_the_token_check():
    """A radix hit on the wrong prompt: the slots are self-consistent, only the token check sees it.

    Request 4 is admitted with a cached prefix of 80 slots whose tokens are not its own at position 10:
    the last read slot's chain is not the chain of its own tokens (reported once, at the last read
    position, stored/expected = the two chains); its TAIL continues from the recorded chain.
    """
    sims = [Sim(tk), Sim(ref)]
    for s in sims:
        lengths = _scenario(s)
        own = list(s.own[4][:80])
        own[10] += 1  # request 4's own prompt differs from the cached prefix at position 10
        s.oracle.init_row(4, own, [0])  # admitted with 80 cached positions (chain set by the host)
        s.oracle.stage([])
    found = [s.verify_all(list(lengths.items())) for s in sims]
    assert found[0] == found[1]
    assert [(r[fp.V_ROW], r[fp.V_POSITION], r[fp.V_REASON]) for r in found[0]] == [(4, 79, fp.R_TOKEN)]
    row = found[0][0]
    s = sims[0]
    assert row[fp.V_STORED] == int(s.group.records[int(s.r2t[4, 79]), fp.F_CHAIN])
    assert row[fp.V_EXPECTED] == fp.prefix_chains_np([own])[0] != row[fp.V_STORED]
    # request 4's next forward (fed its own token): its HEAD reads the same prefix (the same violation,
    # a repeat the host counts); its TAIL continues from the recorded chain, so the reads after it are clean
    for s in sims:
        before = int(s.counters[fp.C_VIOLATIONS])
        s.own[4] = own + [0]
        s.forward([(4, 80, [0])], decode=True)
        repeat = s.new_violations(before)
        assert [r[:3] + r[5:7] for r in repeat] == [row[:3] + row[5:7]]
        assert s.verify_all([(4, 81)]) == []


def test_report_disabled_counts_nothing():
    sim = Sim(tk)
    lengths = _scenario(sim)
    sim.group.sources[0].view[int(sim.r2t[2, 3]), 0] ^= 1
    sim.counters[fp.C_REPORT_ENABLED] = 0
    assert sim.verify_all(list(lengths.items())) == []
    sim.counters[fp.C_REPORT_ENABLED] = 1
    assert len(sim.verify_all(list(lengths.items()))) == 1


def test_long_chunk_written_by_several_blocks_matches_reference():
    sims = [Sim(tk), Sim(ref)]
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(1, 500, (150,), generator=g).tolist()
    for s in sims:
        s.forward([(5, 0, toks[:17]), (6, 0, toks[:3])])
        s.forward([(5, 17, toks[17:150]), (6, 3, toks[3:4])])  # 133 new tokens: 9 blocks of 16
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    assert sims[0].verify_all([(5, 150), (6, 4)]) == []


@pytest.mark.parametrize("with_v", [True, False])
def test_real_data_all_matches_reference_and_catches_a_flip_anywhere(with_v):
    """all: a byte in the middle of the last layer's K row, flipped between the write and the first read, is
    caught by that first read (every byte); a flip after it by the scrub within its bound; partial misses both."""
    sims = [Sim(tk, with_v=with_v, real_data=RealData.ALL), Sim(ref, with_v=with_v, real_data=RealData.ALL),
            Sim(tk, with_v=with_v)]
    lengths = [_scenario(s) for s in sims][0]
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    everyone = list(lengths.items())
    for s in sims:  # row 3 was never read yet (a one-chunk prompt): its slots are unverified
        last_k = [r for r in s.group.rows if r.half == "k"][-1]
        assert last_k.layer == LAYERS - 1
        last_k.view[int(s.r2t[3, 10]), last_k.row_words // 2] ^= 1 << 12
    found = [s.verify_all(everyone) for s in sims]
    assert found[0] == found[1]
    assert [(r[fp.V_ROW], r[fp.V_POSITION], r[fp.V_REASON]) for r in found[0]] == [(3, 10, fp.R_KV_HASH)]
    assert found[2] == []  # partial: the flip is outside layer 0's first 16 bytes (documented miss)
    assert [s.verify_all(everyone) for s in sims] == [[], [], []]  # verified once: later reads check the window
    for s in sims:  # a flip in a slot already verified: the scrub's round-robin finds it
        last_v = [r for r in s.group.rows][-1]
        last_v.view[int(s.r2t[2, 20]), 1] ^= 1 << 3
    assert [s.verify_all(everyone) for s in sims] == [[], [], []]
    bound = -(-(NUM_SLOTS - 1) // 64)
    for s in sims[:2]:
        found = []
        for _ in range(bound):
            before = int(s.counters[fp.C_VIOLATIONS])
            s.backend.launch_scrub(s.group, s.counters, s.ring, 64)
            s.counters[fp.C_FORWARD_INDEX] += 1
            found += s.new_violations(before)
        assert sorted((r[fp.V_SLOT], r[fp.V_BATCH_INDEX]) for r in found) == sorted(
            [(int(s.r2t[2, 20]), -2), (int(s.r2t[3, 10]), -2)])


def test_real_data_none_hashes_nothing_but_checks_the_rest():
    sims = [Sim(tk, real_data=RealData.NONE), Sim(ref, real_data=RealData.NONE)]
    lengths = [_scenario(s) for s in sims][0]
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    for s in sims:
        s.k[0][int(s.r2t[2, 10])] += 1.0  # K bytes: not hashed
        s.r2t[3, 5] = s.r2t[2, 5]  # a foreign slot: still caught by position/chain
    found = [s.verify_all(list(lengths.items())) for s in sims]
    assert found[0] == found[1]
    assert {(r[fp.V_ROW], r[fp.V_POSITION]) for r in found[0]} == {(3, 5), (3, 6)}


def test_tail_records_the_fed_positions_and_flags_a_shift_at_once():
    sims = [Sim(tk), Sim(ref)]
    lengths = [_scenario(s) for s in sims][0]
    rows = [1, 2]
    found = []
    for s in sims:
        before = int(s.counters[fp.C_VIOLATIONS])
        s.forward([(r, lengths[r], [7]) for r in rows], position_shift=1)  # one decode at positions + 1
        found.append(s.new_violations(before))
    assert found[0] == found[1]
    assert [(r[fp.V_ROW], r[fp.V_POSITION], r[fp.V_REASON], r[fp.V_STORED], r[fp.V_EXPECTED]) for r in found[0]] == [
        (row, lengths[row], fp.R_POSITION, lengths[row] + 1, lengths[row]) for row in rows]
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    slot = int(sims[0].r2t[1, lengths[1]])
    assert int(sims[0].group.records[slot, fp.F_POSITION]) == lengths[1] + 1  # what RoPE used, not the layout
    # ... and HEAD of the next forward that reads it flags it again (same slot, position, values).
    again = sims[0].verify_all([(1, lengths[1] + 1)])
    assert [(r[fp.V_POSITION], r[fp.V_REASON]) for r in again] == [(lengths[1], fp.R_POSITION)]


@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_tail_flags_a_fed_token_that_is_not_the_requests_own(decode):
    """Extend: the staged record; decode: the sampled token (the sample hook's copy, scattered by HEAD)."""
    sims = [Sim(tk), Sim(ref)]
    lengths = [_scenario(s) for s in sims][0]
    found = []
    for s in sims:
        before = int(s.counters[fp.C_VIOLATIONS])
        rows = [(1, lengths[1], [11]), (2, lengths[2], [12]), (4, lengths[4], [14])]
        if decode:
            s.sample([11, 12, 14])  # the last forward's batch: rows 1, 2, 4
        s.forward(rows, fed=[11, 13, 14], decode=decode)  # request 2 is fed 13, not 12
        found.append(s.new_violations(before))
    assert found[0] == found[1]
    assert [(r[fp.V_BATCH_INDEX], r[fp.V_ROW], r[fp.V_POSITION], r[fp.V_REASON], r[fp.V_STORED], r[fp.V_EXPECTED])
            for r in found[0]] == [(1, 2, lengths[2], fp.R_TOKEN, 13, 12)]
    # reported by the forward that fed it, not again by the reads after it
    assert [s.verify_all([(r, n + 1) for r, n in lengths.items() if r != 3]) for s in sims] == [[], []]


def test_without_the_fed_check_the_next_read_flags_a_wrong_fed_token_once():
    """ENABLE_WRITE_INPUT_ASSERT=0, VERIFY_TOKEN_ASSERT=1: the row chain follows the request's own tokens."""
    sims = [Sim(tk, check_fed=False), Sim(ref, check_fed=False)]
    lengths = [_scenario(s) for s in sims][0]
    found = []
    for s in sims:
        before = int(s.counters[fp.C_VIOLATIONS])
        s.sample([11, 12, 14])
        s.forward([(1, lengths[1], [11]), (2, lengths[2], [12]), (4, lengths[4], [14])], fed=[11, 13, 14],
                  decode=True)
        assert s.new_violations(before) == []  # not checked when fed
        found.append(s.verify_all([(r, n + 1) for r, n in lengths.items() if r != 3]))
        # the next forward's HEAD reads it again (the same violation: a repeat); its TAIL continues from the
        # recorded chain, so later reads are clean
        before = int(s.counters[fp.C_VIOLATIONS])
        s.sample([21, 22, 24])
        s.forward([(1, lengths[1] + 1, [21]), (2, lengths[2] + 1, [22]), (4, lengths[4] + 1, [24])], decode=True)
        assert [r[:3] + r[5:7] for r in s.new_violations(before)] == [r[:3] + r[5:7] for r in found[-1]]
        assert s.verify_all([(r, n + 2) for r, n in lengths.items() if r != 3]) == []
    assert found[0] == found[1]
    assert [(r[fp.V_ROW], r[fp.V_POSITION], r[fp.V_REASON]) for r in found[0]] == [(2, lengths[2], fp.R_TOKEN)]


@pytest.mark.parametrize("backend", [tk, ref], ids=["triton", "torch"])
def test_sampled_tokens_become_the_next_expected_tokens(backend):
    sim = Sim(backend)
    lengths = _scenario(sim)
    o = sim.oracle
    # The last TAIL (decode of rows 1, 2, 4) announced where each request's next token goes.
    assert o.next_rows[:3].tolist() == [1, 2, 4] and int(o.pending) == 3 and o.sampled[:3].tolist() == [-1] * 3
    sim.sample([101, 102, 104])  # the sample hook: one copy, nothing scattered yet
    assert o.sampled[:3].tolist() == [101, 102, 104]
    assert sim.verify_all([(3, 33)]) == []  # the next HEAD scatters them
    assert [int(o.next_token[r]) for r in (1, 2, 4)] == [101, 102, 104]
    # an unfinished chunk (its record holds the next prompt token): the sample after it is thrown away
    sim.forward([(5, 0, [7, 8, 9]), (6, 0, [3])], unfinished={5})
    assert o.next_rows[:2].tolist() == [-1, 6]
    sim.sample([55, 66])
    assert sim.verify_all([(3, 33)]) == []
    assert int(o.next_token[5]) == 0 and int(o.next_token[6]) == 66
    # a forward that sampled nothing scatters nothing
    sim.forward([(6, 1, [66])], decode=True)
    assert sim.verify_all([(3, 33)]) == [] and int(o.next_token[6]) == 66


def test_token_oracle_leaves_the_fed_tokens_for_the_tail_and_admits_now():
    """``stage(fed_later=True)``: the admissions' chains now (HEAD's verify reads them), the fed tokens at
    ``stage_fed`` (the TAIL's write reads them): the same device state and remembered chains as in one step."""
    prompt = list(range(100, 180))

    def run(fed_later):
        oracle = TokenOracle(rows=6, max_batch_size=4, max_tokens_per_forward=128, device=DEVICE)
        reqs = [(2, "a", 40, 40, lambda: (prompt, [])), (3, "b", 0, 33, lambda: (prompt[:33], [7]))]
        assert oracle.stage(reqs, fed_later=fed_later) == 1
        assert int(oracle.row_chain[2]) == fp.prefix_chains_np([prompt[:40]])[0]
        before = oracle.staged[:75].tolist()
        assert oracle.fed_unstaged == fed_later
        oracle.stage_fed()
        assert not oracle.fed_unstaged
        oracle.stage_fed()  # nothing left: nothing staged twice
        oracle.remember_fed()
        return before, oracle.staged[:75].tolist(), sorted(oracle._chain_cache)

    before, later, remembered = run(True)
    _, now, remembered_now = run(False)
    assert before == [-1] * 75  # nothing staged before the TAIL
    assert later == now == prompt[40:80] + [-1] + prompt[:33] + [7]
    assert remembered == remembered_now == [33, 80]  # both fed prompts, their chains from the right bases


def test_token_oracle_stages_the_fed_tokens_and_admits_a_request_once():
    oracle = TokenOracle(rows=4, max_batch_size=4, max_tokens_per_forward=16, device=DEVICE)
    # request a in row 2: 3 prompt tokens cached, fed the 4th and its first output
    assert oracle.stage([(2, "a", 3, 2, lambda: ([5, 6, 7, 8], [9]))]) == 1
    assert oracle.staged[:3].tolist() == [8, 9, -1]  # fed tokens, then the record's next one (unknown)
    assert int(oracle.row_chain[2]) == fp.prefix_chains_np([[5, 6, 7]])[0]
    # a continuation of the same request keeps the device chain; a new owner of the row is admitted
    oracle.row_chain[2] = 1234
    assert oracle.stage([(2, "a", 5, 1, lambda: ([5, 6, 7, 8], [9]))]) == 0
    assert int(oracle.row_chain[2]) == 1234 and oracle.staged[:2].tolist() == [-1, -1]  # not in the record yet
    assert oracle.stage([(2, "b", 2, 2, lambda: ([1, 2, 3, 4, 5], [])), (1, "c", 0, 1, lambda: ([7], []))]) == 1
    assert oracle.staged[:5].tolist() == [3, 4, 5, 7, -1]  # b's chunk is unfinished: the record has token 4
    assert int(oracle.row_chain[2]) == fp.prefix_chains_np([[1, 2]])[0]
    from kv_canary.views import CanaryCapacityError

    with pytest.raises(CanaryCapacityError, match="token oracle holds 16 tokens"):
        oracle.stage([(3, "d", 0, 17, lambda: (list(range(17)), []))])
    # PD: a request that arrived with its KV: chain over what the row holds, its next fed token
    oracle.init_row(3, [4, 5, 6], [7, 8])
    oracle.stage([])
    assert int(oracle.row_chain[3]) == fp.prefix_chains_np([[4, 5, 6, 7]])[0] and int(oracle.next_token[3]) == 8


def test_admissions_sharing_a_prefix_get_exact_chains_from_the_cache(monkeypatch):
    from kv_canary import token_oracle

    monkeypatch.setattr(token_oracle, "CHAIN_CACHE_TOKENS", 8)
    oracle = TokenOracle(rows=6, max_batch_size=6, max_tokens_per_forward=16, device=DEVICE)
    shared, other = [3, 1, 4, 1, 5], [3, 1, 4, 1, 6]
    reqs = [(1, "a", 5, 1, lambda: (shared + [9], [])), (2, "b", 5, 1, lambda: (other + [9], [])),
            (3, "c", 5, 1, lambda: (shared + [8], [])), (4, "d", 4, 1, lambda: (shared, []))]
    for round_ in range(2):  # the second round hits (or, past the cache's bound, recomputes) every prefix
        assert oracle.stage([(r, (k, round_), p, n, rec) for r, k, p, n, rec in reqs]) == 4
        want = fp.prefix_chains_np([shared, other, shared, shared[:4]])
        assert [int(oracle.row_chain[r]) for r in (1, 2, 3, 4)] == want
        assert oracle._cached_tokens <= 8 or len(oracle._chain_order) == 1


def test_chain_cache_tells_prefixes_of_one_length_apart(monkeypatch):
    """Remembered prefixes are looked up by length: each prefix of one length must still get its own chain, within
    one admission batch and across batches, and the cache keeps its entry bound (oldest out)."""
    from kv_canary import token_oracle

    monkeypatch.setattr(token_oracle, "CHAIN_CACHE_ENTRIES", 2)
    oracle = TokenOracle(rows=6, max_batch_size=6, max_tokens_per_forward=16, device=DEVICE)
    a, b, c, d = [3, 1, 4, 1, 5], [2, 7, 1, 8, 2], [3, 1, 4, 1, 5], [3, 1, 4, 1, 6]
    for round_ in range(3):
        reqs = [(1, ("a", round_), 5, 1, lambda: (a + [9], [])), (2, ("b", round_), 5, 1, lambda: (b + [9], [])),
                (3, ("c", round_), 5, 1, lambda: (c + [9], [])), (4, ("d", round_), 5, 1, lambda: (d + [8], []))]
        if round_ == 2:
            reqs = reqs[::-1]
        assert oracle.stage(reqs) == 4
        want = dict(zip((1, 2, 3, 4), fp.prefix_chains_np([a, b, c, d])))
        assert {r: int(oracle.row_chain[r]) for r in (1, 2, 3, 4)} == want
        assert len(oracle._chain_order) == 2 and oracle._cached_tokens == 10
        assert sum(len(same) for by_last in oracle._chain_cache.values() for same in by_last.values()) == 2


def test_admission_chains_extend_the_longest_remembered_prefix():
    """A multi-turn request's prefix extends a remembered one (the last turn's, a shared system prompt): its chain is
    the remembered chain plus the tokens after it, exactly the chain over all of it; a prefix that only looks like a
    remembered one at the checked tokens (first, middle, last) gets its own; an extension starts from the longest
    remembered prefix, not a shorter one."""
    g = torch.Generator().manual_seed(11)
    system = torch.randint(1, 150000, (40,), generator=g).tolist()
    turn = lambda n: torch.randint(1, 150000, (n,), generator=g).tolist()  # noqa: E731
    oracle = TokenOracle(rows=8, max_batch_size=8, max_tokens_per_forward=64, device=DEVICE)
    conv = [system + turn(7) for _ in range(3)]
    fake = list(system)
    fake[7] += 1  # neither first, middle nor last token of the system prompt: only the compare tells it apart
    prefixes = [system, *conv, fake]
    for round_ in range(3):
        reqs = [(r + 1, ("k", round_, r), len(p), 1, lambda p=p: (p + [5], [])) for r, p in enumerate(prefixes)]
        assert oracle.stage(reqs) == len(prefixes)
        assert [int(oracle.row_chain[r + 1]) for r in range(len(prefixes))] == fp.prefix_chains_np(prefixes)
        prefixes = [p + turn(5) for p in prefixes]  # the next turn: each prefix extended
    # every conversation's entries: its turns' prefixes, each found as the longest remembered one of the next
    assert oracle._longest_remembered(prefixes[1], sorted(oracle._chain_cache, reverse=True))[0] == len(prefixes[1]) - 5
    assert fp.prefix_chains_np([prefixes[1][6:]], starts=[6], bases=fp.prefix_chains_np([prefixes[1][:6]])) \
        == fp.prefix_chains_np([prefixes[1]])


def test_fed_prompts_are_remembered_for_the_next_turns_admission(monkeypatch):
    """After an admitted request's extend, ``remember_fed`` keeps the chain over its cached prefix and fed tokens: the
    next turn, whose cached prefix is this turn's prompt, is admitted without hashing it (only what follows), with
    the exact chain; a short extend or one whose tokens the record lacks is not remembered."""
    from kv_canary import token_oracle

    hashed = []
    real = token_oracle.prefix_chains_np

    def counting(prefixes, starts=None, bases=None):
        hashed.append(sum(len(p) for p in prefixes))
        return real(prefixes, starts=starts, bases=bases)

    monkeypatch.setattr(token_oracle, "prefix_chains_np", counting)
    g = torch.Generator().manual_seed(3)
    draw = lambda n: torch.randint(1, 150000, (n,), generator=g).tolist()  # noqa: E731
    oracle = TokenOracle(rows=8, max_batch_size=4, max_tokens_per_forward=2048, device=DEVICE)
    turn0 = [draw(300), draw(400)]
    assert oracle.stage([(1, "a0", 0, 300, lambda: (turn0[0], [])), (2, "b0", 0, 400, lambda: (turn0[1], []))]) == 0
    oracle.remember_fed()
    assert hashed == [700]  # the two prompts, from the staged tokens, after the launch
    turn1 = [turn0[0] + draw(260), turn0[1] + draw(10)]
    hashed.clear()
    assert oracle.stage([(3, "a1", 300, 260, lambda: (turn1[0], [7])), (4, "b1", 400, 10, lambda: (turn1[1], []))]) == 2
    assert hashed == []  # both cached prefixes were remembered: nothing hashed before the forward
    assert [int(oracle.row_chain[r]) for r in (3, 4)] == real(turn0)
    oracle.remember_fed()  # a1 (260 fed after a remembered prefix) is remembered, b1 (10 fed) is not
    assert hashed == [260]
    turn2 = [turn1[0] + [7] + draw(5), turn1[1] + draw(3)]
    hashed.clear()
    assert oracle.stage([(5, "a2", 560, 6, lambda: (turn2[0], [])), (6, "b2", 410, 3, lambda: (turn2[1], []))]) == 2
    assert hashed == [10]  # b2's 10 tokens after its remembered 400; a2's 560 remembered whole
    assert [int(oracle.row_chain[r]) for r in (5, 6)] == real([turn1[0], turn1[1]])
    # a request whose record does not hold its fed tokens yet is not remembered
    oracle.stage([(7, "c0", 0, 300, lambda: (draw(299), []))])
    oracle.remember_fed()
    assert len(oracle._chain_order) == 4  # turn0's two prompts, a1's prompt, b2's admitted prefix
    # a pending remember whose post-ops never ran is done by the next stage
    hashed.clear()
    again = draw(256)
    oracle.stage([(1, "d0", 0, 256, lambda: (again, []))])
    oracle.stage([(2, "e0", 256, 1, lambda: (again + [1], []))])
    assert hashed == [256] and int(oracle.row_chain[2]) == real([again])[0]
    # a chunked prefill: each chunk extends the last one's remembered chain, the whole prompt is remembered
    long = draw(500)
    oracle.stage([(3, "f0", 0, 300, lambda: (long, []))])
    oracle.remember_fed()
    oracle.stage([(3, "f0", 300, 200, lambda: (long, []))])
    oracle.remember_fed()
    hashed.clear()
    assert oracle.stage([(4, "f1", 500, 4, lambda: (long + draw(4), []))]) == 1
    assert hashed == [] and int(oracle.row_chain[4]) == real([long])[0]
    # a continuation after an unremembered chunk (another request's chain in the row) is not remembered
    other = draw(310)
    oracle.stage([(3, "g0", 0, 10, lambda: (other, []))])
    oracle.stage([(3, "g0", 10, 300, lambda: (other, []))])
    assert oracle._fed_pending == []


def test_an_admitted_prefix_is_remembered_only_where_no_longer_fed_prompt_will_be():
    """A request admitted with a cached prefix and fed >= FED_REMEMBER_MIN_TOKENS has its fed prompt (which extends
    the prefix) remembered after its forward: its prefix is not remembered too (one entry a turn, not two); a prefix
    the batch admits twice (a shared system prompt) and one whose request feeds too few tokens are."""
    g = torch.Generator().manual_seed(5)
    draw = lambda n: torch.randint(1, 150000, (n,), generator=g).tolist()  # noqa: E731
    oracle = TokenOracle(rows=8, max_batch_size=8, max_tokens_per_forward=2048, device=DEVICE)
    own, shared, short = draw(100), draw(80), draw(60)
    a, b, c, d = own + draw(40), shared + draw(40), shared + draw(40), short + draw(3)
    reqs = [(1, "a", 100, 40, lambda: (a, [])), (2, "b", 80, 40, lambda: (b, [])),
            (3, "c", 80, 40, lambda: (c, [])), (4, "d", 60, 3, lambda: (d, []))]
    assert oracle.stage(reqs) == 4
    assert [int(oracle.row_chain[r]) for r in (1, 2, 3, 4)] == fp.prefix_chains_np([own, shared, shared, short])
    assert sorted(len(t) for t, _ in oracle._chain_order) == [60, 80]  # the shared and the short-fed prefixes
    oracle.remember_fed()
    assert sorted(len(t) for t, _ in oracle._chain_order) == [60, 80, 120, 120, 140]  # + the fed prompts
    assert oracle._longest_remembered(a + [9], sorted(oracle._chain_cache, reverse=True)) == \
        (140, fp.prefix_chains_np([a])[0])


def test_numpy_chain_twin_is_bit_equal_to_torch_and_to_the_records():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 2**31 - 1, (3000,), generator=g)
    tokens[:4] = torch.tensor([0, 1, 2**31 - 1, 151000])
    positions = torch.randint(0, 1 << 20, (3000,), generator=g)
    import numpy as np

    assert np.array_equal(fp.chain_terms_np(tokens.numpy(), positions.numpy()).view(np.int64),
                          fp.chain_term(tokens, positions).numpy())
    sims = [Sim(tk), Sim(ref)]
    for s in sims:
        lengths = _scenario(s)
        for row, n in lengths.items():
            want = fp.prefix_chains_np([s.own[row][:n]])[0]
            assert int(s.group.records[int(s.r2t[row, n - 1]), fp.F_CHAIN]) == want == int(s.oracle.row_chain[row])


def test_numpy_prefix_chains_extend_from_starts_and_bases_and_skip_empty_sequences():
    """prefix_chains_np's one vectorized pass: sequences of any length (empty ones too) at any start position, each
    extended from its base, equal the torch chain over the whole prefix."""
    g = torch.Generator().manual_seed(7)
    whole = [torch.randint(0, 2**31 - 1, (n,), generator=g) for n in (1, 0, 300, 65, 0, 1088)]

    def chain(tokens):  # CHAIN over positions [0, len): the anchor plus every term (int64, wrapping)
        if not tokens.numel():
            return fp.CHAIN_ANCHOR
        return int((torch.tensor(fp.CHAIN_ANCHOR) + fp.chain_term(tokens, torch.arange(tokens.numel())).sum()).item())

    want = [chain(t) for t in whole]
    assert fp.prefix_chains_np([t.tolist() for t in whole]) == want
    cuts = [0, 0, 123, 64, 0, 1000]
    bases = fp.prefix_chains_np([t[:c].tolist() for t, c in zip(whole, cuts)])
    rests = [t[c:].numpy() for t, c in zip(whole, cuts)]
    assert fp.prefix_chains_np(rests, starts=cuts, bases=bases) == want
    assert fp.prefix_chains_np([rests[3]], starts=[64], bases=[bases[3]]) == [want[3]]
    assert fp.prefix_chains_np([[], []]) == [fp.CHAIN_ANCHOR] * 2


def test_scrub_checks_every_byte_of_a_round_robin_window():
    """partial HEAD misses a flip in the last layer; the scrub (FULL_HASH) finds it within the stated bound."""
    sims = [Sim(tk, full_hash=True), Sim(ref, full_hash=True)]
    lengths = [_scenario(s) for s in sims][0]
    assert torch.equal(sims[0].group.records, sims[1].group.records)
    per_forward, span = 64, NUM_SLOTS - 1
    bound = -(-span // per_forward)
    for s in sims:
        for _ in range(bound):  # a clean pass over the whole pool
            s.backend.launch_scrub(s.group, s.counters, s.ring, per_forward)
            s.counters[fp.C_FORWARD_INDEX] += 1
        assert int(s.counters[fp.C_VIOLATIONS]) == 0
        assert int(s.counters[fp.C_SLOTS_SCRUBBED]) == s.next_slot - 1  # every written slot, once
        last_k = [r for r in s.group.rows if r.half == "k"][-1]
        last_k.view[int(s.r2t[2, 10]), last_k.row_words // 2] ^= 1 << 7
        assert s.verify_all(list(lengths.items())) == []  # HEAD (partial window) cannot see it
        found = []
        for _ in range(bound):
            before = int(s.counters[fp.C_VIOLATIONS])
            s.backend.launch_scrub(s.group, s.counters, s.ring, per_forward)
            s.counters[fp.C_FORWARD_INDEX] += 1
            found += s.new_violations(before)
        assert [(r[fp.V_SLOT], r[fp.V_POSITION], r[fp.V_REASON], r[fp.V_BATCH_INDEX]) for r in found] == [
            (int(s.r2t[2, 10]), 10, fp.R_KV_HASH, -2)]


def _static_decode_view(rows):
    """The static input buffers of a captured decode batch over ``rows`` and the ForwardView on them."""
    bs = len(rows)
    static = dict(
        input_ids=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.ones(bs, dtype=torch.int64, device=DEVICE),
    )
    view = ForwardView(**static, new_starts=torch.arange(bs, device=DEVICE), new_lens=torch.ones(bs, dtype=torch.int64,
                       device=DEVICE), batch_size=bs, max_new_len=1)
    return static, view


def _load_decode_step(static, reqs, slots):
    """Fill the static buffers for one decode step of ``reqs`` ((row, prefix, [token])) into ``slots``."""
    static["input_ids"].copy_(torch.tensor([t[0] for _, _, t in reqs]))
    static["out_cache_loc"].copy_(slots)
    static["seq_lens"].copy_(torch.tensor([p + 1 for _, p, _ in reqs]))
    static["positions"].copy_(torch.tensor([p for _, p, _ in reqs]))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA-graph capture needs a GPU (this runs on the GPU host)")
def test_verify_and_write_replay_from_a_cuda_graph():
    """Capture HEAD+TAIL once for a decode batch, replay it with new data each step: same records as eager."""
    graph_sim, eager_sim = Sim(tk), Sim(ref)
    lengths = [_scenario(s) for s in (graph_sim, eager_sim)][0]
    rows = [1, 2, 4]
    bs = len(rows)
    static, view = _static_decode_view(rows)
    s = graph_sim

    def head_tail():
        tk.launch_verify(s.group, view, s.r2t, s.counters, s.ring, 2, 16, token_oracle=s.oracle)
        tk.launch_write(s.group, view, s.r2t, s.counters, s.ring, True, block=16, token_oracle=s.oracle)

    s.counters[fp.C_REPORT_ENABLED] = 0  # warmup + capture on padding data, as sglang's capture does
    head_tail()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head_tail()
    s.counters[fp.C_REPORT_ENABLED] = 1
    base = {k: int(s.counters[k]) for k in (fp.C_VIOLATIONS, fp.C_SLOTS_VERIFIED)}

    g = torch.Generator().manual_seed(99)

    def graph_step(reqs):
        """The graph side of one decode step: allocate, map, "attention" writes K/V, then replay HEAD+TAIL."""
        slots = s.alloc(bs)
        for (row, prefix, toks_), slot in zip(reqs, slots.tolist()):
            s.r2t[row, prefix] = slot
            s.oracle.next_token[row] = toks_[0]  # what the sampled-id scatter would have written
        for layer in range(LAYERS):
            s.k[layer][slots.to(DEVICE)] = torch.randn(bs, 2, 8, generator=s.rng).to(DEVICE)
            s.v[layer][slots.to(DEVICE)] = torch.randn(bs, 2, 8, generator=s.rng).to(DEVICE)
        _load_decode_step(static, reqs, slots)
        graph.replay()

    for step in range(4):
        toks = torch.randint(1, 500, (bs,), generator=g).tolist()
        reqs = [(row, lengths[row] + step, [t]) for row, t in zip(rows, toks)]
        eager_sim.forward(reqs)
        graph_step(reqs)
    torch.cuda.synchronize()
    assert torch.equal(graph_sim.group.records.cpu(), eager_sim.group.records.cpu())
    assert int(s.counters[fp.C_VIOLATIONS]) == base[fp.C_VIOLATIONS]
    assert int(s.counters[fp.C_SLOTS_VERIFIED]) > base[fp.C_SLOTS_VERIFIED]
    # A corrupted prefix byte is caught by the next step's replay (and nothing else is reported).
    s.group.sources[0].view[int(s.r2t[2, 7]), 0] ^= 1 << 3
    toks = torch.randint(1, 500, (bs,), generator=g).tolist()
    graph_step([(row, lengths[row] + 4, [t]) for row, t in zip(rows, toks)])
    torch.cuda.synchronize()
    assert int(s.counters[fp.C_VIOLATIONS]) == base[fp.C_VIOLATIONS] + 1
    row = s.ring[base[fp.C_VIOLATIONS] % s.ring.shape[0]].tolist()
    assert (row[fp.V_REASON], row[fp.V_ROW], row[fp.V_POSITION]) == (fp.R_KV_HASH, 2, 7)


def _index_of(sim, rows_lengths):
    """A CachedSlotIndex holding whole cached sequences, as the radix hooks would fill it."""
    from kv_canary.cache_index import CachedSlotIndex

    index = CachedSlotIndex(NUM_SLOTS, DEVICE)
    for row, n in rows_lengths:
        seq = sim.r2t[row, :n].to(torch.int64)
        index.add(seq, sim.own[row][:n], 0, None)
    index.apply_pending()
    return index


def test_index_sweep_matches_reference_and_finds_unused_corruption():
    from kv_canary.kernels import index_sweep

    sims = [Sim(tk), Sim(ref)]
    launch = {id(tk): index_sweep.launch_index_sweep, id(ref): ref.launch_index_sweep}
    for s in sims:
        _scenario(s)
    cached = [(3, 33), (1, 93)]
    for s in sims:
        sweep = launch[id(s.backend)]
        index = _index_of(s, cached)
        sweep(s.group, index, s.counters, s.ring)
        assert int(s.counters[fp.C_VIOLATIONS]) == 0
        assert int(s.counters[fp.C_SLOTS_SWEPT]) == 33 + 93
        s.group.sources[1].view[int(s.r2t[3, 20]), 1] ^= 1 << 9  # a slot only the cache holds (V, layer 0)
        sweep(s.group, index, s.counters, s.ring)
        # a slot the cache no longer holds is not checked, even when corrupt
        index.remove(s.r2t[3, :33].to(torch.int64))
        index.apply_pending()
        sweep(s.group, index, s.counters, s.ring)
        assert int(s.counters[fp.C_SLOTS_SWEPT]) == 2 * (33 + 93) + 93
    rows = [[s.ring[i].tolist() for i in range(int(s.counters[fp.C_VIOLATIONS]))] for s in sims]
    assert rows[0] == rows[1] and len(rows[0]) == 1
    r = rows[0][0]
    assert (r[fp.V_REASON], r[fp.V_POSITION], r[fp.V_BATCH_INDEX], r[fp.V_ROW]) == (fp.R_KV_HASH, 20, -1, -1)


def test_index_sweep_catches_a_cached_slot_rewritten_by_another_sequence():
    """The cache claims token t at position p; the slot's record now says another token (a reused slot)."""
    from kv_canary.kernels import index_sweep

    s = Sim(tk)
    _scenario(s)
    index = _index_of(s, [(3, 33)])
    slot = int(s.r2t[3, 10])
    index.token[slot] += 1  # the claim no longer matches the record's token
    index_sweep.launch_index_sweep(s.group, index, s.counters, s.ring)
    assert int(s.counters[fp.C_VIOLATIONS]) == 1
    assert s.ring[0, fp.V_REASON].item() & fp.R_TOKEN and s.ring[0, fp.V_SLOT].item() == slot


@pytest.mark.parametrize("bs,n", [(1, 1), (1, 4), (3, 4), (5, 17), (2, 40)])
def test_the_one_launch_record_accepted_equals_the_torch_reference_bit_for_bit(bs, n):
    """kernels/accept.py (the Triton backend's verify hook: one launch) against speculative.record_accepted."""
    from kv_canary.kernels.accept import launch_record_accepted
    from kv_canary.speculative import record_accepted

    dev = DEVICE  # the GPU host's unit run compiles it for real
    g = torch.Generator().manual_seed(bs * 100 + n)
    rows = torch.randperm(16, generator=g)[:bs].to(torch.int64)
    kw = dict(req_pool_indices=rows.to(dev), committed=torch.randint(1, 5000, (bs,), generator=g).to(dev),
              next_token_ids=torch.randint(0, 32000, (bs * n,), generator=g, dtype=torch.int32).to(dev),
              accept_lens=torch.randint(1, n + 1, (bs,), generator=g, dtype=torch.int32).to(dev), batch_size=bs, n=n)
    staged = torch.randint(0, 32000, (bs * (n + 1) + 3,), generator=g).to(dev)
    chain = torch.randint(-2**62, 2**62, (16,), generator=g).to(dev)
    out = []
    for fn in (record_accepted, launch_record_accepted):
        o = dict(staged=staged.clone(), row_chain=chain.clone(), sampled=torch.full((16,), -7, device=dev))
        fn(**o, **kw)
        out.append(o)
    assert torch.equal(out[0]["row_chain"], out[1]["row_chain"])
    assert torch.equal(out[0]["sampled"], out[1]["sampled"])
    assert not torch.equal(out[1]["row_chain"], chain) or n == 1
    with pytest.raises(CanaryCapacityError, match="staged entries"):
        launch_record_accepted(staged=staged[:bs * (n + 1) - 1], row_chain=chain.clone(),
                               sampled=torch.zeros(16, dtype=torch.int64, device=dev), **kw)


@pytest.mark.parametrize("bs,n,max_kept", [(1, 4, 4), (3, 4, 4), (5, 6, 4), (9, 8, 8)])
def test_the_one_launch_deferred_tail_inputs_equal_the_torch_reference_bit_for_bit(bs, n, max_kept):
    """kernels/accept.py's spec v1 launch against speculative.build_accepted_drafts: random kept paths (root
    first, 1..max_kept nodes a request, some cut to the root as after a finishing token) over ``bs * n`` tree
    nodes, sglang 0.5.12's dtypes (accept_index and accept_tokens int32, draft tokens/positions int64)."""
    from kv_canary.kernels.accept import launch_accepted_drafts
    from kv_canary.speculative import AcceptedDraftBuffers, build_accepted_drafts

    dev = DEVICE  # the GPU host's unit run compiles it for real
    g = torch.Generator().manual_seed(bs * 1000 + n * 10 + max_kept)
    lens = torch.randint(1, min(n, max_kept) + 1, (bs,), generator=g)
    lens[0] = 1  # cut to the root
    kept_nodes = torch.cat([i * n + torch.cat([torch.zeros(1, dtype=torch.int64),
                                               1 + torch.randperm(n - 1, generator=g)[: int(a) - 1]])
                            for i, a in enumerate(lens)]).to(torch.int32)
    kept = int(lens.sum())
    r2t = torch.randint(1, 50000, (20, 300), generator=g, dtype=torch.int32)
    kw = dict(req_to_token=r2t.to(dev), rows=torch.randperm(20, generator=g)[:bs].to(dev),
              committed=torch.randint(0, 300 - max_kept, (bs,), generator=g).to(dev),
              kept_nodes=kept_nodes.to(dev), kept=kept, batch_size=bs, n=n,
              fed_tokens=torch.randint(0, 32000, (bs * n,), generator=g).to(dev),
              fed_positions=torch.randint(0, 5000, (bs * n,), generator=g).to(dev),
              appended=torch.randint(0, 32000, (kept,), generator=g, dtype=torch.int32).to(dev))
    junk = torch.randint(0, 32000, (bs * (max_kept + 1) + 5,), generator=g).to(dev)
    outs = []
    for fn in (build_accepted_drafts, launch_accepted_drafts):
        out = AcceptedDraftBuffers.allocate(bs + 2, max_kept, torch.device(dev))
        for t in (out.ids, out.positions, out.out_cache_loc, out.seq_lens, out.bonus):
            t.fill_(-9)
        staged = junk.clone()
        fn(out=out, staged=staged, **kw)
        outs.append((out, staged))
    (ref, ref_staged), (tri, tri_staged) = outs
    for name in ("ids", "positions", "out_cache_loc", "seq_lens", "new_starts", "new_lens", "bonus"):
        assert torch.equal(getattr(ref, name), getattr(tri, name)), name
    assert torch.equal(ref_staged, tri_staged)
    # and what they hold: request i's kept nodes at new_starts[i], the row's slots at c + k, the appended tokens
    starts = torch.cumsum(lens, 0) - lens
    assert tri.new_lens[:bs].tolist() == lens.tolist() and tri.new_starts[:bs].tolist() == starts.tolist()
    rows, c = kw["rows"].cpu(), kw["committed"].cpu()
    for i in range(bs):
        s, a = int(starts[i]), int(lens[i])
        nodes = kept_nodes[s:s + a].long()
        assert tri.ids[s:s + a].cpu().tolist() == kw["fed_tokens"].cpu()[nodes].tolist()
        assert tri.out_cache_loc[s:s + a].cpu().tolist() == r2t[rows[i], c[i]:c[i] + a].long().tolist()
        assert int(tri.seq_lens[i]) == int(c[i]) + a
        app = kw["appended"].cpu()[s:s + a].long().tolist()
        assert tri_staged[s + i:s + i + a + 1].cpu().tolist() == [-1] + app[:-1] + [-1]
        assert int(tri.bonus[i]) == app[-1]
    assert int(tri.ids[kept]) == -9 and int(tri.seq_lens[bs]) == -9  # nothing past the batch
    assert torch.equal(tri_staged[kept + bs:], junk[kept + bs:])
