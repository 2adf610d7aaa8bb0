"""sglang 0.5.23: the plugin takes the in-tree kv_canary's place, driven by sglang's own call sites.

0.5.22 is served by this line's hooks expecting 0.5.22's signatures (``v0_5_22``: its PD sender differs; ``fence``,
``release_targets.json``); its line record says PD never ran there (``pd_verified``), so the PD gate refuses it.

0.5.23 ships sglang's own ``kv_canary`` (the same seed design) and calls it from its code:
``ModelRunner._init_post_memory_pool_components`` builds it through the module-level
``install_canary`` that ``model_runner.py`` binds at import; ``ModelRunner.forward`` enters
``with_ops_outside_graph`` + ``with_active_single_forward_manager(0)``; the graph runners and
warmups enter ``with_active_single_forward_manager(0)``; the scheduler calls
``attach_radix_cache``; the post-capture KV sizing asks ``per_forward_workspace_bytes``.
Replacing that one binding (``install``) makes every one of those call sites drive the
plugin's ``CanaryManager`` through ``InTreeSlot``: sglang's in-tree manager is never built,
so nothing of it runs beside ours (no second HEAD/TAIL, no second set of buffers).
``SGLANG_KV_CANARY_IMPL=in-tree`` leaves sglang's own in place instead (``adapter/lines``).

The flags are sglang's own fields here (``--kv-canary``, ``--kv-canary-real-data``,
``--kv-canary-sweep-interval``, upstream's names, meanings and defaults: real data
``none`` unless given); the plugin adds ``contain`` to ``--kv-canary``'s choices.

HiCache (``--enable-hierarchical-cache``, ``log``/``raise``; CPU through the test shim, and the GPU host; ``contain``
on sglang's Python tree core, CPU): ``HICACHE_HOOKS``, the hook
bodies of ``adapter/hicache`` with this line's streams, fences and host pool (``adapter/hicache_0_5_23``); a load's
consumer is named in ``InTreeSlot.with_ops_outside_graph``. Its ``file`` storage tier: ``adapter/hicache_storage``'s
bodies with this line's page get/set contract and hit query (``adapter/hicache_0_5_23``); ``contain`` evicts a bad
node from the device and the host and poisons its pages' storage keys (``adapter/contain_hicache_0_5_23``).
The sweep reads 0.5.23's ``UnifiedRadixCache`` through sglang's own walk (``adapter/unified_radix``);
``contain`` evicts from it through its tree-core interface (``adapter/contain_unified``).
Speculative decoding (EAGLE/EAGLE3 spec v2, topk 1; synchronous on CPU, with the overlap scheduler on a GPU): ``SPEC_HOOKS`` and ``adapter/spec_0_5_23``
(the draft runner's call sites drive the draft pool's manager through ``DraftInTreeSlot``).
Tensor parallel: each rank's canary reads its rank from 0.5.23's parallel context (``tp_rank``; the
``ModelRunner`` has no ``tp_rank`` there); contain's ranks agree over the scheduler's ``tp_cpu_group``.
CUDA graphs (GPU host, H200: docs/results/gpu-h200-2026-11-29-sglang-0.5.23-cuda-graphs): the decode graphs
(backend ``full``) capture HEAD/TAIL, as on 0.5.12, with the manager capturing during warmup and capture
(``DecodeCudaGraphRunner.capture_one_shape``); the prefill graphs (backend ``breakable``, sglang's CUDA default)
capture only the transformer body, and replay it inside the outer ``model.forward``, whose HEAD/TAIL (the
patched forward) run eagerly around it, on the live batch. Other backends are refused by the policy
(``policy_0_5_23.GRAPH_RULES``), naming the flag.
PD disaggregation (mooncake): ``PD_HOOKS``, 0.5.12's hook bodies (``adapter/disagg``); CPU CI (issue 52).
Not ported to this line yet, refused at startup naming the flag (``unported``): ``--speculative-eagle-topk`` > 1 (spec v2
tree verifies), tensor parallel with speculative decoding; PD on 0.5.21/0.5.22 (``pd_verified``: adapter/disagg).
Verified pools: ``MHATokenToKVPool``, ``MLATokenToKVPool``, ``SWAKVPool`` (two MHA halves, the paged
SWA allocator's mapping), ``HybridLinearKVPool`` (its full-attention layers' inner pool; the mamba state
is not covered, as on 0.5.12); checked at install.
"""

from __future__ import annotations

import logging
from typing import Any

from ..in_tree_slot import InTreeSlot
from ..policy_0_5_23 import POLICY_0_5_23
from ..unified_radix import unified_view_for
from . import v0_5_12
from .base import HookTable, SglangLine

logger = logging.getLogger("kv_canary")

HOOKS: HookTable = {
    # sglang's call sites for its in-tree canary get the plugin's manager instead ...
    "sglang.srt.model_executor.model_runner.install_canary": ("lines.v0_5_23.install", "replace"),
    # ... and sglang's own install can never run beside it (model_runner.py is its only caller in 0.5.23)
    "sglang.srt.kv_canary.api.install_canary": ("lines.v0_5_23.refuse_in_tree_install", "replace"),
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("lines.v0_5_23.after_add_cli_args", "after"),
    # the CLI and sglang.Engine(...) both resolve their ServerArgs in the launching process before any other starts
    "sglang.srt.server_args.ServerArgs.resolve_once": ("lines.v0_5_23.after_resolve_once", "after"),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes": (
        "lines.v0_5_23.after_profile_available_bytes", "after"),
    # the end of the scheduler's model setup: pools built, warmups, graph capture and post-capture sizing done
    "sglang.srt.managers.scheduler.Scheduler.init_model_worker": ("lines.v0_5_23.after_init_model_worker", "after"),
    "sglang.srt.model_executor.model_runner.ModelRunner.sample": ("hooks.after_sample", "after"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": ("hooks.after_forward_batch_init_new",
                                                                          "after"),
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("lines.v0_5_23.after_scheduler_init", "after"),
    "sglang.srt.managers.scheduler.Scheduler.on_idle": ("hooks.before_scheduler_on_idle", "before"),
    # an error of the engine's own ends the loop: what the canary found up to it is reported first
    "sglang.srt.managers.scheduler.Scheduler.run_event_loop": ("hooks.around_run_event_loop", "around"),
    "sglang.srt.managers.scheduler.Scheduler.process_input_requests": ("hooks.after_process_input_requests", "after"),
    # decode CUDA graphs: sglang's capture enters only with_active_single_forward_manager(0); the plugin's warmup +
    # capture also runs with the manager capturing (nothing reported or counted, counters kept across a recapture
    # after init), as 0.5.12's CudaGraphRunner.capture_one_batch_size
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape": (
        "hooks.around_capture_one_batch_size", "around"),
}
# speculative decoding (adapter/spec_0_5_23): the accepted tokens join the token oracle, as on 0.5.12; the draft
# pool needs no hook of its own (EagleDraftWorker's own call sites drive DraftInTreeSlot); required with
# --speculative-algorithm only
SPEC_HOOKS: HookTable = {
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify": ("speculative.after_eagle_v2_verify", "after"),
}
# HiCache (adapter/hicache, what differs from 0.5.12: adapter/hicache_0_5_23): records follow the KV to the host pool
# and back; required with --enable-hierarchical-cache only. HybridCacheController inherits start_writing/start_loading;
# UnifiedRadixCache.writing_check processes the write acks (write-back: blocking); the host pool is pool_host's
HICACHE_HOOKS: HookTable = {
    "sglang.srt.managers.cache_controller.HiCacheController.start_writing": ("hicache_0_5_23.around_start_writing",
                                                                            "around"),
    "sglang.srt.managers.cache_controller.HiCacheController.start_loading": ("hicache_0_5_23.around_start_loading",
                                                                            "around"),
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.writing_check": ("hicache.around_writing_check",
                                                                                "around"),
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.free": ("hicache.after_host_free", "after"),
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.clear": ("hicache.after_host_clear", "after"),
    # the storage tier (--hicache-storage-backend file): the records ride inside each page object, as on 0.5.12;
    # HybridCacheController inherits both (AROUND: sglang's own bodies run when the controller has no canary)
    "sglang.srt.managers.cache_controller.HiCacheController._generic_page_set": (
        "hicache_0_5_23.around_generic_page_set", "around"),
    "sglang.srt.managers.cache_controller.HiCacheController._generic_page_get": (
        "hicache_0_5_23.around_generic_page_get", "around"),
    # contain: a storage lookup stops before a page key whose host copy contain evicted as bad
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController._storage_hit_query": (
        "hicache_0_5_23.after_storage_hit_query", "after"),
}
# PD disaggregation (adapter/disagg, as on 0.5.12): the records and origin stamps travel with the KV through mooncake;
# required with --disaggregation-mode only. 0.5.23's targets are 0.5.12's but the sender's (send gained
# indices_event=, send_kvcache dst_layer_ids=, ...: the hooks take them as they come); a decode server names
# --disaggregation-decode-retraction-backup cpu_tensor or none (disagg.check_disaggregation)
_MOONCAKE_SEND = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.send"
PD_HOOKS: HookTable = {
    **{target: hook for target, hook in v0_5_12.PD_HOOKS.items() if target != _MOONCAKE_SEND},
    # MooncakeKVSender.send is wrapped by mooncake_trace_func here ((self, *args, **kwargs) at runtime, no
    # __wrapped__): the hook sits on the base class's send, which it calls with keywords
    "sglang.srt.disaggregation.common.conn.CommonKVSender.send": v0_5_12.PD_HOOKS[_MOONCAKE_SEND],
}
VERIFIED_POOLS = ("MHATokenToKVPool", "MLATokenToKVPool", "SWAKVPool", "HybridLinearKVPool")


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    from ..spec_0_5_23 import spec_unported

    spec = spec_unported(server_args)
    if spec:
        return spec
    if int(getattr(server_args, "tp_size", 1) or 1) > 1 and getattr(server_args, "speculative_algorithm", None):
        return ("tensor parallel with speculative decoding on sglang 0.5.23 is not verified yet; drop --tp-size or "
                "--speculative-algorithm, or use sglang 0.5.12")
    if str(getattr(server_args, "kv_canary", "none") or "none") == "contain":
        from ..contain_unified import contain_evictor_gap

        gap = contain_evictor_gap()
        if gap:
            from sglang.version import __version__ as version

            return (f"contain evicts bad slots through sglang 0.5.23's UnifiedRadixCache interface, which sglang "
                    f"{version} lacks ({gap}); use --kv-canary log or raise, or sglang 0.5.23")
    return ""


def refuse_unported(server_args: Any) -> None:
    line = _running_line()  # this line, or a line that reuses its functions (v0_5_17)
    mode = str(getattr(server_args, "kv_canary", "none") or "none")
    reason = line.unported(server_args) if mode != "none" else ""
    if reason:
        from ...config import FLAG_MODE, CanaryConfigError

        raise CanaryConfigError(f"{FLAG_MODE} {mode} on sglang {line.name}: {reason}")


def _running_line() -> SglangLine:
    from . import current_line

    return current_line()


def install(*, server_args, model_runner, token_oracle_manager=None):
    """In place of sglang's in-tree ``install_canary``: the plugin's manager behind an ``InTreeSlot``, or None."""
    from ..install import config_from_server_args, install_canary

    del token_oracle_manager  # sglang's token-oracle sampler (--sampling-backend token_oracle); ours is built in
    refuse_unported(server_args)
    config = config_from_server_args(server_args)
    if config.enabled:
        from ...sglang_plugin import check_hooks_applied
        from ..server_args import check_supported

        check_supported(server_args, config.mode.value)
        check_hooks_applied(server_args)
        refuse_unverified_pool(server_args, type(getattr(model_runner, "token_to_kv_pool", None)).__name__,
                               config.mode.value, _running_line())
    reserved = _RESERVED.get(id(getattr(model_runner, "kv_cache_configurator", None)))
    if reserved is not None:
        model_runner.kv_canary_reserved_bytes = reserved
    manager = install_canary(server_args=server_args, model_runner=model_runner)
    if manager is None:
        return None
    if getattr(model_runner, "is_draft_worker", False):  # the EAGLE draft's own pool (adapter/spec_0_5_23)
        from ..spec_0_5_23 import DraftInTreeSlot

        return DraftInTreeSlot(manager)
    return InTreeSlot(manager, model_runner)


def refuse_unverified_pool(server_args, pool: str, mode: str, line) -> None:
    """A KV pool ``line`` does not verify, or a hybrid-linear pool with a mamba strategy never run, is refused.
    The strategy is read (through 0.5.23's resolved view) for a ``HybridLinearKVPool`` only: a line reusing
    this one (0.5.17) has no such view and no such pool verified."""
    from ...config import FLAG_MODE, CanaryConfigError

    if line.verified_pools is not None and pool not in line.verified_pools:
        raise CanaryConfigError(f"{FLAG_MODE} {mode}: the KV pool {pool} is not verified on sglang {line.name} yet "
                                f"(verified: {', '.join(line.verified_pools)}); use sglang 0.5.12 or {FLAG_MODE} none")
    strategy = mamba_strategy(server_args) if pool == "HybridLinearKVPool" else "no_buffer"
    if strategy != "no_buffer":
        raise CanaryConfigError(f"{FLAG_MODE} {mode}: --mamba-radix-cache-strategy {strategy} is not verified on "
                                f"sglang {line.name} yet (no_buffer only: extra_buffer snapshots need a GPU platform, "
                                "where 0.5.23 never ran); pass --mamba-radix-cache-strategy no_buffer "
                                "--disable-overlap-schedule")


def mamba_strategy(server_args) -> str:
    """The resolved ``--mamba-radix-cache-strategy`` (sglang's view); ``no_buffer`` when the radix cache is off (no
    mamba state is cached). ``auto`` may still read ``auto`` here and become extra_buffer later: not accepted."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    view = resolved_view(server_args)
    return "no_buffer" if view.disable_radix_cache else str(view.mamba_radix_cache_strategy)


def refuse_in_tree_install(*args, **kwargs):
    """sglang's own ``install_canary``, reached by a path other than ``model_runner.py``'s binding: refused, so two
    canaries never verify (and allocate for) the same pool."""
    from ...config import FLAG_MODE, CanaryConfigError

    raise CanaryConfigError(f"{FLAG_MODE}: sglang {_running_line().name}'s in-tree kv_canary was about to install "
                            "beside sglang-kv-canary; set SGLANG_KV_CANARY_IMPL=in-tree to use sglang's own instead")


_RESERVED = {}  # id(KVCacheConfigurator) -> bytes held back (a slots dataclass: no attribute of ours on it)


def after_profile_available_bytes(available_bytes, configurator, *args, **kwargs):
    """Hold the canary's device bytes back before sglang sizes the KV pool (0.5.23 sizes it in its configurator)."""
    from ..hooks import reserve_before_kv_pool

    reserve = reserve_before_kv_pool(configurator, available_bytes)
    if reserve <= 0:
        return None
    _RESERVED[id(configurator)] = reserve
    return int(available_bytes) - reserve


def after_init_model_worker(_result, scheduler, *args, **kwargs) -> None:
    """Start reporting once the model worker is ready, and refuse a KV pool sglang rebuilt after install (0.5.23's
    post-capture KV sizing): the canary's records and zero-copy views would no longer match it."""
    from ...buffer_groups import groups_still_view
    from ...config import FLAG_MODE, CanaryConfigError
    from ..managers import canary_of
    from ..pools import pool_context

    from ..spec_0_5_23 import start_draft_reporting

    runner = scheduler.tp_worker.model_runner
    manager = canary_of(runner)
    if manager is None or manager.init_finished:
        return
    if not groups_still_view(runner.token_to_kv_pool, manager.groups, pool_context(runner)):
        raise CanaryConfigError(f"{FLAG_MODE} {manager.config.mode.value}: sglang rebuilt the KV pool after the "
                                "canary was installed (post-capture KV sizing); not verified on sglang "
                                f"{_running_line().name} yet: unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING, or pass "
                                "--disable-cuda-graph")
    manager.mark_init_finished()
    start_draft_reporting(scheduler, runner)  # the EAGLE draft's own pool, if verified


def after_add_cli_args(_result, parser) -> None:
    """``--kv-canary``: sglang's flag, plus the plugin's ``contain``."""
    from ...config import CanaryMode

    for action in parser._actions:
        if "--kv-canary" in action.option_strings:
            action.choices = [m.value for m in CanaryMode]
            action.help = ((action.help or "") + " 'contain' (sglang-kv-canary) aborts the requests that read a "
                           "corrupt KV slot and keeps serving.")


def after_resolve_once(_result, server_args, *args, **kwargs) -> None:
    """The settings checked once sglang resolved them, in the launching process (CLI and Engine alike), before any
    scheduler starts; the scheduler checks again at install. ``CanaryConfigError`` names the flag."""
    from ..install import config_from_server_args
    from ..server_args import check_supported

    refuse_unported(server_args)  # before the checks of features this line does not have yet
    config = config_from_server_args(server_args)  # CanaryConfigError (a ValueError) at startup
    if config.enabled:
        from ...sglang_plugin import check_hooks_applied

        check_supported(server_args, config.mode.value)
        check_hooks_applied(server_args)
        if not getattr(after_resolve_once, "logged", False):
            after_resolve_once.logged = True
            logger.info("kv_canary: %s (sglang-kv-canary plugin in place of sglang %s's in-tree kv_canary)",
                        config.describe(), _running_line().name)


def after_scheduler_init(_result, scheduler, *args, **kwargs) -> None:
    """Metrics, contain and the prefix cache, as on 0.5.12; the metrics switch moved to ``metrics_reporter``."""
    from ..hooks import setup_scheduler

    reporter = getattr(scheduler, "metrics_reporter", None)
    setup_scheduler(scheduler, metrics_enabled=bool(getattr(reporter, "current_scheduler_metrics_enabled", False)))


def containment(scheduler, manager):
    """``--kv-canary contain``'s scheduler side on this line: 0.5.23's abort path and ``UnifiedRadixCache``."""
    from ..contain_unified import UnifiedSchedulerContainment

    return UnifiedSchedulerContainment(scheduler, manager)


def req_row(req) -> int:
    """0.5.23 keeps a request's KV bookkeeping in ``Req.kv`` (``req_pool_idx`` moved there)."""
    return req.kv.req_pool_idx


def tp_rank(model_runner) -> int:
    """0.5.23's ``ModelRunner`` has no ``tp_rank``: the process's parallel context holds it."""
    del model_runner
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def dp_rank(model_runner):
    """0.5.23's data-parallel rank: the process's parallel context (None without ``--dp-size``)."""
    rank = getattr(model_runner, "dp_rank", None)
    if rank is None:
        from sglang.srt.runtime_context import get_parallel

        rank = getattr(get_parallel(), "dp_rank", None)
    return None if rank is None else int(rank)


# EAGLE (topk 1) over a hybrid sliding-window target (test_e2e_speculative_swa, CPU): the draft pool stays
# MHATokenToKVPool-only (adapter/speculative.spec_pool_refusal)
SPEC_TARGET_POOLS = ("MHATokenToKVPool", "SWAKVPool")


def hicache_host_pool(controller):
    """HiCache's KV host pool on this line (``adapter/hicache_0_5_23.host_pool``)."""
    from ..hicache_0_5_23 import host_pool

    return host_pool(controller)


LINE = SglangLine(name="0.5.23", versions=("0.5.23",), hooks=HOOKS, pd_hooks=PD_HOOKS, spec_hooks=SPEC_HOOKS,
                  in_tree_canary=True, pd_page_sizes=(1, 16), pd_tensor_parallel=True, pd_verified=True,
                  flags_declared_by_sglang=True, hicache_hooks=HICACHE_HOOKS, hicache_host_pool=hicache_host_pool,
                  policy=POLICY_0_5_23, unported=unported, req_row=req_row, tp_rank=tp_rank, dp_rank=dp_rank,
                  verified_pools=VERIFIED_POOLS, containment=containment, spec_target_pools=SPEC_TARGET_POOLS,
                  prefix_cache_view=unified_view_for,
                  prefix_caches="UnifiedRadixCache (full-attention, hybrid-SWA and hybrid-mamba trees)")
