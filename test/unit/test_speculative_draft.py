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
    DraftBatchAdapter, after_draft_worker_init, around_draft_extend_graph_capture, around_draft_extend_graph_replay,
    around_draft_forward, around_draft_graph_capture, around_draft_graph_replay, draft_skip_reason,
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
from kv_canary.speculative import build_accepted_drafts, record_accepted
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
                 kernels: str = "torch", graph_bs=()):
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
                                  ref.launch_index_sweep, record_accepted, build_accepted_drafts, ref.launch_witness_stamp,
                              ref.launch_witness_check, ref.launch_first_read, graph_safe=False),
            req_to_token=self.r2t,
            capacities=LaunchCapacities(max_batch_size=ROWS + 1, max_context_len=CTX, verify_programs_target=1),
            batch_adapter=adapter(max_batch_size=ROWS + 1, device=torch.device("cpu"),
                                  **({"draft_tokens_per_request": self.n, "decode_steps": max(1, steps - 1)}
                                     if issubclass(adapter, DraftBatchAdapter) else {})),
            device=torch.device("cpu"), num_single_forward_managers=max(1, steps - 1),
        )
        if kernels == "triton":  # the kernels a GPU and the CPU e2e run (the interpreter on CPU)
            triton = select_kernels(KernelBackend.TRITON, torch.device("cpu"))
            self.manager.kernels = triton
            for sfm in self.manager.single_forward_managers:
                sfm._kernels = triton
        for sfm in self.manager.single_forward_managers:  # which manager each forward ran on
            orig = sfm.pre_ops_maybe_inside_graph
            sfm.pre_ops_maybe_inside_graph = lambda view, _o=orig, _i=sfm.index, **kw: (self.sfm_log.append(_i), _o(view, **kw))
        self.model = DraftModel(self.k, self.v)
        _patch_model_forward(self.model, self.manager)
        self.runner = SimpleNamespace(is_draft_worker=True, canary_manager=self.manager, kv_canary_draft_steps=None)
        self.runner.forward = self._runner_forward
        self.worker = SimpleNamespace(
            draft_runner=self.runner, speculative_num_steps=steps, topk=1, hot_token_id=None,
            speculative_num_draft_tokens=self.n, draft_attn_backend=SimpleNamespace(attn_backends=[None] * steps),
            target_worker=SimpleNamespace(model_runner=SimpleNamespace()),
        )
        # the AROUND hook on EagleDraftWorker.draft_forward (what EAGLEDraftCudaGraphRunner's capture calls)
        self.worker.draft_forward = lambda fb: around_draft_forward(EagleDraftWorker.draft_forward, self.worker, fb)
        self.graph_runner = self.extend_graph_runner = None
        if graph_bs:  # EagleDraftWorker.init_cuda_graphs: both draft graph runners capture before the AFTER hook
            self._capture_graphs(graph_bs)
        after_draft_worker_init(None, self.worker)  # EagleDraftWorker.__init__'s AFTER hook: reporting on
        assert self.worker.target_worker.model_runner.kv_canary_draft_manager is self.manager
        self.own = {}  # row -> the request's tokens (the scheduler's record)
        self.committed = {}  # row -> positions with KV (c)
        self.alloc = {}  # row -> kv_allocated_len
        self._next_slot = 1
        self._pages = iter(range(1, SLOTS // page_size))
        self._row_pages = {}
        self.convention_positions = {}  # row -> positions whose draft slot must hold token p + 1

    def _capture_graphs(self, graph_bs):
        self.graph_runner = CpuDraftGraphRunner(self, graph_bs)
        self.extend_graph_runner = CpuDraftExtendGraphRunner(self, graph_bs)

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
        """EagleDraftWorker.draft: the captured phase replayed (EAGLEDraftCudaGraphRunner.replay) where it can run,
        else draft_forward (sglang's own loop), each through the plugin's AROUND hook."""
        fb = self.draft_batch(rows)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return around_draft_graph_replay(EAGLEDraftCudaGraphRunner.replay, self.graph_runner, fb)
        return self.worker.draft_forward(fb)

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
        fb = self._extend_batch(fed, prefix, ForwardMode.DRAFT_EXTEND_V2)
        self.run_draft_extend(fb, accept=None)

    def run_draft_extend(self, fb, accept):
        """The draft extend replayed from ``EAGLEDraftExtendCudaGraphRunner`` where it can run (spec v2's
        ``_draft_extend_for_decode``, spec v1's ``forward_draft_extend_after_decode``), else through the runner;
        ``accept``: the kept tokens per request (int32; spec v1), or None (spec v2)."""
        fb.spec_info = SimpleNamespace(hidden_states=torch.zeros(len(fb.input_ids), 2),
                                       num_correct_drafts=None if accept is None else accept - 1,
                                       num_accept_tokens=accept)
        runner = self.extend_graph_runner
        if runner is not None and runner.can_run(fb):
            around_draft_extend_graph_replay(EAGLEDraftExtendCudaGraphRunner.replay, runner, fb)
        else:
            self.runner.forward(fb)

    def counters(self):
        self.manager.poll(drain=True)
        return self.manager.last_counters


# ---- the draft's CUDA-graph runners on CPU ----------------------------------------------------------------
#
# sglang's own EAGLEDraftCudaGraphRunner / EAGLEDraftExtendCudaGraphRunner code runs unchanged: their
# capture_one_batch_size (the captured ForwardBatch over the runner's buffers, run_once) and replay (the padding:
# seq_lens = the fill value, out_cache_loc / positions / req_pool_indices zeroed, then the real requests copied in),
# each through the plugin's AROUND hooks. CPU cannot capture a CUDA graph, so only the graph object is emulated:
# "capture" records run_once (and the single-forward manager active then), "replay" re-runs it as the device
# would replay the recorded kernels -- with no host code of the canary (no outer bracket, no eager-TAIL count:
# the manager is told it is capturing, reporting stays on) -- and copies its outputs into the captured ones.

from sglang.srt.model_executor.cuda_graph_runner import DeepEPCudaGraphRunnerAdapter  # noqa: E402
from sglang.srt.speculative.eagle_draft_cuda_graph_runner import (  # noqa: E402
    EAGLEDraftCudaGraphRunner, EagleDraftInputBuffers,
)
from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import (  # noqa: E402
    EAGLEDraftExtendCudaGraphRunner, EagleDraftExtendInputBuffers,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402


class EmulatedGraph:
    def __init__(self, manager):
        self.manager, self.run_once, self.out, self.active = manager, None, None, []

    def record(self, run_once):
        self.run_once, self.active = run_once, list(self.manager._active)
        self.out = run_once()
        return self.out

    def replay(self):
        m = self.manager
        m._capturing += 1  # the host code of the canary does not run inside a replay
        m._active.extend(self.active)
        try:
            new = self.run_once()
        finally:
            del m._active[len(m._active) - len(self.active):]
            m._capturing -= 1
        if isinstance(self.out, tuple):
            for old, fresh in zip(self.out, new):
                old.copy_(fresh)
        else:
            self.out.next_token_logits.copy_(new.next_token_logits)
            self.out.hidden_states.copy_(new.hidden_states)

    def pool(self):
        return None


class _CpuCapture:
    def _create_graph(self):
        return EmulatedGraph(self.model_runner.canary_manager)

    def _capture_init(self, run_once_fn):  # sglang's warmup runs (without torch.cuda.synchronize)
        for _ in range(2):
            run_once_fn()

    def _capture_graph(self, graph, pool, stream, run_once_fn):
        return graph.record(run_once_fn)

    def _common(self, h, capture_bs, worker=None, topk=1):
        runner = h.runner
        runner.model_config = SimpleNamespace(vocab_size=VOCAB)
        runner.device_timer = None
        runner.spec_algorithm = SpeculativeAlgorithm.from_string("EAGLE")
        runner.req_to_token_pool = SimpleNamespace(req_to_token=h.r2t)
        runner.token_to_kv_pool = None
        self.eagle_worker, self.model_runner = worker or h.worker, runner
        self.graphs, self.output_buffers = {}, {}
        self.disable_padding = False
        self.require_gathered_buffer = self.require_mlp_tp_gather = False
        self.require_mlp_sync = self.require_attn_tp_gather = False
        self.speculative_num_steps, self.topk = h.steps, topk
        self.deepep_adapter = DeepEPCudaGraphRunnerAdapter()
        self.capture_bs, self.max_bs = list(capture_bs), max(capture_bs)
        self.stream, self.seq_len_fill_value = None, 1  # TritonAttnBackend.get_cuda_graph_seq_len_fill_value

    def capture_all(self, hook, method):
        for bs in self.capture_bs:
            self.graphs[bs], self.output_buffers[bs] = hook(method, self, bs, None)


class CpuDraftGraphRunner(_CpuCapture, EAGLEDraftCudaGraphRunner):
    """EAGLEDraftCudaGraphRunner's buffers as its __init__ builds them; its capture/replay code unchanged (``worker``:
    spec v1's EAGLEWorker, ``topk`` lanes per request)."""

    def __init__(self, h, capture_bs, worker=None, topk=1):
        self._common(h, capture_bs, worker, topk)
        self.num_tokens_per_bs = topk
        self.max_num_token = self.max_bs * topk
        self.draft_attn_backend = SimpleNamespace(
            attn_backends=[None] * h.steps, init_forward_metadata_capture_cuda_graph=lambda fb: None,
            init_forward_metadata_replay_cuda_graph=lambda fb, bs: None)
        n, i64 = self.max_num_token, dict(dtype=torch.int64)
        self.extend_seq_lens_cpu = [1] * self.max_bs
        self.buffers = EagleDraftInputBuffers(
            input_ids=torch.zeros(n, **i64), req_pool_indices=torch.zeros(self.max_bs, **i64),
            out_cache_loc=torch.zeros(n * h.steps, **i64), positions=torch.zeros(n, **i64),
            mrope_positions=torch.zeros(3, n, **i64), seq_lens=torch.full((self.max_bs,), 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((self.max_bs,), 1, dtype=torch.int32),
            extend_seq_lens=torch.ones(self.max_bs, dtype=torch.int32), topk_p=torch.zeros(self.max_bs, topk),
            topk_index=torch.zeros(self.max_bs, topk, **i64), hidden_states=torch.zeros(self.max_bs, 2),
            global_num_tokens_gpu=None, global_num_tokens_for_logprob_gpu=None)
        self.capture_all(around_draft_graph_capture, EAGLEDraftCudaGraphRunner.capture_one_batch_size)


class ExtendModel(torch.nn.Module):
    """The draft model as EAGLEDraftExtendCudaGraphRunner's run_once calls it (model.forward, bracketed inside)."""

    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, input_ids, positions, forward_batch):
        ids = self.h.model(input_ids, positions, forward_batch)
        logits = torch.nn.functional.one_hot((ids.to(torch.int64) + 1) % VOCAB, VOCAB).float()
        return SimpleNamespace(next_token_logits=logits, hidden_states=torch.zeros(ids.shape[0], 2))


class CpuDraftExtendGraphRunner(_CpuCapture, EAGLEDraftExtendCudaGraphRunner):
    """EAGLEDraftExtendCudaGraphRunner (spec v2: DRAFT_EXTEND_V2; spec v1: DRAFT_EXTEND) as its __init__ builds it;
    capture/replay unchanged."""

    def __init__(self, h, capture_bs, mode=ForwardMode.DRAFT_EXTEND_V2, worker=None, topk=1):
        self._common(h, capture_bs, worker, topk)
        self.model_runner = SimpleNamespace(**vars(h.runner))
        self.model_runner.model = ExtendModel(h)
        self.forward_mode, self.padded_static_len = mode, -1
        self.num_tokens_per_bs = h.steps + 1
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.draft_extend_attn_backend = SimpleNamespace(init_forward_metadata_capture_cuda_graph=lambda **kw: None,
                                                         init_forward_metadata_replay_cuda_graph=lambda **kw: None)
        n, bs, i64, i32 = self.max_num_token, self.max_bs, dict(dtype=torch.int64), dict(dtype=torch.int32)
        self.extend_seq_lens_cpu = [self.num_tokens_per_bs] * bs
        self.buffers = EagleDraftExtendInputBuffers(
            input_ids=torch.zeros(n, **i64), req_pool_indices=torch.zeros(bs, **i64),
            out_cache_loc=torch.ones(n, **i64), positions=torch.zeros(n, **i64),
            mrope_positions=torch.zeros(3, n, **i64), hidden_states=torch.zeros(n, 2),
            seq_lens=torch.full((bs,), 1, **i32), seq_lens_cpu=torch.full((bs,), 1, **i32),
            extend_seq_lens=torch.full((bs,), self.num_tokens_per_bs, **i32),
            num_correct_drafts=torch.full((bs,), self.num_tokens_per_bs, **i32),
            num_accept_tokens=torch.full((bs,), self.num_tokens_per_bs, **i32),
            next_token_logits_buffer=torch.zeros(n if mode == ForwardMode.DRAFT_EXTEND_V2 else bs, VOCAB),
            global_num_tokens_gpu=None,
            global_num_tokens_for_logprob_gpu=None)
        self.capture_all(around_draft_extend_graph_capture, EAGLEDraftExtendCudaGraphRunner.capture_one_batch_size)


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


def test_the_draft_pool_is_verified_with_or_without_cuda_graphs_and_skipped_where_said():
    """CUDA graphs no longer skip the draft pool (its graph runners are bracketed: the tests below); sglang 0.5.12's
    EagleDraftWorker.__init__ flipping server_args.disable_cuda_graph for its draft runner changes nothing."""
    args = dict(speculative_algorithm="EAGLE", device="cuda", disaggregation_mode="null")
    for graphs_off in (False, True):
        assert draft_skip_reason(SimpleNamespace(**args, disable_cuda_graph=graphs_off), "raise") == ""
    assert draft_skip_reason(SimpleNamespace(**{**args, "device": "cpu"}), "log") == ""
    assert "contain" in draft_skip_reason(SimpleNamespace(**args), "contain")
    assert "--disaggregation-mode decode" in draft_skip_reason(
        SimpleNamespace(**{**args, "disaggregation_mode": "decode"}), "log")
    assert draft_skip_reason(SimpleNamespace(speculative_algorithm=None), "raise")


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

    import dataclasses

    from kv_canary.adapter.facts import SglangFacts, SpecFacts

    spec = SpecFacts(algorithm="EAGLE", tree_verify=False, num_steps=3, draft_tokens_per_request=4, draft_skip="")
    values = dict(line="0.5.12", device=torch.device("cpu"), tp_rank=0, is_draft_worker=True, model=None,
                  pool=SomeOtherPool(), pool_name="SomeOtherPool", pool_context=None,
                  req_to_token=torch.zeros(2, 8, dtype=torch.int32), req_pool_size=2, cuda_graph_max_bs=0,
                  max_prefill_tokens=64, cuda_graphs=False, pd_mode=None, spec=spec, mrope=False, reserved_bytes=None,
                  tail_anchor=None)
    facts = SglangFacts(**{f.name: values[f.name] for f in dataclasses.fields(SglangFacts)})
    with caplog.at_level("WARNING", logger="kv_canary"):
        assert install_draft_canary(facts, CanaryConfig(mode=CanaryMode.RAISE)) is None
    assert DRAFT_NOT_VERIFIED in caplog.text and "SomeOtherPool" in caplog.text
    to_draft = CanaryConfig(mode=CanaryMode.LOG, perturb_target_group=DRAFT_GROUP, perturb_real_kv_used_prob=0.1)
    with pytest.raises(CanaryConfigError, match="SomeOtherPool"):
        install_draft_canary(facts, to_draft)


def test_a_draft_loop_with_more_forwards_than_steps_is_an_error():
    from kv_canary.runner import CanaryBracketError

    h = DraftHarness(steps=2)  # one draft decode forward per phase
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    fb = h.draft_batch([1])
    h.runner.kv_canary_draft_steps = iter(range(1))
    h.runner.forward(fb)
    with pytest.raises(CanaryBracketError, match="more draft forwards"):
        h.runner.forward(fb)


# ---- under CUDA graphs (the draft's graph runners, sglang's own capture/replay code; see CpuDraftGraphRunner) ----


def _stale_padding_row(h):
    """Row 0 is sglang's padding row (the draft graph runner pads with req_pool_indices 0): make it point at live
    slots of row 1 at other positions, so a padding lane that read it would be reported."""
    h.r2t[0, :4] = h.r2t[1, 2:6]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_graph_replays_raise_nothing_are_counted_and_keep_the_token_offset(page_size, kernels):
    """Three requests replay from the batch-size-4 graphs (one padding lane on a stale row 0), one from the
    batch-size-1 graphs, the draft prefill runs eagerly; every replayed HEAD/TAIL is counted on the host."""
    h = DraftHarness(steps=3, page_size=page_size, kernels=kernels, graph_bs=(1, 2, 4))
    assert h.manager.init_finished and h.manager.counters.tolist()[fp.C_FORWARD_INDEX] == 0  # capture forgotten
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14]}, sampled={1: 15, 2: 16, 3: 17})
    _stale_padding_row(h)
    h.sfm_log.clear()
    _rounds(h, [1, 2, 3], [[4, 1, 2], [2, 3, 1], [1, 1, 4]])
    _rounds(h, [2], [[3], [4]])
    c = h.counters()
    assert int(c[fp.C_VIOLATIONS]) == 0 and h.manager.health_violations == 0
    # each round: one replayed draft phase (steps - 1 = 2 forwards, managers 0 and 1) and one replayed draft extend
    assert h.manager.graph_forwards == 5 * (2 + 1) and h.manager.forwards == 1 + 5 * (2 + 1)
    assert h.manager.outer_steps == 1 + 5 * 2
    assert h.sfm_log == [0, 1, 0] * 5  # the replays ran the captured HEADs: step i on manager i, the extend on 0
    assert int(c[fp.C_FORWARD_INDEX]) == h.manager.forwards == int(c[fp.C_VERIFY_LAUNCHES])
    assert int(c[fp.C_WRITE_LAUNCHES]) == h.manager.forwards
    written = 10 + 3 * 3 * (2 + 4) + 2 * (2 + 4)  # prefill; per round: 2 step slots + n extend slots per request
    assert int(c[fp.C_SLOTS_WRITTEN]) == written  # the padding lanes wrote nothing
    rec = h.manager.groups[0].records
    for row in (1, 2, 3):
        for p in sorted(h.convention_positions[row]):
            slot = int(h.r2t[row, p])
            assert int(rec[slot, fp.F_POSITION]) == p
            assert int(rec[slot, fp.F_TOKEN]) == h.own[row][p + 1], (row, p)


def test_a_graph_too_small_for_the_batch_runs_the_draft_eagerly():
    h = DraftHarness(steps=3, graph_bs=(1, 2))
    h.prefill({1: [5, 6, 7], 2: [8, 9], 3: [10, 11]}, sampled={1: 12, 2: 13, 3: 14})
    _rounds(h, [1, 2, 3], [[2, 3, 1]])  # bs 3 > the largest graph: draft_forward and ModelRunner.forward
    assert h.manager.graph_forwards == 0
    _rounds(h, [1, 2], [[1, 4]])
    assert h.manager.graph_forwards == 3 and int(h.counters()[fp.C_VIOLATIONS]) == 0
    assert h.manager.health_violations == 0 and int(h.counters()[fp.C_FORWARD_INDEX]) == h.manager.forwards


class UnmaskedDraftAdapter(DraftBatchAdapter):
    """The draft step view without the padding mask (a padding lane reads [0, fill + i + 1) of row 0)."""

    def view(self, fb):
        view = super().view(fb)
        if fb.forward_mode.name != "DECODE":
            return view
        step = int(getattr(fb, "kv_canary_draft_step", 0))
        return dataclasses.replace(view, seq_lens=fb.seq_lens[: view.batch_size].to(torch.int64) + step + 1)


def test_padding_lanes_of_a_replayed_draft_graph_read_and_write_nothing():
    h = DraftHarness(steps=3, graph_bs=(4,))
    h.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12]}, sampled={1: 13, 2: 14})
    _stale_padding_row(h)
    fb = h.draft_batch([1, 2])
    verified = int(h.counters()[fp.C_SLOTS_VERIFIED])
    around_draft_graph_replay(EAGLEDraftCudaGraphRunner.replay, h.graph_runner, fb)
    c1, c2 = h.committed[1], h.committed[2]
    # the real lanes read [0, c + i) at steps 0 and 1; the two padding lanes nothing
    assert int(h.counters()[fp.C_SLOTS_VERIFIED]) - verified == (c1 + c1 + 1) + (c2 + c2 + 1)
    buffers = h.graph_runner.buffers  # sglang's replay padded lanes 2, 3: row 0, out_cache_loc 0, seq_len 1
    assert buffers.out_cache_loc[2 * 3:].eq(0).all() and buffers.req_pool_indices[2:4].eq(0).all()
    assert buffers.seq_lens[2:4].tolist() == [1, 1] and int(h.counters()[fp.C_VIOLATIONS]) == 0
    # without the mask the same replay reads the stale row 0 through its padding lanes: a false alarm
    bad = DraftHarness(steps=3, graph_bs=(4,), adapter=UnmaskedDraftAdapter)
    bad.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12]}, sampled={1: 13, 2: 14})
    _stale_padding_row(bad)
    with pytest.raises(CanaryViolationError, match="row=0"):
        bad.draft_phase([1, 2])


def test_the_padded_draft_extend_graph_batch_is_viewed_with_its_padding_lanes_empty():
    h = DraftHarness(steps=3, graph_bs=(4,))
    h.prefill({1: [5, 6, 7, 8], 2: [9, 10]}, sampled={1: 11, 2: 12})
    h.draft_phase([1, 2])
    h.draft_extend([1, 2], [2, 3])  # replayed: 2 real requests, 2 padding lanes
    runner = h.extend_graph_runner
    fb = SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=4, input_ids=runner.buffers.input_ids[:16],
                         positions=runner.buffers.positions[:16], out_cache_loc=runner.buffers.out_cache_loc[:16],
                         req_pool_indices=runner.buffers.req_pool_indices[:4], seq_lens=runner.buffers.seq_lens[:4])
    fb.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    view = h.manager._adapter.view(fb)
    assert view.seq_lens.tolist() == [h.committed[1] - 2 + 4, h.committed[2] - 3 + 4, 0, 0]
    assert view.new_lens.tolist() == [4] * 4 and view.new_starts.tolist() == [0, 4, 8, 12]
    assert view.input_ids.dtype == torch.int64 and int(h.counters()[fp.C_VIOLATIONS]) == 0
    assert h.manager.graph_forwards == 3


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_corrupt_draft_slot_is_caught_inside_a_replayed_draft_graph(page_size):
    h = DraftHarness(steps=3, page_size=page_size, graph_bs=(1, 2, 4))
    h.prefill({1: [5, 6, 7, 8, 9, 10], 2: [11, 12, 13]}, sampled={1: 14, 2: 15})
    _rounds(h, [1, 2], [[2, 1]])
    slot = int(h.r2t[1, 3])
    h.k[slot, 0, 1] += 1.0  # a flipped K value of a committed draft slot
    with pytest.raises(CanaryViolationError, match=f"kind=kv_hash.*group={DRAFT_GROUP}.*slot={slot}"):
        h.draft_phase([1, 2])


def test_a_redirected_req_to_token_entry_is_caught_inside_a_replayed_draft_extend():
    h = DraftHarness(steps=3, graph_bs=(2,))
    h.prefill({1: [5, 6, 7, 8, 9, 10]}, sampled={1: 11})
    h.draft_phase([1])
    h.r2t[1, 2] = h.r2t[1, 4]  # the row points position 2 at position 4's draft slot
    with pytest.raises(CanaryViolationError, match="kind=position"):
        h.draft_extend([1], [2])


def test_capture_is_silent_and_routes_each_step_to_its_manager():
    """While the draft's graphs capture (warmups included) nothing is reported or counted; a recapture after init
    leaves the device counters as they were (the health check sees no forward the host never counted)."""
    h = DraftHarness(steps=3)
    h.prefill({1: [5, 6, 7]}, sampled={1: 8})
    before = h.manager.counters.tolist()
    h.sfm_log.clear()
    runner = CpuDraftGraphRunner(h, (1, 2))  # a recapture after init (sglang's adaptive path), reporting on
    assert h.sfm_log == [0, 1] * 3 * 2  # two warmups + the capture per batch size, step i on manager i
    assert h.manager.outer_steps == 1 and h.manager.forwards == 1  # no outer bracket ran while capturing
    assert h.manager.counters.tolist() == before
    assert runner.graphs[1] is not None and not h.manager.is_capturing



def test_the_draft_views_under_graphs_use_only_variants_precompiled_at_install():
    """No JIT after startup: with the draft pool's install-time precompile (``api._precompile``: every write block,
    every verify-grid class, the speculative variants), the replayed and eager draft forwards add no variant."""
    from kv_canary.kernels import VERIFY_BLOCK
    from kv_canary.kernels import triton_kernels as tk
    from kv_canary.kernels.variants import VariantTracker, programs_classes, track, write_block_lengths

    h = DraftHarness(steps=3, kernels="triton", graph_bs=(1, 2, 4))
    tracker = VariantTracker()
    tracked = track(h.manager.kernels, tracker, tk.tail_variant)
    h.manager.kernels = tracked
    for sfm in h.manager.single_forward_managers:
        sfm._kernels = tracked
    caps = h.manager.capacities
    h.manager.precompile(sorted(write_block_lengths(tk.tail_variant, caps.max_context_len).values()),
                         sorted(programs_classes(lambda bs: caps.verify_programs_per_request(bs, VERIFY_BLOCK),
                                                 caps.max_batch_size).values()), verify_staged=True)
    tracker.seal()
    h.prefill({1: [5, 6, 7, 8, 9], 2: [10, 11], 3: [12, 13, 14]}, sampled={1: 15, 2: 16, 3: 17})
    _rounds(h, [1, 2, 3], [[4, 1, 2], [2, 3, 1]])  # replayed (batch size 4)
    h.graph_runner.capture_bs, h.extend_graph_runner.capture_bs = [1], [1]
    h.graph_runner.max_bs = h.extend_graph_runner.max_bs = 1
    _rounds(h, [1, 2], [[1, 4]])  # eager: draft_forward and ModelRunner.forward
    assert h.manager.graph_forwards == 2 * 3 and int(h.counters()[fp.C_VIOLATIONS]) == 0
    assert tracker.after_startup == {}, tracker.after_startup
