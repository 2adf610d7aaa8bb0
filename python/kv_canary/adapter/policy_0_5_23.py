"""Which sglang 0.5.23 server settings the canary verifies: 0.5.12's allow-list carried over, and the new fields.

Every 0.5.23 ``ServerArgs`` field (a msgspec Struct: ``msgspec.structs.fields``) is
classified exactly once (``test_server_args_policy``), as in ``adapter/server_args``:
``RULES`` (values the canary supports, anything else refused at startup naming the flag),
``CHECKED_ELSEWHERE``, ``NEUTRAL``. The 0.5.12 rules of fields that still exist are
reused as they are; fields 0.5.23 dropped are left out (``_GONE``).

What the 0.5.23 adapter verifies at first: one process's MHA pool (CPU or GPU, TP ranks
each verifying their own shard), the radix cache, chunked prefill, page size 1 or 16.
Every new 0.5.23 setting that moves, offloads, shares across processes, or writes KV
outside a normal forward (unified-cache external linker, FlexKV, custom radix-cache
backends, session radix cache, HiCache buffer-only host memory, host-pool decode
retraction, KV sharding by page interleave, elastic-EP joiners, the PD knobs, ...) is
refused unless off. 0.5.23 replaced the piecewise CUDA graph (and
``--disable-piecewise-cuda-graph``) with a per-phase CUDA graph config (``GRAPH_RULES``): the backends
sglang picks by default on CUDA are verified (prefill ``breakable``, decode ``full``), and ``disabled``;
``full`` prefill and ``breakable`` decode graphs were not run with the canary and are refused naming the
flag. Speculative decoding: EAGLE/EAGLE3 (NEXTN) as 0.5.12, and the
new 0.5.23 knobs that change what the draft or the verify writes or accepts must stay off; the
device, the overlap scheduler and topk are checked by ``adapter/spec_0_5_23.spec_unported``.

A ``ServerArgs`` of 0.5.23 keeps the user's raw values as its fields and sglang's
resolved ones in a stash (``arg_groups.overrides.resolution_result``); the prefill CUDA
graph rule reads the resolved ``cuda_graph_config`` where sglang resolved the record.
"""

from __future__ import annotations

from typing import Any, Mapping

from .server_args import _OFF, _OFFENDERS, _TP, CHECKED_ELSEWHERE as _ELSEWHERE_0_5_12, NEUTRAL as _NEUTRAL_0_5_12
from .server_args import RULES as _RULES_0_5_12
from .server_args import _SPEC_ALGORITHMS, Rule, ServerArgsPolicy, _only, _spec_allowed

# 0.5.12 fields that 0.5.23 no longer has
_GONE = frozenset("""
    cuda_graph_bs cuda_graph_max_bs debug_tensor_dump_inject disable_piecewise_cuda_graph elastic_ep_rejoin
    enable_breakable_cuda_graph enable_deepep_waterfill enable_expert_distribution_metrics enable_nan_detection
    enable_nsa_prefill_context_parallel enable_prefill_context_parallel enforce_piecewise_cuda_graph
    grpc_http_sidecar_port keep_mm_feature_on_device mamba_scheduler_strategy nsa_decode_backend nsa_prefill_backend
    nsa_prefill_cp_mode piecewise_cuda_graph_compiler piecewise_cuda_graph_max_tokens piecewise_cuda_graph_tokens
    prefill_cp_mode record_nolora_graph speculative_skip_dp_mlp_sync torchao_config
""".split())

_DISABLED = "disabled"
_UNREADABLE = object()  # a cuda_graph_config that is neither sglang's CudaGraphConfig nor its JSON


def _phase_backend(config: Any, phase: str) -> Any:
    """The backend ``config`` sets for ``phase``: sglang's ``CudaGraphConfig``, or ``--cuda-graph-config`` as parsed
    (a dict); None where it sets none, ``_UNREADABLE`` for anything else."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        settings = config.get(phase)
        if settings is None:
            return None
        return settings.get("backend") if isinstance(settings, Mapping) else _UNREADABLE
    settings = getattr(config, phase, _UNREADABLE)
    return _UNREADABLE if settings is _UNREADABLE else getattr(settings, "backend", _UNREADABLE)


def _resolved(args: Any, field: str) -> Any:
    """sglang's resolved value of ``field`` where ``args`` is a ServerArgs sglang resolved (None otherwise)."""
    if not getattr(args, "_resolved_overrides", None):
        return None
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:
        return None
    return resolution_result(args, field)


def _prefill_graph_backend(args: Any) -> Any:
    """The prefill-phase CUDA graph backend sglang runs with: the resolved config, else the raw flags in sglang's
    precedence (``arg_groups.cuda_graph_hook.parse_cuda_graph_config``), else sglang's platform default."""
    resolved = _phase_backend(_resolved(args, "cuda_graph_config"), "prefill")
    if resolved is not None:
        return resolved
    given = _phase_backend(getattr(args, "cuda_graph_config", None), "prefill")
    if given is None:
        given = getattr(args, "cuda_graph_backend_prefill", None)
    if given is not None:
        return given
    if getattr(args, "disable_prefill_cuda_graph", False) or getattr(args, "disable_cuda_graph", False):
        return _DISABLED
    if str(getattr(args, "device", None)) == "cpu":
        return _DISABLED
    try:
        from sglang.srt.model_executor.cuda_graph_config import default_prefill_backend
    except ImportError:  # sglang 0.5.14: no platform default, the config's own (tc_piecewise)
        from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig

        return CudaGraphConfig().prefill.backend
    return default_prefill_backend()  # breakable on CUDA


def _prefill_graph_off(value, args) -> bool:
    return value in (True, False, None) and _prefill_graph_backend(args) == _DISABLED


_PREFILL_GRAPH_BACKENDS = (None, "breakable", _DISABLED)  # verified on the GPU host (docs/results)
_DECODE_GRAPH_BACKENDS = (None, "full", _DISABLED)


def _graph_config_within(prefill: tuple, decode: tuple):
    """The ``--cuda-graph-config`` rule: unset, or JSON whose prefill / decode backends are among these."""
    def allowed(value, _args) -> bool:
        return value is None or (_phase_backend(value, "prefill") in prefill
                                 and _phase_backend(value, "decode") in decode)
    return allowed


_PREFILL_GRAPH_WHY = ("prefill CUDA graphs are verified on sglang 0.5.23 with its default backend, breakable (the "
                      "outer forward, HEAD/TAIL included, runs eagerly around the replayed transformer body; GPU host, "
                      "docs/results); full prefill graphs were not run with the canary")
_BREAKABLE_WHY = ("decode CUDA graphs are verified with sglang's default backend, full (HEAD/TAIL captured into each "
                  "graph); breakable decode graphs fail at capture in sglang 0.5.23 itself, canary off too "
                  "('Unsupported BCG output type: LogitsProcessorOutput', GPU host 2026-11-30)")
# 0.5.23: the backends sglang picks by default on CUDA (docs/compatibility.md: GPU host, CUDA graphs)
_DECODE_GRAPH_RULE = Rule(_only(*_DECODE_GRAPH_BACKENDS), "full or disabled", _BREAKABLE_WHY)
GRAPH_RULES = {
    "cuda_graph_backend_prefill": Rule(_only(*_PREFILL_GRAPH_BACKENDS), "breakable or disabled", _PREFILL_GRAPH_WHY),
    "cuda_graph_backend_decode": _DECODE_GRAPH_RULE,
    "cuda_graph_config": Rule(_graph_config_within(_PREFILL_GRAPH_BACKENDS, _DECODE_GRAPH_BACKENDS), "unset, or JSON whose prefill backend is breakable or disabled "
                              "and decode backend full or disabled", f"{_PREFILL_GRAPH_WHY}; {_BREAKABLE_WHY}"),
}
# a line that reuses this policy without 0.5.23's prefill graphs verified (0.5.17): the prefill phase disabled,
# decode full or disabled
_PREFILL_GRAPH_OFF_WHY = "prefill CUDA graphs are verified on sglang 0.5.23 only"
PREFILL_GRAPHS_OFF_RULES = {
    "cuda_graph_backend_prefill": Rule(_only(None, _DISABLED), "disabled", _PREFILL_GRAPH_OFF_WHY),
    "cuda_graph_backend_decode": _DECODE_GRAPH_RULE,
    "cuda_graph_config": Rule(_graph_config_within((None, _DISABLED), _DECODE_GRAPH_BACKENDS), "unset, or JSON whose prefill backend is disabled and decode "
                              "backend full or disabled", f"{_PREFILL_GRAPH_OFF_WHY}; {_BREAKABLE_WHY}"),
    "disable_prefill_cuda_graph": Rule(
        _prefill_graph_off, "on (or --cuda-graph-backend-prefill disabled, or --disable-cuda-graph), with no "
        "--cuda-graph-backend-prefill or --cuda-graph-config prefill backend other than disabled",
        f"{_PREFILL_GRAPH_OFF_WHY}; pass --disable-prefill-cuda-graph"),
}
_PD = "not verified with PD disaggregation on sglang 0.5.23 yet"
_NEW_OFF = {  # new 0.5.23 switches that must stay off: field -> why
    "enable_unified_cache_external_linker": "the external linker loads KV from an external store into slots the "
                                           "canary has not fingerprinted",
    "enable_flexkv": "FlexKV offloads KV to host/SSD/remote tiers and loads it back outside the forwards the canary "
                     "brackets",
    "enable_session_radix_cache": "session references keep and extend KV across requests, which is not verified yet",
    "enable_unified_memory": "one byte buffer split dynamically between sub-pools is not a pool the canary verifies",
    "enable_page_major_kv_layout": "one page-major buffer holding every layer's state is not a pool layout the "
                                   "canary verifies",
    "enable_kv_cache_sharding": "page-interleaved KV sharding stores each logical page on one rank of the group and "
                                "gathers it for the others",
    "enable_dsa_cache_layer_split": "splitting KV cache layers across context-parallel ranks is not verified",
    "enable_linker_mla_dedup": "replicated MLA KV is loaded on rank 0 and broadcast to the other ranks outside the "
                               "forwards the canary brackets",
    "enable_int8_mamba_checkpoint": "radix-cached states are copied into a separate int8 checkpoint pool outside "
                                    "the forwards the canary brackets",
    "enable_encoder_swa_bounded_replay": "bounded replay rebuilds request-owned SWA windows on prefix hits, which is "
                                         "not verified",
    "enable_decoder_swa_bounded_replay": "bounded replay rebuilds request-owned SWA windows on prefix hits, which is "
                                         "not verified",
    "enable_prefill_cp": _TP,
    "enable_cp_tp_group_sharing": _TP,
    "enable_pd_role_switch": f"{_PD}; a runtime prefill/decode role switch moves KV between roles",
    "enable_nvidia_megakernel": "the megakernel's fused decode/verify kernels replace the model's forward, which is "
                                "not verified",
    "enable_amd_monokernel": "the monokernel's fused forward replaces the model's forward, which is not verified",
}

_SPEC_WHY_0_5_23 = (
    "on sglang 0.5.23 the canary verifies EAGLE's and EAGLE3's spec v2 (EAGLEWorkerV2) with topk 1 (synchronous on "
    "CPU, as sglang runs it there; with the overlap scheduler and CUDA graphs on a GPU): the target model's "
    "TARGET_VERIFY forwards and the draft model's own KV pool (docs/speculative.md); STANDALONE, NGRAM, DFLASH, DSPARK, UNO, FROZEN_KV_MTP and "
    "multi-layer/adaptive EAGLE are not verified")
_SPEC_OFF = {  # new 0.5.23 speculative knobs that change what the draft or the verify reads, writes or accepts
    "speculative_use_rejection_sampling": "chain rejection sampling accepts drafts by sampled probabilities, which "
                                          "was not run with the canary (greedy acceptance was)",
    "speculative_use_block_verification": "block verification accepts drafts block-wise, which is not verified",
    "speculative_draft_kv_cache_dtype": "a draft pool with its own KV dtype is not verified",
    "speculative_draft_window_size": "a sliding-window draft is not verified",
    "speculative_draft_sink_size": "a sliding-window draft with attention sinks is not verified",
}

RULES = {field: rule for field, rule in _RULES_0_5_12.items() if field not in _GONE}
RULES.update({field: Rule(_OFF, "off", why) for field, why in _NEW_OFF.items()})
RULES.update({field: Rule(_OFF, "unset", why) for field, why in _SPEC_OFF.items()})
RULES.update({
    **GRAPH_RULES,
    "page_size": Rule(_only(None, 1, 16), "1 or 16", "the canary is verified on sglang 0.5.23 with pages of 1 and "
                      "16 tokens only"),
    "attn_dp_size": Rule(_only(1), "1", _RULES_0_5_12["enable_dp_attention"].why),
    "dcp_size": Rule(_only(1), "1", _TP),
    "radix_cache_backend": Rule(_only(None), "unset", "a registered radix-cache backend (FlexKV, LMCache, ...) "
                                "replaces the radix cache the canary follows"),
    "hicache_host_memory_mode": Rule(_only("cache"), "cache", "buffer_only stages KV through host memory to a "
                                     "storage backend outside the forwards the canary brackets"),
    # PD with tensor parallel: each rank's KV manager carries its own shard's records (adapter/disagg; CPU CI)
    "tp_size": Rule(lambda value, _args: value is None or (isinstance(value, int) and value >= 1),
                    "any size (each rank verifies its own KV shard, with PD too: each rank's records travel with "
                    "its shard)", "tensor parallel ranks"),
    # a decode server must name cpu_tensor or none (adapter/disagg: unset resolves to host_pool on a decode server)
    "disaggregation_decode_retraction_backup": Rule(
        _only(None, "none", "cpu_tensor"), "unset, none or cpu_tensor", f"host_pool is {_PD}: the retraction backup "
        "goes through a HiCache host pool and comes back into slots without the canary's records (cpu_tensor: the "
        "records go to the host and back with the KV)"),
    "disaggregation_decode_host_receive_threshold": Rule(
        _only(1), "1", f"{_PD}; host receive lands KV in the host pool outside the forwards the canary brackets"),
    "disaggregation_decode_allocation_policy": Rule(
        _only("early"), "early", f"{_PD}; prefill_complete keeps KV on the prefill server until prefill ends"),
    "optimistic_prefill_attempts": Rule(_only(0), "0", f"{_PD}; optimistic prefill runs forwards before the "
                                        "bootstrap and may run them again"),
    "decoupled_spec_role": Rule(_only("null"), "null", "decoupled speculative decoding runs the draft and verify "
                                "halves in separate engines, which is not verified"),
    "speculative_algorithm": Rule(_spec_allowed, f"unset, or {' / '.join(_SPEC_ALGORITHMS)} (NEXTN: sglang's alias "
                                  "of EAGLE), with --speculative-eagle-topk 1", _SPEC_WHY_0_5_23),
    "ep_join_mode": Rule(_only(None), "unset", "an elastic-EP joiner enters a running group (scale-up or fault "
                         "recovery), which is not verified"),
})

CHECKED_ELSEWHERE = {
    "disaggregation_mode": _ELSEWHERE_0_5_12["disaggregation_mode"],
    "kv_canary": "config.CanaryConfig.build",
    "kv_canary_real_data": "config.CanaryConfig.build",
    "kv_canary_sweep_interval": "config.CanaryConfig.build",
    # HiCache: verified on this line too, log/raise on CPU and GPU, contain on CPU with the Python tree core
    # (adapter/hicache.LINE_LIMITS)
    "enable_hierarchical_cache": _ELSEWHERE_0_5_12["enable_hierarchical_cache"],
    "hicache_storage_backend": _ELSEWHERE_0_5_12["hicache_storage_backend"],
}

# New in 0.5.23 and neutral: serving, observability, weights, MoE/collectives, kernels, multimodal, watermarking,
# sizes and backends of features a rule above keeps off, speculative knobs of algorithms the speculative_algorithm
# rule refuses (DFLASH, DSPARK, UNO, ...) or of kernels, and sglang's bookkeeping fields
_NEW_NEUTRAL = frozenset("""
    _radix_eviction_policy_explicitly_set _speculative_draft_quantization_explicitly_set
    _swa_full_tokens_ratio_explicitly_set aux_hidden_state_capture uses_mamba_radix_cache stat_loggers
    grpc_worker_threads allowed_media_domains asr_max_buffer_seconds asr_max_concurrent_sessions
    constrained_json_max_whitespace_cnt default_chat_template_kwargs enable_http_worker_reuseport enable_response_store
    gated_launch_port grpc_port grpc_response_timeout_secs http2_initial_connection_window_size
    http2_max_concurrent_streams media_url_max_file_size_mb return_input_ids return_output_ids sidecar sidecar_args
    smg_grpc_mode smg_http_sidecar_port trust_request_chat_template sampling_mask_max_tokens
    expert_balancedness_report_mode load_publish_endpoint load_snapshot_publish_interval otlp_service_name
    trace_modules enable_return_aux_hidden_states return_aux_hidden_state_layer_ids return_hidden_states_mode
    enable_watermark watermark_config watermark_context_window watermark_default_enabled watermark_enforce_all
    watermark_key watermark_key_b watermark_max_probability watermark_mixing_probability
    startup_weight_load_mode weight_cache_mode weight_cache_socket weight_cache_timeout ple_offload_backend
    ple_offload_dir ple_offload_embedding language_model_only enable_paged_experts paged_experts_num_resident
    bf16_gemm_backend boundary_reduction deepep_dispatcher_output_dtype deepep_v2_mode
    disable_aiter_allreduce_fusion_in_decode disable_aiter_allreduce_fusion_in_prefill disable_attn_tp_gather
    dwdp_size enable_dense_mlp_attn_tp enable_layernorm_sp enable_megamoe_for_layernorm_sp enable_scattered_sconv
    enable_shared_experts_attn_tp enable_tf32_matmul enable_tp_lm_head_all_to_all enable_w4a4_mxfp4_megamoe
    enable_waterfill flashinfer_a2a_dispatch_type flashinfer_allreduce_fusion_backend flashinfer_autotune_skip_ops
    fuseep_mode shared_experts_tp_size elastic_ep_initial_size elastic_ep_scale_timeout ep_join_rank_offset
    max_ep_size dsa_decode_backend dsa_paged_mqa_logits_backend dsa_prefill_backend dsa_topk_backend
    dsa_triton_union dsv4_attn_backend dsv4_prefill_backend enable_deepseek_v4_fp4_indexer enable_dsa_fused_indexer
    enable_lean_attention qsa_indexer_dtype prefill_kv_cache_dequant_dtype c128_page_size linear_attn_verify_backend
    enable_linear_replayssm enable_linear_replayssm_spec linear_replayssm_cache_len
    enable_mamba_cache_stochastic_rounding mamba_cache_philox_rounds mamba_max_states_per_path
    mamba_radix_cache_strategy int8_mamba_ckpt_size swa_prefix_tails mlx_enable_sampling
    cuda_graph_bs_decode cuda_graph_max_bs_decode disable_decode_cuda_graph disable_prefill_cuda_graph cuda_graph_bs_prefill
    cuda_graph_max_bs_prefill cuda_graph_max_seq_len_prefill cuda_graph_prefill_max_context
    cp_strategy dcp_comm_backend dcp_replicate_q_proj enable_cp_decode_attn_tp
    radix_eviction_policy_config retraction_policy min_free_slots_delay prefill_decode_interval
    prefill_decode_interval_min_bs dllm_fdfo flexkv_config_file lmcache_config_file
    unified_cache_external_linker_backend unified_cache_external_linker_config hicache_host_memory_fraction
    hicache_storage_prefetch_retry_max_attempts hicache_storage_prefetch_retry_poll_interval
    disaggregation_decode_extra_slots disaggregation_enable_kv_checksum encoder_bootstrap_port encoder_register_urls
    image_processor_backend mm_feature_transport mm_global_cache_backend mm_io_worker_num mm_preprocess_cache_size_mb
    mm_processor_worker_num trust_mm_content_hashes
    decoupled_spec_bind_endpoint decoupled_spec_connect_endpoints decoupled_spec_rank spec_trace_dir uno_lora_path
    speculative_boundary_reduction speculative_domino_candidate_pool_size
    speculative_dsa_topk_backend speculative_dspark_align_verify_tokens_to_graph_tier
    speculative_dspark_block_size speculative_dspark_confidence_sts_path speculative_dspark_sps_table_path
    speculative_enable_w4a4_mxfp4_megamoe
""".split())

NEUTRAL = (_NEUTRAL_0_5_12 - _GONE - frozenset(RULES)) | _NEW_NEUTRAL  # page_size: neutral on 0.5.12, a rule here

POLICY_0_5_23 = ServerArgsPolicy(RULES, CHECKED_ELSEWHERE, NEUTRAL, _OFFENDERS)
