"""Which sglang 0.5.17 server settings the canary verifies: 0.5.23's policy, less what 0.5.17 lacks, plus its own.

sglang 0.5.17's ``ServerArgs`` (a dataclass, 458 fields) is 0.5.23's (546) minus 88 fields
0.5.23 added (``_NOT_YET``) plus 10 fields 0.5.23 dropped (``_ONLY_0_5_17``). So every field
is classified here exactly as ``adapter/policy_0_5_23`` classifies it (the 0.5.12 rules
carried over), but the per-phase CUDA graph rules (``PREFILL_GRAPHS_OFF_RULES``: the prefill phase
must be ``disabled``, the decode phase ``full`` or ``disabled``; 0.5.17 has the same ``cuda_graph_config`` and flags,
with a fourth backend ``tc_piecewise`` that those rules refuse; 0.5.23 verifies its breakable prefill graphs), and
the 10 fields of 0.5.17
alone get their 0.5.12 class where 0.5.12 had them (``test_server_args_policy`` checks
exhaustiveness against the installed 0.5.17).
"""

from __future__ import annotations

from .policy_0_5_23 import POLICY_0_5_23, PREFILL_GRAPHS_OFF_RULES
from .server_args import _OFF, _TP
from .server_args import NEUTRAL as _NEUTRAL_0_5_12
from .server_args import HICACHE_RULES, RULES as _RULES_0_5_12
from .server_args import Rule, ServerArgsPolicy

# 0.5.23 fields that 0.5.17 does not have yet
_NOT_YET = frozenset("""
    _radix_eviction_policy_explicitly_set _speculative_draft_quantization_explicitly_set
    _swa_full_tokens_ratio_explicitly_set allowed_media_domains attn_dp_size aux_hidden_state_capture
    boundary_reduction c128_page_size constrained_json_max_whitespace_cnt cuda_graph_max_seq_len_prefill
    cuda_graph_prefill_max_context deepep_v2_mode disable_aiter_allreduce_fusion_in_decode
    disable_aiter_allreduce_fusion_in_prefill disaggregation_decode_allocation_policy
    disaggregation_decode_host_receive_threshold disaggregation_decode_retraction_backup
    disaggregation_enable_kv_checksum dsa_triton_union dsv4_attn_backend dsv4_prefill_backend
    enable_amd_monokernel enable_cp_tp_group_sharing enable_decoder_swa_bounded_replay enable_dense_mlp_attn_tp
    enable_dsa_fused_indexer enable_encoder_swa_bounded_replay enable_http_worker_reuseport
    enable_kv_cache_sharding enable_layernorm_sp enable_lean_attention enable_linker_mla_dedup
    enable_megamoe_for_layernorm_sp enable_nvidia_megakernel enable_paged_experts enable_pd_role_switch
    enable_response_store enable_return_aux_hidden_states enable_shared_experts_attn_tp
    enable_tp_lm_head_all_to_all enable_unified_cache_external_linker enable_w4a4_mxfp4_megamoe enable_watermark
    expert_balancedness_report_mode flashinfer_a2a_dispatch_type gated_launch_port grpc_response_timeout_secs
    grpc_worker_threads hicache_host_memory_fraction hicache_host_memory_mode
    hicache_storage_prefetch_retry_max_attempts hicache_storage_prefetch_retry_poll_interval
    http2_initial_connection_window_size http2_max_concurrent_streams image_processor_backend
    language_model_only load_publish_endpoint media_url_max_file_size_mb mlx_enable_sampling
    mm_global_cache_backend mm_preprocess_cache_size_mb otlp_service_name paged_experts_num_resident
    ple_offload_backend ple_offload_dir ple_offload_embedding prefill_decode_interval
    prefill_decode_interval_min_bs prefill_kv_cache_dequant_dtype qsa_indexer_dtype radix_eviction_policy_config
    return_aux_hidden_state_layer_ids return_input_ids return_output_ids sampling_mask_max_tokens
    shared_experts_tp_size speculative_boundary_reduction speculative_domino_candidate_pool_size
    speculative_draft_kv_cache_dtype speculative_draft_sink_size speculative_dsa_topk_backend
    speculative_enable_w4a4_mxfp4_megamoe speculative_use_block_verification startup_weight_load_mode
    swa_prefix_tails trust_mm_content_hashes trust_request_chat_template unified_cache_external_linker_backend
    unified_cache_external_linker_config uno_lora_path watermark_config watermark_context_window
    watermark_default_enabled watermark_enforce_all watermark_key watermark_key_b watermark_max_probability
    watermark_mixing_probability
""".split())

# 0.5.17 fields that 0.5.23 no longer has: KV-splitting context parallel stays off (0.5.12's rule; the DSA flavour
# is 0.5.12's NSA one renamed), the rest is neutral (0.5.12's class, or a knob of a backend the rules refuse:
# ``cuda_graph_tc_compiler`` only matters with a ``tc_piecewise`` CUDA graph phase)
_ONLY_0_5_17_RULES = {
    "enable_prefill_context_parallel": _RULES_0_5_12["enable_prefill_context_parallel"],
    "enable_dsa_prefill_context_parallel": Rule(_OFF, "off", _TP),
}
_ONLY_0_5_17_NEUTRAL = frozenset("""
    elastic_ep_rejoin enable_expert_distribution_metrics keep_mm_feature_on_device prefill_cp_mode
    speculative_skip_dp_mlp_sync torchao_config cuda_graph_tc_compiler dsa_prefill_cp_mode
""".split())
assert _ONLY_0_5_17_NEUTRAL - {"cuda_graph_tc_compiler", "dsa_prefill_cp_mode"} <= _NEUTRAL_0_5_12

RULES = {field: rule for field, rule in POLICY_0_5_23.rules.items() if field not in _NOT_YET}
RULES.update(_ONLY_0_5_17_RULES)
RULES.update(PREFILL_GRAPHS_OFF_RULES)  # prefill CUDA graphs and breakable decode graphs: verified on 0.5.23 only
RULES.update(HICACHE_RULES)  # HiCache: 0.5.17's hooks and CPU shim are not written (0.5.23's gate: adapter/hicache)
CHECKED_ELSEWHERE = {
    **{field: why for field, why in POLICY_0_5_23.checked_elsewhere.items()
       if field not in _NOT_YET and field not in HICACHE_RULES},
    "disaggregation_mode": "adapter.disagg.check_disaggregation; lines.v0_5_17.unported (PD not ported yet)",
}
NEUTRAL = (POLICY_0_5_23.neutral - _NOT_YET - frozenset(PREFILL_GRAPHS_OFF_RULES)) | _ONLY_0_5_17_NEUTRAL

POLICY_0_5_17 = ServerArgsPolicy(RULES, CHECKED_ELSEWHERE, NEUTRAL, POLICY_0_5_23.offenders)
