"""EAGLE spec v1 (``EAGLEWorker``: topk > 1, ``--disable-overlap-schedule``): the draft model's own KV pool, eager.

Real sglang 0.5.12 code where the draft's layout comes from: the scratch slots of a draft decode phase are laid
out by sglang's ``assign_draft_cache_locs`` (Triton, under the interpreter) as ``_draft_preprocess_decode`` does
(page size 16 with topk 2: ``get_last_loc_large_page_size_large_top_k`` and the last partial page copied into each
branch by the draft pool's ``move_kv_cache``), the phase is sglang's own ``EAGLEWorker.draft_forward`` (its
``select_top_k_tokens`` over ``bs * topk`` lanes, ``out_cache_loc`` per step, ``positions.add_(1)``) run through the
plugin's AROUND hook, and the draft extends are ``ForwardBatch``es in the modes spec v1 runs (EXTEND for the draft
prefill, DRAFT_EXTEND over the kept tokens, variable length per request). The stand-in draft "model" writes K/V at
``out_cache_loc`` like attention does (scratch slots included). The harness is ``speculative_draft_harness``'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.draft import (
    DraftBatchAdapter, after_eagle_v1_worker_init, around_draft_forward, around_draft_graph_replay, draft_skip_reason,
)
from kv_canary.adapter.kv_stores import forget_kv_moves
from kv_canary.config import RealData
from kv_canary.draft_pool import DRAFT_GROUP
from kv_canary.violations import CanaryViolationError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter (CPU CI); on a GPU host "
           "test_e2e_speculative_v1.py covers spec v1's draft pool")

_spec = importlib.util.spec_from_file_location("kvc_speculative_draft_harness_v2", Path(__file__).with_name(
    "speculative_draft_harness.py"))
_v2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_v2)  # loads the libcuda stand-in where needed (sgl_kernel)

ForwardBatch, ForwardMode = _v2.ForwardBatch, _v2.ForwardMode
import kv_canary_testing.spec_cpu.models  # noqa: E402,F401  CPU stand-ins (select_top_k_tokens uncompiled)
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sglang.srt.speculative.eagle_worker import EAGLEWorker, get_last_loc_large_page_size_large_top_k  # noqa: E402
from sglang.srt.speculative.spec_utils import assign_draft_cache_locs  # noqa: E402
from sglang.srt.utils import next_power_of_2  # noqa: E402

EAGLEDraftCudaGraphRunner = _v2.EAGLEDraftCudaGraphRunner

TOPK = 2
_v2.SLOTS = 2048  # this module's copy of the harness: room for the scratch region
SCRATCH = 2048 - 512  # the scratch slots (page aligned): given back after every phase (restore_state), so reused


def _v1_adapter(steps):
    """The draft adapter spec v1's install builds (api.install_draft_canary)."""

    class V1Adapter(DraftBatchAdapter):
        def __init__(self, **kw):
            super().__init__(**kw, spec_v1=True, num_steps=steps)

    return V1Adapter


class V1DraftHarness(_v2.DraftHarness):
    """spec v1's draft side: scratch-slot draft phases over ``bs * topk`` lanes, DRAFT_EXTEND over kept tokens;
    with ``graph_bs``, both replayed from sglang's draft graph runners (emulated graphs,
    ``speculative_draft_harness``)."""

    def __init__(self, *, steps: int = 3, page_size: int = 1, topk: int = TOPK, **kw):
        self.topk = topk
        super().__init__(steps=steps, page_size=page_size, adapter=_v1_adapter(steps), **kw)
        self._v1_worker()
        self.scratch = []  # the last phase's scratch slots (freed by restore_state right after it)
        # the draft pool's move_kv_cache, wrapped as install_draft_canary does for spec v1
        self.draft_pool = SimpleNamespace(move_kv_cache=self.move_kv_cache)
        forget_kv_moves(self.draft_pool, self.manager.groups)

    def move_kv_cache(self, tgt, src):
        """MHATokenToKVPool.move_kv_cache: the K/V of slots ``src`` copied to ``tgt`` (int32, as sglang's)."""
        self.k[tgt.long()] = self.k[src.long()].clone()
        self.v[tgt.long()] = self.v[src.long()].clone()

    def _v1_worker(self):
        """EAGLEWorker is a TpModelWorker over the draft model: its runner is model_runner (no draft_runner)."""
        if getattr(self, "v1_worker", None) is None:
            self.v1_worker = SimpleNamespace(
                model_runner=self.runner, draft_model_runner=self.runner, speculative_num_steps=self.steps,
                topk=self.topk, hot_token_id=None, server_args=SimpleNamespace(speculative_algorithm="EAGLE"),
                speculative_num_draft_tokens=4,
                draft_attn_backend=SimpleNamespace(attn_backends=[None] * self.steps))
            self.v1_worker.draft_forward = lambda fb: around_draft_forward(EAGLEWorker.draft_forward, self.v1_worker,
                                                                           fb)
        return self.v1_worker

    def _capture_graphs(self, graph_bs):
        """EAGLEWorker.init_cuda_graphs: the draft phase over topk lanes, and the DRAFT_EXTEND (spec v1's mode)."""
        worker = self._v1_worker()
        self.graph_runner = _v2.CpuDraftGraphRunner(self, graph_bs, worker=worker, topk=self.topk)
        self.extend_graph_runner = _v2.CpuDraftExtendGraphRunner(self, graph_bs, mode=ForwardMode.DRAFT_EXTEND,
                                                                 worker=worker, topk=self.topk)

    def v1_draft_batch(self, rows):
        """``_draft_preprocess_decode``: scratch slots for ``bs * topk`` lanes x steps, laid out by sglang's kernel."""
        bs, steps, topk, ps = len(rows), self.steps, self.topk, self.page_size
        rows_t = torch.tensor(rows)
        seq = torch.tensor([self.committed[r] for r in rows])
        dummy = torch.empty((), dtype=torch.int64)
        src = tgt = cumsum = None
        dup = 0
        if ps == 1:
            out = torch.arange(SCRATCH, SCRATCH + bs * topk * steps, dtype=torch.int64)
            new_pages, extend_lens = dummy, dummy
        else:  # fresh pages per branch; the last partial page duplicated into each (move_kv_cache below)
            from unittest import mock

            from sglang.srt import server_args as sglang_server_args

            # get_last_loc asks the global server args for the attention backend (page > 1 with topk > 1: flashinfer)
            with mock.patch.object(sglang_server_args, "_global_server_args",
                                   SimpleNamespace(attention_backend="flashinfer")):
                _, _, _, new_pages, extend_lens, last_page_lens = get_last_loc_large_page_size_large_top_k(
                    self.r2t, rows_t, seq, steps, topk, ps)
            out = torch.tensor([SCRATCH + i for i in range(int(new_pages.sum()) * topk * ps)], dtype=torch.int64)
            cumsum = torch.cumsum(last_page_lens, dim=0)
            dup = int((seq % ps).sum()) * (topk - 1)
            src, tgt = torch.zeros(dup, dtype=torch.int32), torch.zeros(dup, dtype=torch.int32)
        assign_draft_cache_locs[(bs,)](rows_t, self.r2t, seq, extend_lens, new_pages, out, src, tgt, cumsum, dup,
                                       self.r2t.shape[1], topk, steps, ps, next_power_of_2(bs),
                                       next_power_of_2(steps + ps))
        if ps > 1:
            if dup:  # the draft pool's move_kv_cache: the partial page's K/V copied into each branch's page
                self.draft_pool.move_kv_cache(tgt, src)
            out = out[: bs * topk * steps]
        self.scratch = out.tolist()
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs * topk, dtype=torch.int64),
            req_pool_indices=rows_t, seq_lens=seq, out_cache_loc=out, seq_lens_sum=int(seq.sum()),
            seq_lens_cpu=seq.clone(), positions=seq.repeat_interleave(topk), rids=[f"r{r}" for r in rows])
        bonus = torch.tensor([self.own[r][-1] for r in rows])
        guesses = torch.stack([(bonus + 1 + k) % _v2.VOCAB for k in range(topk)], dim=1)
        fb.spec_info = EagleDraftInput(topk_p=torch.full((bs, topk), 1.0 / topk), topk_index=guesses,
                                       hidden_states=torch.zeros(bs, 2), bonus_tokens=bonus)
        return fb

    def v1_draft_phase(self, rows):
        """``EAGLEWorker.draft``: the captured phase replayed (``EAGLEDraftCudaGraphRunner.replay``) where it can
        run, else sglang's ``draft_forward``, each through the plugin's AROUND hooks."""
        fb = self.v1_draft_batch(rows)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return around_draft_graph_replay(EAGLEDraftCudaGraphRunner.replay, self.graph_runner, fb)
        return self.v1_worker.draft_forward(fb)

    def v1_draft_extend(self, rows, accept_lens):
        """``forward_draft_extend_after_decode``: the verify kept ``a`` nodes (slots re-laid at ``[c, c + a)``); the
        DRAFT_EXTEND feeds the appended tokens (positions ``c + j``: the token at ``c + 1 + j``)."""
        fed, prefix = {}, {}
        for row, a in zip(rows, accept_lens):
            c = self.committed[row]
            self.r2t[row, c:c + a] = torch.tensor(self._slots(row, c, a), dtype=torch.int32)
            appended = [(self.own[row][-1] + 7 * (j + 1)) % _v2.VOCAB for j in range(a)]
            fed[row], prefix[row] = appended, c
            self.own[row] = self.own[row] + appended
            self.convention_positions[row].update(range(c, c + a))
            self.committed[row] = self.alloc[row] = c + a
        fb = self._extend_batch(fed, prefix, ForwardMode.DRAFT_EXTEND)
        fb.input_ids = fb.input_ids.to(torch.int32)  # accept_tokens: the verify's int32 predictions
        self.run_draft_extend(fb, accept=torch.tensor(accept_lens, dtype=torch.int32))


def _v1_rounds(h, rows, accepts):
    for acc in accepts:
        h.v1_draft_phase(rows)
        h.v1_draft_extend(rows, acc)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_v1_draft_rounds_raise_nothing_count_every_forward_and_keep_the_token_offset(page_size, kernels):
    h = V1DraftHarness(steps=3, page_size=page_size, kernels=kernels)
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11]}, sampled={1: 12, 2: 13})
    accepts = [[4, 1], [2, 3], [1, 1], [3, 4]]
    verified = []
    for acc in accepts:
        before = int(h.counters()[fp.C_SLOTS_VERIFIED])
        c = sum(h.committed[r] for r in (1, 2))
        h.v1_draft_phase([1, 2])
        # each of the steps - 1 draft forwards read the committed prefix [0, c) of both requests
        verified.append((int(h.counters()[fp.C_SLOTS_VERIFIED]) - before, (h.steps - 1) * c))
        h.v1_draft_extend([1, 2], acc)
    c = h.counters()
    assert int(c[fp.C_VIOLATIONS]) == 0 and h.manager.health_violations == 0
    assert all(got == want for got, want in verified), verified
    # one prefill, four draft extends, and per round steps - 1 = 2 draft decode steps (managers 0 and 1)
    assert h.manager.forwards == 1 + 4 * (2 + 1) and h.manager.outer_steps == 1 + 4 * 2
    assert h.sfm_log == [0] + [0, 1, 0] * 4
    assert int(c[fp.C_FORWARD_INDEX]) == h.manager.forwards == int(c[fp.C_VERIFY_LAUNCHES])
    # the scratch slots are not written (freed right after the phase): the prefill and the kept tokens only
    assert int(c[fp.C_SLOTS_WRITTEN]) == 7 + sum(map(sum, accepts))
    rec = h.manager.groups[0].records
    for row in (1, 2):
        for p in sorted(h.convention_positions[row]):
            slot = int(h.r2t[row, p])
            assert int(rec[slot, fp.F_POSITION]) == p
            assert int(rec[slot, fp.F_TOKEN]) == h.own[row][p + 1], (row, p)  # slot p: the KV of token p + 1


def test_a_v1_draft_step_reads_the_committed_prefix_and_writes_nothing():
    h = V1DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, sampled={1: 11, 2: 12})
    fb = h.v1_draft_batch([1, 2])
    fb.input_ids = torch.zeros(2 * TOPK, dtype=torch.int64)
    fb.out_cache_loc = fb.out_cache_loc.reshape(2, TOPK, 3).permute(2, 0, 1).reshape(3, -1)[0]  # step 0's lanes
    adapter = h.manager._adapter
    views = []
    for step in range(2):
        fb.kv_canary_draft_step = step
        views.append(adapter.view(fb))
    assert [v.seq_lens.tolist() for v in views] == [[4, 2], [4, 2]]  # [0, c) per request, whatever the step
    assert all(v.new_lens.tolist() == [0, 0] and v.max_new_len == 0 and not v.staged for v in views)
    assert all(v.unrecorded_stores for v in views)  # HEAD forgets the scratch slots' old records
    assert views[0].seq_lens.data_ptr() != views[1].seq_lens.data_ptr()  # a buffer per step (graph-safe)
    assert adapter.num_tokens(fb) == 0 and adapter.written_slots(fb) == []
    assert adapter.host_batch(fb).new_lens == [0, 0]
    fb.out_cache_loc = fb.out_cache_loc.clone()
    fb.out_cache_loc[TOPK:] = 0  # a CUDA-graph padding request (out_cache_loc 0): reads nothing
    assert adapter.view(fb).seq_lens.tolist() == [4, 0]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupt_committed_draft_slot_is_caught_by_a_v1_draft_step(page_size):
    h = V1DraftHarness(steps=3, page_size=page_size)
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    _v1_rounds(h, [1], [[2]])
    slot = int(h.r2t[1, 3])
    h.k[slot, 0, 1] += 1.0  # a flipped K value of a committed draft slot
    with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*slot={slot}"):
        h.v1_draft_phase([1])


def test_a_redirected_req_to_token_entry_is_caught_in_a_v1_draft_step():
    h = V1DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    h.r2t[1, 2] = h.r2t[1, 4]  # the row points position 2 at position 4's draft slot
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.v1_draft_phase([1])


def test_a_corrupt_scratch_slot_is_not_read_as_a_prefix():
    """The documented gap: a scratch slot (a branch's in-phase draft KV) is not verified; it is freed right after the
    phase and the next owner's write renews its record, so corrupting it reports nothing."""
    h = V1DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8]}, sampled={1: 9})
    h.v1_draft_phase([1])
    h.k[h.scratch[0], 0, 0] += 5.0
    h.v1_draft_extend([1], [2])
    _v1_rounds(h, [1], [[3], [1]])
    assert int(h.counters()[fp.C_VIOLATIONS]) == 0


def _recycle_scratch(h):
    """Two finished requests (rows 6, 7) whose draft prefills recorded the slots the next draft phases take as
    scratch (and, page size > 1 with topk > 1, the branch pages the last partial page is copied into): sglang hands
    freed slots out again, their records stay."""
    if h.page_size == 1:
        saved, h._next_slot = h._next_slot, SCRATCH
    else:
        saved, h._pages = h._pages, iter(range(SCRATCH // h.page_size, _v2.SLOTS // h.page_size))
    h.prefill({row: [(row + i) % _v2.VOCAB for i in range(90)] for row in (6, 7)}, sampled={6: 19, 7: 20})
    if h.page_size == 1:
        h._next_slot = saved
    else:
        h._pages = saved


@pytest.mark.parametrize("page_size,kernels,broken,graph_bs", [
    (1, "torch", None, ()), (1, "triton", None, ()), (16, "torch", None, ()), (16, "triton", None, ()),
    (1, "torch", None, (1, 2, 4)), (16, "torch", None, (1, 2, 4)), (1, "torch", "view", ()),
    (16, "torch", "move", ())])
def test_recycled_scratch_slots_are_forgotten_so_the_scrub_stays_quiet(page_size, kernels, broken, graph_bs):
    """``all`` (the scrub over the whole draft pool every forward): a draft decode phase stores its K/V into scratch
    slots earlier requests' draft TAILs recorded, and records none. HEAD forgets the step's ``out_cache_loc``
    records (``unrecorded_stores``; replayed with 3 requests padded to 4: the padding lanes' slot 0), the wrapped
    ``move_kv_cache`` the branch copies of the last partial page (page size 16): nothing is reported. Before the
    fix the scrub read each scratch slot's new bytes against the old record (the CPU e2e's ``kv_hash rid=scrub
    group=draft`` rows): ``broken`` puts back the view without the forget, or the move without it."""
    h = V1DraftHarness(steps=3, page_size=page_size, kernels=kernels, graph_bs=graph_bs, real_data=RealData.ALL,
                       scrub_slots_per_forward=_v2.SLOTS)
    _recycle_scratch(h)
    rows = [1, 2, 3]
    h.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12, 13], 3: [16, 17]}, sampled={1: 14, 2: 15, 3: 18})
    if broken == "view":
        view = h.manager._adapter.view
        h.manager._adapter.view = lambda fb: dataclasses.replace(view(fb), unrecorded_stores=False)
    if broken == "move":
        h.draft_pool.move_kv_cache = h.move_kv_cache
    recorded = h.manager.groups[0].records[:, fp.F_CHAIN] != 0
    if broken:
        with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*rid=scrub"):
            _v1_rounds(h, rows, [[2, 1, 3], [1, 3, 2]])
        return
    h.v1_draft_phase(rows)
    # the steps - 1 draft forwards' scratch slots (request-major [bs, topk, steps]; the last step only samples, its
    # slots stay unwritten and keep their records) were recorded, and are forgotten
    stored = torch.tensor(h.scratch).view(len(rows), TOPK, h.steps)[:, :, : h.steps - 1].flatten()
    assert bool(recorded[stored].all()) and not h.manager.groups[0].records[stored].any()
    h.v1_draft_extend(rows, [2, 1, 3])
    _v1_rounds(h, rows, [[1, 3, 2], [3, 2, 1]])
    assert int(h.counters()[fp.C_VIOLATIONS]) == 0 and h.manager.health_violations == 0
    assert int(h.counters()[fp.C_SLOTS_SCRUBBED]) > 0 and not h.manager.groups[0].records[0].any()
    assert h.manager.graph_forwards == (3 * (2 + 1) if graph_bs else 0)  # replayed: the phases' steps, extends


def test_the_v1_draft_pool_is_verified_with_cuda_graphs_and_the_init_hook_starts_reporting():
    """spec v1's draft pool is verified eager and under CUDA graphs alike (EAGLEDraftCudaGraphRunner /
    EAGLEDraftExtendCudaGraphRunner: the replayed tests below); EAGLEWorker.__init__'s AFTER hook starts reporting."""
    args = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2, disable_overlap_schedule=True,
                device="cuda", disaggregation_mode="null")
    for graphs_off in (True, False):
        assert draft_skip_reason(SimpleNamespace(**args, disable_cuda_graph=graphs_off), "raise") == ""
    started = []
    manager = SimpleNamespace(mark_init_finished=lambda: started.append(1))
    target = SimpleNamespace()
    worker = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=True, canary_manager=manager),
                             target_worker=SimpleNamespace(model_runner=target))
    after_eagle_v1_worker_init(None, worker)
    assert started == [1] and target.kv_canary_draft_manager is manager


def _slot_records(h):
    """(row, position) -> the draft pool's record of the slot the row holds there (every committed position)."""
    rec = h.manager.groups[0].records
    return {(row, p): rec[int(h.r2t[row, p])].tolist() for row, c in h.committed.items() for p in range(c)}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_v1_draft_rounds_replayed_from_cuda_graphs_verify_and_record_what_the_eager_rounds_do(page_size, kernels):
    """sglang's own EAGLEDraftCudaGraphRunner (bs * topk lanes) and EAGLEDraftExtendCudaGraphRunner (spec v1's
    DRAFT_EXTEND: the kept tokens packed, the rest of the bs * (num_steps + 1) token slots at out_cache_loc 0, padding
    requests at the fill value) replay the captured HEAD/TAIL: batches of 2 (a captured size) and 3 (padded to 4)
    verify and record exactly what the same rounds do eagerly, with no violation, every replay counted."""
    rows = {1: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14, 15, 16, 17, 18]}
    sampled = {1: 19, 2: 20, 3: 21}
    accepts = [[4, 1, 2], [2, 3, 4], [1, 1, 1], [3, 4, 2]]
    results = []
    for graph_bs in ((), (1, 2, 4)):
        h = V1DraftHarness(steps=3, page_size=page_size, kernels=kernels, graph_bs=graph_bs)
        h.prefill(rows, sampled=sampled)
        # the row a padding request reads as (req_pool_indices 0) holds a finished request's stale entries: a padding
        # request that read anything would report a false position violation
        h.r2t[0, :4] = h.r2t[1, 1:5]
        for acc in accepts:
            h.v1_draft_phase([1, 2])
            h.v1_draft_extend([1, 2], acc[:2])
            h.v1_draft_phase([1, 2, 3])
            h.v1_draft_extend([1, 2, 3], acc)
        c = h.counters()
        assert int(c[fp.C_VIOLATIONS]) == 0 and h.manager.health_violations == 0
        results.append((h, [int(c[i]) for i in (fp.C_SLOTS_VERIFIED, fp.C_SLOTS_WRITTEN)], _slot_records(h)))
    (eager, eager_counts, eager_records), (graph, graph_counts, graph_records) = results
    assert graph.manager.graph_forwards == 8 * (2 + 1) and eager.manager.graph_forwards == 0  # phases + extends
    assert graph_counts == eager_counts and eager_counts[0] > 0
    assert graph_records == eager_records


def test_a_corrupt_committed_slot_is_caught_by_a_replayed_v1_draft_phase():
    h = V1DraftHarness(steps=3, graph_bs=(1, 2, 4))
    h.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12, 13], 3: [16, 17]}, sampled={1: 14, 2: 15, 3: 18})
    _v1_rounds(h, [1, 2, 3], [[2, 3, 1]])
    assert h.manager.graph_forwards == 2 + 1  # the phase's two steps and the extend, replayed (3 padded to 4)
    slot = int(h.r2t[2, 4])  # a kept token's slot, written by the replayed DRAFT_EXTEND
    h.k[slot, 0, 2] += 1.0
    with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*slot={slot}"):
        h.v1_draft_phase([1, 2, 3])  # padded to 4 requests: the padding request reads nothing


def test_a_v1_draft_extend_is_viewed_with_int64_ids_like_every_precompiled_variant():
    """spec v1's DRAFT_EXTEND is fed ``accept_tokens`` (int32): a JIT after startup on the first one (the CPU e2e
    logged ``kv_canary_jit_after_startup`` for the int32 variant) unless the view copies them into int64."""
    h = V1DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, sampled={1: 11, 2: 12})
    h.v1_draft_phase([1, 2])
    fb = h._extend_batch({1: [13, 14, 15], 2: [17]}, {1: 4, 2: 2}, ForwardMode.DRAFT_EXTEND)
    fb.input_ids = fb.input_ids.to(torch.int32)
    view = h.manager._adapter.view(fb)
    assert view.input_ids.dtype == torch.int64 and view.input_ids.tolist() == [13, 14, 15, 17] and view.staged
    assert view.seq_lens.tolist() == [7, 3] and view.new_lens.tolist() == [3, 1]  # reads [0, c), writes [c, c + a)
