"""sglang 0.5.23 EAGLE (spec v2, topk 1): the target's and the draft's pools, through sglang's own call sites.

0.5.23 has one EAGLE worker (``EAGLEWorkerV2``; spec v1's ``EAGLEWorker`` is gone), synchronous when the overlap
scheduler is off (always on CPU). Its draft worker (``EagleDraftWorker``) already calls the in-tree canary's
interface on the draft runner's ``canary_manager`` -- the object the line's ``install`` returns for the draft runner
(``lines.v0_5_23``) -- so the plugin needs none of 0.5.12's draft hooks:

* ``EagleDraftWorker.draft``: ``with_ops_outside_graph(single_forward_indices=range(num_steps - 1))`` around the
  draft decode phase (eager, or the replay of ``EAGLEDraftCudaGraphRunner``), and inside ``draft_forward`` each
  step's ``draft_runner.forward`` under ``with_active_single_forward_manager(i)``;
* ``_draft_extend_for_prefill`` / ``_draft_extend_for_decode``: an outer step with manager 0 around the draft's
  EXTEND / DRAFT_EXTEND_V2 forward (eager or replayed);
* ``ModelRunner.forward`` leaves the draft runner to those call sites (``not self.is_draft_worker``).

``DraftInTreeSlot`` serves them with the draft pool's ``DraftCanaryManager`` and tells the draft adapter which
decode step a forward is (``DraftCanaryManager.note_draft_step``; 0.5.12's hooks mark the batch instead).
Reporting starts at the end of ``Scheduler.init_model_worker`` (``start_draft_reporting``, like the target's), and
the target runner learns the draft manager (the idle drain polls both). The target side: the AFTER hook on
``EAGLEWorkerV2.verify`` (``speculative.after_eagle_v2_verify``), as on 0.5.12.

Verified with topk 1 (``spec_unported`` refuses topk > 1 at startup, naming the flag): on CPU synchronous spec v2; on
the GPU spec v2 with the overlap scheduler (0.5.23's default there) and without it, the target's verify, the draft
decode phase and the draft extends replayed from sglang's CUDA graphs (docs/results/, the 0.5.23 GPU runs).
"""

from __future__ import annotations

from typing import Any

from .in_tree_slot import InTreeSlot

SPEC_WHERE = ("verified with topk 1: synchronous spec v2 on CPU (overlap scheduler off, as sglang runs it there), spec v2 "
              "with the overlap scheduler (0.5.23's GPU default) or without it on the GPU, under CUDA graphs")


def _setting(server_args: Any, field: str) -> Any:
    """What sglang runs with: its resolved value where it resolved ``server_args`` (e.g. the overlap scheduler it turns
    off on CPU for speculative decoding), else the field."""
    from .policy_0_5_23 import _resolved

    value = _resolved(server_args, field)
    return getattr(server_args, field, None) if value is None else value


def spec_unported(server_args: Any) -> str:
    """With ``--speculative-algorithm``: the first setting 0.5.23's speculative path is not verified with ('')."""
    if not getattr(server_args, "speculative_algorithm", None):
        return ""
    topk = _setting(server_args, "speculative_eagle_topk")
    if topk is not None and int(topk) != 1:
        return (f"--speculative-eagle-topk {topk}: speculative decoding on sglang 0.5.23 is {SPEC_WHERE}; 0.5.23 "
                "runs topk > 1 as spec v2 tree verifies (the accepted path compacted to the front of each request's "
                "block), which is not verified; pass --speculative-eagle-topk 1, or use sglang 0.5.12 (spec v1)")
    return ""


class _DraftPhase:
    """``with_ops_outside_graph`` of the draft runner: the manager's outer bracket; its post-ops read step 0."""

    __slots__ = ("_manager", "_outer")

    def __init__(self, manager, outer):
        self._manager, self._outer = manager, outer

    def __enter__(self) -> None:
        self._manager.note_draft_step(0)
        self._outer.__enter__()

    def __exit__(self, exc_type, exc, tb):
        self._manager.note_draft_step(0)
        return self._outer.__exit__(exc_type, exc, tb)


class _DraftStep:
    """``with_active_single_forward_manager(i)`` of the draft runner: manager ``i``, and the draft adapter's step ``i``
    (``ModelRunner.forward`` hands the model its own batch object, so the step cannot ride on the phase's)."""

    __slots__ = ("_manager", "_index", "_active")

    def __init__(self, manager, index: int):
        self._manager, self._index = manager, index
        self._active = manager.with_active_single_forward_manager(index)

    def __enter__(self) -> None:
        self._manager.note_draft_step(self._index)
        self._active.__enter__()

    def __exit__(self, exc_type, exc, tb):
        self._manager.note_draft_step(0)
        return self._active.__exit__(exc_type, exc, tb)


class DraftInTreeSlot(InTreeSlot):
    """The draft runner's ``canary_manager`` on 0.5.23: ``EagleDraftWorker``'s call sites, served by the draft pool's
    ``DraftCanaryManager`` (``kv_canary_manager``)."""

    def with_ops_outside_graph(self, *, single_forward_indices, maybe_inaccurate_forward_batch):
        manager = self.kv_canary_manager
        return _DraftPhase(manager, manager.with_ops_outside_graph(
            single_forward_indices=single_forward_indices, maybe_inaccurate_forward_batch=maybe_inaccurate_forward_batch))

    def with_active_single_forward_manager(self, index: int):
        return _DraftStep(self.kv_canary_manager, index)

    def mark_init_finished(self) -> None:
        """Called by ``EagleDraftWorker.init_cuda_graphs``; the plugin starts the draft's reporting with the target's,
        at the end of ``Scheduler.init_model_worker`` (``start_draft_reporting``)."""


def draft_runner_of(scheduler) -> Any:
    """The draft model's runner of a 0.5.23 scheduler (``Scheduler.draft_worker``: ``EAGLEWorkerV2``, whose
    ``draft_worker`` is the ``EagleDraftWorker``), or None."""
    worker = getattr(scheduler, "draft_worker", None)
    draft = getattr(worker, "draft_worker", None)
    return getattr(draft, "draft_runner", None)


def start_draft_reporting(scheduler, target_runner) -> None:
    """End of the scheduler's model setup: the draft pool's manager (if verified) starts reporting, after the same
    check as the target's (its pool was not rebuilt after install), and the target runner learns it (idle drain)."""
    from ..buffer_groups import groups_still_view
    from ..config import FLAG_MODE, CanaryConfigError
    from .managers import manager_of
    from .pools import pool_context

    runner = draft_runner_of(scheduler)
    manager = manager_of(runner) if runner is not None else None
    if manager is None or manager.init_finished:
        return
    if not groups_still_view(runner.token_to_kv_pool, manager.groups, pool_context(runner)):
        raise CanaryConfigError(f"{FLAG_MODE} {manager.config.mode.value}: sglang rebuilt the speculative draft "
                                "model's KV pool after the canary was installed; not verified on sglang 0.5.23 yet")
    manager.mark_init_finished()
    target_runner.kv_canary_draft_manager = manager
