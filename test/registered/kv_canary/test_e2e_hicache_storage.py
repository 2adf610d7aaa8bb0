"""HiCache's storage tier (``--hicache-storage-backend file``, sglang 0.5.12 and 0.5.23): pages written to files carry
their records in a trailer, and host copies read back from storage are verified like any host copy at their
load-back. On 0.5.23 (CPU and the GPU host) ``contain`` runs on sglang's Python tree core
(``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``).

The conversations of ``test_e2e_hicache`` against a host pool only 1.5x the device pool, with pages of 16 (a file
per page: the storage writes keep up on 2 cores): a prefix leaves the device and then the host before its next
turn, and comes back from files (~300-token prefixes: above the 256-token prefetch threshold; prefetches run
to completion, ``--hicache-storage-prefetch-policy wait_complete``, so each turn's hit does not depend on timing).
Two passes: the first writes every prefix to storage, the second reads most of them back. Prefetches are proven by
sglang's own counter (``sglang:prefetched_tokens_total``), load-backs by ``sglang:load_back_tokens_total``.
On CPU the host pool runs through the test shim; a GPU runs sglang's own.
"""

from __future__ import annotations

import os
import time

import pytest

from kv_canary.violations import CONTAIN_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device, register_cpu_ci, register_cuda_ci
from kv_canary_testing.line_suites import installed_sglang
from kv_canary_testing.prometheus import sglang_counter
from kv_canary_testing.workload import run_requests
from test_e2e_hicache import MAX_TOTAL_TOKENS, conversations, shim_env

register_cpu_ci(est_time=240, suite="kv-canary-cpu")
register_cuda_ci(est_time=240, suite="kv-canary-cuda")

PAGE_SIZE, PASSES = 16, 2
FLIPS = 6  # storage-page flips of the contain run
COUNTERS = ("sglang:prefetched_tokens_total", "sglang:load_back_tokens_total", "sglang:evicted_tokens_total",
            "sglang:backuped_tokens_total")


def storage_args():
    """``layer_first`` and ``partial`` named: sglang 0.5.23's defaults (``page_first``, ``none``) are refused here."""
    return ["--enable-hierarchical-cache", "--hicache-ratio", "1.5", "--hicache-write-policy", "write_through",
            "--hicache-mem-layout", "layer_first", "--kv-canary-real-data", "partial",
            "--page-size", str(PAGE_SIZE), "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete", "--enable-metrics"]


def serve(mode: str, tmp_path, env=None, passes: int = PASSES, storage=None, name: str = "server"):
    """A HiCache server with file storage in ``tmp_path/storage``: the conversations ``passes`` times, one request
    at a time; sglang's counters, the settled log, the server, the stored files, the wall time, and per pass its
    result and (``contain``) its settled log."""
    storage = storage or tmp_path / "storage"
    storage.mkdir(exist_ok=True)
    srv = canary_server(mode, log_path=tmp_path / f"{name}.log", extra_args=storage_args(),
                        env={**shim_env(), "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage), **(env or {})},
                        max_total_tokens=MAX_TOTAL_TOKENS)
    started = time.monotonic()
    srv.start(timeout=600)
    try:
        results, logs = [], []
        for _ in range(passes):
            results.append(run_requests(srv.base_url, conversations(), concurrency=1, timeout=300))
            logs.append(CanaryLog.read_settled(srv) if mode == "contain" else None)
        counters = {name: sglang_counter(srv.base_url, name) for name in COUNTERS}
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    finally:
        srv.stop()
    contained = {c["rid"] for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"}
    for r in results:  # only requests contain aborted may fail
        assert r.failed == 0 or mode == "contain", "\n".join(r.errors[:5]) + srv.log_tail()
    assert sum(r.failed for r in results) <= len(contained), srv.log_tail()
    assert running, srv.log_tail()
    files = len(list(storage.iterdir()))
    return counters, log, srv, files, time.monotonic() - started, results, logs


def _stats(log, *keys):
    last = log.stats[-1] if log.stats else {}
    return " ".join(f"{k}={last.get(k)}" for k in keys)


STORAGE_STATS = ("hicache_storage_pages_set", "hicache_storage_pages_existing", "hicache_storage_pages_got",
                 "hicache_storage_pages_without_records", "hicache_slots_loaded", "slots_first_read", "violations")


@pytest.mark.e2e
def test_prefixes_read_back_from_storage_are_verified_with_no_violation(tmp_path):
    """The host scrub runs fast beside it (host copies read back from files land with their records): no alarm."""
    counters, log, srv, files, wall, _, _ = serve("raise", tmp_path,
                                                  env={"SGLANG_KV_CANARY_HOST_SCRUB_SLOTS_PER_SECOND": "20000"})
    prefetched, loaded = counters["sglang:prefetched_tokens_total"], counters["sglang:load_back_tokens_total"]
    print(f"kv_canary_e2e_hicache_storage mode=raise device={e2e_device()} wall_s={wall:.0f} files={files} "
          + " ".join(f"{k.split(':')[1]}={v:.0f}" for k, v in counters.items()) + " " + _stats(log, *STORAGE_STATS))
    assert log.installed and "storage=file" in log.text, srv.log_tail()
    # sglang itself read prefixes back from the files and loaded them to the device
    assert prefetched > 0 and loaded > 0
    got = log.last_stat("hicache_storage_pages_got")
    assert log.last_stat("hicache_storage_pages_set") > 0 and got > 0
    assert got * PAGE_SIZE >= prefetched  # every prefetched token came with its page's records
    assert log.last_stat("hicache_storage_pages_without_records") == 0  # every page this server wrote has its trailer
    # the canary loaded the records of exactly the slots sglang loaded back, and hashed every byte at the first read
    assert log.last_stat("hicache_slots_loaded") == loaded
    assert log.last_stat("slots_first_read") == loaded
    assert log.last_stat("hicache_host_scrubbed") > 0
    assert log.violations == [] and log.last_stat("violations") == 0, log.violations[:5]


@pytest.mark.e2e
def test_a_flipped_storage_page_is_caught_when_loaded_back(tmp_path):
    """``log`` + ``SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB``: one K/V byte of a page the canary wrote is flipped
    in its file (anywhere in the page's rows, mostly outside the hashed window); every flipped page read back and
    loaded to the device is reported at that load-back, naming the storage key and page slot, and nothing else."""
    env = {"SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB": "0.1", "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "0",
           "SGLANG_KV_CANARY_PERTURB_SEED": "7"}
    counters, log, srv, files, wall, _, _ = serve("log", tmp_path, env=env)
    flips = {(p["key"], p["page_slot"]): p for p in log.perturbations if p["kv_canary_perturb"] == "storage_page"}
    reported = {(v.get("storage_key"), v.get("storage_page_slot")) for v in log.violations}
    reported_slots = {v["host_slot"] for v in log.violations}
    loaded_flips = log.last_stat("hicache_flipped_storage_pages_loaded")
    outside = [k for k in reported if k in flips and flips[k]["hashed"] == "0"]
    print(f"kv_canary_e2e_hicache_storage mode=log device={e2e_device()} wall_s={wall:.0f} storage_page_flips="
          f"{len(flips)} flipped_pages_loaded={loaded_flips} violations={len(log.violations)} "
          f"pages_reported={len(reported)} host_slots_reported={len(reported_slots)} "
          f"reported_outside_window={len(outside)} "
          + " ".join(f"{k.split(':')[1]}={v:.0f}" for k, v in counters.items()) + " " + _stats(log, *STORAGE_STATS))
    assert len(log.perturbations) == len(flips) and flips, "no storage page was flipped"
    assert counters["sglang:prefetched_tokens_total"] > 0 and loaded_flips > 0, "no flipped page came back"
    assert all(v["kind"] == "kv_hash" and v.get("hicache") == "load" for v in log.violations), log.violations[:5]
    assert reported <= set(flips), "a violation no storage flip explains (a false alarm)"
    assert len(reported) == loaded_flips  # every flipped page that was loaded back, reported
    # the window hashes 16 bytes of layer 0's K: the rest was caught by the first read's full-row hash
    assert outside, "no flip outside the hashed window was loaded back"


@pytest.mark.e2e
@pytest.mark.skipif(installed_sglang() == "0.5.23" and os.environ.get("KVC_HICACHE_CONTAIN_0523_ALL") != "1",
                    reason="CI time: on sglang 0.5.23 by hand, KVC_HICACHE_CONTAIN_0523_ALL=1 (passed on 2026-11-30, "
                           "CPU, 49 s: 6 flipped pages reported, each at one load-back only, 2 readers aborted, 40 "
                           "storage keys poisoned, 14 later hits cut); CI runs 0.5.23's contain through "
                           "test_e2e_hicache's load-back case")
def test_contain_poisons_a_bad_storage_page_so_it_never_comes_back(tmp_path):
    """``contain`` + storage-page flips (at most ``FLIPS``): each flipped page loaded back is reported, its readers
    are contained, its node leaves the device and the host, and its storage keys are poisoned
    (``kv_canary_contain=evict ... storage_keys_poisoned=``): storage has no delete, so without them the next
    lookup would read the bad page back. Three passes: a reported page is never loaded back again."""
    env = {"SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB": "0.1", "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "0",
           "SGLANG_KV_CANARY_PERTURB_SEED": "7", "SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS": str(FLIPS)}
    if installed_sglang() == "0.5.23":  # contain with HiCache: sglang's Python tree core (per-node host drop)
        env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
    counters, log, srv, files, wall, results, logs = serve("contain", tmp_path, env=env, passes=3)
    flips = {(p["key"], p["page_slot"]) for p in log.perturbations if p["kv_canary_perturb"] == "storage_page"}
    evictions = [c for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "evict"]
    contained = {c["rid"] for c in parse_lines(log.text, CONTAIN_PREFIX) if c[CONTAIN_PREFIX] == "abort"}
    forwards = {}  # storage key -> the load-back forwards that reported it
    for v in log.violations:
        forwards.setdefault(v.get("storage_key"), set()).add(v["forward"])
    print(f"kv_canary_e2e_hicache_storage mode=contain device={e2e_device()} wall_s={wall:.0f} storage_page_flips="
          f"{len(flips)} violations={len(log.violations)} pages_reported={len(forwards)} evictions={len(evictions)} "
          f"storage_keys_poisoned={sum(int(c.get('storage_keys_poisoned', 0)) for c in evictions)} "
          f"contained_requests={len(contained)} failed={[r.failed for r in results]} "
          + " ".join(f"{k.split(':')[1]}={v:.0f}" for k, v in counters.items()) + " "
          + _stats(log, *STORAGE_STATS, "hicache_storage_keys_poisoned", "hicache_storage_hits_poisoned"))
    assert len(flips) == FLIPS and len(logs[0].perturbations) == FLIPS, "flips after the first pass"
    assert log.violations, "no flipped page was loaded back"
    assert all(v["kind"] == "kv_hash" and v.get("hicache") == "load" for v in log.violations), log.violations[:5]
    assert {(v.get("storage_key"), v.get("storage_page_slot")) for v in log.violations} <= flips  # no false alarm
    assert {v["rid"] for v in log.violations} <= contained  # every reader contained
    assert evictions and all(int(c.get("storage_keys_poisoned", 0)) > 0 for c in evictions), evictions[:5]
    assert log.last_stat("hicache_storage_hits_poisoned") > 0  # a later lookup stopped before a poisoned page
    # a contained page never comes back: each is reported at one load-back only
    assert all(len(f) == 1 for f in forwards.values()), forwards


@pytest.mark.e2e
@pytest.mark.skipif(os.environ.get("KVC_HICACHE_STORAGE_RESTART") != "1",
                    reason="CI time (three servers): by hand, KVC_HICACHE_STORAGE_RESTART=1 (passed on 2026-11-26, "
                           "CPU, 0.5.12: 720 pages read back after the restart, 0 violations; the other window: 36 "
                           "pages without records, 0 violations; 2026-11-30, CPU, 0.5.23: 708 pages read back, 0 "
                           "violations; the other window: 36 without records, 0 violations)")
def test_a_restarted_server_reads_the_records_and_another_window_reads_none(tmp_path):
    """The records survive a restart inside the page objects: a second server on the same storage directory reads
    the first one's pages with their records and verifies them; a third whose KV_HASH window differs reads them as
    pages without records (a miss, recomputed), never as corrupt."""
    storage = tmp_path / "storage"
    serve("raise", tmp_path, passes=1, storage=storage, name="first")
    _, again, *_ = serve("raise", tmp_path, passes=1, storage=storage, name="second")
    _, other, *_ = serve("raise", tmp_path, passes=1, storage=storage, name="other",
                         env={"SGLANG_KV_CANARY_KV_HASH_BYTES": "32"})
    print(f"kv_canary_e2e_hicache_storage restart: {_stats(again, *STORAGE_STATS)}; another window: "
          f"{_stats(other, *STORAGE_STATS)}")
    assert again.last_stat("hicache_storage_pages_got") > 0 and again.last_stat("slots_first_read") > 0
    assert again.last_stat("hicache_storage_pages_without_records") == 0
    assert other.last_stat("hicache_storage_pages_without_records") > 0
    assert other.last_stat("hicache_storage_pages_got") == 0
    for log in (again, other):
        assert log.violations == [] and log.last_stat("violations") == 0, log.violations[:5]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
