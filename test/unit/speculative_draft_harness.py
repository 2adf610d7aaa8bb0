"""The EAGLE (spec v2, topk 1) draft harness the draft-pool unit tests share: the draft model's own KV pool, verified
by its own manager (``test_speculative_draft_*.py``; ``test_speculative_v1_draft`` and ``test_speculative_eagle3``
load a copy of their own).

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
the records the TAIL wrote. Under CUDA graphs: sglang's own draft graph runners with an emulated graph object
(``CpuDraftGraphRunner``, ``CpuDraftExtendGraphRunner``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_canary.adapter.draft import (
    DraftBatchAdapter, after_draft_worker_init, around_draft_extend_graph_capture, around_draft_extend_graph_replay,
    around_draft_forward, around_draft_graph_capture, around_draft_graph_replay, route_draft_runner_forward,
)
from kv_canary.api import _patch_model_forward
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig, CanaryMode, KernelBackend
from kv_canary.draft_pool import DRAFT_GROUP, DraftCanaryManager, draft_config
from kv_canary.kernels import reference as ref
from kv_canary.kernels import CanaryKernels, select_kernels
from kv_canary.views import LaunchCapacities
from kv_canary.speculative import build_accepted_drafts, record_accepted

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
                 kernels: str = "torch", graph_bs=(), **config_fields):
        self.steps, self.n, self.page_size = steps, steps + 1, page_size  # topk 1: n = num_steps + 1
        self.k = torch.zeros(SLOTS, 1, 4)
        self.v = torch.zeros(SLOTS, 1, 4)
        config = draft_config(CanaryConfig(mode=mode, d2h_delay_steps=0, stats_print_every_n_steps=0, **config_fields))
        group = build_group(PoolLayout(DRAFT_GROUP, [self.k], [self.v]), config, torch.device("cpu"))
        self.r2t = torch.zeros(ROWS, CTX, dtype=torch.int32)
        self.sfm_log = []
        self.manager = DraftCanaryManager(
            config=config, groups=[group],
            kernels=CanaryKernels("torch", ref.launch_verify, ref.launch_write, ref.launch_scrub,
                                  ref.launch_index_sweep, record_accepted, build_accepted_drafts,
                                  ref.launch_witness_stamp, ref.launch_witness_check, ref.launch_first_read,
                                  graph_safe=False),
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
            sfm.pre_ops_maybe_inside_graph = lambda view, _o=orig, _i=sfm.index, **kw: (
                self.sfm_log.append(_i), _o(view, **kw))
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
