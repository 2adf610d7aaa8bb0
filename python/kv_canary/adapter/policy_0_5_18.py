"""Which sglang 0.5.18 server settings the canary verifies: 0.5.17's policy on 0.5.18's fields.

sglang 0.5.18's ``ServerArgs`` (a dataclass, 472 fields) is 0.5.17's (458) minus 2 fields 0.5.18 dropped
(``_GONE``) plus 16 fields 0.5.23 has too (``_FROM_0_5_23``: classified as ``adapter/policy_0_5_23`` classifies
them; read from the wheel statically, and checked on an installed 0.5.18 by ``test_server_args_policy``, 2026-11-29).
"""

from __future__ import annotations

from .policy_0_5_15 import derived
from .policy_0_5_17 import POLICY_0_5_17
from .policy_0_5_23 import POLICY_0_5_23

_GONE = frozenset({"enable_expert_distribution_metrics", "torchao_config"})
_FROM_0_5_23 = frozenset("""
    _speculative_draft_quantization_explicitly_set allowed_media_domains c128_page_size
    disaggregation_decode_retraction_backup enable_tp_lm_head_all_to_all expert_balancedness_report_mode
    http2_max_concurrent_streams image_processor_backend language_model_only media_url_max_file_size_mb
    mlx_enable_sampling mm_global_cache_backend mm_preprocess_cache_size_mb speculative_draft_kv_cache_dtype
    startup_weight_load_mode trust_mm_content_hashes
""".split())

POLICY_0_5_18 = derived(POLICY_0_5_17, _GONE, {field: field for field in _FROM_0_5_23}, POLICY_0_5_23)
