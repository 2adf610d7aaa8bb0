"""The sglang plugin: entry point ``register()`` (group ``sglang.srt.plugins``) and its hooks.

sglang 0.5.12 calls ``load_plugins()`` in ``sglang serve``, ``python -m
sglang.launch_server``, ``Engine`` and every scheduler process; ``register``
then registers hooks with sglang's ``HookRegistry``:

* ``ServerArgs.add_cli_args`` / ``from_cli_args`` / ``__init__``: the ``--kv-canary``
  flags (and ``ServerArgs(kv_canary=...)``, so ``sglang.Engine(kv_canary=...)`` works),
  validated with the ``SGLANG_KV_CANARY_*`` env vars and the server-args allow-list
  (``adapter/server_args``) before any process starts; every hook below must have been
  applied by sglang (``check_hooks_applied``), else startup is refused;
* ``ModelRunnerKVCacheMixin._profile_available_bytes``: hold the canary's bytes back before the KV
  pool is sized from free memory (no OOM after startup);
* ``ModelRunner.init_memory_pool``: ``install_canary`` right after the KV pool exists;
* ``ModelRunner.initialize``: ``mark_init_finished`` after warmup and graph capture;
* ``ModelRunner.forward``: the outside-graph bracket + active single-forward manager 0;
* ``ModelRunner.sample``: the sampled token ids join the token oracle (one device copy; the next HEAD scatters);
* ``ForwardBatch.init_new``: keep the batch's Req objects (cached-prefix tokens for the token check);
* ``CudaGraphRunner.capture_one_batch_size``: warmup runs and capture happen with
  manager 0 active, so the canary's kernels are recorded into the graph;
* ``Scheduler.__init__``: hand the radix cache to the canary (sweep, unused-cache perturbation);
* ``RadixCache._record_store_event`` / ``_delete_leaf`` / ``reset``: keep the sweep's device index
  of cached slots in step with the tree (``--kv-canary-sweep-interval`` only); for hybrid
  sliding-window models ``SWARadixCache._insert_helper`` / ``_delete_leaf`` / ``_delete_tombstone_leaf``
  / ``reset`` and ``SWATokenToKVPoolAllocator.free`` (``adapter/swa_radix``); for hybrid linear-attention
  models ``MambaRadixCache._record_store_event`` / ``_delete_leaf`` / ``_delete_tombstone_leaf`` / ``reset``
  (``adapter/mamba_radix``);
* ``Scheduler.on_idle``: drain the delayed counter copies, so violations of the
  last forwards before an idle period are reported without waiting for traffic;
* ``Scheduler.process_input_requests``: ``--kv-canary contain`` aborts and evicts
  there (``adapter/contain``), where sglang itself handles ``AbortReq``; with
  ``--enable-metrics`` the ``sglang:kv_canary_*`` counters are updated there and
  on idle (``adapter/metrics``);
* PD disaggregation (``adapter/disagg``): the records and an origin stamp are
  registered as extra transfer buffers when the KV manager is built, the prefill
  stamps what it sends, the decode side notes each arrival's tokens and identity,
  and decode-side retraction carries the records to the host and back.

Speculative decoding (``adapter/speculative``): ``EAGLEWorkerV2.verify`` moves the target's token
oracle to the accepted prefix; the EAGLE draft worker's own KV pool gets its own manager
(``adapter/draft``: ``EagleDraftWorker.draft_forward`` is one outer step of ``num_steps - 1`` forwards,
``EagleDraftWorker.__init__`` starts its reporting), eager or under CUDA graphs (``EAGLEDraftCudaGraphRunner`` /
``EAGLEDraftExtendCudaGraphRunner``: captured with HEAD/TAIL inside, each replay one outer step).
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

    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND}
    for target, (hook_name, kind) in {**HOOKS, **PD_HOOKS, **SPEC_HOOKS}.items():
        HookRegistry.register(target, _resolve_hook(hook_name), kinds[kind])
    _registered = True


def _resolve_hook(name: str):
    """A hook function of this module, or ``module.function`` of the adapter layer."""
    if "." not in name:
        return globals()[name]
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(f"{__package__}.adapter.{module}"), attr)


# target -> (hook function in this module, hook type); every one must be applied (check_hooks_applied)
HOOKS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("_after_add_cli_args", "after"),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("_around_from_cli_args", "around"),
    "sglang.srt.server_args.ServerArgs.__init__": ("_around_server_args_init", "around"),
    "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes": (
        "_after_profile_available_bytes", "after"),
    "sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool": ("_after_init_memory_pool", "after"),
    "sglang.srt.model_executor.model_runner.ModelRunner.initialize": ("_around_initialize", "around"),
    "sglang.srt.model_executor.model_runner.ModelRunner.forward": ("_around_forward", "around"),
    "sglang.srt.model_executor.model_runner.ModelRunner.sample": ("_after_sample", "after"),
    "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size":
        ("_around_capture_one_batch_size", "around"),
    "sglang.srt.managers.scheduler.Scheduler.on_idle": ("_after_scheduler_on_idle", "after"),
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("_after_scheduler_init", "after"),
    "sglang.srt.managers.scheduler.Scheduler.process_input_requests": ("_after_process_input_requests", "after"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": ("_after_forward_batch_init_new", "after"),
    # the sweep's cached-slot index follows the radix cache
    "sglang.srt.mem_cache.radix_cache.RadixCache._record_store_event": ("radix.after_node_stored", "after"),
    "sglang.srt.mem_cache.radix_cache.RadixCache._delete_leaf": ("radix.after_node_removed", "after"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.reset": ("radix.after_tree_reset", "after"),
    # ... and sglang's SWARadixCache (hybrid sliding-window models; adapter/swa_radix)
    "sglang.srt.mem_cache.swa_radix_cache.SWARadixCache._insert_helper": ("swa_radix.around_insert_helper", "around"),
    "sglang.srt.mem_cache.swa_radix_cache.SWARadixCache._delete_leaf": ("radix.after_node_removed", "after"),
    "sglang.srt.mem_cache.swa_radix_cache.SWARadixCache._delete_tombstone_leaf": ("radix.after_node_removed",
                                                                                  "after"),
    "sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.reset": ("radix.after_tree_reset", "after"),
    "sglang.srt.mem_cache.swa_memory_pool.SWATokenToKVPoolAllocator.free": ("swa_radix.after_allocator_free",
                                                                            "after"),
    # ... and sglang's MambaRadixCache (hybrid linear-attention models; adapter/mamba_radix)
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._record_store_event": ("radix.after_node_stored",
                                                                                   "after"),
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._delete_leaf": ("radix.after_node_removed", "after"),
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._delete_tombstone_leaf": ("radix.after_node_removed",
                                                                                      "after"),
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.reset": ("radix.after_tree_reset", "after"),
}
# PD disaggregation (adapter/disagg): the records travel with the KV; required with --disaggregation-mode
# only (the transfer backend's module may not even import where PD is not installed)
PD_HOOKS = {
    "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager": ("disagg.around_init_kv_manager",
                                                                                 "around"),
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager": ("disagg.around_init_kv_manager",
                                                                              "around"),
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache": ("disagg.around_send_kvcache", "around"),
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache_slice": (
        "disagg.around_send_kvcache_slice", "around"),
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.send": ("disagg.before_sender_send", "before"),
    "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch": (
        "disagg.after_get_new_prebuilt_batch", "after"),
    "sglang.srt.managers.schedule_batch.Req.offload_kv_cache": ("disagg.after_offload_kv_cache", "after"),
    "sglang.srt.managers.schedule_batch.Req.load_kv_cache": ("disagg.around_load_kv_cache", "around"),
}
# speculative decoding (adapter/speculative): the accepted tokens join the token oracle; required with
# --speculative-algorithm only
SPEC_HOOKS = {
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify": ("speculative.after_eagle_v2_verify", "after"),
    # spec v1 (EAGLEWorker: topk > 1, --disable-overlap-schedule): the tree verify's deferred TAIL over the kept drafts
    "sglang.srt.speculative.eagle_worker.EAGLEWorker.verify": ("speculative.around_eagle_v1_verify", "around"),
    # the draft model's own pool (adapter/draft): the draft decode phase is one outer step, then start reporting
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft_forward": ("draft.around_draft_forward", "around"),
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.__init__": ("draft.after_draft_worker_init", "after"),
    # spec v1's draft pool (EAGLEWorker): its draft decode phase likewise; each step reads the committed prefix
    "sglang.srt.speculative.eagle_worker.EAGLEWorker.draft_forward": ("draft.around_draft_forward", "around"),
    "sglang.srt.speculative.eagle_worker.EAGLEWorker.__init__": ("draft.after_eagle_v1_worker_init", "after"),
    # ... and under CUDA graphs: the draft decode phase and the draft extend are captured with their HEAD/TAIL, and
    # each replay is an outer step (EagleDraftWorker.draft / _draft_extend_for_decode replay without draft_forward /
    # ModelRunner.forward)
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.capture_one_batch_size": (
        "draft.around_draft_graph_capture", "around"),
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.replay": (
        "draft.around_draft_graph_replay", "around"),
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner."
    "capture_one_batch_size": ("draft.around_draft_extend_graph_capture", "around"),
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.replay": (
        "draft.around_draft_extend_graph_replay", "around"),
}


def check_hooks_applied(server_args=None) -> None:
    """Refuse to run half-wired: sglang's HookRegistry only logs a hook it failed to apply."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from .adapter.disagg import disaggregation_mode
    from .config import FLAG_MODE, CanaryConfigError

    patched = getattr(HookRegistry, "_patched", None)
    required = {**HOOKS, **(PD_HOOKS if disaggregation_mode(server_args) in ("prefill", "decode") else {}),
                **(SPEC_HOOKS if getattr(server_args, "speculative_algorithm", None) else {})}
    missing = sorted(t for t in required if patched is None or t not in patched)
    if missing:
        raise CanaryConfigError(
            f"{FLAG_MODE}: sglang did not apply the canary's hook(s) on {', '.join(missing)} (see the "
            "'Failed to apply hooks' error above); the canary would run half-wired. Check that this is stock "
            f"sglang {SUPPORTED_SGLANG} and that SGLANG_PLUGINS allows kv_canary, or run with {FLAG_MODE} none."
        )


# ---------------------------------------------------------------- server args


def _after_add_cli_args(_result, parser) -> None:
    from .config import CanaryMode, RealData

    group = parser.add_argument_group("kv-canary")
    group.add_argument(
        "--kv-canary",
        type=str,
        default=CanaryMode.NONE.value,
        choices=[m.value for m in CanaryMode],
        help="KV-cache integrity canary: 'log' logs each violation and keeps serving, 'raise' stops "
        "the server with a report, 'contain' aborts the requests that read a corrupt KV slot, evicts it from "
        "the radix cache and keeps serving, 'none' (default) costs nothing. Needs --disable-piecewise-cuda-graph "
        "on GPU. Tuned by SGLANG_KV_CANARY_* env vars (see the sglang-kv-canary README).",
    )
    group.add_argument(
        "--kv-canary-real-data",
        type=str,
        default=RealData.PARTIAL.value,
        choices=[r.value for r in RealData],
        help="How much of each slot's real K/V bytes the canary hashes: 'none' (token, position and chain "
        "only), 'partial' (default: SGLANG_KV_CANARY_KV_HASH_BYTES of K and V in SGLANG_KV_CANARY_KV_HASH_LAYERS), "
        "'all' (every byte of K and V of every layer of every slot written or read; costly).",
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
    mode, sweep = getattr(args, "kv_canary", "none"), getattr(args, "kv_canary_sweep_interval", 0)
    real_data = getattr(args, "kv_canary_real_data", "partial")
    _refuse_unsupported(args, mode)  # the user's own flags, before sglang's __post_init__ reacts to them
    server_args = original(cls, args)
    apply_canary_settings(server_args, mode, sweep, real_data)
    return server_args


def _around_server_args_init(original, server_args, *args, kv_canary=None, kv_canary_sweep_interval=None,
                             kv_canary_real_data=None, **kwargs):
    """``ServerArgs(..., kv_canary="raise")`` (the Engine API) works like the CLI flags.

    Without these keywords (``from_cli_args``, which applies the flags itself, or a plain
    ``ServerArgs(...)``) the canary settings are only defaulted here.
    """
    if kv_canary is None and kv_canary_sweep_interval is None and kv_canary_real_data is None:
        original(server_args, *args, **kwargs)
        server_args.kv_canary, server_args.kv_canary_sweep_interval = "none", 0
        server_args.kv_canary_real_data = "partial"
        return
    mode = "none" if kv_canary is None else kv_canary
    _refuse_unsupported(_GivenArgs(type(server_args), kwargs), mode)
    original(server_args, *args, **kwargs)
    apply_canary_settings(server_args, mode, kv_canary_sweep_interval or 0, kv_canary_real_data or "partial")


class _GivenArgs:
    """The keyword arguments given to ``ServerArgs(...)``, falling back to the class defaults."""

    def __init__(self, cls, kwargs):
        self._cls, self._kwargs = cls, kwargs

    def __getattr__(self, name):
        return self._kwargs[name] if name in self._kwargs else getattr(self._cls, name, None)


def _refuse_unsupported(given, mode) -> None:
    from .adapter.server_args import check_supported
    from .config import CanaryMode

    try:
        parsed = CanaryMode(str(getattr(mode, "value", mode)).strip().lower())
    except ValueError:
        return  # CanaryConfig.build names the bad --kv-canary value
    if parsed.enabled:
        check_supported(given, parsed.value, given_only=True)


def apply_canary_settings(server_args, mode, sweep_interval, real_data="partial") -> None:
    """Attach the canary settings to ``server_args`` and refuse, before any process starts, what it cannot verify."""
    server_args.kv_canary = getattr(mode, "value", mode)
    server_args.kv_canary_sweep_interval = sweep_interval
    server_args.kv_canary_real_data = getattr(real_data, "value", real_data)
    from .adapter.server_args import check_supported
    from .api import config_from_server_args

    config = config_from_server_args(server_args)  # CanaryConfigError (a ValueError) at startup
    if config.enabled:
        check_supported(server_args, config.mode.value)  # again: __post_init__ may have changed settings
        check_hooks_applied(server_args)
        logger.info("kv_canary: %s", config.describe())


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
    manager = _canary_of(model_runner)
    if manager is not None:
        forward_batch.kv_canary_reqs = getattr(batch, "reqs", None)
        if manager.transfer is not None and forward_batch.forward_mode.is_extend():
            from .adapter.disagg import note_extend_rooms

            note_extend_rooms(manager, forward_batch.kv_canary_reqs)


def _after_sample(next_token_ids, model_runner, *args, **kwargs) -> None:
    """The scheduler's sampled tokens: what the next forward must be fed (the token oracle)."""
    manager = _canary_of(model_runner)
    if manager is not None and next_token_ids is not None:
        manager.record_sampled(next_token_ids)


def _around_forward(original, model_runner, forward_batch, *args, **kwargs):
    manager = _canary_of(model_runner)
    if manager is None:
        if getattr(model_runner, "is_draft_worker", False):  # the EAGLE draft's own pool (adapter/draft)
            from .adapter.draft import route_draft_runner_forward

            return route_draft_runner_forward(original, model_runner, forward_batch, *args, **kwargs)
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
    from .adapter.radix import RadixCacheView
    from .adapter.mamba_radix import MambaRadixCacheView
    from .adapter.swa_radix import SWARadixCacheView
    from .config import FLAG_MODE, FLAG_SWEEP_INTERVAL, CanaryConfigError, CanaryMode

    manager = _scheduler_canary(scheduler)
    if manager is None:
        mode = str(getattr(scheduler.server_args, "kv_canary", "none"))
        if mode != "none":
            check_hooks_applied(scheduler.server_args)
            raise CanaryConfigError(f"{FLAG_MODE} {mode}: the canary was not installed in this scheduler process")
        return

    collector = getattr(scheduler, "metrics_collector", None)
    if getattr(scheduler, "current_scheduler_metrics_enabled", False) and collector is not None:
        from .adapter.metrics import CanaryMetrics

        scheduler.kv_canary_metrics = CanaryMetrics(collector.labels)
    if manager.config.mode is CanaryMode.CONTAIN:
        from .adapter.contain import SchedulerContainment

        scheduler.kv_canary_containment = SchedulerContainment(scheduler)
        manager.attach_containment(scheduler.kv_canary_containment)
    tree = getattr(scheduler, "tree_cache", None)
    if RadixCacheView.supports(tree):
        manager.attach_prefix_cache(RadixCacheView(tree))
    elif SWARadixCacheView.supports(tree):
        manager.attach_prefix_cache(SWARadixCacheView(tree))
    elif MambaRadixCacheView.supports(tree):
        manager.attach_prefix_cache(MambaRadixCacheView(tree))
    elif manager.config.sweep_interval > 0:
        raise CanaryConfigError(
            f"{FLAG_SWEEP_INTERVAL} {manager.config.sweep_interval} needs sglang's radix cache, but the prefix "
            f"cache is {type(tree).__name__}: "
            + (f"drop --disable-radix-cache or {FLAG_SWEEP_INTERVAL}" if "Chunk" in type(tree).__name__ else
               f"the sweep follows RadixCache, SWARadixCache and MambaRadixCache only (not yet this model's "
               f"cache); unset {FLAG_SWEEP_INTERVAL}")
        )
    elif manager.config.perturb_real_kv_unused_cache_prob > 0:
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB needs sglang's radix cache, but the prefix "
            f"cache is {type(tree).__name__}: unset it"
        )


def _after_process_input_requests(_result, scheduler, *args, **kwargs) -> None:
    """The scheduler's safe point (where sglang handles AbortReq): apply --kv-canary contain's aborts/evictions."""
    containment = getattr(scheduler, "kv_canary_containment", None)
    if containment is not None:
        containment.apply()
    _export_metrics(scheduler)


def _export_metrics(scheduler) -> None:
    metrics = getattr(scheduler, "kv_canary_metrics", None)
    manager = _scheduler_canary(scheduler)
    if metrics is not None and manager is not None:
        metrics.update(manager, getattr(scheduler, "kv_canary_containment", None))


def _after_scheduler_on_idle(_result, scheduler, *args, **kwargs) -> None:
    """Idle: read every counter copy still in flight, so the last forwards' violations surface now."""
    manager = _scheduler_canary(scheduler)
    if manager is not None and manager.init_finished:
        manager.poll(drain=True)
        _export_metrics(scheduler)
        from .adapter.draft import draft_manager_of_target

        draft = draft_manager_of_target(scheduler.tp_worker.model_runner)
        if draft is not None and draft.init_finished:
            draft.poll(drain=True)


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
