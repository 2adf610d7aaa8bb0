"""sglang 0.5.12: no in-tree kv_canary; the plugin adds the flags and brackets every forward itself.

Also serves 0.5.12.post1: every hook target has 0.5.12's signature there (``fence``, ``release_targets.json``).

``ModelRunner.forward`` gets the outside bracket, ``CudaGraphRunner.capture_one_batch_size``
records HEAD/TAIL into the graphs, ``ModelRunner.init_memory_pool`` installs the canary, and
the radix-cache flavours (``RadixCache``, ``SWARadixCache``, ``MambaRadixCache``) report their
changes to the sweep's index. PD (mooncake), speculative decoding (EAGLE spec v1/v2) and HiCache have
their own tables, required with their flags.
"""

from __future__ import annotations

from ..radix import RadixCacheView
from ..server_args import POLICY_0_5_12
from .base import HookTable, SglangLine

# target -> (hook, hook type); every one must be applied (sglang_plugin.check_hooks_applied)
HOOKS: HookTable = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("flags.after_add_cli_args", "after"),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("flags.around_from_cli_args", "around"),
    "sglang.srt.server_args.ServerArgs.__init__": ("flags.around_server_args_init", "around"),
    "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes": (
        "hooks.after_profile_available_bytes", "after"),
    "sglang.srt.model_executor.model_runner.ModelRunner.init_memory_pool": ("hooks.after_init_memory_pool", "after"),
    "sglang.srt.model_executor.model_runner.ModelRunner.initialize": ("hooks.around_initialize", "around"),
    "sglang.srt.model_executor.model_runner.ModelRunner.forward": ("hooks.around_forward", "around"),
    "sglang.srt.model_executor.model_runner.ModelRunner.sample": ("hooks.after_sample", "after"),
    "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size":
        ("hooks.around_capture_one_batch_size", "around"),
    "sglang.srt.managers.scheduler.Scheduler.on_idle": ("hooks.before_scheduler_on_idle", "before"),
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("hooks.after_scheduler_init", "after"),
    # an error of the engine's own ends the loop: what the canary found up to it is reported first
    "sglang.srt.managers.scheduler.Scheduler.run_event_loop": ("hooks.around_run_event_loop", "around"),
    "sglang.srt.managers.scheduler.Scheduler.process_input_requests": ("hooks.after_process_input_requests", "after"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": ("hooks.after_forward_batch_init_new", "after"),
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
PD_HOOKS: HookTable = {
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
SPEC_HOOKS: HookTable = {
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

# HiCache (adapter/hicache): records follow the KV to the host pool and back; required with
# --enable-hierarchical-cache only
HICACHE_HOOKS: HookTable = {
    "sglang.srt.managers.cache_controller.HiCacheController.start_writing": ("hicache.around_start_writing",
                                                                            "around"),
    "sglang.srt.managers.cache_controller.HiCacheController.start_loading": ("hicache.around_start_loading",
                                                                            "around"),
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.writing_check": ("hicache.around_writing_check", "around"),
    "sglang.srt.mem_cache.memory_pool_host.HostKVCache.free": ("hicache.after_host_free", "after"),
    "sglang.srt.mem_cache.memory_pool_host.HostKVCache.clear": ("hicache.after_host_clear", "after"),
    # the storage tier (--hicache-storage-backend file): the records ride inside each page object; sglang's own
    # bodies run when the controller has no canary (AROUND, not REPLACE)
    "sglang.srt.managers.cache_controller.HiCacheController._generic_page_set": (
        "hicache_storage.around_generic_page_set", "around"),
    "sglang.srt.managers.cache_controller.HiCacheController._generic_page_get": (
        "hicache_storage.around_generic_page_get", "around"),
    # contain: a storage lookup stops before the pages of host copies evicted as bad (storage has no delete)
    "sglang.srt.managers.cache_controller.HiCacheController._storage_hit_query": (
        "hicache_storage.after_storage_hit_query", "after"),
}


def spec_v1(server_args) -> bool:
    """EAGLE with the overlap scheduler off runs spec v1 (``EAGLEWorker``: tree verifies, their TAIL deferred); sglang
    forces it off for topk > 1 (``ServerArgs.__post_init__``; ``SpeculativeAlgorithm.create_worker`` picks by it)."""
    return bool(getattr(server_args, "disable_overlap_schedule", False))


def radix_view_for(tree_cache, manager):
    """The 0.5.12 line's prefix-cache reader (``SglangLine.prefix_cache_view``): RadixCache, SWARadixCache or
    MambaRadixCache, else None. Here, not in ``radix``: the SWA and mamba views import ``radix``."""
    from ..mamba_radix import MambaRadixCacheView
    from ..swa_radix import SWARadixCacheView

    del manager
    for view in (RadixCacheView, SWARadixCacheView, MambaRadixCacheView):
        if view.supports(tree_cache):
            return view(tree_cache)
    return None


LINE = SglangLine(name="0.5.12", versions=("0.5.12", "0.5.12.post1"), hooks=HOOKS, pd_hooks=PD_HOOKS, pd_verified=True,
                  spec_hooks=SPEC_HOOKS, hicache_hooks=HICACHE_HOOKS, policy=POLICY_0_5_12,
                  prefix_cache_view=radix_view_for, spec_v1=spec_v1, prefix_caches="RadixCache, SWARadixCache and MambaRadixCache")
