"""EAGLE (spec v2, topk 1): the draft model's own KV pool, verified by its own manager, no false alarm.

Real sglang 0.5.12 objects and code where the draft's layout comes from: the batches are
``ForwardBatch`` objects in the modes the draft worker runs (EXTEND for the draft prefill,
DECODE for each draft step, DRAFT_EXTEND_V2 after a verify); the rows are over-allocated by
sglang's ``assign_req_to_token_pool_func`` and the draft steps' slots come from sglang's
``assign_draft_cache_locs_page_size_1`` (Triton, under the interpreter on CPU), as
``prepare_for_decode`` / ``prepare_for_v2_draft`` lay them out; the draft decode loop is sglang's
own ``EagleDraftWorker.draft_forward`` (its ``out_cache_loc`` per step, ``positions.add_(1)``),
run through the plugin's hooks (``around_draft_forward``, ``route_draft_runner_forward``) with a
stand-in draft runner whose "model" writes K/V at ``out_cache_loc`` like attention does.
Page size 1 and 16. The token convention (draft slot p holds the KV of token p + 1) is checked in
the records the TAIL wrote.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.batch_adapter import SglangBatchAdapter
from kv_canary.adapter.draft import (
    DraftBatchAdapter, after_draft_worker_init, around_draft_forward, draft_skip_reason, record_target_cuda_graph_setting,
    route_draft_runner_forward,
)
from kv_canary.api import _patch_model_forward
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig, CanaryConfigError, CanaryMode, KernelBackend
from kv_canary.draft_pool import (
    DRAFT_GROUP, DRAFT_STATS_PREFIX, DraftCanaryManager, draft_config, target_config,
)
from kv_canary.kernels import reference as ref
from kv_canary.kernels import CanaryKernels, select_kernels
from kv_canary.views import LaunchCapacities
from kv_canary.violations import CanaryViolationError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter (CPU CI); on a GPU "
           "host test_e2e_speculative*.py cover EAGLE with real CUDA graphs")

sglang_fb = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
ForwardBatch, ForwardMode = sglang_fb.ForwardBatch, sglang_fb.ForwardMode
from sglang.srt.speculative.eagle_info_v2 import assign_draft_cache_locs_page_size_1  # noqa: E402
from sglang.srt.speculative.spec_utils import assign_req_to_token_pool_func  # noqa: E402


def _eagle_draft_worker():
    """sglang's ``EagleDraftWorker`` class; its module imports sgl_kernel, which needs a ``libcuda.so.1``: on a
    machine without the NVIDIA driver the stand-in the CPU e2e servers use is loaded first (by soname)."""
    try:
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    except ImportError:
        import ctypes

        from kv_canary_testing.libcuda_stub import ensure_libcuda_stub

        ctypes.CDLL(str(ensure_libcuda_stub() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    return EagleDraftWorker


EagleDraftWorker = _eagle_draft_worker()

SLOTS, CTX, ROWS, VOCAB = 512, 96, 8, 64


class DraftModel(torch.nn.Module):
    """Writes K/V at out_cache_loc (attention's write); predicts token + 1 (the draft's guess)."""

    def __init__(self, k, v):
        super().__init__()
        self.k, self.v = k, v

    def forward(self, input_ids, positions, forward_batch):
        loc = forward_batch.out_cache_loc
        self.k[loc] = input_ids.float()[:, None, None] + positions.float()[:, None, None] / 100
        self.v[loc] = -self.k[loc]
        return input_ids


class DraftHarness:
    """sglang spec v2's draft side for a few requests: prefill, draft phases, draft extends after verifies."""

    def __init__(self, *, steps: int = 3, page_size: int = 1, mode=CanaryMode.RAISE, adapter=DraftBatchAdapter,
                 kernels: str = "torch"):
        self.steps, self.n, self.page_size = steps, steps + 1, page_size  # topk 1: n = num_steps + 1
        self.k = torch.zeros(SLOTS, 1, 4)
        self.v = torch.zeros(SLOTS, 1, 4)
        config = draft_config(CanaryConfig(mode=mode, d2h_delay_steps=0, stats_print_every_n_steps=0))
        group = build_group(PoolLayout(DRAFT_GROUP, [self.k], [self.v]), config, torch.device("cpu"))
        self.r2t = torch.zeros(ROWS, CTX, dtype=torch.int32)
        self.sfm_log = []
        self.manager = DraftCanaryManager(
            config=config, groups=[group],
            kernels=CanaryKernels("torch", ref.launch_verify, ref.launch_write, ref.launch_scrub,
                                  ref.launch_index_sweep, graph_safe=False),
            req_to_token=self.r2t,
            capacities=LaunchCapacities(max_batch_size=ROWS + 1, max_context_len=CTX, verify_programs_target=1),
            batch_adapter=adapter(max_batch_size=ROWS + 1, device=torch.device("cpu"),
                                  **({"draft_tokens_per_request": self.n, "decode_steps": max(1, steps - 1)}
                                     if adapter is DraftBatchAdapter else {})),
            device=torch.device("cpu"), num_single_forward_managers=max(1, steps - 1),
        )
        if kernels == "triton":  # the kernels a GPU and the CPU e2e run (the interpreter on CPU)
            triton = select_kernels(KernelBackend.TRITON, torch.device("cpu"))
            self.manager.kernels = triton
            for sfm in self.manager.single_forward_managers:
                sfm._kernels = triton
        for sfm in self.manager.single_forward_managers:  # which manager each forward ran on
            orig = sfm.pre_ops_maybe_inside_graph
            sfm.pre_ops_maybe_inside_graph = lambda view, _o=orig, _i=sfm.index: (self.sfm_log.append(_i), _o(view))
        self.model = DraftModel(self.k, self.v)
        _patch_model_forward(self.model, self.manager)
        self.runner = SimpleNamespace(is_draft_worker=True, canary_manager=self.manager, kv_canary_draft_steps=None)
        self.runner.forward = self._runner_forward
        self.worker = SimpleNamespace(
            draft_runner=self.runner, speculative_num_steps=steps, topk=1, hot_token_id=None,
            speculative_num_draft_tokens=self.n, draft_attn_backend=SimpleNamespace(attn_backends=[None] * steps),
            target_worker=SimpleNamespace(model_runner=SimpleNamespace()),
        )
        after_draft_worker_init(None, self.worker)  # EagleDraftWorker.__init__'s AFTER hook: reporting on
        assert self.worker.target_worker.model_runner.kv_canary_draft_manager is self.manager
        self.own = {}  # row -> the request's tokens (the scheduler's record)
        self.committed = {}  # row -> positions with KV (c)
        self.alloc = {}  # row -> kv_allocated_len
        self._next_slot = 1
        self._pages = iter(range(1, SLOTS // page_size))
        self._row_pages = {}
        self.convention_positions = {}  # row -> positions whose draft slot must hold token p + 1

    # ---- the draft ModelRunner.forward, through the plugin's hook ----------------------------

    def _runner_forward(self, fb, skip_attn_backend_init=False):
        def original(runner, forward_batch, *a, **kw):
            ids = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            logits = torch.nn.functional.one_hot((ids.to(torch.int64) + 1) % VOCAB, VOCAB).float()
            return SimpleNamespace(logits_output=SimpleNamespace(
                next_token_logits=logits, hidden_states=torch.zeros(ids.shape[0], 2)))

        return route_draft_runner_forward(original, self.runner, fb, skip_attn_backend_init=skip_attn_backend_init)

    # ---- sglang's row layout ----------------------------------------------------------------

    def _slots(self, row, start, count, fresh=True):
        if self.page_size == 1:
            out = list(range(self._next_slot, self._next_slot + count))
            self._next_slot += count
            return out
        out = []
        for p in range(start, start + count):
            key = (row, p // self.page_size)
            if key not in self._row_pages:
                self._row_pages[key] = next(self._pages)
            out.append(self._row_pages[key] * self.page_size + p % self.page_size)
        return out

    def _extend_batch(self, rows_ids, prefix, mode=ForwardMode.EXTEND):
        """rows_ids: {row: fed ids}; prefix: {row: extend prefix length}; the row's slots must exist."""
        ids, locs, pos, ext, pre, seqs = [], [], [], [], [], []
        for row, fed in rows_ids.items():
            p, k = prefix[row], len(fed)
            ids += fed
            locs += self.r2t[row, p:p + k].tolist()
            pos += list(range(p, p + k))
            ext.append(k)
            pre.append(p)
            seqs.append(p + k)
        i32 = dict(dtype=torch.int32)
        # DRAFT_EXTEND_V2 is fed the verify's next_token_ids: int32 (EagleVerifyInput.sample's predict)
        id_dtype = torch.int32 if mode == ForwardMode.DRAFT_EXTEND_V2 else torch.int64
        return ForwardBatch(
            forward_mode=mode, batch_size=len(rows_ids), input_ids=torch.tensor(ids, dtype=id_dtype),
            req_pool_indices=torch.tensor(list(rows_ids)), seq_lens=torch.tensor(seqs),
            out_cache_loc=torch.tensor(locs, dtype=torch.int64), seq_lens_sum=sum(seqs),
            seq_lens_cpu=torch.tensor(seqs), positions=torch.tensor(pos), rids=[f"r{r}" for r in rows_ids],
            extend_seq_lens=torch.tensor(ext, **i32), extend_prefix_lens=torch.tensor(pre, **i32),
            extend_start_loc=torch.tensor([sum(ext[:i]) for i in range(len(ext))], **i32),
            extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre, extend_num_tokens=sum(ext),
        )

    # ---- the draft worker's forwards ----------------------------------------------------------

    def prefill(self, rows_tokens, sampled, shared=None, chunk_end=None):
        """Target prefill of ``rows_tokens`` (new tokens after ``shared[row]`` radix-cached positions whose slots
        are ``self.r2t[shared_row, :P]``), then ``_draft_extend_for_prefill``: ids shifted left, sampled appended.

        shared: {row: (source row, P)}; chunk_end: {row: True} for an unfinished chunk (the sample is thrown away).
        """
        shared = shared or {}
        fed, prefix = {}, {}
        for row, toks in rows_tokens.items():
            p = self.committed.get(row, 0)
            if row in shared:
                src, p = shared[row]
                self.r2t[row, :p] = self.r2t[src, :p]
                self.own[row] = self.own[src][:p]
                if self.page_size > 1:  # the shared pages are the source row's
                    for q in range(0, p, self.page_size):
                        self._row_pages[(row, q // self.page_size)] = self._row_pages[(src, q // self.page_size)]
            self.r2t[row, p:p + len(toks)] = torch.tensor(self._slots(row, p, len(toks)), dtype=torch.int32)
            self.own[row] = self.own.get(row, [])[:p] + list(toks)
            fed[row] = list(toks[1:]) + [sampled[row]]
            prefix[row] = p
            end = p + len(toks)
            # convention: position q holds token q + 1 where this forward fed the request's own next token
            keep = range(p, end if (chunk_end or {}).get(row) else end - 1)
            self.convention_positions.setdefault(row, set()).update(keep)
            self.committed[row] = self.alloc[row] = end
        self.runner.forward(self._extend_batch(fed, prefix))
        for row in rows_tokens:
            if not (chunk_end or {}).get(row):
                self.own[row] = self.own[row] + [sampled[row]]  # the bonus token: fed at c by the next verify

    def _prepare_for_decode(self, rows):
        cur, nxt, locs = [], [], []
        for row in rows:
            c, want = self.alloc[row], max(self.alloc[row], self.committed[row] + 2 * self.n)
            cur.append(c)
            nxt.append(want)
            locs += self._slots(row, c, want - c)
            self.alloc[row] = want
        assign_req_to_token_pool_func(torch.tensor(rows), self.r2t, torch.tensor(cur), torch.tensor(nxt),
                                      torch.tensor(locs, dtype=torch.int64), len(rows))

    def draft_batch(self, rows):
        """prepare_for_v2_draft: the DECODE ForwardBatch draft_forward runs its steps on."""
        self._prepare_for_decode(rows)
        bs = len(rows)
        seq = torch.tensor([self.committed[r] for r in rows])
        out = torch.empty(bs * self.steps, dtype=torch.int64)
        assign_draft_cache_locs_page_size_1[(bs,)](torch.tensor(rows), self.r2t, seq, out, self.r2t.shape[1], 1,
                                                   self.steps)
        bonus = torch.tensor([self.own[r][-1] for r in rows])
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=bonus.clone(),
            req_pool_indices=torch.tensor(rows), seq_lens=seq, out_cache_loc=out, seq_lens_sum=int(seq.sum()),
            seq_lens_cpu=seq.clone(), positions=seq.clone(), rids=[f"r{r}" for r in rows],
        )
        # the draft extend's output: the draft's first guess (token after the bonus), as draft_forward reads it
        fb.spec_info = SimpleNamespace(topk_p=torch.ones(bs, 1), topk_index=((bonus + 1) % VOCAB)[:, None],
                                       hidden_states=torch.zeros(bs, 2))
        return fb

    def draft_phase(self, rows):
        """EagleDraftWorker.draft_forward (sglang's own loop) through the plugin's AROUND hook."""
        fb = self.draft_batch(rows)
        return around_draft_forward(EagleDraftWorker.draft_forward, self.worker, fb)

    def draft_extend(self, rows, accept_lens):
        """Target verify accepted ``accept_lens`` (bonus included); ``_draft_extend_for_decode``'s DRAFT_EXTEND_V2."""
        fed, prefix = {}, {}
        for row, a in zip(rows, accept_lens):
            c = self.committed[row]
            appended = [(self.own[row][-1] + 7 * (j + 1)) % VOCAB for j in range(a)]  # the target's tokens
            fed[row] = appended + [0] * (self.n - a)  # predict past the accepted ones: never appended
            prefix[row] = c
            self.own[row] = self.own[row] + appended
            self.convention_positions[row].update(range(c, c + a))
            self.committed[row] = c + a
        self.runner.forward(self._extend_batch(fed, prefix, ForwardMode.DRAFT_EXTEND_V2))

    def counters(self):
        self.manager.poll(drain=True)
        return self.manager.last_counters


def _rounds(h, rows, accepts):
    for acc in accepts:
        h.draft_phase(rows)
        h.draft_extend(rows, acc)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_rounds_raise_nothing_and_keep_the_token_offset(page_size, kernels):
    """Also the Triton kernels: draft_forward's per-step out_cache_loc is a strided view (a flat read of it
    wrote other requests' slots: the view copies it into a contiguous buffer)."""
    h = DraftHarness(steps=3, page_size=page_size, kernels=kernels)
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11]}, sampled={1: 12, 2: 13})
    _rounds(h, [1, 2], [[4, 1], [2, 3], [1, 1], [4, 4]])
    c = h.counters()
    assert int(c[fp.C_VIOLATIONS]) == 0
    # one prefill, four draft extends, and per round steps - 1 = 2 decode steps (managers 0 and 1)
    assert h.manager.forwards == 1 + 4 * (2 + 1) and h.manager.outer_steps == 1 + 4 * 2
    assert h.sfm_log == [0] + [0, 1, 0] * 4
    assert int(c[fp.C_FORWARD_INDEX]) == h.manager.forwards == int(c[fp.C_VERIFY_LAUNCHES])
    rec = h.manager.groups[0].records
    for row in (1, 2):
        for p in sorted(h.convention_positions[row]):
            slot = int(h.r2t[row, p])
            assert int(rec[slot, fp.F_POSITION]) == p
            assert int(rec[slot, fp.F_TOKEN]) == h.own[row][p + 1], (row, p)  # slot p: the KV of token p + 1


def test_a_draft_step_reads_the_committed_prefix_plus_the_earlier_steps():
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8]}, sampled={1: 9})
    fb = h.draft_batch([1])
    adapter = h.manager._adapter
    views = []
    for step in range(2):
        fb.kv_canary_draft_step = step
        views.append(adapter.view(fb))
    c = h.committed[1]
    assert [int(v.seq_lens[0]) for v in views] == [c + 1, c + 2]  # reads [0, c + i], writes position c + i
    assert all(int(v.new_lens[0]) == 1 and not v.staged for v in views)
    assert views[0].seq_lens.data_ptr() != views[1].seq_lens.data_ptr()  # a buffer per step (graph-safe)
    before = int(h.counters()[fp.C_SLOTS_VERIFIED])
    around_draft_forward(EagleDraftWorker.draft_forward, h.worker, fb)
    assert int(h.counters()[fp.C_SLOTS_VERIFIED]) - before == c + (c + 1)


def test_a_draft_extend_is_viewed_with_int64_ids_like_every_precompiled_variant():
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, sampled={1: 11, 2: 12})
    h.draft_phase([1, 2])
    fb = h._extend_batch({1: [13, 14, 15, 16], 2: [17, 18, 19, 20]}, {1: 4, 2: 2}, ForwardMode.DRAFT_EXTEND_V2)
    view = h.manager._adapter.view(fb)
    assert fb.input_ids.dtype == torch.int32 and view.input_ids.dtype == torch.int64
    assert view.input_ids.tolist() == fb.input_ids.tolist() and view.staged  # an extend view
    assert view.seq_lens.tolist() == [8, 6] and view.new_lens.tolist() == [4, 4]  # reads [0, c), writes [c, c + n)


def test_the_targets_decode_view_on_a_draft_step_would_be_a_false_alarm():
    """Without the step view (the target's adapter), step 0's TAIL sees position c fed at sequence index c - 1."""
    h = DraftHarness(steps=3, adapter=SglangBatchAdapter)
    h.prefill({1: [5, 6, 7, 8]}, sampled={1: 9})
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.draft_phase([1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_prefix_and_chunk_boundaries_are_not_reported(page_size):
    """The draft slots sglang leaves with another token's KV (a cached prefix's last slot, an unfinished chunk's
    last slot) chain and hash correctly: no token check in the draft pool, so no false alarm."""
    h = DraftHarness(steps=2, page_size=page_size)
    h.prefill({1: list(range(3, 3 + 32))}, sampled={1: 50})
    _rounds(h, [1], [[2], [3]])
    # row 2 shares row 1's first 16 positions (the radix match) and continues with its own tokens in two chunks
    h.prefill({2: [60, 61, 62]}, sampled={2: 40}, shared={2: (1, 16)}, chunk_end={2: True})
    h.prefill({2: [63, 1, 2]}, sampled={2: 41})
    assert h.own[1][16] != h.own[2][16] and int(h.r2t[2, 15]) == int(h.r2t[1, 15])
    _rounds(h, [1, 2], [[1, 3], [3, 2]])
    assert int(h.counters()[fp.C_VIOLATIONS]) == 0
    rec = h.manager.groups[0].records
    # what sglang left: row 1's token at the shared slot 15, the thrown-away sample at the chunk's last slot
    assert int(rec[int(h.r2t[2, 15]), fp.F_TOKEN]) == h.own[1][16]
    assert int(rec[int(h.r2t[2, 18]), fp.F_TOKEN]) == 40


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupt_draft_slot_is_caught_by_the_next_draft_forward(page_size):
    h = DraftHarness(steps=3, page_size=page_size)
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    _rounds(h, [1], [[2]])
    slot = int(h.r2t[1, 3])
    h.k[slot, 0, 1] += 1.0  # a flipped K value of a committed draft slot
    with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*slot={slot}"):
        h.draft_phase([1])


def test_a_redirected_req_to_token_entry_is_caught_in_a_draft_step():
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    h.r2t[1, 2] = h.r2t[1, 4]  # the row points position 2 at position 4's draft slot
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.draft_phase([1])


def test_stats_lines_are_the_draft_pools_own(caplog):
    h = DraftHarness(steps=2)
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    h.counters()
    line = h.manager.stats_line()
    assert line.startswith(DRAFT_STATS_PREFIX + "=") and "slots_written=3" in line


def test_draft_and_target_configs():
    base = CanaryConfig(mode=CanaryMode.RAISE, sweep_interval=4, perturb_real_kv_used_prob=0.2)
    d = draft_config(base)
    assert not d.uses_token_oracle and d.write_input_assert and d.sweep_interval == 0
    assert not d.any_perturbation  # perturbations stay in the target's pool by default
    assert target_config(base, "") is base
    to_draft = dataclasses.replace(base, perturb_target_group=DRAFT_GROUP)
    assert draft_config(to_draft).perturb_real_kv_used_prob == 0.2
    assert draft_config(to_draft).perturb_target_group == ""
    assert not target_config(to_draft, "").any_perturbation
    with pytest.raises(CanaryConfigError, match="SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=draft"):
        target_config(to_draft, "no --speculative-algorithm")


def test_the_draft_pool_is_skipped_under_cuda_graphs_and_said_why():
    args = SimpleNamespace(speculative_algorithm="EAGLE", device="cuda", disable_cuda_graph=False,
                           disaggregation_mode="null")

    def but(**kw):
        recorded = SimpleNamespace(**{**vars(args), **kw})
        record_target_cuda_graph_setting(recorded)  # what the target's install does first
        return recorded

    assert "not recorded" in draft_skip_reason(args, "raise")  # no target install seen: never verify the draft
    assert "--disable-cuda-graph" in draft_skip_reason(but(), "raise")
    assert draft_skip_reason(but(disable_cuda_graph=True), "raise") == ""
    assert draft_skip_reason(but(device="cpu"), "raise") == ""
    assert "contain" in draft_skip_reason(but(device="cpu"), "contain")
    assert "--disaggregation-mode decode" in draft_skip_reason(but(device="cpu", disaggregation_mode="decode"), "log")
    assert draft_skip_reason(SimpleNamespace(speculative_algorithm=None), "raise")


def test_eagle_flipping_disable_cuda_graph_for_its_draft_runner_does_not_enable_the_draft_pool():
    """sglang 0.5.12's EagleDraftWorker.__init__ (spec v2) sets server_args.disable_cuda_graph = True while it builds the
    draft's ModelRunner (its own graph runners capture afterwards). Found on an H200: the draft pool was
    installed, its graph replays ran HEAD/TAIL the host never counted, and health violations stopped the
    server. The target's recorded setting decides."""
    import inspect

    from sglang.srt.speculative import eagle_worker_v2

    src = inspect.getsource(eagle_worker_v2.EagleDraftWorker.__init__)
    assert "server_args.disable_cuda_graph = True" in src  # the flip this guards against
    args = SimpleNamespace(speculative_algorithm="EAGLE", device="cuda", disable_cuda_graph=False,
                           disaggregation_mode="null")
    record_target_cuda_graph_setting(args)  # the target's install, graphs on
    args.disable_cuda_graph = True  # EagleDraftWorker building the draft runner
    assert "--disable-cuda-graph" in draft_skip_reason(args, "raise")


def test_the_draft_pools_bytes_are_held_back_with_the_targets():
    from kv_canary.api import canary_reserved_bytes

    def runner(**args):
        server_args = SimpleNamespace(kv_canary="raise", kv_canary_sweep_interval=0, kv_canary_real_data="partial",
                                      device="cpu", disable_cuda_graph=True, max_running_requests=8,
                                      disaggregation_mode="null", **args)
        return SimpleNamespace(server_args=server_args, is_draft_worker=False,
                               model_config=SimpleNamespace(context_len=256, is_hybrid_swa=False))

    budget = 1 << 24
    plain = canary_reserved_bytes(runner(speculative_algorithm=None), budget)
    eagle = canary_reserved_bytes(runner(speculative_algorithm="EAGLE"), budget)
    slots = budget // 1024  # at most the slots the budget buys at the fallback cell size
    assert eagle - plain >= 4096 * fp.RING_WIDTH * 8 + slots // 2 * fp.RECORD_WIDTH * 8


def test_an_unsupported_draft_pool_is_skipped_and_said(caplog):
    """The target stays verified (as before the draft pool was); a draft-targeted perturbation is refused."""
    from kv_canary.api import install_draft_canary
    from kv_canary.draft_pool import DRAFT_NOT_VERIFIED

    class SomeOtherPool:
        pass

    runner = SimpleNamespace(device="cpu", token_to_kv_pool=SomeOtherPool())
    args = SimpleNamespace(speculative_algorithm="EAGLE")
    with caplog.at_level("WARNING", logger="kv_canary"):
        assert install_draft_canary(server_args=args, model_runner=runner, config=CanaryConfig(mode=CanaryMode.RAISE),
                                    skip_reason="") is None
    assert DRAFT_NOT_VERIFIED in caplog.text and "SomeOtherPool" in caplog.text
    to_draft = CanaryConfig(mode=CanaryMode.LOG, perturb_target_group=DRAFT_GROUP, perturb_real_kv_used_prob=0.1)
    with pytest.raises(CanaryConfigError, match="SomeOtherPool"):
        install_draft_canary(server_args=args, model_runner=runner, config=to_draft, skip_reason="")


def test_a_draft_loop_with_more_forwards_than_steps_is_an_error():
    from kv_canary.runner import CanaryBracketError

    h = DraftHarness(steps=2)  # one draft decode forward per phase
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    fb = h.draft_batch([1])
    h.runner.kv_canary_draft_steps = iter(range(1))
    h.runner.forward(fb)
    with pytest.raises(CanaryBracketError, match="more draft forwards"):
        h.runner.forward(fb)
