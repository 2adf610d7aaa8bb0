"""Which sglang 0.5.21 server settings the canary verifies: 0.5.23's policy on 0.5.21's fields.

sglang 0.5.21's ``ServerArgs`` (a msgspec Struct, 519 fields, read from the wheel imported in front of the 0.5.23
venv) is 0.5.23's (546) minus 29 fields 0.5.23 added (``_NOT_YET``) plus 2 fields 0.5.23 dropped and 0.5.17 has
(``_FROM_0_5_17``: both neutral there). One rule reads the other way round on 0.5.21: host receive
(``--disaggregation-decode-host-receive-threshold``) is off at 0 there (its default; any value > 0 turns it on),
where 0.5.23's rule accepts only its own default, 1.
"""

from __future__ import annotations

from .policy_0_5_15 import derived
from .policy_0_5_17 import POLICY_0_5_17
from .policy_0_5_23 import POLICY_0_5_23
from .server_args import Rule, ServerArgsPolicy

_NOT_YET = frozenset("""
    attn_dp_size aux_hidden_state_capture disaggregation_decode_allocation_policy dsa_triton_union
    enable_amd_monokernel enable_cp_tp_group_sharing enable_dsa_fused_indexer enable_http_worker_reuseport
    enable_kv_cache_sharding enable_megamoe_for_layernorm_sp enable_nvidia_megakernel enable_paged_experts
    enable_return_aux_hidden_states enable_watermark paged_experts_num_resident prefill_decode_interval_min_bs
    qsa_indexer_dtype return_aux_hidden_state_layer_ids speculative_enable_w4a4_mxfp4_megamoe
    speculative_use_block_verification unified_cache_external_linker_config watermark_config watermark_context_window
    watermark_default_enabled watermark_enforce_all watermark_key watermark_key_b watermark_max_probability
    watermark_mixing_probability
""".split())
_FROM_0_5_17 = frozenset({"cuda_graph_tc_compiler", "speculative_skip_dp_mlp_sync"})

_HOST_RECEIVE = "disaggregation_decode_host_receive_threshold"
_DERIVED = derived(POLICY_0_5_23, _NOT_YET, {field: field for field in _FROM_0_5_17}, POLICY_0_5_17)
POLICY_0_5_21 = ServerArgsPolicy(
    {**_DERIVED.rules, _HOST_RECEIVE: Rule(lambda value, _args: value in (None, 0), "0",
                                           POLICY_0_5_23.rules[_HOST_RECEIVE].why)},
    _DERIVED.checked_elsewhere, _DERIVED.neutral, _DERIVED.offenders)
