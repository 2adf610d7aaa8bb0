"""Triton kernels against the torch reference on random pools (``kv_canary_testing.kernel_sim``).

On CPU the Triton kernels run under TRITON_INTERPRET=1; on a GPU host (CUDA available and TRITON_INTERPRET unset
or 0) the same tests run compiled kernels on CUDA tensors, plus a CUDA-graph capture/replay test. The scenario
drives real forwards through both backends on identical pools: chunked prefill of several requests, two of which
share a prefix (the second reuses the first's slots, as the radix cache does), then decode steps; then corruptions
of each kind, and checks both backends report the same violations. The token oracle's chains:
test_token_oracle.py; the scrub and the index sweep: test_kernel_scrub_sweep.py; speculative acceptance's
one-launch kernels: test_accept_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

# kernel_sim first: it sets TRITON_INTERPRET on CPU before Triton is imported
from kv_canary_testing.kernel_sim import DEVICE, LAYERS, NUM_SLOTS, Sim, scenario as _scenario

from kv_canary import fingerprint as fp
from kv_canary.config import RealData
from kv_canary.kernels import reference as ref
from kv_canary.kernels import triton_kernels as tk
from kv_canary.token_oracle import TokenOracle
from kv_canary.views import ForwardView




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
    everything = group(real_data=RealData.ALL)
    assert tk.few_sources(everything) == 2 and tk.verify_warps(everything, 256) == 8
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


@pytest.mark.parametrize("backend", [tk, ref], ids=["triton", "torch"])
def test_a_shared_prefix_is_checked_once_a_forward_and_a_foreign_link_still_is(backend):
    """Row 4 reads row 1's first 40 slots. In a batch [1, 4] its lanes there are row 1's checks (same slot, same
    predecessor): a corrupted shared slot is reported once, by row 1, and every read counts as verified. A row
    whose link into the shared slots differs (another predecessor) or that maps a shared position to another slot
    is still checked at that lane; the two backends report the same rows."""
    sims = [Sim(tk), Sim(ref)]
    lengths = [_scenario(s) for s in sims][0]
    sim = sims[0 if backend is tk else 1]
    pair = [(1, lengths[1]), (4, lengths[4])]
    before = int(sim.counters[fp.C_SLOTS_VERIFIED])
    assert sim.verify_all(pair) == []
    assert int(sim.counters[fp.C_SLOTS_VERIFIED]) - before == lengths[1] + lengths[4]
    slot = int(sim.r2t[1, 20])
    sim.group.records[slot, fp.F_POSITION] += 1  # a shared slot's record corrupted
    found = sim.verify_all(pair)
    assert [(r[fp.V_ROW], r[fp.V_POSITION], r[fp.V_REASON] & fp.R_POSITION) for r in found] == [(1, 20, fp.R_POSITION)]
    reversed_order = sim.verify_all([(4, lengths[4]), (1, lengths[1])])
    assert reversed_order and all(r[fp.V_ROW] == 4 for r in reversed_order)  # the other order: row 4 reports it
    sim.group.records[slot, fp.F_POSITION] -= 1
    # row 4's position 10 points at row 2's slot of position 10 (a foreign slot): checked, and its successor's
    # link too (same slot as row 1's there, another predecessor)
    sim.r2t[4, 10] = sim.r2t[2, 10]
    found = {(r[fp.V_ROW], r[fp.V_POSITION]): r[fp.V_REASON] for r in sim.verify_all(pair)}
    assert found[(4, 10)] & fp.R_CHAIN and found[(4, 11)] == fp.R_CHAIN and all(r == 4 for r, _ in found)
    other = sims[1 if backend is tk else 0]
    other.r2t[4, 10] = other.r2t[2, 10]
    assert sim.verify_all(pair) == other.verify_all(pair)


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
    _scenario(sim)
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
