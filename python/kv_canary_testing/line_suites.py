"""Which test files run on which sglang line (read by test/conftest.py and scripts/run_suite.py).

Test files that drive what only one sglang line's adapter verifies (python/kv_canary/adapter/lines): on
another line they are not collected (their sglang imports may not even exist there), and the run's header
(and run_suite's file list) says so, with the reason.
"""

from __future__ import annotations

import os
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
        "why": "sglang 0.5.23's adapter refuses these at startup (docs/compatibility.md): spec v1; MTP over "
               "the tiny MiMo config does not run on sglang 0.5.23's GPU at all (the canary-off control died in "
               "sglang's MiMo forward too: a 0-token extend, H200 2026-11-30c); or the "
               "test drives 0.5.12's own classes (SWARadixCache, MambaRadixCache, ...)",
        "files": (
            "unit/test_mamba_radix_index.py", "unit/test_pools.py", "unit/test_speculative.py",
            "unit/test_speculative_draft_eager.py", "unit/test_speculative_draft_graphs.py",
            "unit/test_speculative_draft_install.py", "unit/test_speculative_v1.py",
            "unit/test_speculative_v1_draft.py",
            "unit/test_swa_radix_index.py", "unit/test_perturb_and_radix.py", "unit/test_plugin.py", "unit/test_pd.py",
            "unit/test_speculative_eagle3.py",
            "registered/kv_canary/test_e2e_speculative_mtp.py",
            "registered/kv_canary/test_e2e_speculative_v1.py", "registered/kv_canary/test_refused_configs.py",
        ),
    },
    "0.5.12 and 0.5.23 (PD)": {
        "why": "PD disaggregation is verified on sglang 0.5.12 and 0.5.23 (adapter/disagg; 0.5.17 refuses "
               "--disaggregation-mode at startup: its hooks are not written)",
        "line": ("0.5.12", "0.5.23"),
        "files": ("registered/kv_canary/test_e2e_pd.py",),
    },
    "0.5.23 (PD with TP)": {
        "why": "PD with --tp-size > 1 is verified on sglang 0.5.23 (SglangLine.pd_tensor_parallel); 0.5.12 refuses it "
               "at startup, naming --tp-size",
        "line": "0.5.23",
        "files": ("registered/kv_canary/test_e2e_pd_tp.py",),
    },
    "0.5.12 and 0.5.23 (sglang's own Qwen3-Next, GPU only)": {
        "why": "sglang's Qwen3NextForCausalLM builds on CUDA only (the file skips on CPU, naming why); 0.5.17 refuses "
               "HybridLinearKVPool. On 0.5.23 it runs with the verified mamba strategy (no_buffer, overlap off)",
        "line": ("0.5.12", "0.5.23"),
        "files": ("registered/kv_canary/test_e2e_hybrid_linear.py",),
    },
    "0.5.12 (real bugs)": {
        "why": "puts real sglang bugs back (kv_canary_testing.real_bugs): the fixes it reverses were checked against "
               "sglang 0.5.12 and do not reverse on 0.5.23; the fixes it applies forward (bugs 0.5.12 ships) were "
               "checked against 0.5.12 only (real_bug_patches/README.md)",
        "line": "0.5.12",
        "files": ("registered/kv_canary/test_e2e_real_bugs.py", "registered/kv_canary/test_e2e_real_bugs_0512_more.py"),
    },
    "0.5.23 (real bugs)": {
        "why": "puts back real sglang bugs whose fixes reverse on sglang 0.5.23 only (real_bug_patches/README.md): "
               "UnifiedRadixCache's SWA component, EAGLE spec v2's draft worker",
        "line": "0.5.23",
        "files": ("registered/kv_canary/test_e2e_real_bugs_0523.py", "registered/kv_canary/test_e2e_real_bugs_spec_0523.py"),
    },
    "0.5.12 and 0.5.23 (HiCache storage)": {
        "why": "HiCache's storage tier is verified on sglang 0.5.12 and 0.5.23 (adapter/hicache_storage, "
               "hicache_0_5_23; 0.5.17 refuses --enable-hierarchical-cache at startup); on 0.5.23 on CPU only, "
               "contain on sglang's Python tree core (adapter/hicache.LINE_LIMITS)",
        "line": ("0.5.12", "0.5.23"),
        "files": ("registered/kv_canary/test_e2e_hicache_storage.py", "unit/test_hicache_storage.py"),
    },
    "0.5.12 and 0.5.23 (HiCache)": {
        "why": "HiCache is verified on sglang 0.5.12 and 0.5.23 (adapter/hicache.VERIFIED_LINES; 0.5.17 refuses "
               "--enable-hierarchical-cache at startup: its hooks and CPU shim are not written, docs/hicache.md)",
        "line": ("0.5.12", "0.5.23"),
        "files": ("registered/kv_canary/test_e2e_hicache.py",),
    },
    "0.5.23": {
        "why": "drives sglang 0.5.23's own code (the in-tree canary's call sites, its flags, UnifiedRadixCache)",
        "files": ("registered/kv_canary/test_e2e_newest_line.py", "unit/test_contain_unified.py",
                  "unit/test_unified_walk_changes.py", "unit/test_hicache_storage_0_5_23.py",
                  "unit/test_contain_hicache_0_5_23.py"),
    },
    "0.5.23 (TP on CPU)": {
        "why": "tensor parallel on CPU (two gloo ranks) drives 0.5.23's parallel-context rank reader; 0.5.12's TP=2 "
               "is recorded on the GPU host (docs/results/gpu-h200x2-2026-11-22) and its rank reader is the "
               "ModelRunner's own tp_rank; 0.5.17 refuses TP",
        "line": "0.5.23",
        "cpu_only": True,  # the GPU host's two-GPU run on 0.5.12 still runs it
        "files": ("registered/kv_canary/test_e2e_tp.py",),
    },
    "0.5.23 (DP on CPU)": {
        "why": "data parallel (--dp-size 2: two scheduler processes, each with its own canary) runs the same plugin "
               "code on both lines; CI time: the CPU CI runs it once, on 0.5.23 (0.5.12 run by hand: "
               "docs/compatibility.md); 0.5.17 refuses --dp-size",
        "line": "0.5.23",
        "cpu_only": True,
        "files": ("registered/kv_canary/test_e2e_dp.py",),
    },
    "0.5.23 (0.5.12's recorded on the GPU host)": {
        "why": "CI time: on 0.5.12 EAGLE3 rides the draft hooks test_e2e_speculative drives, and the hybrid-linear "
               "pool's MambaRadixCache hooks are unit-tested (unit/test_mamba_radix_index); both run with sglang's "
               "own models on the GPU host (test_e2e_speculative_eagle3, test_e2e_hybrid_linear: docs/results)",
        "line": "0.5.23",
        "cpu_only": True,
        "files": ("registered/kv_canary/test_e2e_speculative_eagle3.py",
                  "registered/kv_canary/test_e2e_hybrid_linear_cpu.py"),
    },
    "0.5.12 and 0.5.23": {
        "why": "sglang 0.5.17's adapter refuses contain, speculative decoding, tensor parallel, SWAKVPool and "
               "HybridLinearKVPool at startup (docs/compatibility.md)",
        "line": ("0.5.12", "0.5.23"),
        "files": ("registered/kv_canary/test_e2e_contain.py",
                  "registered/kv_canary/test_e2e_shared_prefix_contain.py",
                  "registered/kv_canary/test_e2e_swa.py", "registered/kv_canary/test_e2e_speculative.py",
                  "registered/kv_canary/test_e2e_speculative_eagle3.py",
                  "registered/kv_canary/test_e2e_speculative_perturb.py", "registered/kv_canary/test_e2e_tp.py",
                  "registered/kv_canary/test_e2e_hybrid_linear_cpu.py"),
    },
    "0.5.23 (covered on 0.5.12 by another file)": {
        "why": "the paged pool on 0.5.12 is driven by test_e2e_real_data's page-16 case (sweep included); the "
               "CPU CI runs this file on 0.5.23, whose unified radix tree it drives",
        "line": "0.5.23",
        "files": ("registered/kv_canary/test_e2e_page_size.py",),
    },
    "0.5.23 and 0.5.17 (0.5.12's wiring driven by other files)": {
        "why": "CI time (scripts/test.sh: the whole suite on the newest line, the line-specific e2e on the other): "
               "on 0.5.12 what these drive that is 0.5.12's own is driven by other files there (the forward "
               "bracket and RadixCache sweep by test_e2e_baseline, injections by test_e2e_perturb_real_kv_used / "
               "test_e2e_real_data and unit/test_perturb_and_radix, the pool readers by test_e2e_real_data); "
               "0.5.12's MLA pool and TP=2 are recorded on the GPU host (docs/results)",
        # 0.5.13, 0.5.15, 0.5.18-0.5.21: diffs of 0.5.17 or 0.5.23 (the release matrix's smoke)
        "line": ("0.5.23", "0.5.17", "0.5.15", "0.5.13", "0.5.18", "0.5.19", "0.5.20", "0.5.21"),
        "cpu_only": True,  # a GPU-host run on 0.5.12 still runs them
        "files": ("registered/kv_canary/test_e2e_perturb_modes.py", "registered/kv_canary/test_e2e_mla_fp8.py",
                  "registered/test_fixture_smoke.py"),
    },
    "0.5.23 and 0.5.17 (the core: no sglang code)": {
        "why": "CI time: these drive the core's kernels and readers on plain tensors (no sglang import), the same "
               "code on every line, so the CPU CI runs them once, on the newest line; a GPU host runs them on "
               "whichever line it has",
        "line": ("0.5.23", "0.5.17"),
        "cpu_only": True,
        "files": ("unit/test_config.py", "unit/test_d2h.py", "unit/test_full_row.py",
                  "unit/test_ring_reader.py", "unit/test_swa_host.py",
                  "unit/test_witness.py", "unit/test_hicache_host_records.py", "unit/test_hicache_runner.py",
                  "unit/test_hicache_first_read.py", "unit/test_hicache_host_scrub.py",
                  "unit/test_bench_decode_kernels.py"),
    },
    "0.5.12 and 0.5.17 (the core: no sglang code)": {
        "why": "CI time: as the group above (the core on plain tensors, the same code on every line), run once on "
               "CPU; on 0.5.12, whose part of the CPU CI ends earlier than the newest line's when the two run side "
               "by side (scripts/test.sh)",
        "line": ("0.5.12", "0.5.17"),
        "cpu_only": True,
        "files": ("unit/test_kernels.py", "unit/test_token_oracle.py", "unit/test_kernel_scrub_sweep.py",
                  "unit/test_accept_kernels.py", "unit/test_swa_kernels.py"),
    },
}


def installed_sglang() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def installed_line() -> Optional[str]:
    """The line serving the installed release (``SglangLine.versions``: 0.5.16 -> 0.5.17), else the release itself."""
    release = installed_sglang()
    from kv_canary.adapter.lines import LINE_MODULES, load_line

    for name, module in LINE_MODULES.items():
        if release in load_line(module).versions + load_line(module).untested_versions:
            return name
    return release


def not_on_this_line() -> Dict[str, str]:
    """{test file relative to test/: why it is not run on the installed sglang line}. ``KVC_COLLECT_EVERY_LINE=1``:
    nothing is left out (by hand, e.g. a GPU-host run of a file on a line that does not verify it yet)."""
    if os.environ.get("KVC_COLLECT_EVERY_LINE") == "1":
        return {}
    line = installed_line()
    # scripts/run_suite.py --hw cuda sets KVC_TEST_DEVICE; the GPU host's unit step runs pytest on a CUDA machine
    on_gpu = os.environ.get("KVC_TEST_DEVICE", "cpu") != "cpu" or _cuda_available()

    def lines(only, spec):
        on = spec.get("line", only)
        return (on,) if isinstance(on, str) else tuple(on)

    return {f: f"only on sglang {' and '.join(lines(only, spec))}{' (CPU runs)' if spec.get('cpu_only') else ''}: "
               f"{spec['why']}" for only, spec in ONLY_ON_LINE.items()
            if line not in lines(only, spec) and not (on_gpu and spec.get("cpu_only")) for f in spec["files"]}
