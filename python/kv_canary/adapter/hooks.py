"""Hook bodies shared by the sglang lines (registered through each line's table, ``adapter/lines``).

Reading sglang objects by attribute; what differs between releases sits in the line files.
"""

from __future__ import annotations

import contextlib
import logging

from .managers import canary_of, manager_of  # noqa: F401 - manager_of: named here too

logger = logging.getLogger("kv_canary")


# ---------------------------------------------------------------- model runner


def after_profile_available_bytes(available_bytes, model_runner, *args, **kwargs):
    """Hold the canary's device bytes back before sglang sizes the KV pool from free memory."""
    reserve = reserve_before_kv_pool(model_runner, available_bytes)
    if reserve <= 0:
        return None
    model_runner.kv_canary_reserved_bytes = reserve
    return int(available_bytes) - reserve


def reserve_before_kv_pool(sizer, available_bytes) -> int:
    """The canary's bytes to hold back (logged); ``sizer``: what sglang sizes the pool from (it has
    ``server_args``, ``model_config``, ``is_draft_worker``: 0.5.12's ModelRunner, 0.5.23's KVCacheConfigurator)."""
    from .install import canary_reserved_bytes

    reserve = canary_reserved_bytes(sizer, int(available_bytes))
    if reserve > 0:
        logger.info("kv_canary_reserved_bytes=%d available_bytes_before=%d (held back before the KV pool is sized)",
                    reserve, available_bytes)
    return reserve


def after_init_memory_pool(_result, model_runner, *args, **kwargs) -> None:
    from .install import install_canary

    model_runner.canary_manager = install_canary(server_args=model_runner.server_args, model_runner=model_runner)


def around_initialize(original, model_runner, *args, **kwargs):
    model_runner.canary_manager = None
    result = original(model_runner, *args, **kwargs)
    manager = canary_of(model_runner)
    if manager is not None and not manager.init_finished:
        manager.mark_init_finished()
    return result


def after_forward_batch_init_new(forward_batch, _cls, batch, model_runner, *args, **kwargs) -> None:
    """Keep the scheduler's Req objects on the batch: the token check needs cached prefixes' tokens."""
    manager = canary_of(model_runner)
    if manager is not None:
        forward_batch.kv_canary_reqs = getattr(batch, "reqs", None)
        if manager.transfer is not None and forward_batch.forward_mode.is_extend():
            from .disagg import note_extend_rooms

            note_extend_rooms(manager, forward_batch.kv_canary_reqs)


def after_sample(next_token_ids, model_runner, *args, **kwargs) -> None:
    """The scheduler's sampled tokens: what the next forward must be fed (the token oracle)."""
    manager = canary_of(model_runner)
    if manager is not None and next_token_ids is not None:
        manager.record_sampled(next_token_ids)


def around_forward(original, model_runner, forward_batch, *args, **kwargs):
    manager = canary_of(model_runner)
    if manager is None:
        if getattr(model_runner, "is_draft_worker", False):  # the EAGLE draft's own pool (adapter/draft)
            from .draft import route_draft_runner_forward

            return route_draft_runner_forward(original, model_runner, forward_batch, *args, **kwargs)
        return original(model_runner, forward_batch, *args, **kwargs)
    if manager.host_records is not None:  # HiCache: does this forward consume a load-back?
        from .hicache import note_load_consumer

        note_load_consumer(manager, model_runner)
    with manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=forward_batch):
        with manager.with_active_single_forward_manager(0):
            return original(model_runner, forward_batch, *args, **kwargs)


# ---------------------------------------------------------------- scheduler


def scheduler_canary(scheduler):
    worker = getattr(scheduler, "tp_worker", None)
    return canary_of(getattr(worker, "model_runner", None)) if worker is not None else None


def after_scheduler_init(_result, scheduler, *args, **kwargs) -> None:
    """Give the canary the scheduler's radix cache: the sweep and the unused-cache perturbation read it."""
    setup_scheduler(scheduler, metrics_enabled=bool(getattr(scheduler, "current_scheduler_metrics_enabled", False)))


def setup_scheduler(scheduler, *, metrics_enabled: bool) -> None:
    """A scheduler with the canary on must have it installed; then attach metrics, contain and the prefix cache."""
    from ..config import FLAG_MODE, CanaryConfigError

    manager = scheduler_canary(scheduler)
    if manager is None:
        mode = str(getattr(scheduler.server_args, "kv_canary", "none"))
        if mode != "none":
            _check_hooks_applied(scheduler.server_args)
            raise CanaryConfigError(f"{FLAG_MODE} {mode}: the canary was not installed in this scheduler process")
        return
    attach_to_scheduler(scheduler, manager, metrics_enabled=metrics_enabled)


def attach_to_scheduler(scheduler, manager, *, metrics_enabled: bool) -> None:
    """Metrics (``--enable-metrics``), ``--kv-canary contain``'s scheduler side and the prefix cache."""
    from ..config import FLAG_SWEEP_INTERVAL, CanaryConfigError, CanaryMode

    collector = getattr(scheduler, "metrics_collector", None)
    if metrics_enabled and collector is not None:
        from .metrics import CanaryMetrics

        scheduler.kv_canary_metrics = CanaryMetrics(collector.labels)
    from .lines import current_line

    if manager.config.mode is CanaryMode.CONTAIN:
        scheduler.kv_canary_containment = current_line().containment(scheduler, manager)
        manager.attach_containment(scheduler.kv_canary_containment)
    if manager.config.hicache:  # records follow the KV to the host tier (adapter/hicache)
        from .hicache import attach_hicache

        attach_hicache(scheduler, manager)
    tree = getattr(scheduler, "tree_cache", None)
    view = current_line().prefix_cache_view(tree, manager)
    if view is not None:
        manager.attach_prefix_cache(view)
    elif manager.config.sweep_interval > 0:
        raise CanaryConfigError(
            f"{FLAG_SWEEP_INTERVAL} {manager.config.sweep_interval} needs sglang's radix cache, but the prefix "
            f"cache is {type(tree).__name__}: "
            + (f"drop --disable-radix-cache or {FLAG_SWEEP_INTERVAL}" if "Chunk" in type(tree).__name__ else
               f"the sweep follows {current_line().prefix_caches} only (not yet this model's cache); unset "
               f"{FLAG_SWEEP_INTERVAL}")
        )
    elif manager.config.perturb_real_kv_unused_cache_prob > 0:
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB needs sglang's radix cache, but the prefix "
            f"cache is {type(tree).__name__}: unset it"
        )


def after_process_input_requests(_result, scheduler, *args, **kwargs) -> None:
    """The scheduler's safe point (where sglang handles AbortReq): apply --kv-canary contain's aborts/evictions."""
    containment = getattr(scheduler, "kv_canary_containment", None)
    if containment is not None:
        containment.apply()
    export_metrics(scheduler)


def export_metrics(scheduler, *, force: bool = False) -> None:
    """Every scheduler step at most every ``metrics.EXPORT_INTERVAL_S``; ``force`` (idle): now."""
    metrics = getattr(scheduler, "kv_canary_metrics", None)
    if metrics is None:
        return
    manager = scheduler_canary(scheduler)
    if manager is not None:
        metrics.update(manager, getattr(scheduler, "kv_canary_containment", None), force=force)


def before_scheduler_on_idle(scheduler, *args, **kwargs) -> None:
    """Idle: read every counter copy still in flight, so the last forwards' violations surface now: before sglang's
    ``on_idle`` body, which ends in its idle sleep (``--sleep-on-idle``: up to a second, or until the next request
    arrives), so the drain, the settled stats line and the metrics export never wait for it, nor delay that
    request."""
    managers = _scheduler_managers(scheduler)
    for i, manager in enumerate(managers):
        manager.poll(drain=True)
        if i == 0:  # the target's
            export_metrics(scheduler, force=True)


def around_run_event_loop(original, scheduler, *args, **kwargs):
    """The scheduler's loop (every flavour: sglang's ``run_event_loop`` dispatches) raised an error of the engine's
    own (a forward, the sampler, a CUDA error surfacing at a sync): each canary reports what its device counted up to
    that step before the error ends the process (``Reporting.report_before_engine_error``). The canary's own errors
    (``raise`` mode's report, a refused configuration) propagate as they are."""
    try:
        return original(scheduler, *args, **kwargs)
    except Exception as error:
        if not type(error).__module__.startswith("kv_canary"):
            for manager in _scheduler_managers(scheduler):
                manager.report_before_engine_error(error)
        raise


def _scheduler_managers(scheduler):
    """[the scheduler's target canary, its EAGLE draft canary if any], each past init ([] before the target's)."""
    manager = scheduler_canary(scheduler)
    if manager is None or not manager.init_finished:
        return []
    from .draft import draft_manager_of_target

    draft = draft_manager_of_target(scheduler.tp_worker.model_runner)
    return [manager] + ([draft] if draft is not None and draft.init_finished else [])


# ---------------------------------------------------------------- CUDA graphs


def around_capture_one_batch_size(original, graph_runner, *args, **kwargs):
    manager = canary_of(graph_runner.model_runner)
    ctx = (
        contextlib.nullcontext()
        if manager is None
        else stacked(manager.capturing(), manager.with_active_single_forward_manager(0))
    )
    with ctx:
        return original(graph_runner, *args, **kwargs)


@contextlib.contextmanager
def stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _check_hooks_applied(server_args) -> None:
    from ..sglang_plugin import check_hooks_applied

    check_hooks_applied(server_args)
