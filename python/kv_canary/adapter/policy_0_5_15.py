"""Which sglang 0.5.14/0.5.15 server settings the canary verifies: 0.5.17's policy on their fields.

sglang 0.5.15's ``ServerArgs`` (a dataclass, 422 fields; 0.5.15.post1: the same) is 0.5.17's (458) minus 39 fields
0.5.17 added (``_NOT_YET``) plus 3 fields 0.5.17 renamed (``_RENAMED``: each classified as its new name is).
0.5.14's (404) is 0.5.15's minus 18 more (``_NOT_YET_0_5_14``), so it gets its own policy: a rule of a field a
release lacks reads None there, and some rules refuse None (``--dcp-size``: 1). Every other field is classified
exactly as ``adapter/policy_0_5_17`` classifies it (``test_server_args_policy`` checks exhaustiveness against the
installed release; the line picks the policy by release: ``SglangLine.policy_for``).
"""

from __future__ import annotations

from .policy_0_5_17 import POLICY_0_5_17
from .server_args import ServerArgsPolicy

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
_RENAMED = {"optimistic_prefill_retries": "optimistic_prefill_attempts", "grpc_http_sidecar_port": "smg_http_sidecar_port",
            "enable_deepep_waterfill": "enable_waterfill"}
# 0.5.15 fields that 0.5.14 does not have yet
_NOT_YET_0_5_14 = frozenset("""
    bf16_gemm_backend dcp_size decoupled_spec_bind_endpoint decoupled_spec_connect_endpoints decoupled_spec_rank
    decoupled_spec_role dsa_paged_mqa_logits_backend enable_linear_replayssm enable_mamba_cache_stochastic_rounding
    enable_page_major_kv_layout enable_session_radix_cache enable_tf32_matmul enable_unified_memory
    linear_replayssm_cache_len mamba_cache_philox_rounds min_free_slots_delay spec_trace_dir uses_mamba_radix_cache
""".split())


def _without(policy: ServerArgsPolicy, gone: frozenset, renamed=None) -> ServerArgsPolicy:
    """``policy`` less the fields in ``gone``, plus each old name of ``renamed`` classified as its new name."""
    renamed = renamed or {}
    rules = {f: r for f, r in policy.rules.items() if f not in gone}
    elsewhere = {f: why for f, why in policy.checked_elsewhere.items() if f not in gone}
    neutral = policy.neutral - gone
    for old, new in renamed.items():
        if new in policy.rules:
            rules[old] = policy.rules[new]
        elif new in policy.checked_elsewhere:
            elsewhere[old] = policy.checked_elsewhere[new]
        else:
            neutral = neutral | {old}
    offenders = {**policy.offenders, **{old: policy.offenders[new] for old, new in renamed.items()
                                        if new in policy.offenders}}
    return ServerArgsPolicy(rules, elsewhere, frozenset(neutral), offenders)


POLICY_0_5_15 = _without(POLICY_0_5_17, _NOT_YET, _RENAMED)
POLICY_0_5_14 = _without(POLICY_0_5_15, _NOT_YET_0_5_14)
