"""Which sglang 0.5.13-0.5.15 server settings the canary verifies: 0.5.17's policy on their fields.

sglang 0.5.15's ``ServerArgs`` (a dataclass, 422 fields; 0.5.15.post1: the same) is 0.5.17's (458) minus 39 fields
0.5.17 added (``_NOT_YET``) plus 3 fields 0.5.17 renamed (``_RENAMED``: each classified as its new name is).
0.5.14's (404) is 0.5.15's minus 18 more (``_NOT_YET_0_5_14``), so it gets its own policy: a rule of a field a
release lacks reads None there, and some rules refuse None (``--dcp-size``: 1). Every other field is classified
exactly as ``adapter/policy_0_5_17`` classifies it (``test_server_args_policy`` checks exhaustiveness against the
installed release; the line picks the policy by release: ``SglangLine.policy_for``).

0.5.13's (396; 0.5.13.post1: the same) is 0.5.15's minus 36 fields (``_NOT_YET_0_5_13``: the per-phase CUDA graph
config among them, with ``PREFILL_GRAPHS_OFF_RULES``) plus 10 fields 0.5.12 has too (``_FROM_0_5_12``: the piecewise
CUDA graph flags, classified as 0.5.12's policy classifies them: piecewise graphs refused on a GPU).
"""

from __future__ import annotations

from .policy_0_5_17 import POLICY_0_5_17
from .server_args import POLICY_0_5_12, ServerArgsPolicy

# 0.5.17 fields that 0.5.15 does not have yet
_NOT_YET = frozenset("""
    dcp_comm_backend dcp_replicate_q_proj default_chat_template_kwargs dllm_fdfo dwdp_size elastic_ep_initial_size
    elastic_ep_scale_timeout enable_cp_decode_attn_tp enable_dsa_cache_layer_split enable_flexkv
    enable_linear_replayssm_spec enable_scattered_sconv enable_waterfill ep_join_mode ep_join_rank_offset
    flashinfer_autotune_skip_ops flexkv_config_file fuseep_mode grpc_port linear_attn_verify_backend
    mamba_max_states_per_path max_ep_size mm_feature_transport mm_io_worker_num mm_processor_worker_num
    optimistic_prefill_attempts retraction_policy return_hidden_states_mode sidecar sidecar_args smg_grpc_mode
    smg_http_sidecar_port speculative_dspark_align_verify_tokens_to_graph_tier speculative_dspark_block_size
    speculative_dspark_confidence_sts_path speculative_dspark_sps_table_path weight_cache_mode weight_cache_socket
    weight_cache_timeout
""".split())
# 0.5.15 field -> the 0.5.17 field it became (same meaning, same default)
_RENAMED = {"optimistic_prefill_retries": "optimistic_prefill_attempts",
            "grpc_http_sidecar_port": "smg_http_sidecar_port", "enable_deepep_waterfill": "enable_waterfill"}
# 0.5.15 fields that 0.5.14 does not have yet
_NOT_YET_0_5_14 = frozenset("""
    bf16_gemm_backend dcp_size decoupled_spec_bind_endpoint decoupled_spec_connect_endpoints decoupled_spec_rank
    decoupled_spec_role dsa_paged_mqa_logits_backend enable_linear_replayssm enable_mamba_cache_stochastic_rounding
    enable_page_major_kv_layout enable_session_radix_cache enable_tf32_matmul enable_unified_memory
    linear_replayssm_cache_len mamba_cache_philox_rounds min_free_slots_delay spec_trace_dir uses_mamba_radix_cache
""".split())

# 0.5.15 fields that 0.5.13 does not have yet
_NOT_YET_0_5_13 = _NOT_YET_0_5_14 | frozenset("""
    cp_strategy cuda_graph_backend_decode cuda_graph_backend_prefill cuda_graph_bs_decode cuda_graph_bs_prefill
    cuda_graph_config cuda_graph_max_bs_decode cuda_graph_max_bs_prefill cuda_graph_tc_compiler
    disable_decode_cuda_graph disable_prefill_cuda_graph disaggregation_decode_extra_slots enable_int8_mamba_checkpoint
    enable_prefill_cp flashinfer_allreduce_fusion_backend int8_mamba_ckpt_size mamba_radix_cache_strategy
    speculative_use_rejection_sampling
""".split())
# 0.5.13 fields 0.5.14 dropped, all 0.5.12 fields: 0.5.12's class
_FROM_0_5_12 = frozenset("""
    cuda_graph_bs cuda_graph_max_bs debug_tensor_dump_inject disable_piecewise_cuda_graph enable_breakable_cuda_graph
    enforce_piecewise_cuda_graph mamba_scheduler_strategy piecewise_cuda_graph_compiler piecewise_cuda_graph_max_tokens
    piecewise_cuda_graph_tokens
""".split())


def derived(policy: ServerArgsPolicy, gone: frozenset, renamed=None, source=None) -> ServerArgsPolicy:
    """``policy`` less the fields in ``gone``, plus each old name of ``renamed`` classified as its new name is in
    ``source`` (default: ``policy``)."""
    renamed = renamed or {}
    source = source or policy
    rules = {f: r for f, r in policy.rules.items() if f not in gone}
    elsewhere = {f: why for f, why in policy.checked_elsewhere.items() if f not in gone}
    neutral = policy.neutral - gone
    for old, new in renamed.items():
        if new in source.rules:
            rules[old] = source.rules[new]
        elif new in source.checked_elsewhere:
            elsewhere[old] = source.checked_elsewhere[new]
        elif new in source.neutral:
            neutral = neutral | {old}
        else:
            raise ValueError(f"{new} is not classified by the policy {old} is read from")
    offenders = {**policy.offenders, **{old: source.offenders[new] for old, new in renamed.items()
                                        if new in source.offenders}}
    return ServerArgsPolicy(rules, elsewhere, frozenset(neutral), offenders)


POLICY_0_5_15 = derived(POLICY_0_5_17, _NOT_YET, _RENAMED)
POLICY_0_5_14 = derived(POLICY_0_5_15, _NOT_YET_0_5_14)
POLICY_0_5_13 = derived(POLICY_0_5_15, _NOT_YET_0_5_13, {field: field for field in _FROM_0_5_12}, POLICY_0_5_12)
