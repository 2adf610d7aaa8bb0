"""sglang 0.5.12 EAGLE draft worker (spec v2, topk 1): its own KV pool, verified (``kv_canary.draft_pool``).

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
  ``ModelRunner.forward`` like the target's: an outer step with manager 0.

Views (``DraftBatchAdapter``): EXTEND and DRAFT_EXTEND_V2 are extend batches (``extend_seq_lens``
new tokens after ``extend_prefix_lens``); a draft decode step ``i`` (DECODE, one token per request,
``seq_lens`` = ``c``) runs at position ``c + i`` and reads ``[0, c + i]``: its view's ``seq_lens`` is
``c + i + 1`` (a preallocated buffer per step, graph-safe), and its ``out_cache_loc`` (a strided column
of ``[bs, num_steps]`` in ``draft_forward``) is copied into a preallocated contiguous buffer per step.

Not verified (refused or skipped with a startup line naming why): the draft's CUDA graphs
(``EAGLEDraftCudaGraphRunner``, ``EAGLEDraftExtendCudaGraphRunner``: the draft pool is verified only
with ``--disable-cuda-graph`` or on CPU), ``--kv-canary contain`` and PD disaggregation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

import torch

from ..views import ForwardView
from .batch_adapter import SglangBatchAdapter


class DraftBatchAdapter(SglangBatchAdapter):
    """``SglangBatchAdapter`` plus the draft decode steps' views (see the module docstring)."""

    def __init__(self, *, max_batch_size: int, device: torch.device, draft_tokens_per_request: int = 1,
                 decode_steps: int = 1):
        super().__init__(max_batch_size=max_batch_size, device=device)
        # per draft decode step (draft_forward's loop): its view's seq_lens and contiguous out_cache_loc
        self._step_seq_lens = torch.zeros((max(1, decode_steps), max_batch_size), dtype=torch.int64, device=device)
        self._step_loc = torch.zeros((max(1, decode_steps), max_batch_size), dtype=torch.int64, device=device)
        # DRAFT_EXTEND_V2 feeds the verify's next_token_ids (int32): int64 ids, as every other batch and the
        # kernel variants precompiled at install (no JIT while serving)
        self._extend_ids = torch.zeros(max_batch_size * max(1, draft_tokens_per_request), dtype=torch.int64,
                                       device=device)

    def view(self, fb) -> ForwardView:
        view = super().view(fb)
        if view.batch_size == 0:
            return view
        if fb.forward_mode.name == "DRAFT_EXTEND_V2" and view.input_ids.dtype != torch.int64:
            n = int(view.input_ids.shape[0])
            if n > self._extend_ids.numel():
                raise ValueError(f"kv-canary: a draft extend feeds {n} tokens; the draft adapter holds "
                                 f"{self._extend_ids.numel()} (--max-running-requests x --speculative-num-draft-tokens)")
            ids = self._extend_ids[:n]
            ids.copy_(view.input_ids)
            return dataclasses.replace(view, input_ids=ids)
        if fb.forward_mode.name != "DECODE":
            return view
        if view.max_new_len != 1:
            raise ValueError(f"kv-canary: a draft decode step feeds {view.max_new_len} tokens per request; only "
                             "--speculative-eagle-topk 1 (one) is verified")
        step = int(getattr(fb, "kv_canary_draft_step", 0))
        if step >= self._step_seq_lens.shape[0]:
            raise ValueError(f"kv-canary: draft decode step {step}; the draft adapter holds "
                             f"{self._step_seq_lens.shape[0]} (--speculative-num-steps - 1)")
        seq_lens = self._step_seq_lens[step, : view.batch_size]
        torch.add(fb.seq_lens[: view.batch_size].to(torch.int64), step + 1, out=seq_lens)
        # draft_forward's out_cache_loc[i] is a strided view (a column of the request-major [bs, steps]
        # layout); the kernels index it as a flat tensor: a copy into the step's own buffer (graph-safe)
        loc = fb.out_cache_loc
        if not loc.is_contiguous():
            loc = self._step_loc[step, : loc.shape[0]]
            loc.copy_(fb.out_cache_loc)
        if not (view.input_ids.is_contiguous() and view.positions.is_contiguous()):
            raise ValueError("kv-canary: a draft decode step's input_ids/positions are not contiguous")
        return dataclasses.replace(view, seq_lens=seq_lens, out_cache_loc=loc)

    def host_batch(self, fb):
        batch = super().host_batch(fb)
        if batch is None or fb.forward_mode.name != "DECODE":
            return batch
        step = int(getattr(fb, "kv_canary_draft_step", 0))
        return dataclasses.replace(batch, seq_lens=[s + step + 1 for s in batch.seq_lens])


TARGET_DISABLE_CUDA_GRAPH = "_kv_canary_target_disable_cuda_graph"  # set on server_args by the target's install


def record_target_cuda_graph_setting(server_args: Any) -> None:
    """At the target's install (and memory sizing), before an EAGLE worker flips the flag for its draft."""
    setattr(server_args, TARGET_DISABLE_CUDA_GRAPH, bool(getattr(server_args, "disable_cuda_graph", False)))


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
    # EAGLE workers set server_args.disable_cuda_graph = True while they build the draft's ModelRunner (their
    # own graph runners capture later): the value the target's install recorded is the operator's setting
    graphs_off = getattr(server_args, TARGET_DISABLE_CUDA_GRAPH, None)
    if graphs_off is None:
        return "the target model's CUDA-graph setting was not recorded before the draft pool's install"
    if str(getattr(server_args, "device", "cuda")) != "cpu" and not graphs_off:
        return ("CUDA graphs are on and the draft's graph runners (EAGLEDraftCudaGraphRunner, "
                "EAGLEDraftExtendCudaGraphRunner) are not bracketed yet; pass --disable-cuda-graph to verify it")
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


def around_draft_forward(original, worker, forward_batch, *args, **kwargs):
    """AROUND ``EagleDraftWorker.draft_forward``: the draft decode phase is one outer step, step i on manager i."""
    runner = worker.draft_runner
    manager = _draft_manager(runner)
    if manager is None:
        return original(worker, forward_batch, *args, **kwargs)
    forwards = range(max(0, int(worker.speculative_num_steps) - 1))  # the last step only samples
    forward_batch.kv_canary_draft_step = 0
    with manager.with_ops_outside_graph(single_forward_indices=forwards, maybe_inaccurate_forward_batch=forward_batch):
        runner.kv_canary_draft_steps = iter(forwards)
        try:
            return original(worker, forward_batch, *args, **kwargs)
        finally:
            runner.kv_canary_draft_steps = None
            forward_batch.kv_canary_draft_step = 0  # the post-ops read the phase's first step


def after_draft_worker_init(_result, worker, *args, **kwargs) -> None:
    """AFTER ``EagleDraftWorker.__init__``: the draft's graphs (if any) exist; start reporting."""
    manager = _draft_manager(getattr(worker, "draft_runner", None))
    if manager is None:
        return
    if getattr(worker, "topk", 1) != 1:
        from ..config import CanaryConfigError

        raise CanaryConfigError(f"--speculative-eagle-topk {worker.topk}: the draft pool is verified with topk 1 only")
    manager.mark_init_finished()
    target = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    if target is not None:
        target.kv_canary_draft_manager = manager


def draft_manager_of_target(target_runner):
    """The draft pool's manager a target runner learned (None: not verified)."""
    return getattr(target_runner, "kv_canary_draft_manager", None)
