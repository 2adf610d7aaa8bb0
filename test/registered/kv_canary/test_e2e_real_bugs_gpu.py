"""Real sglang bugs that cannot run their three runs on CPU (issue 53; docs/real-bugs.md, "GPU host or refused").

Each test here skips, naming why, where it cannot run. Two kinds:

* **GPU host** (the lead runs them: ``KVC_TEST_DEVICE=cuda``): the bug lives in code that CPU servers never run
  (CUDA graph replay, the fa3 backend, a race between CUDA streams).
  ``test_cudagraph_swa_pad_loc`` (#24743) ran there (H200, 2026-11-30: (a) fired, (b) missed: the strict xfail);
  its fourth run, (b2) with ``--kv-canary-real-data all`` and the sweep at every forward, caught it at the read
  (H200, 2026-11-30e). #24097 and #36738 are in ``test_e2e_real_bugs_gpu_more.py``.
* **Refused by the canary**: the configuration the bug needs is one the adapter refuses at startup on the line the
  patch reverses on (docs/compatibility.md), so (b) and (c) cannot run anywhere today.
"""

import pytest

from kv_canary_testing.canary_e2e import register_cuda_ci
from kv_canary_testing.model_dir import NUM_WORDS
from kv_canary_testing.real_bug_runs import needs_gpu_and_line, summarize_violations, three_runs
from kv_canary_testing.workload import RequestSpec, run_requests

register_cuda_ci(est_time=360, suite="kv-canary-cuda")  # #24743: three servers, b2 two more


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
    "K/V it changes are hashed by real data all only (b2)"))
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


# (b2): the bug in, log, every byte: `all` hashes every byte at a slot's first read (after the reading forward's
# stores) and
# turns on the scrub (256 slots a forward: every slot of this 4,096-slot pool within 16 forwards, while the requests
# still hold them); the sweep (config.py: every N forwards, every slot the radix cache holds; 1: the smallest) adds the
# window check of cached slots, which layer 0's identical bytes pass
PAD_B2_ARGS = ["--kv-canary-real-data", "all", "--kv-canary-sweep-interval", "1"]
# the scrub's rate: all's default (256 slots a forward), and the whole pool every forward (the upper bound: a missed
# overwrite there is not the scrub's rate)
PAD_B2_SCRUB = {"all-default": {}, "whole-pool": {"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "4096"}}


@pytest.fixture(scope="module", params=sorted(PAD_B2_SCRUB))
def pad_b2_run(request, tmp_path_factory):
    needs_gpu_and_line(("0.5.12",), PAD_WHY)
    args = ["--page-size", "1", "--cuda-graph-bs", "1", "2", "4", "8", "--max-running-requests", str(PAD_N)]
    return three_runs(PAD_BUG, args, PAD_B2_SCRUB[request.param], shrinking_decode_batch, 4096, tmp_path_factory,
                      runs=("b2",), run_args={"b2": PAD_B2_ARGS})["b2"]


@pytest.mark.e2e
def test_cudagraph_swa_pad_loc_b2_scrub_reports_the_overwrite(pad_b2_run):
    """``all`` sees the deeper layers' bytes change under the slot's full-row hash: ``kv_hash`` in the swa group.
    Seen on the H200 (2026-11-30e): at the read, naming the reader (``all``'s first-read hash runs after the forward's
    stores), in both servers; the scrub may report it too, found at rest with no reader (``rid=scrub``,
    ``containment.SCRUB_RID``). Two servers: the scrub at ``all``'s default rate and over the whole pool every
    forward."""
    log = pad_b2_run.log
    assert pad_b2_run.running and log.installed and "real_data=all" in log.text, log.text[-2000:]
    assert log.violations, "the scrub and the sweep reported nothing"
    kinds, positions, forwards, line = summarize_violations(PAD_BUG, log)
    print(line)
    assert {v["group"] for v in log.violations} == {"swa"}, log.violations[:5]
    assert all("kv_hash" in k.split("+") for k in kinds), kinds
    rids = {v["rid"] for v in log.violations}
    assert rids <= {"scrub", "cache"} | {o.rid for o in pad_b2_run.result.values()}, rids  # scrub expected


# ---- the others: GPU-only code without a workload yet, or a configuration the canary refuses -----------------------

NOT_ON_CPU = {
    "swa_match_tombstone_reset_pr17061": (
        ("0.5.12",), True,
        "a live run shorter than a window between two SWA tombstones, which only SWA-pool LRU eviction of an internal "
        "node makes; CPU servers need --swa-full-tokens-ratio 1.0 (torch_native reads SWA layers untranslated), so "
        "SWA never runs out before the full pool (a decode-eviction workload did not fire it: docs/real-bugs.md)"),
    "pd_swa_tail_stale_mapping_pr25805": (
        ("0.5.23",), False,
        "PD decode side + hybrid SWA + EAGLE/MTP: sglang 0.5.23's adapter refuses --disaggregation-mode, and "
        "speculative decoding over an SWAKVPool with the draft pool unverified (PD) at startup (docs/compatibility.md), "
        "so runs (b) and (c) cannot start"),
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
