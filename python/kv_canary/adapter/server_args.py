"""Which sglang 0.5.12 server settings the canary verifies correctly: an allow-list, checked at startup.

Every ``ServerArgs`` field is classified (``test_server_args_policy`` keeps it
exhaustive; the plugin only runs on sglang 0.5.12, so the field set is fixed):

* ``RULES``: fields that change how KV slots are written, read, moved or shared.
  Each lists the values the canary supports; any other value -- including one a
  later sglang adds -- is refused with a ``CanaryConfigError`` naming the flag,
  the value, why, and what to do.
* ``CHECKED_ELSEWHERE``: fields another startup check owns.
* ``NEUTRAL``: fields that do not touch KV-slot bookkeeping (tokenizer, HTTP,
  logging, weights, sampling, attention kernels -- the canary reads
  req_to_token and the pool itself, whatever kernel fills them).

PD disaggregation has its own gate (``adapter.disagg.check_disaggregation``,
run by ``api.config_from_server_args``): what it verifies, what it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..config import FLAG_MODE, CanaryConfigError


@dataclass(frozen=True)
class Rule:
    """``allowed(value, server_args)``; ``supported`` and ``why`` go into the refusal message."""

    allowed: Callable[[Any, Any], bool]
    supported: str
    why: str


def _only(*values) -> Callable[[Any, Any], bool]:
    return lambda value, _args: value in values


_OFF = _only(False, None)
# EAGLEWorkerV2 serves both with the same batches (TARGET_VERIFY, draft decode steps, DRAFT_EXTEND_V2, the draft
# prefill extend with shifted ids); EAGLE3 differs only inside the models (the target hands the draft hidden states
# captured at several layers). NEXTN is sglang's alias of EAGLE (MTP drafts), resolved by ServerArgs.__post_init__
# (to EAGLE, or FROZEN_KV_MTP for a Gemma 4 assistant draft: refused on the check after __post_init__).
_SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
_SPEC_SUPPORTED = ("EAGLE or EAGLE3 (NEXTN: sglang's alias of EAGLE): with --speculative-eagle-topk 1 and the "
                   "overlap scheduler on (spec v2), or any --speculative-eagle-topk with --disable-overlap-schedule "
                   "(spec v1; sglang forces it for topk > 1)")
_SPEC_WHY = (
    "the canary verifies speculative decoding only where it was run end to end: EAGLE's and EAGLE3's target model "
    "with topk 1 (EAGLEWorkerV2: TARGET_VERIFY views, eager or replayed from CUDA graphs, drafts staged, the token "
    "oracle advanced to the accepted prefix; docs/speculative.md) and the draft model's own KV pool (eager or under "
    "CUDA graphs); spec v1 (EAGLEWorker, topk > 1 or --disable-overlap-schedule): the target model's KV (the tree "
    "verify's TAIL deferred to the kept drafts) and the draft pool, eager or under CUDA graphs; STANDALONE, NGRAM, "
    "DFLASH, FROZEN_KV_MTP, multi-layer/adaptive EAGLE are not verified")


def _spec_offender(value, args) -> str:
    """The flag (and value) that takes a speculative setting out of what the canary verifies ('' if none)."""
    if value is None or value not in _SPEC_ALGORITHMS:
        return ""
    for field, bad in (("enable_multi_layer_eagle", bool), ("speculative_adaptive", bool)):
        v = getattr(args, field, None)
        if bad(v):
            return f"{flag_name(field)}{'' if v is True else f' {v}'}"
    return ""


def _spec_allowed(value, args) -> bool:
    """EAGLE/EAGLE3, spec v2 or v1. ``None`` fields of raw flags are sglang's to pick (checked again)."""
    if value is None:
        return True
    return value in _SPEC_ALGORITHMS and not _spec_offender(value, args)


# HiCache: verified on 0.5.12 and 0.5.23 by adapter/hicache.check_hicache (CHECKED_ELSEWHERE below); 0.5.17 keeps
# refusing it with these rules (policy_0_5_17)
HICACHE_RULES: Dict[str, "Rule"] = {}

_TP = "pipeline/context parallelism splits a sequence's KV across processes; the canary verifies one process's pool"

RULES: Dict[str, Rule] = {
    "speculative_algorithm": Rule(_spec_allowed, f"unset, or {_SPEC_SUPPORTED}", _SPEC_WHY),
    "device": Rule(_only(None, "cuda", "cpu"), "cuda or cpu", "the canary's kernels are verified on CUDA and CPU only"),
    "kv_cache_dtype": Rule(_only("auto", "fp8_e4m3", "fp8_e5m2"), "auto, fp8_e4m3 or fp8_e5m2",
                           "the canary hashes the stored bytes of an fp8 cache like any other; fp4 caches keep "
                           "separate scale buffers the canary does not hash yet"),
    "enable_lmcache": Rule(_OFF, "off", "LMCache loads KV into slots the canary has not fingerprinted"),
    "enable_hisparse": Rule(_OFF, "off", "HiSparse offloads KV outside the forwards the canary brackets"),
    "disaggregation_decode_enable_offload_kvcache": Rule(
        _OFF, "off", "offloaded decode KV is written outside the forwards the canary brackets"),
    # DP attention: stock sglang does not run it on CPU with the torch_native backend (its padding raises
    # NotImplementedError, measured on 0.5.23: docs/compatibility.md), so it waits for a GPU run
    "enable_dp_attention": Rule(_OFF, "off", "DP attention runs idle/padded batches per rank that are not verified "
                                             "(not run with the canary: it needs GPUs)"),
    "dp_size": Rule(
        lambda value, _args: value is None or (isinstance(value, int) and value >= 1),
        "any size (each DP rank is its own scheduler process: its canary verifies its own pool; DP attention is "
        "refused by --enable-dp-attention)",
        "data-parallel ranks are separate scheduler processes with separate pools"),
    "tp_size": Rule(
        lambda value, args: value in (None, 1) or (isinstance(value, int) and value > 1 and getattr(
            args, "disaggregation_mode", "null") in (None, "null")),
        "any size (each rank verifies its own KV shard); 1 with --disaggregation-mode",
        "PD disaggregation with tensor parallel ranks is not verified yet (records travel per rank)"),
    "pp_size": Rule(_only(1), "1", _TP),
    "attn_cp_size": Rule(_only(1), "1", _TP),
    "nnodes": Rule(_only(1), "1", "multi-node serving is not verified"),
    "enable_prefill_context_parallel": Rule(_OFF, "off", _TP),
    "enable_nsa_prefill_context_parallel": Rule(_OFF, "off", _TP),
    "enable_torch_compile": Rule(
        _OFF, "off", "torch.compile traces model.forward, including the canary's HEAD/TAIL launches and their "
        "host bookkeeping, which it does not support"),
    "enforce_piecewise_cuda_graph": Rule(
        _OFF, "off", "piecewise CUDA graphs split model.forward into pieces the canary cannot bracket"),
    "enable_breakable_cuda_graph": Rule(_OFF, "off", "breakable CUDA graphs are not verified"),
    "enable_two_batch_overlap": Rule(_OFF, "off", "two-batch overlap splits a forward into micro-batches the "
                                                  "canary does not bracket separately"),
    "enable_single_batch_overlap": Rule(_OFF, "off", "single-batch overlap is not verified"),
    "enable_pdmux": Rule(_OFF, "off", "PD multiplexing runs prefill and decode on separate streams concurrently"),
    "enable_memory_saver": Rule(
        _OFF, "off", "releasing and resuming GPU memory drops KV contents behind the canary's fingerprints"),
    "prefill_only_disable_kv_cache": Rule(_OFF, "off", "without a KV cache there is nothing to verify"),
    "dllm_algorithm": Rule(_only(None), "unset", "diffusion LLM decoding rewrites KV slots in place"),
    "encoder_only": Rule(_OFF, "off", "encoder/language disaggregation is not verified"),
    "language_only": Rule(_OFF, "off", "encoder/language disaggregation is not verified"),
    "enable_streaming_session": Rule(_OFF, "off", "streaming sessions keep and extend KV across requests, "
                                                  "which is not verified yet"),
    "enable_mixed_chunk": Rule(_OFF, "off", "mixed prefill+decode batches are not verified yet"),
}

HICACHE_RULES.update({
    "enable_hierarchical_cache": Rule(
        _OFF, "off", "HiCache moves KV between GPU, host and storage outside the forwards the canary brackets; "
        "slots loaded back from the host tier carry no fingerprint (verified on sglang 0.5.12 and 0.5.23)"),
    "hicache_storage_backend": Rule(_only(None), "unset",
                                    "storage backends load KV into slots the canary has not fingerprinted"),
})

# Owned by another startup check.
CHECKED_ELSEWHERE: Dict[str, str] = {
    "enable_hierarchical_cache": "adapter.hicache.check_hicache (what HiCache combinations are verified)",
    "hicache_storage_backend": "adapter.hicache.check_hicache (file on 0.5.12, with HiCache; no other backend)",
    "disable_piecewise_cuda_graph": "config.CanaryConfig.build (piecewise CUDA graphs must be off on GPU)",
    "disaggregation_mode": "adapter.disagg.check_disaggregation",
}

NEUTRAL = frozenset("""
    model_path tokenizer_path tokenizer_mode tokenizer_backend tokenizer_worker_num detokenizer_worker_num
    skip_tokenizer_init load_format model_loader_extra_config trust_remote_code context_length is_embedding
    enable_multimodal revision model_impl model_config_parser host port fastapi_root_path grpc_mode
    skip_server_warmup warmups nccl_port checkpoint_engine_wait_weights_before_ready ssl_keyfile ssl_certfile
    ssl_ca_certs ssl_keyfile_password enable_ssl_refresh enable_http2 dtype quantization quantization_param_path
    enable_fp32_lm_head modelopt_quant modelopt_checkpoint_restore_path modelopt_checkpoint_save_path
    modelopt_export_path quantize_and_serve rl_quant_profile mem_fraction_static max_running_requests
    max_queued_requests max_total_tokens chunked_prefill_size enable_dynamic_chunking max_prefill_tokens
    prefill_max_requests schedule_policy enable_priority_scheduling disable_priority_preemption
    default_priority_value abort_on_priority_when_disabled schedule_low_priority_values_first
    priority_scheduling_preemption_threshold schedule_conservativeness page_size swa_full_tokens_ratio
    disable_hybrid_swa_memory radix_eviction_policy enable_prefill_delayer prefill_delayer_max_delay_passes
    prefill_delayer_token_usage_low_watermark prefill_delayer_forward_passes_buckets
    prefill_delayer_wait_seconds_buckets prefill_delayer_queue_min_ratio prefill_delayer_max_delay_ms
    pp_max_micro_batch_size pp_async_batch_depth stream_interval batch_notify_size
    stream_response_default_include_usage incremental_streaming_output random_seed
    constrained_json_whitespace_pattern constrained_json_disable_any_whitespace watchdog_timeout
    soft_watchdog_timeout dist_timeout download_dir model_checksum base_gpu_id gpu_id_step sleep_on_idle use_ray
    custom_sigquit_handler log_level log_level_http log_requests log_requests_level log_requests_format
    log_requests_target uvicorn_access_log_exclude_prefixes crash_dump_folder show_time_cost enable_metrics
    grpc_http_sidecar_port enable_mfu_metrics enable_metrics_for_all_schedulers
    tokenizer_metrics_custom_labels_header tokenizer_metrics_allowed_custom_labels extra_metric_labels
    bucket_time_to_first_token bucket_inter_token_latency bucket_e2e_request_latency prompt_tokens_buckets
    generation_tokens_buckets gc_warning_threshold_secs decode_log_interval enable_request_time_stats_logging
    kv_events_config enable_forward_pass_metrics forward_pass_metrics_worker_id forward_pass_metrics_ipc_name
    enable_trace otlp_traces_endpoint export_metrics_to_file export_metrics_to_file_dir api_key admin_api_key
    served_model_name weight_version chat_template hf_chat_template_name completion_template file_storage_path
    enable_cache_report reasoning_parser strip_thinking_cache enable_strict_thinking tool_call_parser tool_server
    sampling_defaults load_balance_method moe_dp_size dist_init_addr node_rank json_model_override_args
    preferred_sampling_params enable_lora enable_lora_overlap_loading max_lora_rank lora_target_modules lora_paths
    max_loaded_loras max_loras_per_batch lora_eviction_policy lora_backend max_lora_chunk_size
    experts_shared_outer_loras lora_use_virtual_experts lora_strict_loading lora_drain_wait_threshold
    attention_backend decode_attention_backend prefill_attention_backend sampling_backend grammar_backend
    mm_attention_backend fp8_gemm_runner_backend fp4_gemm_runner_backend nsa_prefill_backend nsa_decode_backend
    disable_flashinfer_autotune mamba_backend speculative_draft_model_path speculative_draft_model_revision
    speculative_draft_load_format speculative_num_steps speculative_eagle_topk speculative_num_draft_tokens
    speculative_dflash_block_size speculative_accept_threshold_single speculative_accept_threshold_acc
    speculative_token_map speculative_attention_mode speculative_draft_attention_backend
    speculative_draft_window_size speculative_moe_runner_backend speculative_moe_a2a_backend
    speculative_draft_model_quantization speculative_adaptive speculative_adaptive_config
    speculative_skip_dp_mlp_sync speculative_ngram_min_bfs_breadth speculative_ngram_max_bfs_breadth
    speculative_ngram_match_type speculative_ngram_max_trie_depth speculative_ngram_capacity
    speculative_ngram_external_corpus_path speculative_ngram_external_sam_budget
    speculative_ngram_external_corpus_max_tokens enable_multi_layer_eagle ep_size moe_a2a_backend
    moe_runner_backend record_nolora_graph flashinfer_mxfp4_moe_precision enable_flashinfer_allreduce_fusion
    enforce_disable_flashinfer_allreduce_fusion enable_aiter_allreduce_fusion deepep_mode ep_num_redundant_experts
    ep_dispatch_algorithm init_expert_location enable_eplb eplb_algorithm eplb_rebalance_num_iterations
    eplb_rebalance_layers_per_chunk eplb_min_rebalancing_utilization_threshold expert_distribution_recorder_mode
    expert_distribution_recorder_buffer_size enable_expert_distribution_metrics deepep_config moe_dense_tp_size
    elastic_ep_backend enable_elastic_expert_backup mooncake_ib_device enable_deepep_waterfill elastic_ep_rejoin
    max_mamba_cache_size mamba_ssm_dtype mamba_full_memory_ratio mamba_scheduler_strategy mamba_track_interval
    linear_attn_backend linear_attn_decode_backend linear_attn_prefill_backend hicache_ratio hicache_size
    hicache_write_policy hicache_io_backend hicache_mem_layout hicache_storage_prefetch_policy
    hicache_storage_backend_extra_config hisparse_config kt_weight_path kt_method kt_cpuinfer kt_threadpool_count
    kt_num_gpu_experts kt_max_deferred_experts_per_token dllm_algorithm_config cpu_offload_gb offload_group_size
    offload_num_in_group offload_prefetch_step offload_mode enable_mis disable_radix_cache cuda_graph_max_bs
    cuda_graph_bs disable_cuda_graph disable_cuda_graph_padding enable_profile_cuda_graph enable_cudagraph_gc
    debug_cuda_graph enable_layerwise_nvtx_marker enable_nccl_nvls enable_symm_mem
    disable_flashinfer_cutlass_moe_fp4_allgather enable_tokenizer_batch_encode disable_tokenizer_batch_decode
    disable_outlines_disk_cache disable_custom_all_reduce enable_mscclpp enable_torch_symm_mem pre_warm_nccl
    disable_overlap_schedule enable_dp_attention_local_control_broadcast enable_dp_lm_head
    tbo_token_distribution_threshold enable_torch_compile_debug_mode torch_compile_max_bs
    piecewise_cuda_graph_max_tokens piecewise_cuda_graph_tokens piecewise_cuda_graph_compiler torchao_config
    enable_nan_detection enable_p2p_check triton_attention_reduce_in_fp32 triton_attention_num_kv_splits
    triton_attention_split_tile_size num_continuous_decode_steps delete_ckpt_after_loading
    enable_weights_cpu_backup enable_draft_weights_cpu_backup allow_auto_truncate enable_custom_logit_processor
    flashinfer_mla_disable_ragged disable_shared_experts_fusion enforce_shared_experts_fusion
    disable_chunked_prefix_cache disable_fast_image_processor keep_mm_feature_on_device enable_return_hidden_states
    enable_return_routed_experts enable_return_indexer_topk scheduler_recv_interval numa_node
    enable_deterministic_inference rl_on_policy_target enable_attn_tp_input_scattered gc_threshold
    nsa_prefill_cp_mode enable_fused_qk_norm_rope enable_precise_embedding_interpolation
    enable_fused_moe_sum_all_reduce prefill_cp_mode enable_dynamic_batch_tokenizer
    dynamic_batch_tokenizer_batch_size dynamic_batch_tokenizer_batch_timeout debug_tensor_dump_output_folder
    debug_tensor_dump_layers debug_tensor_dump_input_file debug_tensor_dump_inject disaggregation_transfer_backend
    disaggregation_bootstrap_port disaggregation_ib_device disaggregation_decode_enable_radix_cache
    num_reserved_decode_tokens disaggregation_decode_polling_interval encoder_transfer_backend encoder_urls
    enable_adaptive_dispatch_to_encoder custom_weight_loader weight_loader_disable_mmap
    weight_loader_prefetch_checkpoints weight_loader_prefetch_num_threads weight_loader_drop_cache_after_load
    remote_instance_weight_loader_seed_instance_ip remote_instance_weight_loader_seed_instance_service_port
    remote_instance_weight_loader_send_weights_group_ports remote_instance_weight_loader_backend
    remote_instance_weight_loader_start_seed_via_transfer_engine engine_info_bootstrap_port modelexpress_config
    pdmux_config_path sm_group_num enable_broadcast_mm_inputs_process enable_prefix_mm_cache mm_enable_dp_encoder
    mm_process_config limit_mm_data_per_request enable_mm_global_cache decrypted_config_file
    decrypted_draft_config_file forward_hooks enable_quant_communications msprobe_dump_config
""".split())


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _show(field: str, value: Any) -> str:
    """How the user wrote it: ``--enable-x`` for a store_true flag, ``--x VALUE`` otherwise."""
    return flag_name(field) if value is True else f"{flag_name(field)} {value}"


_OFFENDERS = {"speculative_algorithm": _spec_offender}  # field -> (value, args) -> the flag that is the problem


@dataclass(frozen=True)
class ServerArgsPolicy:
    """One sglang line's classification of every ``ServerArgs`` field (``test_server_args_policy``)."""

    rules: Mapping[str, Rule]
    checked_elsewhere: Mapping[str, str]
    neutral: frozenset
    offenders: Mapping[str, Callable[[Any, Any], str]]

    def classified(self) -> Tuple[frozenset, ...]:
        return frozenset(self.rules), frozenset(self.checked_elsewhere), self.neutral


POLICY_0_5_12 = ServerArgsPolicy(RULES, CHECKED_ELSEWHERE, NEUTRAL, _OFFENDERS)


def check_supported(server_args: Any, mode: str, *, given_only: bool = False,
                    policy: Optional[ServerArgsPolicy] = None) -> None:
    """Refuse (``CanaryConfigError``) the first setting in the line's rules with an unsupported value.

    ``given_only``: ``server_args`` holds the user's raw flags (an argparse namespace,
    where None means "not given, sglang picks"): check only the values given. ``policy``:
    the running sglang line's (``adapter/lines``) unless given.
    """
    if policy is None:
        from .lines import current_choice, current_line

        policy = current_line().policy_for(current_choice().version)
    for field, rule in policy.rules.items():
        value = getattr(server_args, field, None)
        if given_only and value is None:
            continue
        if not rule.allowed(value, server_args):
            offender = policy.offenders[field](value, server_args) if field in policy.offenders else ""
            raise CanaryConfigError(
                f"{FLAG_MODE} {mode} cannot verify {_show(field, value)}{f' with {offender}' if offender else ''}: "
                f"{rule.why}. "
                f"Supported: {flag_name(field)} {rule.supported}. Drop {flag_name(field)} or run with "
                f"{FLAG_MODE} none."
            )
