"""sglang 0.5.12 EAGLE draft worker (spec v2 and v1): its own KV pool, verified (``kv_canary.draft_pool``).

Wiring (hooks through sglang's HookRegistry, registered by the plugin):

* ``ModelRunner.init_memory_pool`` of the draft runner (``is_draft_worker``): ``api.install_canary``
  builds the draft's ``DraftCanaryManager`` (or logs why the draft pool is not verified);
* ``EagleDraftWorker.__init__`` (AFTER, once its attention backends and graphs exist):
  ``mark_init_finished``, and the target runner learns the draft manager (idle drain);
* ``EagleDraftWorker.draft_forward`` (AROUND): one outer step for the draft decode phase,
  ``with_ops_outside_graph(single_forward_indices=range(num_steps - 1))``; each
  ``draft_runner.forward`` inside its loop runs with single-forward manager ``i`` active
  (``route_draft_runner_forward``, from the plugin's ``ModelRunner.forward`` hook), and the batch
  carries the step (``kv_canary_draft_step``) for the view;
* the draft's other forwards (prefill extend, DRAFT_EXTEND_V2 after a verify) go through
  ``ModelRunner.forward`` like the target's: an outer step with manager 0;
* CUDA graphs: ``EAGLEDraftCudaGraphRunner.capture_one_batch_size`` (AROUND, reporting off) captures
  ``draft_forward`` itself, so step i's HEAD/TAIL (manager i) are recorded; ``EagleDraftWorker.draft`` then
  replays the phase without ``draft_forward``: ``EAGLEDraftCudaGraphRunner.replay`` (AROUND) is the outer step of
  ``num_steps - 1`` forwards (counted as replayed: the health check holds). Likewise
  ``EAGLEDraftExtendCudaGraphRunner.capture_one_batch_size`` (manager 0 active, reporting off) and ``.replay``
  (an outer step of one forward) for the draft extend ``_draft_extend_for_decode`` replays without
  ``ModelRunner.forward``.

Views (``DraftBatchAdapter``): EXTEND is an extend batch; DRAFT_EXTEND_V2 (``n`` =
``--speculative-num-draft-tokens`` tokens per request at ``[c, c + n)``, eager or replayed) a uniform one on
preallocated buffers; a draft decode step ``i`` (DECODE, one token per request, ``seq_lens`` = ``c``) runs at
position ``c + i`` and reads ``[0, c + i]``: its view's ``seq_lens`` is ``c + i + 1`` (a preallocated buffer per
step), and its ``out_cache_loc`` (a strided column of ``[bs, num_steps]`` in ``draft_forward``) is copied into a
preallocated contiguous buffer per step. All graph-safe (no allocation, no host sync); a CUDA-graph padding lane
(``out_cache_loc`` 0) gets ``seq_lens`` 0: it reads and writes nothing.

Spec v1 (``EAGLEWorker``: topk > 1 or ``--disable-overlap-schedule``), eager or under CUDA graphs: the same manager
and hooks (``EAGLEWorker.draft_forward`` AROUND is ``around_draft_forward``; ``EAGLEWorker.__init__`` AFTER starts
reporting; the two graph runners' capture/replay hooks as above); a draft decode step runs ``bs * topk`` lanes into
scratch slots sglang gives back right after the phase, so its view (``DraftBatchAdapter(spec_v1=True)``) reads each
request's committed prefix ``[0, c)`` and writes nothing, its HEAD forgetting the scratch slots' earlier owners'
records (``unrecorded_stores``: the scrub would read the new bytes as corrupt; page size > 1 with topk > 1, the branch
copies of the last partial page are forgotten by ``kv_stores.forget_kv_moves``); the draft extend after a verify
(DRAFT_EXTEND: each request's kept tokens, packed) is viewed with starts/lengths computed on the device, one view
eager and replayed (``_v1_draft_extend_view``); EXTEND after a prefill is an extend view. Not verified: a step's
reads of its own branch's earlier scratch slots (docs/speculative.md).

Not verified (skipped with a startup line naming why): ``--kv-canary contain`` and PD disaggregation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict

import torch

from ..views import ForwardView
from .batch_adapter import SglangBatchAdapter


class DraftBatchAdapter(SglangBatchAdapter):
    """``SglangBatchAdapter`` plus the draft decode steps' views (see the module docstring)."""

    def __init__(self, *, max_batch_size: int, device: torch.device, draft_tokens_per_request: int = 1,
                 decode_steps: int = 1, spec_v1: bool = False, num_steps: int = 1):
        super().__init__(max_batch_size=max_batch_size, device=device)
        # rows of the per-step buffers start 16-byte aligned (Triton specializes pointer alignment: no new variant)
        width = -(-max_batch_size // 16) * 16
        # spec v1 (EAGLEWorker): a draft decode step runs topk lanes per request into scratch slots; its view reads
        # the committed prefix [0, c) and writes nothing (new_lens 0). Its DRAFT_EXTEND feeds each request's kept
        # tokens (1 to num_steps + 1), packed; EAGLEDraftExtendCudaGraphRunner replays it with num_steps + 1 token
        # slots per request: starts/lengths computed on the device into these buffers (int32, as an eager
        # extend's); its seq_lens, real requests and int64 ids share the DRAFT_EXTEND_V2 buffers below
        self._spec_v1 = spec_v1
        self.active_step = 0  # the draft decode step, where the engine's wiring routes steps without marking the batch
        self._v1_extend_max = max(1, num_steps) + 1
        if spec_v1:
            self._uniform_buffers(0)
            self._v1_starts = torch.zeros(width, dtype=torch.int32, device=device)
            self._v1_lens = torch.zeros(width, dtype=torch.int32, device=device)
            self._v1_first = torch.zeros(width, dtype=torch.int32, device=device)  # start, clamped in range
            self._v1_first_loc = torch.zeros(width, dtype=torch.int64, device=device)  # out_cache_loc there
        steps = max(1, decode_steps)
        # per draft decode step (draft_forward's loop): its view's seq_lens and contiguous out_cache_loc, and which
        # lanes are real (a CUDA-graph padding lane has out_cache_loc 0 and must read and write nothing)
        self._step_seq_lens = torch.zeros((steps, width), dtype=torch.int64, device=device)
        self._step_loc = torch.zeros((steps, width), dtype=torch.int64, device=device)
        self._step_real = torch.zeros((steps, width), dtype=torch.bool, device=device)
        # DRAFT_EXTEND_V2: n = --speculative-num-draft-tokens tokens per request (eager and replayed from
        # EAGLEDraftExtendCudaGraphRunner alike): uniform starts/lengths, its seq_lens with padding lanes at 0,
        # which requests are real, and int64 ids (it is fed the verify's int32 next_token_ids eagerly), as
        # precompiled at install; spec v1's DRAFT_EXTEND uses the same three (at most num_steps + 1 ids a request)
        self._extend_n = max(1, draft_tokens_per_request)
        self._uniform_buffers(self._extend_n)
        self._extend_seq_lens = torch.zeros(width, dtype=torch.int64, device=device)
        self._extend_real = torch.zeros(width, dtype=torch.bool, device=device)
        id_slots = max(self._extend_n, self._v1_extend_max if spec_v1 else 0)
        self._extend_ids = torch.zeros(max_batch_size * id_slots, dtype=torch.int64, device=device)

    def draft_step(self, fb) -> int:
        """The draft decode step ``fb`` runs: marked on the batch (``kv_canary_draft_step``: 0.5.12's hooks), else the
        one the engine's own call sites made active (``active_step``: 0.5.23's ``DraftInTreeSlot``)."""
        step = getattr(fb, "kv_canary_draft_step", None)
        return self.active_step if step is None else int(step)

    def view(self, fb) -> ForwardView:
        if fb.forward_mode.name == "DRAFT_EXTEND_V2":
            return self._draft_extend_view(fb)
        if self._spec_v1 and fb.forward_mode.name == "DECODE" and self.batch_size(fb):
            return self._v1_step_view(fb)
        if self._spec_v1 and fb.forward_mode.name == "DRAFT_EXTEND" and self.batch_size(fb):
            return self._v1_draft_extend_view(fb)
        view = super().view(fb)
        if view.batch_size == 0 or fb.forward_mode.name != "DECODE":
            return view
        if view.max_new_len != 1:
            raise ValueError(f"kv-canary: a draft decode step feeds {view.max_new_len} tokens per request; only "
                             "--speculative-eagle-topk 1 (one) is verified")
        step = self.draft_step(fb)
        if step >= self._step_seq_lens.shape[0]:
            raise ValueError(f"kv-canary: draft decode step {step}; the draft adapter holds "
                             f"{self._step_seq_lens.shape[0]} (--speculative-num-steps - 1)")
        bs = view.batch_size
        # draft_forward's out_cache_loc[i] is a strided view (a column of the request-major [bs, steps]
        # layout); the kernels index it as a flat tensor: a copy into the step's own buffer (graph-safe)
        loc = fb.out_cache_loc
        if not loc.is_contiguous():
            loc = self._step_loc[step, : loc.shape[0]]
            loc.copy_(fb.out_cache_loc)
        # reads [0, c + i], writes position c + i; a padding lane (EAGLEDraftCudaGraphRunner pads with row 0,
        # seq_len = the fill value, out_cache_loc 0) gets 0: it reads and writes nothing
        seq_lens, real = self._step_seq_lens[step, :bs], self._step_real[step, :bs]
        torch.add(fb.seq_lens[:bs], step + 1, out=seq_lens)
        torch.gt(loc[:bs], 0, out=real)
        seq_lens.mul_(real)
        if not (view.input_ids.is_contiguous() and view.positions.is_contiguous()):
            raise ValueError("kv-canary: a draft decode step's input_ids/positions are not contiguous")
        return dataclasses.replace(view, seq_lens=seq_lens, out_cache_loc=loc)

    def _int64_ids(self, fb) -> torch.Tensor:
        """The batch's ids as int64 (every precompiled TAIL variant's): spec v1's DRAFT_EXTEND is fed the verify's
        kept tokens (``accept_tokens``: int32) eagerly, copied into the preallocated buffer."""
        tokens = int(fb.input_ids.shape[0])
        if fb.input_ids.dtype == torch.int64:
            return fb.input_ids
        if tokens > self._extend_ids.numel():
            raise ValueError(f"kv-canary: a draft extend feeds {tokens} tokens; the draft adapter holds "
                             f"{self._extend_ids.numel()} (--max-running-requests x tokens per request)")
        ids = self._extend_ids[:tokens]
        ids.copy_(fb.input_ids)
        return ids

    def _v1_draft_extend_view(self, fb) -> ForwardView:
        """Spec v1's DRAFT_EXTEND (``forward_draft_extend_after_decode``), eager or captured/replayed by
        ``EAGLEDraftExtendCudaGraphRunner`` alike: request ``b`` is fed its ``a_b`` kept tokens (``extend_seq_lens``,
        int32[bs], 1 to num_steps + 1), packed in batch order, at positions ``[seq_lens - a_b, seq_lens)``. The
        graph's batch has no ``extend_start_loc`` and ``bs * (num_steps + 1)`` token slots: after the packed tokens,
        ``out_cache_loc`` 0 (the padding slot), and a padding request has ``extend_seq_lens`` num_steps + 1 and
        ``seq_lens`` the fill value. So, on the device into fixed buffers: starts = exclusive cumsum of the
        lengths; a request is real when ``out_cache_loc`` at its start is a slot (> 0); a padding request gets
        length and ``seq_lens`` 0 (reads and writes nothing). The same view eagerly (no padding) and replayed."""
        bs, cap = self.batch_size(fb), self._v1_extend_max
        lens_cpu = getattr(fb, "extend_seq_lens_cpu", None)
        if lens_cpu and max(lens_cpu) > cap:
            raise ValueError(f"kv-canary: a spec v1 draft extend feeds {max(lens_cpu)} tokens for one request; at "
                             f"most --speculative-num-steps + 1 = {cap} are kept per verify")
        tokens = int(fb.input_ids.shape[0])
        raw = fb.extend_seq_lens[:bs]
        starts, lens, first = self._v1_starts[:bs], self._v1_lens[:bs], self._v1_first[:bs]
        torch.cumsum(raw, 0, dtype=torch.int32, out=starts)
        starts.sub_(raw)  # exclusive
        torch.clamp(starts, max=max(0, tokens - 1), out=first)  # a trailing empty request: gather in range
        real, loc = self._extend_real[:bs], self._v1_first_loc[:bs]
        if fb.out_cache_loc.dtype != loc.dtype:
            raise ValueError(f"kv-canary: a spec v1 draft extend's out_cache_loc is {fb.out_cache_loc.dtype}; "
                             "sglang 0.5.12 gives int64")
        torch.index_select(fb.out_cache_loc, 0, first, out=loc)
        torch.gt(loc, 0, out=real)
        torch.mul(raw, real, out=lens)
        seq_lens = self._extend_seq_lens[:bs]
        torch.mul(fb.seq_lens[:bs], real, out=seq_lens)
        return ForwardView(input_ids=self._int64_ids(fb), positions=fb.positions, out_cache_loc=fb.out_cache_loc,
                           req_pool_indices=fb.req_pool_indices, seq_lens=seq_lens, new_starts=starts,
                           new_lens=lens, batch_size=bs, max_new_len=cap, staged=True)

    def _v1_step_view(self, fb) -> ForwardView:
        """Spec v1 draft decode step ``i``: ``bs * topk`` lanes (request-major: lane ``b * topk + k``) at position
        ``c + i``, each reading the request's committed prefix ``[0, c)`` and its own branch's earlier scratch slots
        (not in ``req_to_token``), writing a scratch slot sglang frees right after the phase. The view: the ``bs``
        requests with ``seq_lens`` = ``c`` (a preallocated buffer per step), ``new_lens`` 0 -- HEAD verifies
        ``[0, c)`` and forgets the records of the ``bs * topk`` scratch slots (``unrecorded_stores``; a padding
        lane's slot 0 holds none), TAIL writes nothing. A CUDA-graph padding request (``out_cache_loc`` 0 at its
        first lane) gets 0: it reads nothing."""
        step = self.draft_step(fb)
        if step >= self._step_seq_lens.shape[0]:
            raise ValueError(f"kv-canary: draft decode step {step}; the draft adapter holds "
                             f"{self._step_seq_lens.shape[0]} (--speculative-num-steps - 1)")
        bs = self.batch_size(fb)
        lanes = self._tokens_per_request(fb, bs)  # topk: input_ids holds bs * topk tokens
        seq_lens, real = self._step_seq_lens[step, :bs], self._step_real[step, :bs]
        torch.gt(fb.out_cache_loc[: bs * lanes: lanes], 0, out=real)
        torch.mul(fb.seq_lens[:bs], real, out=seq_lens)
        starts, lens = self._uniform_buffers(0)
        return ForwardView(input_ids=fb.input_ids, positions=fb.positions, out_cache_loc=fb.out_cache_loc,
                           req_pool_indices=fb.req_pool_indices, seq_lens=seq_lens, new_starts=starts[:bs],
                           new_lens=lens[:bs], batch_size=bs, max_new_len=0, staged=False, unrecorded_stores=True)

    def _draft_extend_view(self, fb) -> ForwardView:
        """DRAFT_EXTEND_V2: every request is fed n tokens at ``[c, c + n)`` (``seq_lens`` = ``c + n``), eagerly or
        replayed from ``EAGLEDraftExtendCudaGraphRunner`` (whose batch has no ``extend_start_loc``); fixed buffers,
        no host sync, a padding lane (out_cache_loc 0) reads and writes nothing."""
        bs, n = self.batch_size(fb), self._extend_n
        tokens = int(fb.input_ids.shape[0])
        if tokens != bs * n:
            raise ValueError(f"kv-canary: a draft extend feeds {tokens} tokens for {bs} requests; the draft pool is "
                             f"verified with --speculative-num-draft-tokens {n} per request")
        ids = self._int64_ids(fb)
        starts, lens = self._uniform_buffers(n)
        seq_lens, real = self._extend_seq_lens[:bs], self._extend_real[:bs]
        torch.gt(fb.out_cache_loc[: tokens : n], 0, out=real)
        torch.mul(fb.seq_lens[:bs], real, out=seq_lens)
        return ForwardView(input_ids=ids, positions=fb.positions, out_cache_loc=fb.out_cache_loc,
                           req_pool_indices=fb.req_pool_indices, seq_lens=seq_lens, new_starts=starts[:bs],
                           new_lens=lens[:bs], batch_size=bs, max_new_len=n, staged=True)

    def num_tokens(self, fb) -> int:
        """A draft decode phase writes one slot per request per step (``input_ids`` is the phase's last step's, or
        untouched where the phase replayed from a graph)."""
        if fb.forward_mode.name == "DECODE":
            return 0 if self._spec_v1 else self.batch_size(fb)  # spec v1: scratch slots, not written
        return super().num_tokens(fb)

    def written_slots(self, fb):
        if self._spec_v1 and fb.forward_mode.name == "DECODE":
            return []
        return super().written_slots(fb)

    def _tokens_per_request(self, fb, bs: int) -> int:
        """As the target's; a draft decode phase's batch has no ``input_ids`` before its first step (0.5.23's
        ``EagleDraftWorker.draft`` opens the outer step first): topk 1 feeds one token per request per step."""
        if fb.input_ids is None and fb.forward_mode.name == "DECODE" and not self._spec_v1:
            return 1
        return SglangBatchAdapter._tokens_per_request(fb, bs)

    def host_batch(self, fb):
        batch = super().host_batch(fb)
        if batch is None or fb.forward_mode.name != "DECODE":
            return batch
        if self._spec_v1:
            return dataclasses.replace(batch, new_lens=[0] * len(batch.rows))
        step = self.draft_step(fb)
        return dataclasses.replace(batch, seq_lens=[s + step + 1 for s in batch.seq_lens])


def draft_skip_reason(server_args: Any, mode: str) -> str:
    """'' when the draft pool is verified with these settings, else why not (naming the flag)."""
    from .disagg import disaggregation_mode

    if not getattr(server_args, "speculative_algorithm", None):
        return "no --speculative-algorithm"
    if mode == "contain":
        return "--kv-canary contain evicts from the target's radix cache only"
    pd = disaggregation_mode(server_args)
    if pd in ("prefill", "decode"):
        return f"--disaggregation-mode {pd}"
    # eager or under CUDA graphs alike (EAGLEDraftCudaGraphRunner / EAGLEDraftExtendCudaGraphRunner capture the
    # draft's HEAD/TAIL and each replay is an outer step): no CUDA-graph condition here
    return ""


def _draft_manager(runner):
    if runner is None or not getattr(runner, "is_draft_worker", False):
        return None
    return getattr(runner, "canary_manager", None)


def route_draft_runner_forward(original, model_runner, forward_batch, *args, **kwargs):
    """The plugin's ``ModelRunner.forward`` hook for the draft runner (None: no draft manager)."""
    manager = _draft_manager(model_runner)
    if manager is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    steps = getattr(model_runner, "kv_canary_draft_steps", None)
    if steps is not None:  # a step of draft_forward's loop: its outer step is the whole draft phase
        step = next(steps, None)
        if step is None:
            from ..runner import CanaryBracketError

            raise CanaryBracketError("kv-canary: EagleDraftWorker.draft_forward ran more draft forwards than "
                                     "--speculative-num-steps - 1; this draft loop is not the one the canary wires")
        forward_batch.kv_canary_draft_step = step
        with manager.with_active_single_forward_manager(step):
            return original(model_runner, forward_batch, *args, **kwargs)
    with manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=forward_batch):
        with manager.with_active_single_forward_manager(0):
            return original(model_runner, forward_batch, *args, **kwargs)


def _draft_phase_forwards(worker) -> range:
    """The single-forward managers of one draft decode phase: ``num_steps - 1`` forwards (the last step only samples)."""
    return range(max(0, int(worker.speculative_num_steps) - 1))


@contextlib.contextmanager
def _routed_steps(runner, forwards: range):
    """Each ``draft_runner.forward`` of ``draft_forward``'s loop runs on single-forward manager i (step i)."""
    runner.kv_canary_draft_steps = iter(forwards)
    try:
        yield
    finally:
        runner.kv_canary_draft_steps = None


def _worker_draft_runner(worker):
    """The draft runner of an ``EagleDraftWorker`` (spec v2: ``draft_runner``) or ``EAGLEWorker`` (spec v1: itself a
    ``TpModelWorker`` over the draft model, ``model_runner``)."""
    runner = getattr(worker, "draft_runner", None)
    return runner if runner is not None else getattr(worker, "model_runner", None)


def around_draft_forward(original, worker, forward_batch, *args, **kwargs):
    """AROUND ``EagleDraftWorker.draft_forward``: step i on manager i; eagerly, the phase is one outer step.

    ``EAGLEDraftCudaGraphRunner`` captures ``draft_forward`` itself (inside ``capturing()``, see
    ``around_draft_graph_capture``): then only the routing is recorded, and each replay is bracketed by
    ``around_draft_graph_replay``.
    """
    runner = _worker_draft_runner(worker)
    manager = _draft_manager(runner)
    if manager is None:
        return original(worker, forward_batch, *args, **kwargs)
    forwards = _draft_phase_forwards(worker)
    forward_batch.kv_canary_draft_step = 0
    if manager.is_capturing:
        with _routed_steps(runner, forwards):
            return original(worker, forward_batch, *args, **kwargs)
    with manager.with_ops_outside_graph(single_forward_indices=forwards, maybe_inaccurate_forward_batch=forward_batch):
        try:
            with _routed_steps(runner, forwards):
                return original(worker, forward_batch, *args, **kwargs)
        finally:
            forward_batch.kv_canary_draft_step = 0  # the post-ops read the phase's first step


def around_draft_graph_capture(original, graph_runner, *args, **kwargs):
    """AROUND ``EAGLEDraftCudaGraphRunner.capture_one_batch_size``: warmups and capture run ``draft_forward`` with
    reporting off; step i's HEAD/TAIL (manager i, ``around_draft_forward``) are recorded into the graph."""
    manager = _draft_manager(getattr(graph_runner, "model_runner", None))
    if manager is None:
        return original(graph_runner, *args, **kwargs)
    with manager.capturing():
        return original(graph_runner, *args, **kwargs)


def around_draft_graph_replay(original, graph_runner, forward_batch, *args, **kwargs):
    """AROUND ``EAGLEDraftCudaGraphRunner.replay`` (``EagleDraftWorker.draft`` replays the whole draft decode
    phase without calling ``draft_forward``): one outer step of ``num_steps - 1`` forwards, counted as replayed."""
    manager = _draft_manager(getattr(graph_runner, "model_runner", None))
    if manager is None:
        return original(graph_runner, forward_batch, *args, **kwargs)
    forwards = _draft_phase_forwards(graph_runner.eagle_worker)
    forward_batch.kv_canary_draft_step = 0
    with manager.with_ops_outside_graph(single_forward_indices=forwards, maybe_inaccurate_forward_batch=forward_batch):
        return original(graph_runner, forward_batch, *args, **kwargs)


def around_draft_extend_graph_capture(original, graph_runner, *args, **kwargs):
    """AROUND ``EAGLEDraftExtendCudaGraphRunner.capture_one_batch_size``: its ``run_once`` calls the draft model's
    ``forward`` directly; manager 0 is active (reporting off) so HEAD/TAIL are recorded into the graph."""
    manager = _draft_manager(getattr(graph_runner, "model_runner", None))
    if manager is None:
        return original(graph_runner, *args, **kwargs)
    with manager.capturing(), manager.with_active_single_forward_manager(0):
        return original(graph_runner, *args, **kwargs)


def around_draft_extend_graph_replay(original, graph_runner, forward_batch, *args, **kwargs):
    """AROUND ``EAGLEDraftExtendCudaGraphRunner.replay`` (``_draft_extend_for_decode`` replays the draft extend
    without ``ModelRunner.forward``): one outer step of one forward, counted as replayed."""
    manager = _draft_manager(getattr(graph_runner, "model_runner", None))
    if manager is None:
        return original(graph_runner, forward_batch, *args, **kwargs)
    with manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=forward_batch):
        return original(graph_runner, forward_batch, *args, **kwargs)


def after_draft_worker_init(_result, worker, *args, **kwargs) -> None:
    """AFTER ``EagleDraftWorker.__init__``: the draft's graphs (if any) exist; start reporting."""
    manager = _draft_manager(getattr(worker, "draft_runner", None))
    if manager is None:
        return
    if getattr(worker, "topk", 1) != 1:
        from ..config import CanaryConfigError

        raise CanaryConfigError(f"--speculative-eagle-topk {worker.topk}: the draft pool is verified with topk 1 only")
    _start_reporting(worker, manager)


def _start_reporting(worker, manager) -> None:
    """After the draft worker's init (its graphs, if any, captured): the draft manager starts reporting and the target
    runner learns it (idle drain)."""
    manager.mark_init_finished()
    target = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    if target is not None:
        target.kv_canary_draft_manager = manager


def after_eagle_v1_worker_init(_result, worker, *args, **kwargs) -> None:
    """AFTER ``EAGLEWorker.__init__`` (spec v1; any topk: the v1 step views read the committed prefix per request,
    whatever the lanes): its draft graphs (if any) exist; as for spec v2, the draft manager starts reporting and the
    target runner learns it (idle drain)."""
    manager = _draft_manager(getattr(worker, "model_runner", None))
    if manager is not None:
        _start_reporting(worker, manager)


def draft_manager_of_target(target_runner):
    """The draft pool's manager a target runner learned (None: not verified)."""
    return getattr(target_runner, "kv_canary_draft_manager", None)
