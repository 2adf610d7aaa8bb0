"""The sglang plugin: entry point ``register()`` (group ``sglang.srt.plugins``) and its hooks.

sglang 0.5.12 calls ``load_plugins()`` in ``sglang serve``, ``python -m
sglang.launch_server``, ``Engine`` and every scheduler process; ``register``
then registers hooks with sglang's ``HookRegistry``:

* ``ServerArgs.add_cli_args`` / ``from_cli_args``: the ``--kv-canary`` flag,
  validated (with the ``SGLANG_KV_CANARY_*`` env vars) before any process starts;
* ``ModelRunnerKVCacheMixin._profile_available_bytes``: hold the canary's bytes back before the KV
  pool is sized from free memory (no OOM after startup);
* ``ModelRunner.init_memory_pool``: ``install_canary`` right after the KV pool exists;
* ``ModelRunner.initialize``: ``mark_init_finished`` after warmup and graph capture;
* ``ModelRunner.forward``: the outside-graph bracket + active single-forward manager 0;
* ``ForwardBatch.init_new``: keep the batch's Req objects (cached-prefix tokens for the token check);
* ``CudaGraphRunner.capture_one_batch_size``: warmup runs and capture happen with
  manager 0 active, so the canary's kernels are recorded into the graph;
* ``Scheduler.__init__``: hand the radix cache to the canary (sweep, unused-cache perturbation);
* ``RadixCache._record_store_event`` / ``_delete_leaf`` / ``reset``: keep the sweep's device index
  of cached slots in step with the tree (``--kv-canary-sweep-interval`` only);
* ``Scheduler.on_idle``: drain the delayed counter copies, so violations of the
  last forwards before an idle period are reported without waiting for traffic.

Draft workers (speculative decoding) are excluded everywhere for now.
On an sglang other than 0.5.12, or one with its own in-tree kv_canary, the
plugin logs one line and registers nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

logger = logging.getLogger("kv_canary")

SUPPORTED_SGLANG = "0.5.12"
_registered = False


def version_gate() -> str:
    """'' when this sglang is supported, else the reason it is not."""
    try:
        from sglang.version import __version__ as version
    except ImportError:  # pragma: no cover - sglang always ships it
        return "cannot read sglang's version"
    if version != SUPPORTED_SGLANG:
        return f"sglang {version} is not {SUPPORTED_SGLANG}"
    if importlib.util.find_spec("sglang.srt.kv_canary") is not None:
        return "this sglang ships its own in-tree kv_canary; use its --kv-canary instead"
    return ""


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    reason = version_gate()
    if reason:
        logger.warning("kv_canary plugin inactive: %s; --kv-canary is not available", reason)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = [
        ("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER),
        ("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, HookType.AROUND),
        ("sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes",
         _after_profile_available_bytes, HookType.AFTER),
        ("sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool", _after_init_memory_pool,
         HookType.AFTER),
        ("sglang.srt.model_executor.model_runner.ModelRunner.initialize", _around_initialize, HookType.AROUND),
        ("sglang.srt.model_executor.model_runner.ModelRunner.forward", _around_forward, HookType.AROUND),
        ("sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size",
         _around_capture_one_batch_size, HookType.AROUND),
        ("sglang.srt.managers.scheduler.Scheduler.on_idle", _after_scheduler_on_idle, HookType.AFTER),
        ("sglang.srt.managers.scheduler.Scheduler.__init__", _after_scheduler_init, HookType.AFTER),
        ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", _after_forward_batch_init_new,
         HookType.AFTER),
        ("sglang.srt.mem_cache.radix_cache.RadixCache._record_store_event", _after_radix_node_stored,
         HookType.AFTER),
        ("sglang.srt.mem_cache.radix_cache.RadixCache._delete_leaf", _after_radix_delete_leaf, HookType.AFTER),
        ("sglang.srt.mem_cache.radix_cache.RadixCache.reset", _after_radix_reset, HookType.AFTER),
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    _registered = True


# ---------------------------------------------------------------- server args


def _after_add_cli_args(_result, parser) -> None:
    from .config import CanaryMode

    group = parser.add_argument_group("kv-canary")
    group.add_argument(
        "--kv-canary",
        type=str,
        default=CanaryMode.NONE.value,
        choices=[m.value for m in CanaryMode],
        help="KV-cache integrity canary: 'log' logs each violation and keeps serving, 'raise' stops "
        "the server with a report, 'none' (default) costs nothing. Needs --disable-piecewise-cuda-graph "
        "on GPU. Tuned by SGLANG_KV_CANARY_* env vars (see the sglang-kv-canary README).",
    )
    group.add_argument(
        "--kv-canary-sweep-interval",
        type=int,
        default=0,
        metavar="N",
        help="Every N forwards, also verify every slot held by the radix cache, including cached prefixes "
        "no running request uses (0 = off, the default). Needs --kv-canary log or raise.",
    )


def _around_from_cli_args(original, cls, args):
    server_args = original(cls, args)
    server_args.kv_canary = getattr(args, "kv_canary", "none")
    server_args.kv_canary_sweep_interval = getattr(args, "kv_canary_sweep_interval", 0)
    from .api import config_from_server_args

    config = config_from_server_args(server_args)  # CanaryConfigError (a ValueError) at startup
    if config.enabled:
        logger.info("kv_canary: %s", config.describe())
    return server_args


# ---------------------------------------------------------------- model runner


def _canary_of(model_runner):
    """The runner's manager, or None (canary off, draft worker, or not installed)."""
    if getattr(model_runner, "is_draft_worker", False):
        return None
    return getattr(model_runner, "canary_manager", None)


def _after_profile_available_bytes(available_bytes, model_runner, *args, **kwargs):
    """Hold the canary's device bytes back before sglang sizes the KV pool from free memory."""
    from .api import canary_reserved_bytes

    reserve = canary_reserved_bytes(model_runner, int(available_bytes))
    if reserve <= 0:
        return None
    model_runner.kv_canary_reserved_bytes = reserve
    logger.info("kv_canary_reserved_bytes=%d available_bytes_before=%d (held back before the KV pool is sized)",
                reserve, available_bytes)
    return int(available_bytes) - reserve


def _after_init_memory_pool(_result, model_runner, *args, **kwargs) -> None:
    from .api import install_canary

    model_runner.canary_manager = install_canary(server_args=model_runner.server_args, model_runner=model_runner)


def _around_initialize(original, model_runner, *args, **kwargs):
    model_runner.canary_manager = None
    result = original(model_runner, *args, **kwargs)
    manager = _canary_of(model_runner)
    if manager is not None:
        manager.mark_init_finished()
    return result


def _after_forward_batch_init_new(forward_batch, _cls, batch, model_runner, *args, **kwargs) -> None:
    """Keep the scheduler's Req objects on the batch: the token check needs cached prefixes' tokens."""
    if _canary_of(model_runner) is not None:
        forward_batch.kv_canary_reqs = getattr(batch, "reqs", None)


def _around_forward(original, model_runner, forward_batch, *args, **kwargs):
    manager = _canary_of(model_runner)
    if manager is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    with manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=forward_batch):
        with manager.with_active_single_forward_manager(0):
            return original(model_runner, forward_batch, *args, **kwargs)


# ---------------------------------------------------------------- scheduler


def _scheduler_canary(scheduler):
    worker = getattr(scheduler, "tp_worker", None)
    return _canary_of(getattr(worker, "model_runner", None)) if worker is not None else None


def _after_scheduler_init(_result, scheduler, *args, **kwargs) -> None:
    """Give the canary the scheduler's radix cache: the sweep and the unused-cache perturbation read it."""
    manager = _scheduler_canary(scheduler)
    if manager is None:
        return
    from .adapter.radix import RadixCacheView
    from .config import FLAG_SWEEP_INTERVAL, CanaryConfigError

    tree = getattr(scheduler, "tree_cache", None)
    if RadixCacheView.supports(tree):
        manager.attach_prefix_cache(RadixCacheView(tree))
    elif manager.config.sweep_interval > 0:
        raise CanaryConfigError(
            f"{FLAG_SWEEP_INTERVAL} {manager.config.sweep_interval} needs sglang's radix cache, but the prefix "
            f"cache is {type(tree).__name__}: drop --disable-radix-cache or {FLAG_SWEEP_INTERVAL}"
        )


def _after_radix_node_stored(_result, tree, node, *args, **kwargs) -> None:
    """A radix node with new slots: the sweep's cached-slot index learns them (host queue only)."""
    if getattr(tree, "kv_canary_index", None) is not None:
        from .adapter.radix import on_node_stored

        on_node_stored(tree, node)


def _after_radix_delete_leaf(_result, tree, node, *args, **kwargs) -> None:
    if getattr(tree, "kv_canary_index", None) is not None:
        from .adapter.radix import on_node_removed

        on_node_removed(tree, node)


def _after_radix_reset(_result, tree, *args, **kwargs) -> None:
    if getattr(tree, "kv_canary_index", None) is not None:
        from .adapter.radix import on_reset

        on_reset(tree)


def _after_scheduler_on_idle(_result, scheduler, *args, **kwargs) -> None:
    """Idle: read every counter copy still in flight, so the last forwards' violations surface now."""
    manager = _scheduler_canary(scheduler)
    if manager is not None and manager.init_finished:
        manager.poll(drain=True)


# ---------------------------------------------------------------- CUDA graphs


def _around_capture_one_batch_size(original, graph_runner, *args, **kwargs):
    manager = _canary_of(graph_runner.model_runner)
    ctx = (
        contextlib.nullcontext()
        if manager is None
        else _stacked(manager.capturing(), manager.with_active_single_forward_manager(0))
    )
    with ctx:
        return original(graph_runner, *args, **kwargs)


@contextlib.contextmanager
def _stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
