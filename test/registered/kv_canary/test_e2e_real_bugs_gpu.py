"""Real sglang bugs that cannot run their three runs on CPU (issue 53; docs/real-bugs.md, "GPU host or refused").

Each test here skips, naming why, where it cannot run. Two kinds:

* **GPU host** (the lead runs them: ``KVC_TEST_DEVICE=cuda``): the bug lives in code that CPU servers never run
  (CUDA graph replay, the fa3 backend, a race between CUDA streams).
  ``test_cudagraph_swa_pad_loc`` is a written workload, **not yet run on a GPU** (this session had none): its
  assertions are the expected outcome, to be confirmed or corrected with what the GPU host shows.
* **Refused by the canary**: the configuration the bug needs is one the adapter refuses at startup on the line the
  patch reverses on (docs/compatibility.md), so (b) and (c) cannot run anywhere today.
"""

import pytest

from kv_canary_testing.canary_e2e import e2e_device, register_cuda_ci
from kv_canary_testing.model_dir import NUM_WORDS
from kv_canary_testing.real_bug_runs import three_runs
from kv_canary_testing.server import installed_sglang_version
from kv_canary_testing.workload import RequestSpec, run_requests

register_cuda_ci(est_time=240, suite="kv-canary-cuda")

CUDA = e2e_device() == "cuda"
LINE = installed_sglang_version()


def needs_gpu_and_line(lines, why):
    if not CUDA:
        pytest.skip(f"GPU host: {why}")
    if LINE not in lines:
        pytest.skip(f"the patch reverses on sglang {', '.join(lines)}, this is {LINE}")


# ---- #24743: padded CUDA-graph decode replay keeps the last replay's SWA slot indices ------------------------------

PAD_BUG = "cudagraph_swa_pad_loc_pr24743"
PAD_WHY = ("#24743's bug is in CudaGraphRunner's replay (pad rows of a padded decode batch keep the previous "
           "replay's out_cache_loc_swa); CPU servers run with --disable-cuda-graph and never replay")
PAD_N = 8  # a captured batch size; the batch then shrinks one request at a time: 7 (padded to 8), 6, 5 ...


def shrinking_decode_batch(srv):
    """Eight greedy requests decoding together, each finishing 4 tokens after the previous one: every shrink pads
    the batch to the next captured size, and the pad rows keep the SWA slot indices of the requests that sat there
    at the previous replay. filter_batch keeps the order, so those requests now sit one row up, alive: the pad
    tokens' SWA stores land on their newest token's SWA slot, which their next decode reads (inside the window)."""
    import random

    rng = random.Random(11)
    specs = [RequestSpec(i, "pad", tuple(rng.randrange(NUM_WORDS) for _ in range(20)), 16 + 4 * i)
             for i in range(PAD_N)]
    return {o.index: o for o in run_requests(srv.base_url, specs, concurrency=PAD_N, use_input_ids=True).outcomes}


@pytest.fixture(scope="module")
def pad_runs(tmp_path_factory):
    needs_gpu_and_line(("0.5.12",), PAD_WHY)
    args = ["--page-size", "1", "--cuda-graph-bs", "1", "2", "4", "8", "--max-running-requests", str(PAD_N)]
    return three_runs(PAD_BUG, args, {}, shrinking_decode_batch, 4096, tmp_path_factory,
                      describe=lambda run: "outputs=" + str({i: o.output_ids[:4]
                                                             for i, o in sorted(run.result.items())}))


@pytest.mark.e2e
def test_cudagraph_swa_pad_loc_a_outputs_differ(pad_runs):
    """Triton reads the overwritten SWA slots on the GPU, so greedy outputs differ (H200, 2026-11-30: they did)."""
    out, fixed = pad_runs["a"].result, pad_runs["c"].result
    assert all(o.status == "ok" for o in out.values())
    assert any(out[i].output_ids != fixed[i].output_ids for i in out), "no output changed: the bug did not fire"


@pytest.mark.e2e
@pytest.mark.xfail(strict=True, reason=(
    "a known miss (H200, 2026-11-30, docs/real-bugs.md): the pad row recomputes the live request's last token at its "
    "position, so its store is byte-identical in layer 0, the layer real data partial hashes; the deeper layers' "
    "K/V it changes are never hashed at a later read"))
def test_cudagraph_swa_pad_loc_b_canary_reports_the_overwrite(pad_runs):
    """``kv_hash`` in the swa group, at the slot the pad row wrote, in the next forward (not seen: the xfail)."""
    log = pad_runs["b"].log
    assert log.installed and log.violations, "the canary reported nothing"
    assert {v["group"] for v in log.violations} == {"swa"}, log.violations[:5]
    print(f"kv_canary_real_bug {PAD_BUG} b: {sorted({v['kind'] for v in log.violations})} "
          f"first={log.violations[0]}")


@pytest.mark.e2e
def test_cudagraph_swa_pad_loc_c_fixed_has_no_violation(pad_runs):
    log = pad_runs["c"].log
    assert log.installed and log.violations == [] and log.last_stat("violations") == 0


# ---- the others: GPU-only code, or a configuration the canary refuses ---------------------------------------------

NOT_ON_CPU = {
    "fa3_mla_embedding_skip_kv_pr24097": (
        ("0.5.12", "0.5.23"), True,
        "the fa3 backend (Hopper) with an MLA model served as an embedding model: the fast path that skips the KV "
        "store is fa3's; torch_native on CPU has no such path"),
    "swa_match_tombstone_reset_pr17061": (
        ("0.5.12",), True,
        "a live run shorter than a window between two SWA tombstones, which only SWA-pool LRU eviction of an internal "
        "node makes; CPU servers need --swa-full-tokens-ratio 1.0 (torch_native reads SWA layers untranslated), so "
        "SWA never runs out before the full pool (a decode-eviction workload did not fire it: docs/real-bugs.md)"),
    "hicache_loadback_fence_pr36738": (
        ("0.5.23",), True,
        "a race between HiCache's host-to-device transfer stream and the forward stream (the PR: the load-back must "
        "wait for the forward stream); on CPU the test shim's copies run in program order, so the race cannot occur"),
    "pd_swa_tail_stale_mapping_pr25805": (
        ("0.5.23",), False,
        "PD decode side + hybrid SWA + EAGLE/MTP: sglang 0.5.23's adapter refuses --disaggregation-mode and refuses "
        "speculative decoding over an SWAKVPool at startup (docs/compatibility.md), so runs (b) and (c) cannot start"),
    "swa_bigram_evict_frontier_pr34870": (
        ("0.5.23",), False,
        "hybrid SWA + EAGLE: the canary refuses --speculative-algorithm with an SWAKVPool target at startup "
        "(spec_pool_refusal: speculative decoding is verified over MHATokenToKVPool pools only), so runs (b) and (c) "
        "cannot start; run (a) is recorded by hand in docs/real-bugs.md"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("bug", sorted(NOT_ON_CPU))
def test_not_on_cpu(bug):
    """A skip that names why (the record: docs/real-bugs.md); a GPU workload replaces it when one is written."""
    lines, gpu, why = NOT_ON_CPU[bug]
    kind = "GPU host, no workload written yet" if gpu else "refused by the canary"
    pytest.skip(f"{bug} (sglang {', '.join(lines)}; {kind}): {why}")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
