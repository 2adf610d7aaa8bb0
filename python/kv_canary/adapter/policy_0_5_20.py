"""Which sglang 0.5.20 server settings the canary verifies: 0.5.19's policy on 0.5.20's fields.

sglang 0.5.20's ``ServerArgs`` (a msgspec Struct, 499 fields) is 0.5.19's (488) minus 4 prefill context-parallel
fields 0.5.20 dropped (``_GONE``; ``--enable-prefill-cp`` and ``--attn-cp-size`` stay, with 0.5.19's rules) plus 15
fields 0.5.23 has too (``_FROM_0_5_23``: classified as ``adapter/policy_0_5_23`` classifies them); read from the
installed 0.5.20 2026-11-30 (``test_server_args_policy`` in a ``KVC_SGLANG=0.5.20`` venv checks it).
"""

from __future__ import annotations

from .policy_0_5_15 import derived
from .policy_0_5_19 import POLICY_0_5_19
from .policy_0_5_23 import POLICY_0_5_23

_GONE = frozenset({"dsa_prefill_cp_mode", "enable_dsa_prefill_context_parallel", "enable_prefill_context_parallel",
                   "prefill_cp_mode"})
_FROM_0_5_23 = frozenset("""
    _radix_eviction_policy_explicitly_set dsv4_attn_backend enable_response_store enable_unified_cache_external_linker
    flashinfer_a2a_dispatch_type ple_offload_backend ple_offload_dir ple_offload_embedding radix_eviction_policy_config
    return_input_ids return_output_ids sampling_mask_max_tokens speculative_domino_candidate_pool_size
    unified_cache_external_linker_backend uno_lora_path
""".split())

POLICY_0_5_20 = derived(POLICY_0_5_19, _GONE, {field: field for field in _FROM_0_5_23}, POLICY_0_5_23)
