"""EAGLE spec v1 (``EAGLEWorker``: topk > 1, ``--disable-overlap-schedule``) on the target model: tree verifies.

Real sglang 0.5.12 code builds and verifies the trees: the draft rounds' ``select_top_k_tokens`` and
``organize_draft_results``, ``build_tree_kernel_efficient`` (its CUDA op given the test package's CPU stand-in,
``kv_canary_testing.spec_cpu``), the rows laid out by ``assign_req_to_token_pool_func`` as
``EagleVerifyInput.prepare_for_verify`` does, the TARGET_VERIFY ``ForwardBatch``, and sglang's own
``EagleVerifyInput.verify`` (greedy tree walk, slots freed, rows re-laid or, page size > 1 with topk > 1,
the kept K/V moved by ``move_kv_cache``) run through the plugin's AROUND hook on ``EAGLEWorker.verify``, which
writes the kept drafts (the deferred TAIL). Scheduler objects (``Req``, sampling info, allocator) are small
stand-ins with the fields sglang's verify reads. Reference kernels and the Triton ones (under the interpreter).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.batch_adapter import SglangBatchAdapter
from kv_canary.adapter.speculative import around_eagle_v1_verify
from kv_canary.config import CanaryMode, RealData
from kv_canary.fingerprint import prefix_chains_np
from kv_canary.violations import CanaryViolationError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter, trees built by the CPU "
           "stand-in of sgl_kernel's build_tree (CPU CI); on a GPU host test_e2e_speculative_v1.py covers spec v1")

sglang_fb = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
ForwardBatch, ForwardMode = sglang_fb.ForwardBatch, sglang_fb.ForwardMode
import kv_canary_testing.spec_cpu.models  # noqa: E402,F401  the CPU stand-ins (installed on import, no CUDA)
from sglang.srt.speculative import eagle_info, spec_utils  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402
from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient, organize_draft_results  # noqa: E402
from sglang.srt.speculative.spec_utils import assign_req_to_token_pool_func, select_top_k_tokens  # noqa: E402

_spec = importlib.util.spec_from_file_location("kvc_test_speculative_v2", Path(__file__).with_name(
    "test_speculative.py"))
_v2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_v2)
KERNELS = _v2.KERNELS
VOCAB = 500
WRONG = 9999  # a target prediction no draft equals


class _Req:
    """The fields of sglang's ``Req`` its spec v1 verify reads and writes; finishes after ``max_new`` outputs."""

    def __init__(self, row: int, max_new: int = 10 ** 6):
        self.req_pool_idx, self.max_new, self.output_ids = row, max_new, []
        self.require_reasoning, self.grammar, self._finished = False, None, False
        self.kv_committed_len = self.kv_allocated_len = self.spec_verify_ct = self.spec_num_correct_drafts = 0

    def check_finished(self):
        self._finished = len(self.output_ids) >= self.max_new

    def finished(self):
        return self._finished

    def update_spec_correct_drafts_histogram(self, n):
        pass


class _Sampling:
    """Greedy sampling info (what ``EagleVerifyInput.verify`` reads of it)."""

    def __init__(self, bs):
        self.bs, self.is_all_greedy, self.has_custom_logit_processor, self.logit_bias = bs, True, False, None
        self.penalizer_orchestrator = SimpleNamespace(is_required=False)

    def __len__(self):
        return self.bs


class V1Harness(_v2.EagleHarness):
    """EagleHarness with spec v1's trees: n slots per request placed at [c, c + n), sglang's verify keeps a path."""

    def __init__(self, topk: int = 2, steps: int = 3, n: int = 4, **kw):
        super().__init__(n=n, **kw)
        self.topk, self.steps = topk, steps
        self.manager._adapter = SglangBatchAdapter(max_batch_size=9, device=torch.device("cpu"), tree_verify=True)
        self.manager.kernels = self.manager.single_forward_managers[0]._kernels  # the deferred TAIL's inputs too
        self.manager.enable_deferred_writes(steps + 1)  # as api.install_canary does for spec v1
        self.reqs_v1 = {}
        self.freed = []
        self.worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(
            canary_manager=self.manager, is_draft_worker=False)))

    def prefill(self, rows_tokens, bonus):
        super().prefill(rows_tokens, bonus)
        for row in rows_tokens:
            self.reqs_v1.setdefault(row, _Req(row))

    def tree(self, rows, seed):
        """sglang's draft rounds (select_top_k_tokens over synthetic draft-model top-k), then build_tree."""
        g = torch.Generator().manual_seed(seed)
        bs, topk = len(rows), self.topk

        def draft_topk(lanes):
            p = torch.rand(lanes, topk, generator=g).sort(dim=1, descending=True).values
            return p / p.sum(dim=1, keepdim=True), torch.randint(1, VOCAB, (lanes, topk), generator=g)

        topk_p, topk_index = draft_topk(bs)
        hidden, scores = torch.zeros(bs, 1), None
        score_list, token_list, parents_list = [], [], []
        for i in range(self.steps):
            _, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
            score_list.append(info[0])
            token_list.append(info[1])
            parents_list.append(info[2])
            if i == self.steps - 1:
                break
            topk_p, topk_index = draft_topk(bs * topk)
        parent_list, top_scores_index, draft_tokens = organize_draft_results(score_list, token_list, parents_list,
                                                                             self.n)
        seq = torch.tensor([self.lens[r] for r in rows])
        bonus = torch.tensor([self.bonus[r] for r in rows])
        mask, positions, r_index, r_next, r_sib, draft = build_tree_kernel_efficient(
            bonus, parent_list, top_scores_index, draft_tokens, seq, int(seq.sum()), topk, self.steps, self.n)
        return EagleVerifyInput(
            draft_token=draft, custom_mask=mask, positions=positions, retrieve_index=r_index,
            retrieve_next_token=r_next, retrieve_next_sibling=r_sib, retrieve_cum_len=None, spec_steps=self.steps,
            topk=topk, draft_token_num=self.n, capture_hidden_mode=None, seq_lens_sum=int(seq.sum()),
            seq_lens_cpu=seq.clone())

    def verify_batch(self, rows, seed=0):
        """prepare_for_verify: n new slots per request at req_to_token[row, c : c + n]; the TARGET_VERIFY batch."""
        spec = self.tree(rows, seed)
        bs, n = len(rows), self.n
        seq = torch.tensor([self.lens[r] for r in rows])
        locs = []
        for r in rows:
            locs += self._new_slots(r, self.lens[r], n)
        out = torch.tensor(locs, dtype=torch.int64)
        assign_req_to_token_pool_func(torch.tensor(rows), self.r2t, seq, seq + n, out, bs)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=spec.draft_token,
            req_pool_indices=torch.tensor(rows), seq_lens=seq, out_cache_loc=out, seq_lens_sum=int(seq.sum()),
            seq_lens_cpu=seq.clone(), positions=spec.positions, rids=[f"r{r}" for r in rows])
        return fb, spec

    def predictions(self, spec, keep, rows):
        """(target predictions per node, flat; path lengths) such that request i keeps up to ``keep[i]`` drafts
        along the path that picks, at each depth, the last child (a sibling is skipped where there is one)."""
        bs, n = len(keep), self.n
        pred = torch.full((bs * n,), WRONG, dtype=torch.int64)
        cand = spec.draft_token.view(bs, n)
        lengths = []
        for i, want in enumerate(keep):
            node, length = 0, 1
            for _ in range(want):
                child, last = int(spec.retrieve_next_token[i, node]), -1
                while child != -1:
                    last, child = child, int(spec.retrieve_next_sibling[i, child])
                if last == -1:
                    break
                pred[i * n + node] = cand[i, last]
                node, length = last, length + 1
            pred[i * n + node] = VOCAB + 7 * i + len(self.own[rows[i]])  # the bonus: no draft equals it
            lengths.append(length)
        return pred, lengths

    def verify(self, fb, spec, keep, finish_after=None):
        """EAGLEWorker.verify through the plugin's AROUND hook: sglang's EagleVerifyInput.verify keeps a path."""
        rows = fb.req_pool_indices.tolist()
        if finish_after:
            for row, left in finish_after.items():
                self.reqs_v1[row].max_new = len(self.reqs_v1[row].output_ids) + left
        pred, self.path_lengths = self.predictions(spec, keep, rows)
        logits = torch.full((len(pred), WRONG + 1), -1.0)
        logits[torch.arange(len(pred)), pred] = 1.0
        h = self

        class _Alloc:
            def free(self, slots):
                h.freed += [int(x) for x in slots.tolist()]

            def get_kvcache(self):
                return SimpleNamespace(move_kv_cache=h.move_kv_cache)

        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, spec_info=spec, seq_lens=fb.seq_lens.clone(),
            seq_lens_cpu=fb.seq_lens.clone(), req_pool_indices=fb.req_pool_indices, out_cache_loc=fb.out_cache_loc,
            reqs=[self.reqs_v1[r] for r in rows], sampling_info=_Sampling(len(rows)), device="cpu",
            model_config=SimpleNamespace(think_end_id=None), req_to_token_pool=SimpleNamespace(req_to_token=self.r2t),
            token_to_kv_pool_allocator=_Alloc(), batch_size=lambda: len(rows))

        def sglang_verify(worker, b):  # EAGLEWorker.verify after the target forward
            spec.hidden_states = None  # logits_output.hidden_states (no draft model here)
            res = spec.verify(b, SimpleNamespace(next_token_logits=logits, hidden_states=None), _Alloc(),
                              self.page_size)
            return None, res, False

        _, res, _ = around_eagle_v1_verify(sglang_verify, self.worker, batch)
        for i, row in enumerate(rows):  # the scheduler's record: what sglang's verify appended
            a = res.num_correct_drafts_per_req_cpu[i] + 1
            appended = self.reqs_v1[row].output_ids[-a:]
            self.own[row] = self.own[row] + [self.bonus[row]] + appended[:-1]
            self.lens[row] += a
            self.bonus[row] = appended[-1]
        return res

    def move_kv_cache(self, tgt, src):
        """MHATokenToKVPool.move_kv_cache: K/V of slots ``src`` copied to ``tgt`` (page size > 1, topk > 1)."""
        self.k[tgt.long()] = self.k[src.long()].clone()
        self.v[tgt.long()] = self.v[src.long()].clone()

    def round(self, rows, keep, seed=0, finish_after=None):
        fb, spec = self.verify_batch(rows, seed)
        self.step(fb)
        res = self.verify(fb, spec, keep, finish_after)
        return fb, spec, res


@pytest.fixture(autouse=True)
def _uncompiled_src_tgt(monkeypatch):
    """Page size > 1 with topk > 1: sglang's @torch.compile'd get_src_tgt_cache_loc, run uncompiled on CPU."""
    f = spec_utils.get_src_tgt_cache_loc
    monkeypatch.setattr(eagle_info, "get_src_tgt_cache_loc", getattr(f, "_torchdynamo_orig_callable", f))


def _harness(kernels, page_size=1, topk=2, mode=CanaryMode.RAISE, **kw):
    h = V1Harness(topk=topk, steps=3, n=4, page_size=page_size, kernels=kernels, mode=mode, **kw)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, bonus={1: 11, 2: 12})
    return h


def _clean(h):
    h.manager.poll(drain=True)
    return int(h.manager.last_counters[fp.C_VIOLATIONS]), h.manager.health_violations


def _assert_oracle_at_kept_prefix(h, rows):
    o = h.manager.token_oracle
    o.flush_pending()
    for row in rows:
        assert int(o.row_chain[row]) == prefix_chains_np([h.own[row]])[0], row
        assert int(o.next_token[row]) == h.bonus[row], row


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("page_size,topk", [(1, 2), (1, 1), (16, 1), (16, 2)])
def test_tree_verify_rounds_keep_all_some_none_and_raise_nothing(page_size, topk, kernels):
    """Kept all / some / none, both requests; the kept slots' records chain at their sequence index (the next
    HEAD over [0, c + a) passes), the health counters count the deferred writes, the oracle is exact."""
    h = _harness(kernels, page_size, topk)
    kept_total = 0
    for seed, keep in enumerate(([3, 0], [1, 3], [0, 1], [3, 3], [2, 2])):
        fb, spec, res = h.round([1, 2], keep, seed=seed)
        got = [x + 1 for x in res.num_correct_drafts_per_req_cpu]
        if topk == 2:  # the tree has a sibling to skip at depth 1 at least
            assert (spec.positions.view(2, 4)[:, 1:] - fb.seq_lens[:, None]).min() >= 1
        kept_total += sum(got)
    violations, health = _clean(h)
    assert violations == 0 and health == 0
    c = h.manager.last_counters
    # 1 prefill + 5 verifies; 6 tokens prefilled, then only the kept nodes (no tree node that was not kept)
    assert int(c[fp.C_FORWARD_INDEX]) == 6 and h.manager.forwards == 6
    assert int(c[fp.C_SLOTS_WRITTEN]) == 6 + kept_total
    assert int(c[fp.C_WRITE_LAUNCHES]) == 6 + 5 and int(c[fp.C_VERIFY_LAUNCHES]) == 6
    for row in (1, 2):  # every kept slot's record holds the request's token at its sequence index
        for p in range(h.lens[row]):
            rec = h.manager.groups[0].records[int(h.r2t[row, p])]
            assert int(rec[fp.F_POSITION]) == p and int(rec[fp.F_TOKEN]) == h.own[row][p], (row, p)
    _assert_oracle_at_kept_prefix(h, (1, 2))
    # one more verify reads everything kept so far
    h.round([1, 2], [1, 1], seed=9)
    assert _clean(h) == (0, 0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_finished_request_is_cut_after_its_finishing_token(kernels):
    """sglang's has_finished branch: the request finishing mid-path keeps the nodes up to its finishing token."""
    h = _harness(kernels)
    for seed in range(20):  # a tree whose kept path for request 1 is 3 nodes or longer
        fb, spec = h.verify_batch([1, 2], seed)
        if h.predictions(spec, [3, 3], [1, 2])[1][0] >= 3:
            break
        h.next_slot -= 8  # page size 1: give the slots back (nothing else allocated meanwhile)
    h.step(fb)
    res = h.verify(fb, spec, [3, 3], finish_after={1: 2})
    assert [x + 1 for x in res.num_correct_drafts_per_req_cpu] == [2, h.path_lengths[1]]
    assert h.reqs_v1[1].finished() and h.path_lengths[0] >= 3
    assert _clean(h) == (0, 0)
    row1 = h.lens[1]
    for p in range(row1):
        assert int(h.manager.groups[0].records[int(h.r2t[1, p])][fp.F_POSITION]) == p
    h.round([2], [2], seed=3)
    assert _clean(h) == (0, 0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_corrupt_kept_slot_is_caught_and_a_dropped_one_is_never_read(kernels):
    h = _harness(kernels)
    fb, spec, res = h.round([1], [1], seed=1)
    kept = {int(h.r2t[1, p]) for p in range(h.lens[1])}
    dropped = [s for s in fb.out_cache_loc.tolist() if s not in kept]
    assert dropped and set(dropped) <= set(h.freed)
    h.k[dropped] += 1.0  # freed tree nodes: nothing reads them
    h.round([1], [2], seed=2)
    assert _clean(h) == (0, 0)
    h.k[int(h.r2t[1, h.lens[1] - 1]), 0, 0] += 1.0  # the last kept draft
    with pytest.raises(CanaryViolationError, match="kv_hash"):
        h.round([1], [1], seed=3)
        h.manager.poll(drain=True)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("forget", [True, False])
def test_rejected_nodes_in_recycled_slots_are_forgotten_so_the_scrub_stays_quiet(kernels, forget):
    """``all``, the scrub over the whole pool every forward: the verify stores its n nodes into slots a finished
    request recorded; HEAD forgets them (``unrecorded_stores``; the kept ones are written by the deferred TAIL), so
    the rejected ones' new bytes are not read against the old records (without: the e2e's ``rid=scrub`` rows)."""
    h = _harness(kernels, real_data=RealData.ALL, scrub_slots_per_forward=_v2.SLOTS)
    reused = h.next_slot
    h.prefill({3: list(range(20, 32))}, bonus={3: 33})  # row 3 finishes: its 12 slots are free, records kept
    h.next_slot = reused  # handed out again: the next verify's tree nodes
    if not forget:
        view = h.manager._adapter.view
        h.manager._adapter.view = lambda fb: dataclasses.replace(view(fb), unrecorded_stores=False)
    fb, spec, res = h.round([1], [1], seed=1)
    assert set(fb.out_cache_loc.tolist()) <= set(range(reused, reused + 12))
    assert res.num_correct_drafts_per_req_cpu[0] + 1 < h.n  # some nodes rejected: freed, their bytes new
    with pytest.raises(CanaryViolationError, match="kind=kv_hash.*rid=scrub") if not forget else nullcontext():
        h.round([1], [2], seed=2)
        assert _clean(h) == (0, 0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_wrong_root_token_is_caught(kernels):
    """The tree's root is the token sampled last round: a verify fed another one is reported at acceptance."""
    h = _harness(kernels)
    h.bonus[1] = 13  # the scheduler sampled 11
    with pytest.raises(CanaryViolationError, match="token"):
        h.round([1], [2], seed=4)
        h.manager.poll(drain=True)


def test_the_spec_v2_view_false_alarms_on_a_tree():
    """Issue 8: the v2 view (TAIL over the n tree slots at c + k) reports the tree's depth positions."""
    h = _harness("torch", mode=CanaryMode.LOG)
    h.manager._adapter = SglangBatchAdapter(max_batch_size=9, device=torch.device("cpu"))
    fb, spec = h.verify_batch([1, 2], seed=0)
    assert (spec.positions.view(2, 4) - fb.seq_lens[:, None]).tolist() != [[0, 1, 2, 3]] * 2  # a real tree
    h.step(fb)
    h.manager.poll(drain=True)
    assert h.manager.last_counters[fp.C_VIOLATIONS] > 0
    assert h.manager.violations_by_kind.get("position", 0) > 0


def test_the_tree_view_reads_the_prefix_writes_nothing_and_a_padding_lane_reads_nothing():
    h = _harness("torch")
    fb, _ = h.verify_batch([1], seed=0)
    adapter = SglangBatchAdapter(max_batch_size=4, device=torch.device("cpu"), tree_verify=True)
    view = adapter.view(fb)
    assert view.seq_lens.tolist() == [4] and view.new_lens.tolist() == [0] and not view.staged
    assert view.unrecorded_stores  # HEAD forgets the tree nodes' slots (the kept ones: the deferred TAIL)
    assert not SglangBatchAdapter(max_batch_size=4, device=torch.device("cpu")).view(fb).unrecorded_stores  # spec v2
    assert adapter.num_tokens(fb) == 0 and adapter.written_slots(fb) == []
    padded = _v2._padded(fb, 3, 4)
    assert adapter.view(padded).seq_lens.tolist() == [4, 0, 0]


def test_without_the_verify_hook_the_kept_drafts_are_unwritten_and_reported():
    """The hook is load-bearing: sglang's verify alone keeps slots the canary never wrote; the next HEAD reads them."""
    h = _harness("torch")
    fb, spec = h.verify_batch([1], seed=0)
    h.step(fb)
    pred, _ = h.predictions(spec, [2], [1])
    logits = torch.full((4, WRONG + 1), -1.0)
    logits[torch.arange(4), pred] = 1.0
    spec.hidden_states = None
    res = spec.verify(SimpleNamespace(
        forward_mode=ForwardMode.DECODE, spec_info=spec, seq_lens=fb.seq_lens.clone(),
        seq_lens_cpu=fb.seq_lens.clone(), req_pool_indices=fb.req_pool_indices, out_cache_loc=fb.out_cache_loc,
        reqs=[h.reqs_v1[1]], sampling_info=_Sampling(1), device="cpu", model_config=SimpleNamespace(think_end_id=None),
        req_to_token_pool=SimpleNamespace(req_to_token=h.r2t)),
        SimpleNamespace(next_token_logits=logits, hidden_states=None), SimpleNamespace(free=lambda s: None), 1)
    a = res.num_correct_drafts_per_req_cpu[0] + 1
    h.lens[1] += a
    h.bonus[1] = int(res.accept_tokens[-1])
    h.manager.record_sampled(torch.tensor([h.bonus[1]]))
    with pytest.raises(CanaryViolationError):
        h.round([1], [1], seed=5)
        h.manager.poll(drain=True)


def test_spec_v1_is_a_config_fact_and_its_draft_pool_is_verified_with_or_without_cuda_graphs():
    from kv_canary.adapter.draft import draft_skip_reason
    from kv_canary.adapter.facts import SpecFacts

    args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=2, disable_overlap_schedule=True)
    assert SpecFacts.read(args, "raise").tree_verify
    assert not SpecFacts.read(SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=1,
                                              disable_overlap_schedule=False), "raise").tree_verify
    assert SpecFacts.read(SimpleNamespace(speculative_algorithm=None, disable_overlap_schedule=True), "raise") is None
    for graphs_off in (False, True):  # test_speculative_v1_draft.py: eager and replayed draft rounds
        args.disable_cuda_graph = graphs_off
        assert draft_skip_reason(args, "raise") == ""
    assert "--kv-canary contain" in draft_skip_reason(args, "contain")


@pytest.mark.parametrize("delay", [1, 3])
def test_deferred_writes_are_counted_with_delayed_counter_copies(delay):
    """The health check matches each counter copy to the host's expected counts: deferred write launches land in
    the next forward's copy, or in the idle drain's extra copy after the last verify (no copy dropped)."""
    h = _harness("torch", delay=delay)
    for seed in range(8):
        h.round([1, 2], [seed % 4, (seed + 1) % 4], seed=seed)
        if seed % 3 == 2:
            h.manager.poll(drain=True)  # the scheduler going idle between rounds
    assert _clean(h) == (0, 0)
    c = h.manager.last_counters
    assert int(c[fp.C_WRITE_LAUNCHES]) == 9 + 8  # the last verify's deferred write is in the drained copy
    assert int(c[fp.C_SLOTS_WRITTEN]) == sum(len(h.own[r]) for r in (1, 2))


def test_the_install_time_precompile_covers_the_deferred_tail():
    """After ``enable_deferred_writes`` (spec v1) the precompile launches the deferred TAIL's variants (its inputs
    launch, and a write that bumps no forward): serving tree verifies then compiles no new Triton variant (a JIT on
    the serving path, GPU: a stall)."""
    from kv_canary.kernels import VERIFY_BLOCK
    from kv_canary.kernels import triton_kernels as tk
    from kv_canary.kernels.variants import VariantTracker, programs_classes, track, write_block_lengths

    h = V1Harness(topk=2, steps=3, n=4, kernels="triton", mode=CanaryMode.RAISE)
    m = h.manager
    tracker = VariantTracker()
    for sfm in m.single_forward_managers:
        sfm._kernels = track(sfm._kernels, tracker, tk.tail_variant)
    m.kernels, m.variant_tracker = m.single_forward_managers[0]._kernels, tracker
    caps = m.capacities
    lengths = sorted(write_block_lengths(tk.tail_variant, caps.max_context_len).values())
    sizes = sorted(programs_classes(lambda bs: caps.verify_programs_per_request(bs, VERIFY_BLOCK),
                                    caps.max_batch_size).values())
    m.precompile(lengths, sizes, verify_staged=True)  # the harness enabled the deferred TAIL (spec v1)
    m.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, bonus={1: 11, 2: 12})
    for seed in range(3):
        h.round([1, 2], [2, 1], seed=seed)
    assert _clean(h) == (0, 0)
    assert tracker.sealed and tracker.after_startup == {}, tracker.after_startup
