"""Which sglang 0.5.19 server settings the canary verifies: 0.5.18's policy on 0.5.19's fields.

sglang 0.5.19's ``ServerArgs`` (a dataclass, 488 fields) is 0.5.18's (472) plus 16 fields 0.5.23 has too
(``_FROM_0_5_23``: classified as ``adapter/policy_0_5_23`` classifies them), none dropped; read from the wheels'
ASTs 2026-11-29 (an installed 0.5.19 checks it: ``test_server_args_policy`` in a ``KVC_SGLANG=0.5.19`` venv).
"""

from __future__ import annotations

from .policy_0_5_15 import derived
from .policy_0_5_18 import POLICY_0_5_18
from .policy_0_5_23 import POLICY_0_5_23

_FROM_0_5_23 = frozenset("""
    deepep_v2_mode dsv4_prefill_backend enable_dense_mlp_attn_tp enable_layernorm_sp enable_lean_attention
    enable_shared_experts_attn_tp enable_w4a4_mxfp4_megamoe gated_launch_port grpc_worker_threads
    hicache_host_memory_mode hicache_storage_prefetch_retry_max_attempts hicache_storage_prefetch_retry_poll_interval
    http2_initial_connection_window_size load_publish_endpoint prefill_decode_interval speculative_dsa_topk_backend
""".split())

POLICY_0_5_19 = derived(POLICY_0_5_18, frozenset(), {field: field for field in _FROM_0_5_23}, POLICY_0_5_23)
