"""EAGLE (spec v2, topk = 1) on the target model: TARGET_VERIFY views, accept/reject, no false alarm.

(Spec v1, trees: test_speculative_v1.py.)

Real sglang 0.5.12 objects and code: the verify batches are ``ForwardBatch`` objects in
``ForwardMode.TARGET_VERIFY``; the rows are laid out by sglang's own Triton helpers, run
under the interpreter on CPU, as ``EagleDraftInputV2Mixin.prepare_for_decode`` (over-allocation
``assign_req_to_token_pool_func``) and ``prepare_for_v2_verify`` (``assign_extend_cache_locs``)
lay them out on a GPU; the accepted tokens reach the oracle through the plugin's
``EAGLEWorkerV2.verify`` hook with a real ``GenerationBatchResult``. The canary runs with the
reference kernels (``kv_canary_testing.runner_harness``); page size 1 and 16.

sglang 0.5.12 cannot run EAGLE on CPU (see docs/history/speculative.md), so these batches are built
here, not captured from a server.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter.batch_adapter import SglangBatchAdapter
from kv_canary.adapter.speculative import after_eagle_v2_verify
from kv_canary.config import CanaryMode, KernelBackend
from kv_canary.fingerprint import prefix_chains_np
from kv_canary.kernels import select_kernels
from kv_canary.violations import CanaryViolationError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-tensor batches laid out by sglang's Triton helpers under the interpreter (CPU CI); on a GPU "
           "host test_e2e_speculative*.py cover EAGLE with real CUDA graphs")

sglang_fb = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
ForwardBatch, ForwardMode = sglang_fb.ForwardBatch, sglang_fb.ForwardMode
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.speculative.eagle_info_v2 import assign_extend_cache_locs  # noqa: E402
from sglang.srt.speculative.spec_utils import assign_req_to_token_pool_func  # noqa: E402
from sglang.srt.utils.common import next_power_of_2  # noqa: E402

from kv_canary_testing import runner_harness as _runner  # noqa: E402 - needs sglang
SLOTS, CTX = _runner.SLOTS, _runner.CTX


KERNELS = ["torch", "triton"]  # the reference kernels and the Triton ones (the interpreter on CPU)


class EagleHarness(_runner.Harness):
    """The runner harness plus spec v2's bookkeeping: over-allocated rows, verify rounds, acceptance."""

    def __init__(self, n: int = 3, page_size: int = 1, kernels: str = "torch", **kw):
        super().__init__(**kw)
        if kernels == "triton":  # the kernels a GPU (and the CPU e2e) runs, instead of the spied reference
            triton = select_kernels(KernelBackend.TRITON, torch.device("cpu"))
            for sfm in self.manager.single_forward_managers:
                sfm._kernels = triton
        self.n = n  # speculative_num_draft_tokens (= num_steps + 1 for topk 1)
        self.page_size = page_size
        self.alloc = {}  # row -> kv_allocated_len
        self.bonus = {}  # row -> the token sampled last (fed at position committed)
        self.worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(
            canary_manager=self.manager, is_draft_worker=False)))
        self._pages = iter(range(1, SLOTS // page_size))  # page 0 holds the padding slot
        self.row_pages = {}

    # ---- sglang's layout of a row ----------------------------------------------------

    def _new_slots(self, row: int, start: int, count: int) -> list:
        """Slots for positions [start, start + count) of the row; page_size > 1: position p lives in the
        row's page p // page_size at offset p % page_size (sglang's paged allocator)."""
        if self.page_size == 1:
            slots = list(range(self.next_slot, self.next_slot + count))
            self.next_slot += count
            return slots
        slots = []
        for p in range(start, start + count):
            key = (row, p // self.page_size)
            if key not in self.row_pages:
                self.row_pages[key] = next(self._pages)
            slots.append(self.row_pages[key] * self.page_size + p % self.page_size)
        return slots

    def prefill(self, rows_tokens, bonus):
        """The target's EXTEND forward, then ModelRunner.sample (the plugin's hook) with the bonus tokens."""
        if self.page_size > 1:
            for row, toks in rows_tokens.items():
                start = self.lens.get(row, 0)
                self.r2t[row, start:start + len(toks)] = torch.tensor(self._new_slots(row, start, len(toks)),
                                                                      dtype=torch.int32)
        fb = self._extend_batch(rows_tokens)
        self.step(fb)
        self.manager.record_sampled(torch.tensor([bonus[r] for r in rows_tokens]))
        for row, toks in rows_tokens.items():
            self.alloc[row] = self.lens[row]
            self.bonus[row] = bonus[row]

    def _extend_batch(self, rows_tokens):
        if self.page_size == 1:
            return self.batch(rows_tokens)
        # the Harness allocates consecutive slots; keep the page-aligned ones written above
        saved = {row: self.r2t[row].clone() for row in rows_tokens}
        fb = self.batch(rows_tokens)
        locs = []
        for row, toks in rows_tokens.items():
            self.r2t[row] = saved[row]
            start = self.lens[row] - len(toks)
            locs += self.r2t[row, start:start + len(toks)].tolist()
        fb.out_cache_loc = torch.tensor(locs)
        return fb

    def _prepare_for_decode(self, rows):
        """EagleDraftInputV2Mixin.prepare_for_decode: each row holds committed + 2 * alloc_len_per_decode slots."""
        per_decode = self.n  # get_alloc_len_per_decode() for spec v2, topk 1: num_steps + 1
        cur, nxt, locs = [], [], []
        for row in rows:
            c, want = self.alloc[row], self.lens[row] + 2 * per_decode
            want = max(c, want)
            cur.append(c)
            nxt.append(want)
            locs += self._new_slots(row, c, want - c)
            self.alloc[row] = want
        assign_req_to_token_pool_func(
            torch.tensor(rows), self.r2t, torch.tensor(cur), torch.tensor(nxt), torch.tensor(locs, dtype=torch.int64),
            len(rows),
        )

    def verify_batch(self, drafts):
        """drafts: {row: [n - 1 draft tokens]} -> the TARGET_VERIFY ForwardBatch prepare_for_v2_verify builds."""
        rows = list(drafts)
        self._prepare_for_decode(rows)
        bs, n = len(rows), self.n
        seq = torch.tensor([self.lens[r] for r in rows])
        ids = torch.tensor([t for r in rows for t in [self.bonus[r], *drafts[r]]])
        out = torch.empty(bs * n, dtype=torch.int64)
        assign_extend_cache_locs[(bs,)](
            torch.tensor(rows), self.r2t, seq, seq + n, out, self.r2t.shape[1], next_power_of_2(bs),
        )
        positions = (seq[:, None] + torch.arange(n)[None, :]).flatten()  # build_tree's positions for topk 1
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=ids,
            req_pool_indices=torch.tensor(rows), seq_lens=seq, out_cache_loc=out, seq_lens_sum=int(seq.sum()),
            seq_lens_cpu=seq.clone(), positions=positions, rids=[f"r{r}" for r in rows],
        )

    def accept(self, fb, accept_lens, new_bonus):
        """EAGLEWorkerV2.verify's result for the batch, through the plugin's AFTER hook; the scheduler's update."""
        rows = fb.req_pool_indices.tolist()
        n = self.n
        ids = fb.input_ids.view(len(rows), n)
        predict = torch.zeros(len(rows) * n, dtype=torch.int32)
        for i, (row, a) in enumerate(zip(rows, accept_lens)):
            # accepted drafts are the target's predictions; the last accepted entry is the new bonus token
            predict[i * n:i * n + a - 1] = ids[i, 1:a].to(torch.int32)
            predict[i * n + a - 1] = new_bonus[row]
            predict[i * n + a:(i + 1) * n] = 9999  # the target's guesses after a rejected draft: never appended
        result = GenerationBatchResult(next_token_ids=predict, accept_lens=torch.tensor(accept_lens, dtype=torch.int32),
                                       speculative_num_draft_tokens=n)
        after_eagle_v2_verify(result, self.worker, fb)
        for i, (row, a) in enumerate(zip(rows, accept_lens)):
            self.own[row] = self.own[row] + [int(x) for x in ids[i, :a]]
            self.lens[row] += a
            self.bonus[row] = new_bonus[row]

    def round(self, drafts, accept_lens, new_bonus):
        fb = self.verify_batch(drafts)
        self.step(fb)
        self.accept(fb, accept_lens, new_bonus)
        return fb


def _clean(h):
    c = h.manager.last_counters
    return int(c[fp.C_VIOLATIONS])


def _assert_oracle_at_accepted_prefix(h, rows):
    """row_chain is the chain of the committed tokens (what the scheduler appended), the bonus token is what the
    next forward must be fed (after the next HEAD's scatter, done here as it would)."""
    o = h.manager.token_oracle
    o.flush_pending()
    for row in rows:
        assert int(o.row_chain[row]) == prefix_chains_np([h.own[row]])[0], row
        assert int(o.next_token[row]) == h.bonus[row], row


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_rounds_with_accept_and_reject_raise_nothing(page_size, kernels):
    h = EagleHarness(n=3, page_size=page_size, kernels=kernels, mode=CanaryMode.RAISE)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, bonus={1: 11, 2: 12})
    # all accepted / all rejected / partly accepted, in both requests
    h.round({1: [13, 14], 2: [15, 16]}, accept_lens=[3, 1], new_bonus={1: 17, 2: 18})
    h.round({1: [19, 20], 2: [21, 22]}, accept_lens=[2, 3], new_bonus={1: 23, 2: 24})
    h.round({1: [25, 26], 2: [27, 28]}, accept_lens=[1, 2], new_bonus={1: 29, 2: 30})
    h.round({1: [31, 32], 2: [33, 34]}, accept_lens=[3, 3], new_bonus={1: 35, 2: 36})
    assert _clean(h) == 0
    c = h.manager.last_counters
    # every verify wrote all n slots; HEAD read exactly the committed prefixes
    assert int(c[fp.C_SLOTS_WRITTEN]) == 6 + 4 * 2 * 3
    committed_before = [(4, 2), (4 + 3, 2 + 1), (7 + 2, 3 + 3), (9 + 1, 6 + 2)]
    assert int(c[fp.C_SLOTS_VERIFIED]) == sum(a + b for a, b in committed_before)
    # the oracle is at the accepted prefix: no rejected draft's term in the chain, the bonus token next
    _assert_oracle_at_accepted_prefix(h, (1, 2))


def test_the_view_counts_the_drafts_and_a_padding_lane_reads_nothing():
    h = EagleHarness(n=4)
    h.prefill({3: [5, 6, 7]}, bonus={3: 8})
    fb = h.verify_batch({3: [9, 10, 11]})
    view = SglangBatchAdapter(max_batch_size=4, device=torch.device("cpu")).view(fb)
    assert view.seq_lens.tolist() == [3 + 4] and view.new_lens.tolist() == [4]
    assert view.draft_tokens_per_request == 4
    hb = SglangBatchAdapter(max_batch_size=4, device=torch.device("cpu")).host_batch(fb)
    assert list(hb.read_positions(0)) == [0, 1, 2]
    # a CUDA-graph padding request: out_cache_loc 0, seq_len = the fill value (1), row 0
    pad = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, input_ids=torch.cat([fb.input_ids, fb.input_ids]),
        req_pool_indices=torch.tensor([3, 0]), seq_lens=torch.tensor([3, 1]),
        out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(4, dtype=torch.int64)]), seq_lens_sum=4,
        positions=torch.cat([fb.positions, torch.zeros(4, dtype=torch.int64)]),
    )
    view = SglangBatchAdapter(max_batch_size=4, device=torch.device("cpu")).view(pad)
    assert view.seq_lens.tolist() == [7, 0]


def test_the_old_decode_like_view_was_a_false_alarm():
    """Issue 8: read as decode-like, a verify's drafts are stamped at positions shifted by -n."""
    h = EagleHarness(n=3, mode=CanaryMode.LOG)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8]}, bonus={1: 11})
    fb = h.verify_batch({1: [13, 14]})
    fb.forward_mode = ForwardMode.DECODE  # what the adapter assumed before
    h.step(fb)
    h.manager.poll(drain=True)
    assert h.manager.last_counters[fp.C_VIOLATIONS] > 0


def test_a_corrupt_accepted_slot_is_caught_and_a_rejected_one_is_never_read():
    h = EagleHarness(n=3, mode=CanaryMode.RAISE)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8]}, bonus={1: 11})
    fb = h.round({1: [13, 14]}, accept_lens=[1], new_bonus={1: 17})  # both drafts rejected
    rejected = fb.out_cache_loc[1:].tolist()
    h.k[rejected] += 1.0  # stale KV past the committed length: the next verify rewrites it first
    h.round({1: [19, 20]}, accept_lens=[3], new_bonus={1: 23})
    assert _clean(h) == 0
    accepted = int(h.r2t[1, 6])  # a draft accepted in the last round
    h.k[accepted, 0, 0] += 1.0
    with pytest.raises(CanaryViolationError):
        h.round({1: [25, 26]}, accept_lens=[1], new_bonus={1: 29})
        h.manager.poll(drain=True)


def test_a_wrong_token_fed_at_the_committed_position_is_caught():
    """Drafts are not token-checked, the token sampled last round is: a verify fed the wrong one is flagged."""
    h = EagleHarness(n=3, mode=CanaryMode.RAISE)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8]}, bonus={1: 11})
    h.bonus[1] = 12  # the scheduler sampled 11; the verify is fed 12
    with pytest.raises(CanaryViolationError, match="token"):
        h.round({1: [13, 14]}, accept_lens=[1], new_bonus={1: 17})
        h.manager.poll(drain=True)


def test_the_allow_list_lets_through_eagle_and_eagle3_spec_v2_and_v1():
    from kv_canary.adapter.server_args import check_supported
    from kv_canary.config import CanaryConfigError

    def args(**kw):
        base = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, disable_overlap_schedule=False,
                    enable_multi_layer_eagle=False, speculative_adaptive=False, disable_cuda_graph=False,
                    device="cpu")
        base.update(kw)
        return SimpleNamespace(**base)

    from kv_canary.adapter.server_args import RULES

    rule = RULES["speculative_algorithm"]
    assert rule.allowed("EAGLE", args()) and rule.allowed(None, args(speculative_algorithm=None))
    assert rule.allowed("EAGLE", args(device="cuda", disable_cuda_graph=True))
    assert rule.allowed("EAGLE", args(device="cuda"))  # the target's TARGET_VERIFY CUDA graphs
    assert rule.allowed("EAGLE", args(speculative_eagle_topk=None))  # raw flags: sglang picks, checked again
    # spec v1 (EAGLEWorker): the tree verify's TAIL deferred to the kept drafts (test_speculative_v1)
    for v1 in (dict(speculative_eagle_topk=4), dict(disable_overlap_schedule=True),
               dict(speculative_eagle_topk=2, disable_overlap_schedule=True)):
        assert rule.allowed("EAGLE", args(**v1)), v1
        check_supported(args(**v1), "raise", given_only=True)
    for bad, flag in ((dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle"),
                      (dict(speculative_adaptive=True), "--speculative-adaptive")):
        assert not rule.allowed("EAGLE", args(**bad)), bad
        with pytest.raises(CanaryConfigError, match=f"cannot verify --speculative-algorithm EAGLE with {flag}:"):
            check_supported(args(**bad), "raise", given_only=True)
    for algo in ("STANDALONE", "NGRAM", "DFLASH", "FROZEN_KV_MTP"):
        assert not rule.allowed(algo, args(speculative_algorithm=algo)), algo
    # EAGLE3 runs through the same EAGLEWorkerV2 / EAGLEWorker batches (test_e2e_speculative_eagle3); NEXTN is
    # sglang's alias of EAGLE (raw flags only: __post_init__ resolves it, and the check after it sees EAGLE or
    # FROZEN_KV_MTP)
    for algo in ("EAGLE3", "NEXTN"):
        assert rule.allowed(algo, args(speculative_algorithm=algo)), algo
        assert rule.allowed(algo, args(speculative_algorithm=algo, speculative_eagle_topk=4)), algo
        with pytest.raises(CanaryConfigError, match=f"cannot verify --speculative-algorithm {algo} with "
                                                    "--speculative-adaptive:"):
            check_supported(args(speculative_algorithm=algo, speculative_adaptive=True), "raise", given_only=True)
    with pytest.raises(CanaryConfigError, match="cannot verify --speculative-algorithm NGRAM"):
        check_supported(args(speculative_algorithm="NGRAM"), "raise", given_only=True)


def _padded(fb, bs: int, n: int):
    """The TARGET_VERIFY batch a CUDA graph captured for ``bs`` requests replays with ``fb`` in it, padded as
    sglang's ``populate_from_forward_batch`` pads it: seq_lens = the fill value (1), out_cache_loc 0, and
    stale input ids / positions / request rows (here: the first real request's row, the worst case)."""
    raw = fb.batch_size
    pad = bs - raw

    def cat(t, fill):
        return torch.cat([t, torch.full((fill,), int(t[0]), dtype=t.dtype)])

    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=cat(fb.input_ids, pad * n),
        req_pool_indices=cat(fb.req_pool_indices, pad), seq_lens=torch.cat([fb.seq_lens, torch.ones(pad,
                                                                                                   dtype=fb.seq_lens.dtype)]),
        out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad * n, dtype=fb.out_cache_loc.dtype)]),
        positions=cat(fb.positions, pad * n), seq_lens_sum=int(fb.seq_lens.sum()) + pad, rids=fb.rids,
    )


@pytest.mark.parametrize("kernels", KERNELS)
def test_padded_graph_batches_verify_the_real_requests_only(kernels):
    """CUDA-graph replays: the outside bracket sees the real batch, HEAD/TAIL the padded one (its padding lanes
    point at a live row); rounds with accepted and rejected drafts raise nothing and the oracle stays exact."""
    h = EagleHarness(n=3, kernels=kernels, mode=CanaryMode.RAISE)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, bonus={1: 11, 2: 12})
    m = h.manager
    for drafts, accept_lens in (({1: [13, 14], 2: [15, 16]}, [2, 1]), ({1: [19, 20], 2: [21, 22]}, [3, 2]),
                                ({1: [25, 26], 2: [27, 28]}, [1, 3])):
        fb = h.verify_batch(drafts)
        padded = _padded(fb, 4, h.n)
        with m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
            with m.with_active_single_forward_manager(0):
                h.model(padded.input_ids, padded.positions, padded)
        base = 100 + 10 * len(h.own[1])
        h.accept(fb, accept_lens, new_bonus={1: base, 2: base + 1})
    m.poll(drain=True)
    assert _clean(h) == 0 and m.health_violations == 0
    assert int(m.last_counters[fp.C_SLOTS_WRITTEN]) == 6 + 3 * 2 * 3  # padding lanes write nothing
    _assert_oracle_at_accepted_prefix(h, (1, 2))


@pytest.mark.parametrize("kernels", KERNELS)
def test_an_accepted_draft_that_is_not_the_appended_token_is_caught(kernels):
    """sglang's acceptance must append exactly the drafts the target verified: if the scheduler appended another
    token than the one fed (and cached) at an accepted position, the next verify's HEAD reports it."""
    h = EagleHarness(n=3, kernels=kernels, mode=CanaryMode.RAISE)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8]}, bonus={1: 11})
    fb = h.verify_batch({1: [13, 14]})
    h.step(fb)
    fb.input_ids = fb.input_ids.clone()
    fb.input_ids[1] = 77  # accept() builds predict from these: the "appended" token at position 5 is 77, fed 13
    h.accept(fb, [3], new_bonus={1: 17})
    with pytest.raises(CanaryViolationError, match="token"):
        h.round({1: [19, 20]}, accept_lens=[1], new_bonus={1: 23})
        h.manager.poll(drain=True)


def test_without_the_verify_hook_the_next_verify_is_reported():
    """The hook is what moves the oracle to the accepted prefix: skipped, the next verify fails (a stale chain)."""
    h = EagleHarness(n=3, mode=CanaryMode.RAISE)
    h.manager.mark_init_finished()
    h.prefill({1: [5, 6, 7, 8]}, bonus={1: 11})
    fb = h.verify_batch({1: [13, 14]})
    h.step(fb)
    # the scheduler's update (two tokens accepted) without the plugin's hook
    h.own[1] = h.own[1] + [int(x) for x in fb.input_ids[:2]]
    h.lens[1] += 2
    h.bonus[1] = 17
    h.manager.record_sampled(torch.tensor([17]))  # even with the bonus token known: the chain is stale
    with pytest.raises(CanaryViolationError, match="token"):
        h.round({1: [19, 20]}, accept_lens=[1], new_bonus={1: 23})
        h.manager.poll(drain=True)

