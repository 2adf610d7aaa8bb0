"""Which test files run on which sglang line (read by test/conftest.py and scripts/run_suite.py).

Test files that drive what only one sglang line's adapter verifies (python/kv_canary/adapter/lines): on
another line they are not collected (their sglang imports may not even exist there), and the run's header
(and run_suite's file list) says so, with the reason.
"""

from __future__ import annotations

from typing import Dict, Optional

# Test files that drive what only one sglang line's adapter verifies (python/kv_canary/adapter/lines): on another
# line they are not collected (their sglang imports may not even exist there), and the run's header says so.
ONLY_ON_LINE = {
    "0.5.12 (same code on both lines)": {
        "why": "drives the core (kernels, token oracle, scrub) through hooks the newest-line files already drive on "
               "0.5.23; the CPU CI runs it once, on 0.5.12 (scripts/test.sh: the whole suite on one line, the "
               "line-specific e2e on the other); and on 0.5.17, the newest line the GPU host runs (CUDA graphs)",
        "line": ("0.5.12", "0.5.17"),
        "files": (
            "registered/kv_canary/test_e2e_real_data.py", "registered/kv_canary/test_e2e_perturb_real_kv_used.py",
            "registered/kv_canary/test_e2e_fed_positions_tokens.py",
        ),
    },
    "0.5.12": {
        "why": "sglang 0.5.23's adapter refuses these at startup (docs/compatibility.md): speculative decoding, PD, "
               "the GPU hybrid-linear e2e (sglang's own Qwen3-Next; 0.5.23 cannot load on the GPU host); or the "
               "test drives 0.5.12's own classes (SWARadixCache, MambaRadixCache, ...)",
        "files": (
            "unit/test_mamba_radix_index.py", "unit/test_pools.py", "unit/test_speculative.py",
            "unit/test_speculative_draft.py", "unit/test_speculative_v1.py", "unit/test_speculative_v1_draft.py",
            "unit/test_swa_radix_index.py", "unit/test_perturb_and_radix.py", "unit/test_plugin.py", "unit/test_pd.py",
            "unit/test_speculative_eagle3.py",
            "registered/kv_canary/test_e2e_hybrid_linear.py",
            "registered/kv_canary/test_e2e_pd.py",
            "registered/kv_canary/test_e2e_speculative_mtp.py",
            "registered/kv_canary/test_e2e_speculative_v1.py", "registered/kv_canary/test_refused_configs.py",
        ),
    },
    "0.5.23": {
        "why": "drives sglang 0.5.23's own code (the in-tree canary's call sites, its flags, UnifiedRadixCache)",
        "files": ("registered/kv_canary/test_e2e_newest_line.py", "unit/test_contain_unified.py"),
    },
    "0.5.12 and 0.5.23": {
        "why": "sglang 0.5.17's adapter refuses contain, tensor parallel, SWAKVPool and HybridLinearKVPool at "
               "startup (docs/compatibility.md)",
        "line": ("0.5.12", "0.5.23"),
        "files": ("registered/kv_canary/test_e2e_contain.py", "registered/kv_canary/test_e2e_tp.py",
                  "registered/kv_canary/test_e2e_swa.py", "registered/kv_canary/test_e2e_hybrid_linear_cpu.py"),
    },
    "0.5.23 (covered on 0.5.12 by another file)": {
        "why": "the paged pool on 0.5.12 is driven by test_e2e_real_data's page-16 case (sweep included); the "
               "CPU CI runs this file on 0.5.23, whose unified radix tree it drives",
        "line": "0.5.23",
        "files": ("registered/kv_canary/test_e2e_page_size.py",),
    },
}


def installed_sglang() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def not_on_this_line() -> Dict[str, str]:
    """{test file relative to test/: why it is not run on the installed sglang line}."""
    line = installed_sglang()
    def lines(only, spec):
        on = spec.get("line", only)
        return (on,) if isinstance(on, str) else tuple(on)

    return {f: f"only on sglang {' and '.join(lines(only, spec))}: {spec['why']}" for only, spec in ONLY_ON_LINE.items()
            if line not in lines(only, spec) for f in spec["files"]}
