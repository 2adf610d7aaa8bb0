"""The write witness's stamp and check kernels (``kernels/witness.py``) against their torch twins.

On CPU the Triton kernels run under TRITON_INTERPRET=1; on a GPU host the compiled kernels run, and once more
captured in a CUDA graph and replayed. Pools: MHA bf16 (odd head dim), fp8 e4m3fn stored as uint8, MLA (one
latent row, no V half), a translated (SWA) group; page size 16 layouts are the same per-slot rows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

import pytest  # noqa: E402

from kv_canary import fingerprint as fp  # noqa: E402
from kv_canary.buffer_groups import PoolLayout, build_group  # noqa: E402
from kv_canary.config import CanaryConfig, CanaryConfigError  # noqa: E402
from kv_canary.kernels import reference as ref  # noqa: E402
from kv_canary.kernels import witness  # noqa: E402
from kv_canary.views import ForwardView  # noqa: E402
from kv_canary.witness_stamp import STAMP_WORDS, WITNESS_STAMPS  # noqa: E402

SLOTS, LAYERS = 96, 3


def _pool(kind: str):
    """(k buffers, v buffers or None, kv_dtype, slot map or None) of a small pool of ``kind``."""
    g = torch.Generator().manual_seed(7)
    if kind == "mha_bf16":  # head dim 6: a 12-byte row per head, 3 words
        k = [torch.randn(SLOTS, 2, 6, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
        v = [torch.randn(SLOTS, 2, 6, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
        return k, v, None, None
    if kind == "fp8":  # sglang stores fp8 K/V as uint8
        k = [torch.randint(0, 120, (SLOTS, 1, 16), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
        v = [torch.randint(0, 120, (SLOTS, 1, 16), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
        return k, v, torch.float8_e4m3fn, None
    if kind == "mla":  # kv_lora_rank 8 + rope 4, fp16, no V
        return [torch.randn(SLOTS, 1, 12, generator=g).half() for _ in range(LAYERS)], None, None, None
    if kind == "swa":  # engine slot s -> group slot (s * 7) % 64 + 1 (0 for engine slot 0)
        k = [torch.randn(65, 2, 4, generator=g) for _ in range(LAYERS)]
        v = [torch.randn(65, 2, 4, generator=g) for _ in range(LAYERS)]
        slot_map = torch.tensor([0] + [(s * 7) % 64 + 1 for s in range(1, SLOTS)], dtype=torch.int64)
        return k, v, None, slot_map
    raise ValueError(kind)


class Pool:
    def __init__(self, kind, backend):
        k, v, kv_dtype, slot_map = _pool(kind)
        self.k = [t.to(DEVICE) for t in k]
        self.v = None if v is None else [t.to(DEVICE) for t in v]
        self.group = build_group(PoolLayout("g", self.k, self.v, kv_dtype=kv_dtype,
                                            slot_translation=None if slot_map is None else slot_map.to(DEVICE)),
                                 CanaryConfig(), DEVICE)
        self.backend = backend
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
        self.counters[fp.C_REPORT_ENABLED] = 1
        self.counters[fp.C_CURRENT_FORWARD] = 5
        self.ring = torch.zeros(64, fp.RING_WIDTH, dtype=torch.int64, device=DEVICE)

    def stamp(self, view):
        if self.backend == "triton":
            witness.launch_stamp(self.group, view, group_index=1)
        else:
            ref.launch_witness_stamp(self.group, view, group_index=1)

    def check(self, view):
        if self.backend == "triton":
            witness.launch_check(self.group, view, self.counters, self.ring, group_index=1)
        else:
            ref.launch_witness_check(self.group, view, self.counters, self.ring, group_index=1)

    def write(self, view, skip=()):
        """'Attention' stores every new slot's rows, except the (lane, layer, half) in ``skip``."""
        slots = view.out_cache_loc.to(torch.int64)
        if self.group.slot_map is not None:
            slots = self.group.slot_map[slots]
        for layer in range(LAYERS):
            for half, bufs in (("k", self.k), ("v", self.v)):
                if bufs is None:
                    continue
                for lane, slot in enumerate(slots.tolist()):
                    if slot > 0 and (lane, layer, half) not in skip:
                        bufs[layer][slot] = (torch.arange(bufs[layer][slot].numel(), device=DEVICE) % 5 + lane
                                             ).reshape(bufs[layer][slot].shape).to(bufs[layer].dtype)

    def rows(self):
        n = int(self.counters[fp.C_VIOLATIONS])
        return sorted(tuple(r) for r in self.ring[:n].tolist())


def _view(locs, reqs):
    """reqs: (row, seq_len, new_len) per request, their new runs in order over ``locs`` (0 = padding lane)."""
    starts, at = [], 0
    for _, _, n in reqs:
        starts.append(at)
        at += n
    t = lambda xs, dt=torch.int64: torch.tensor(xs, dtype=dt, device=DEVICE)  # noqa: E731
    return ForwardView(
        input_ids=t([3] * len(locs)), positions=t([100 + i for i in range(len(locs))]), out_cache_loc=t(locs),
        req_pool_indices=t([r for r, _, _ in reqs]), seq_lens=t([s for _, s, _ in reqs]),
        new_starts=t(starts, torch.int32), new_lens=t([n for _, _, n in reqs], torch.int32),
        batch_size=len(reqs), max_new_len=max(n for _, _, n in reqs))


@pytest.mark.parametrize("kind,rows_max", [("mha_bf16", 128), ("fp8", 128), ("mla", 128), ("swa", 128),
                                           ("mha_bf16", 2), ("mla", 2)])
def test_every_skipped_row_is_reported_and_both_backends_agree(kind, rows_max, monkeypatch):
    """rows_max 2: a group's rows in several gather steps (groups of more than 128 rows: a model of 65+ layers),
    and the lanes in programs of 4 (the GPU's 8: several programs a forward)."""
    monkeypatch.setattr(witness, "WITNESS_ROWS_MAX", rows_max)
    if rows_max == 2:
        monkeypatch.setattr(witness, "WITNESS_BLOCK", 4)
    # request 0 (row 2): 3 new tokens at positions 10..12; request 1 (row 5): 2 at 40..41; a padding lane (slot 0)
    view = _view([11, 12, 13, 30, 31, 0], [(2, 13, 3), (5, 42, 2)])
    skip = {(1, 1, "v"), (3, 0, "k"), (3, 1, "k"), (3, 2, "k"), (3, 0, "v"), (3, 1, "v"), (3, 2, "v")}
    if kind == "mla":
        skip = {(1, 1, "k"), (3, 0, "k"), (3, 1, "k"), (3, 2, "k")}
    out = {}
    for backend in ("triton", "torch"):
        pool = Pool(kind, backend)
        pool.stamp(view)
        pool.write(view, skip)
        pool.check(view)
        out[backend] = pool.rows()
        assert int(pool.counters[fp.C_SLOTS_WITNESSED]) == 5
    assert out["triton"] == out["torch"]
    rows_per_layer = 1 if kind == "mla" else 2
    pool_slot = (lambda s: (s * 7) % 64 + 1) if kind == "swa" else (lambda s: s)
    group_bits = fp.R_UNWRITTEN | (1 << fp.GROUP_SHIFT)
    first_of_lane1 = 1 * rows_per_layer + (0 if kind == "mla" else 1)  # layer 1's V (MLA: layer 1's row)
    assert out["torch"] == sorted([
        (group_bits, pool_slot(12), 11, 0, 2, first_of_lane1, 1, 5),
        (group_bits, pool_slot(30), 40, 1, 5, 0, LAYERS * rows_per_layer, 5),
    ])


@pytest.mark.parametrize("kind", ["mha_bf16", "fp8", "mla", "swa"])
def test_a_complete_write_leaves_no_stamp_and_no_violation(kind):
    view = _view([7, 8, 0, 0], [(1, 5, 2), (3, 9, 2)])  # request 1 is CUDA-graph padding (slots 0)
    pool = Pool(kind, "triton")
    before = [b.clone() for b in pool.k]
    pool.stamp(view)
    assert any(not torch.equal(a, b) for a, b in zip(before, pool.k))  # the stamp landed
    assert all(torch.equal(a[0], b[0]) for a, b in zip(before, pool.k))  # never the padding slot
    pool.write(view)
    pool.check(view)
    assert pool.rows() == [] and int(pool.counters[fp.C_SLOTS_WITNESSED]) == 2


def test_a_strided_out_cache_loc_is_read_lane_by_lane():
    # a spec v1 draft step's out_cache_loc is a column of the [bs * topk, steps] scratch table
    table = torch.tensor([[41, 51, 61], [42, 52, 62], [43, 53, 63]], dtype=torch.int64, device=DEVICE)
    view = _view([0, 0, 0], [(1, 9, 0)])
    view = ForwardView(**{**view.__dict__, "out_cache_loc": table[:, 1], "positions": table[:, 2]})
    out = {}
    for backend in ("triton", "torch"):
        pool = Pool("mha_bf16", backend)
        pool.stamp(view)
        pool.write(view, skip={(2, 0, "k")})
        pool.check(view)
        out[backend] = pool.rows()
        for other in (41, 42, 43, 61, 62, 63):  # the other steps' slots are never touched
            assert int(pool.k[0][other].reshape(-1).view(torch.int32)[0]) != pool.group.witness_stamp
    assert out["triton"] == out["torch"] == [(fp.R_UNWRITTEN | (1 << fp.GROUP_SHIFT), 53, 63, -1, -1, 0, 1, 5)]


def test_the_stamp_is_finite_tiny_and_no_constant_or_computed_row_holds_it():
    """Every stamp element is a finite subnormal (a dropped store's forward reads it: no NaN, ~0), the signs
    alternate and no two elements of a word are equal (a constant row, a fill value, one-signed rows never match),
    and what a computation's NaN/inf/0 converts to is never it."""
    for dtype, stamp in WITNESS_STAMPS.items():
        elems = torch.tensor([stamp], dtype=torch.int32).view(dtype)
        values = elems.float()
        assert torch.isfinite(values).all() and (values != 0).all(), dtype
        assert (values.abs() < torch.finfo(dtype).tiny).all(), (dtype, values)  # subnormal
        assert values.abs().max() <= 0.012, (dtype, values)
        if elems.numel() > 1:
            assert len(set(elems.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).tolist())) == elems.numel()
            assert all(a * b < 0 for a, b in zip(values.tolist(), values.tolist()[1:])), (dtype, values)
        for special in (float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0):
            computed = torch.full((4 // dtype.itemsize,), special).to(dtype)
            assert int(computed.view(torch.int32)) != stamp, (dtype, special)


@pytest.mark.parametrize("kind", ["mha_bf16", "fp8", "mla", "swa"])
def test_a_row_with_one_end_unwritten_is_reported_and_one_stamp_word_alone_is_not(kind):
    """A store that wrote the row's first half only leaves its last end stamped: reported. A correct store that
    happens to hold the stamp word in one word of an end (not both) is not a dropped store: not reported."""
    view = _view([7, 8], [(1, 5, 2)])
    for backend in ("triton", "torch"):
        pool = Pool(kind, backend)
        pool.stamp(view)
        pool.write(view)
        stamp, slot_map = pool.group.witness_stamp, pool.group.slot_map
        s7, s8 = (int(slot_map[s]) if slot_map is not None else s for s in (7, 8))  # the group's slots
        row7, row8 = pool.group.rows[0].view[s7], pool.group.rows[0].view[s8]
        row7[-STAMP_WORDS:] = stamp  # slot 7, row 0: its last end never written
        row8[0] = stamp  # slot 8, row 0: one stamp word in its first end, the other word written
        row8[-1] = stamp  # ... and in its last end
        pool.check(view)
        assert [(r[1], r[5], r[6]) for r in pool.rows()] == [(s7, 0, 1)], backend


def test_a_kv_dtype_without_a_stamp_is_refused_naming_the_variable():
    layout = PoolLayout("g", [torch.zeros(4, 1, 4, dtype=torch.int16)], None)
    with pytest.raises(CanaryConfigError, match="SGLANG_KV_CANARY_WRITE_WITNESS=0"):
        build_group(layout, CanaryConfig(), torch.device("cpu"))
    build_group(layout, CanaryConfig(write_witness=False), torch.device("cpu"))


def test_rows_too_short_for_a_stamp_at_each_end_are_refused_naming_the_variable():
    layout = PoolLayout("g", [torch.zeros(4, 1, 2, dtype=torch.bfloat16)], None)  # 4-byte rows: one word
    with pytest.raises(CanaryConfigError, match="rows of 4 bytes.*SGLANG_KV_CANARY_WRITE_WITNESS=0"):
        build_group(layout, CanaryConfig(), torch.device("cpu"))
    build_group(layout, CanaryConfig(write_witness=False), torch.device("cpu"))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA-graph capture needs a GPU (the GPU host runs it)")
def test_stamp_and_check_replay_from_a_cuda_graph():
    view = _view([21, 22, 23, 0], [(1, 30, 3), (4, 1, 1)])
    pool = Pool("mha_bf16", "triton")
    pool.stamp(view)  # compile outside the capture
    pool.check(view)
    pool.counters.zero_()
    pool.counters[fp.C_REPORT_ENABLED] = 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.stamp(view)
        pool.check(view)  # nothing wrote: every slot reported
    pool.counters.zero_()
    pool.counters[fp.C_REPORT_ENABLED] = 1
    graph.replay()
    torch.cuda.synchronize()
    assert [r[1] for r in pool.rows()] == [21, 22, 23] and int(pool.counters[fp.C_SLOTS_WITNESSED]) == 3
