#!/usr/bin/env python3
"""Demo: a real sglang server on CPU (the line KVC_SGLANG picks: 0.5.23 by default, or 0.5.12) with the kv-canary on, a workload, and the result.

1. ``--kv-canary raise`` on the bundled tiny model: a mixed workload (shared
   prefixes, chunked prefill, aborts, eviction) -> slots fingerprinted and
   verified, zero violations.
2. ``--kv-canary log`` with ``SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB``: K/V
   bytes are flipped on purpose -> every injection is reported, and the server
   keeps serving.

Run it with ``bash scripts/demo.sh`` (sets up the environment first).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kv_canary_testing.canary_e2e import CanaryLog, canary_server
from kv_canary_testing.workload import build_workload, run_requests


def run_phase(title, mode, env, n_requests, log_dir: Path, device: str, extra_args=()):
    print(f"\n=== {title} ===", flush=True)
    srv = canary_server(mode, log_path=log_dir / f"{mode}.log", env=env, device=device, extra_args=extra_args)
    t0 = time.monotonic()
    with srv:
        print(f"server up on {srv.base_url} in {time.monotonic() - t0:.0f}s "
              f"(--kv-canary {mode}; log: {srv.log_path})", flush=True)
        result = run_requests(srv.base_url, build_workload(n_requests, seed=5, n_aborts=3), concurrency=8,
                              timeout=300)
        log = CanaryLog.read_settled(srv)
        alive = srv.is_running()
    print(f"workload: {result.summary()}")
    print(f"canary:   slots_written={log.last_stat('slots_written')} "
          f"slots_verified={log.last_stat('slots_verified')} "
          f"violations={len(log.violations)} server_still_serving={alive}")
    return result, log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kv-canary-demo-"))

    clean, clean_log = run_phase("clean run, --kv-canary raise", "raise", {}, args.requests, log_dir, args.device)
    perturb_env = {"SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.1",
                   "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "10"}
    # The flips land anywhere in a slot (any layer, K or V, any byte): hash every byte to catch them all.
    _, bad_log = run_phase("deliberate corruption, --kv-canary log --kv-canary-real-data all", "log", perturb_env,
                           args.requests, log_dir, args.device, extra_args=["--kv-canary-real-data", "all"])
    print("\ninjections (kv_canary_perturb=) and the first violation reported for each slot:")
    for p in bad_log.perturbations[:10]:
        hits = [v for v in bad_log.violations if v["slot"] == p["slot"] and int(v["forward"]) >= int(p["forward"])]
        first = f"kind={hits[0]['kind']} forward={hits[0]['forward']} rid={hits[0]['rid']}" if hits else "MISSED"
        print(f"  slot={p['slot']:>5} position={p['position']:>4} injected@forward={p['forward']:>4} -> {first}")
    missed = bad_log.unmatched_injections()
    ok = clean.failed == 0 and not clean_log.violations and bad_log.perturbations and not missed
    print(f"\nresult: clean run {'verified with 0 violations' if not clean_log.violations else 'HAD VIOLATIONS'}; "
          f"{len(bad_log.perturbations) - len(missed)}/{len(bad_log.perturbations)} injections detected. "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
