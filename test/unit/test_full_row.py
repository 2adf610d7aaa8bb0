"""The split whole-row hash (``kernels/full_row.py``) against the torch reference, bit for bit, on the layouts
the canary meets: odd row widths, rows wider than one word tile, rows the word tiles divide (unmasked loads), MLA
(no V half), FP8-like uint8 rows, a translated (SWA) group, page-size-16 slot runs; TAIL's FULL_HASH, the scrub
and ``all``'s first-read verification (including a list longer than its capacity); and a CUDA-graph replay on the GPU host.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

import pytest  # noqa: E402

from kv_canary import fingerprint as fp  # noqa: E402
from kv_canary.buffer_groups import FullRowState, PoolLayout, build_group  # noqa: E402
from kv_canary.config import CanaryConfig, RealData  # noqa: E402
from kv_canary.kernels import full_row  # noqa: E402
from kv_canary.kernels import reference as ref  # noqa: E402
from kv_canary.kernels import triton_kernels as tk  # noqa: E402
from kv_canary.views import ForwardView  # noqa: E402

SLOTS = 160
PAGE = 16

# name: (per-layer row shape, dtype, layers, with V)
LAYOUTS = {
    "odd_words": ((2, 7), torch.bfloat16, 3, True),  # 28-byte rows: 7 words
    "two_tiles": ((5, 120), torch.bfloat16, 2, True),  # 300 words: more than one 256-word tile
    "mla": ((1, 36), torch.bfloat16, 3, False),  # K only (kv_lora + rope)
    "fp8_like": ((2, 12), torch.uint8, 4, True),  # 24 one-byte elements: 6 words
    "even_rows": ((4, 32), torch.bfloat16, 2, True),  # 64 words: word tiles divide every row (unmasked loads)
}


def _pool(shape, dtype, layers, with_v, seed):
    g = torch.Generator().manual_seed(seed)

    def buf():
        if dtype == torch.uint8:
            return torch.randint(0, 256, (SLOTS, *shape), generator=g, dtype=torch.uint8).to(DEVICE)
        return torch.randn(SLOTS, *shape, generator=g).to(dtype).to(DEVICE)

    k = [buf() for _ in range(layers)]
    return k, ([buf() for _ in range(layers)] if with_v else None)


def _groups(layout_name, translate=False, seed=0):
    """The same pool twice (one per backend), ``all`` (first-read state + FULL_HASH)."""
    shape, dtype, layers, with_v = LAYOUTS[layout_name]
    out = []
    for _ in range(2):
        k, v = _pool(shape, dtype, layers, with_v, seed)
        slot_map = None
        if translate:  # engine slot s -> group slot (a permutation of 1..SLOTS-1; 0 stays 0)
            perm = torch.randperm(SLOTS - 1, generator=torch.Generator().manual_seed(seed + 1)) + 1
            slot_map = torch.cat([torch.zeros(1, dtype=torch.int64), perm]).to(torch.int32).to(DEVICE)
        config = CanaryConfig(real_data=RealData.ALL, scrub_slots_per_forward=32)
        kv_dtype = torch.float8_e4m3fn if dtype == torch.uint8 else None  # sglang stores fp8 K/V as uint8
        out.append(build_group(PoolLayout("g", k, v, slot_translation=slot_map, kv_dtype=kv_dtype), config, DEVICE))
    return out


def _page_slots(n_tokens, seed):
    """Slots as a page-size-16 allocator hands them out: runs of 16 inside shuffled pages (never page 0)."""
    pages = (torch.randperm(SLOTS // PAGE - 1, generator=torch.Generator().manual_seed(seed)) + 1)
    return (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n_tokens]


def _view(lens, slots, r2t_rows=None):
    starts = [sum(lens[:i]) for i in range(len(lens))]
    n = sum(lens)
    return ForwardView(
        input_ids=torch.ones(n, dtype=torch.int64, device=DEVICE),
        positions=torch.cat([torch.arange(x) for x in lens]).to(DEVICE),
        out_cache_loc=slots.to(DEVICE),
        req_pool_indices=torch.tensor(r2t_rows or list(range(len(lens))), dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=DEVICE),
        new_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        new_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        batch_size=len(lens), max_new_len=max(lens))


def _state():
    counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
    counters[fp.C_REPORT_ENABLED] = 1
    return counters, torch.zeros(64, fp.RING_WIDTH, dtype=torch.int64, device=DEVICE)


def _left_clean(state):
    """Between launches every slot's sums and chunk tickets are zero (the program completing a slot zeroes both),
    and the first-read list is empty with its ticket zero (the program completing the list empties it)."""
    return (int(state.acc.abs().sum()) == 0 and int(state.tickets.abs().sum()) == 0
            and int(state.work_state.abs().sum()) == 0)


def _rows(counters, ring, before=0):
    n = int(counters[fp.C_VIOLATIONS]) - before
    return sorted(tuple(ring[(before + i) % ring.shape[0]].tolist()) for i in range(n))


def _write(groups, lens, slots, r2t):
    states = [_state() for _ in groups]
    view = _view(lens, slots)
    for backend, group, (counters, ring) in zip((tk, ref), groups, states):
        backend.launch_write(group, view, r2t, counters, ring, True, block=16, check_fed=False)
    return states


SHAPES = {"gpu": full_row.GPU_SHAPE, "interpreter": full_row.INTERPRETER_SHAPE}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("translate", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tail_full_hash_is_bit_equal_to_the_reference(layout, translate, shape, monkeypatch):
    """Whatever the launch shape (how the rows are cut into programs), the records are the reference's."""
    monkeypatch.setattr(full_row, "SHAPE", SHAPES[shape])
    groups = _groups(layout, translate)
    lens = [1, 37, 5]
    slots = _page_slots(sum(lens), seed=3)
    r2t = torch.zeros(4, 64, dtype=torch.int32, device=DEVICE)
    _write(groups, lens, slots, r2t)
    assert torch.equal(groups[0].records, groups[1].records)
    written = ref.translate(groups[1], slots.to(DEVICE))
    want = fp.full_hash_from_words(groups[1].all_words(written))
    assert torch.equal(groups[0].records[written, fp.F_FULL_HASH], want)
    assert int((groups[0].records[:, fp.F_FULL_HASH] != 0).sum()) == sum(lens)
    assert _left_clean(groups[0].full_row)


def _read_view(rows_lens):
    """A decode forward of requests (row, prefix): reads [0, prefix), writes nothing (slot 0)."""
    bs = len(rows_lens)
    return ForwardView(
        input_ids=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor([n for _, n in rows_lens], dtype=torch.int64, device=DEVICE),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor([r for r, _ in rows_lens], dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor([n + 1 for _, n in rows_lens], dtype=torch.int64, device=DEVICE),
        new_starts=torch.arange(bs, dtype=torch.int64, device=DEVICE),
        new_lens=torch.ones(bs, dtype=torch.int64, device=DEVICE), batch_size=bs, max_new_len=1)


@pytest.mark.parametrize("layout,translate,shape", [("odd_words", False, "interpreter"), ("mla", True, "gpu"),
                                                    ("fp8_like", False, "interpreter"), ("two_tiles", True, "gpu"),
                                                    ("two_tiles", False, "interpreter"), ("even_rows", True, "gpu"),
                                                    ("even_rows", False, "interpreter")])
def test_first_read_verifies_every_byte_once_and_the_scrub_finds_a_later_flip(layout, translate, shape, monkeypatch):
    monkeypatch.setattr(full_row, "SHAPE", SHAPES[shape])
    groups = _groups(layout, translate, seed=5)
    lens = [40, 23]
    slots = _page_slots(sum(lens), seed=9)
    r2t = torch.zeros(4, 64, dtype=torch.int32, device=DEVICE)
    r2t[0, :40] = slots[:40].to(torch.int32).to(DEVICE)
    r2t[1, :23] = slots[40:].to(torch.int32).to(DEVICE)
    r2t[2, :23] = r2t[1, :23]  # row 2 shares row 1's slots (a radix hit): one verification for both
    states = _write(groups, lens, slots, r2t)
    flipped = int(ref.translate(groups[0], slots[45:46].to(DEVICE)))
    for group in groups:  # between the write and the first read: in the last layer's last row, mid-row
        row = group.rows[-1]
        row.view[flipped, row.row_words // 2] ^= 1 << 9
    found = []
    for backend, group, (counters, ring) in zip((tk, ref), groups, states):
        before = int(counters[fp.C_VIOLATIONS])
        backend.launch_verify(group, _read_view([(0, 40), (1, 23), (2, 23)]), r2t, counters, ring, 2, 16)
        found.append([(r[fp.V_REASON], r[fp.V_SLOT], r[fp.V_POSITION]) for r in _rows(counters, ring, before)])
    assert found[0] == found[1] == [(fp.R_KV_HASH, flipped, 5)]
    assert torch.equal(groups[0].full_row.tags, groups[1].full_row.tags)
    assert int(groups[0].full_row.work_state.abs().sum()) == 0  # the list is emptied after each forward
    assert _left_clean(groups[0].full_row)
    for backend, group, (counters, ring) in zip((tk, ref), groups, states):  # verified: not hashed again
        before = int(counters[fp.C_VIOLATIONS])
        backend.launch_verify(group, _read_view([(0, 40), (1, 23)]), r2t, counters, ring, 2, 16)
        assert _rows(counters, ring, before) == []
    other = int(ref.translate(groups[0], slots[3:4].to(DEVICE)))
    for group in groups:  # after the first read: the scrub finds it within ceil((slots - 1) / 32) forwards
        group.rows[0].view[other, 0] ^= 1
    bound = -(-(SLOTS - 1) // 32)
    for backend, group, (counters, ring) in zip((tk, ref), groups, states):
        before = int(counters[fp.C_VIOLATIONS])
        for _ in range(bound):
            backend.launch_scrub(group, counters, ring, 32)
            counters[fp.C_FORWARD_INDEX] += 1
        assert sorted(r[fp.V_SLOT] for r in _rows(counters, ring, before)) == sorted([flipped, other])
        assert sum(lens) <= int(counters[fp.C_SLOTS_SCRUBBED]) <= sum(lens) + 1  # never-written slots skipped
    assert _left_clean(groups[0].full_row)


def test_a_first_read_list_past_its_capacity_is_finished_by_later_forwards(monkeypatch):
    groups = _groups("odd_words", seed=11)
    small = FullRowState.build(SLOTS, True, DEVICE, capacity=8)  # 8 slots a forward
    groups[0] = groups[0].__class__(**{**groups[0].__dict__, "full_row": small})
    slots = _page_slots(30, seed=2)
    r2t = torch.zeros(2, 64, dtype=torch.int32, device=DEVICE)
    r2t[0, :30] = slots.to(torch.int32).to(DEVICE)
    (counters, ring), _ = _write(groups, [30], slots, r2t)
    for k in range(4):
        tk.launch_verify(groups[0], _read_view([(0, 30)]), r2t, counters, ring, 2, 16)
        verified = int((groups[0].full_row.tags[slots.to(DEVICE)] != 0).sum())
        assert verified == min(30, 8 * (k + 1))
    assert int(counters[fp.C_VIOLATIONS]) == 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA-graph capture needs a GPU (this runs on the GPU host)")
def test_all_head_and_tail_replay_from_a_cuda_graph():
    """HEAD (verify + first-read list + its hash) and TAIL (write + split FULL_HASH), captured once for a
    decode batch of 2 and replayed: same records as eager; a flip made before a slot's first read is caught."""
    group, eager = _groups("two_tiles", seed=21)
    r2t = torch.zeros(4, 64, dtype=torch.int32, device=DEVICE)
    slots = _page_slots(48, seed=4)
    r2t[0, :20] = slots[:20].to(torch.int32).to(DEVICE)
    r2t[1, :20] = slots[20:40].to(torch.int32).to(DEVICE)
    (counters, ring), (ec, er) = _write([group, eager], [20, 20], slots[:40], r2t)
    static = _read_view([(0, 20), (1, 20)])

    def head_tail():
        tk.launch_verify(group, static, r2t, counters, ring, 2, 16)
        tk.launch_write(group, static, r2t, counters, ring, True, block=16, check_fed=False)

    counters[fp.C_REPORT_ENABLED] = 0
    head_tail()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head_tail()
    counters[fp.C_REPORT_ENABLED] = 1
    group.full_row.tags.zero_()  # the warmup verified the prefix with reporting off: start unverified
    flipped = int(slots[7])
    for g in (group, eager):
        g.rows[-1].view[flipped, 3] ^= 1 << 4
    before = int(counters[fp.C_VIOLATIONS])
    for step in range(3):
        new = slots[40 + 2 * step: 42 + 2 * step].to(DEVICE)
        for n, row in enumerate((0, 1)):
            r2t[row, 20 + step] = int(new[n])
        static.out_cache_loc.copy_(new)
        static.positions.copy_(torch.tensor([20 + step] * 2))
        static.seq_lens.copy_(torch.tensor([21 + step] * 2))
        graph.replay()
        eager_view = _read_view([(0, 20 + step), (1, 20 + step)])
        eager_view.out_cache_loc.copy_(new)
        ref.launch_verify(eager, eager_view, r2t, ec, er, 2, 16)
        ref.launch_write(eager, eager_view, r2t, ec, er, True, check_fed=False)
    torch.cuda.synchronize()
    assert torch.equal(group.records, eager.records)
    found = _rows(counters, ring, before)
    assert [(r[fp.V_REASON], r[fp.V_SLOT]) for r in found] == [(fp.R_KV_HASH, flipped)]
    assert _left_clean(group.full_row)
