#!/usr/bin/env python3
"""CPU cost of the HiCache host scrub (``host_scrub.HostScrub``) per host slot, no server.

Builds a host pool of ``--slots`` slots with Llama-3-8B rows (32 layers x K and V x 8 heads x 128 dims x bf16 =
128 KiB a slot), records that match it, every slot landed, and times ``HostScrub.step`` over whole passes in this
thread. Reports µs per slot, host bytes hashed per second, and the share of one core the scrub thread takes at
``SGLANG_KV_CANARY_HOST_SCRUB_SLOTS_PER_SECOND`` = 1,024 and 8,192 (its cost on the scheduler process; the serving
overhead on a GPU is a separate row).

    python benchmarks/bench_host_scrub.py [--slots 4096] [--out F]
"""

from __future__ import annotations

import argparse
import platform
import time

from bench_output import emit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--row-bytes", type=int, default=2048, help="one layer's K (or V) row: heads x dim x 2")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import numpy as np

    from kv_canary import fingerprint as fp
    from kv_canary.host_scrub import CHUNK, HostScrub

    rng = np.random.default_rng(0)
    words = args.row_bytes // 4
    rows = [rng.integers(0, 1 << 32, size=(args.slots, words), dtype=np.uint32) for _ in range(2 * args.layers)]
    sums = np.zeros(args.slots, dtype=np.uint64)
    for k, r in enumerate(rows):
        sums += fp.full_hash_terms_np(r, k * words)
    records = np.zeros((args.slots, fp.RECORD_WIDTH), dtype=np.int64)
    records[:, fp.F_FULL_HASH] = fp.full_hash_finalize_np(sums)
    scrub = HostScrub(rows, lambda idx: records[idx], slots_per_second=1 << 24)
    scrub.backup_landed(np.arange(args.slots))
    steps = -(-args.slots // CHUNK) * args.passes
    t0 = time.perf_counter()
    for _ in range(steps):
        scrub.step()
    dt = time.perf_counter() - t0
    us_per_slot = dt / (args.slots * args.passes) * 1e6
    slot_bytes = 2 * args.layers * args.row_bytes
    result = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "slots": args.slots,
              "slot_bytes": slot_bytes, "chunk": CHUNK, "passes": args.passes,
              "us_per_slot": round(us_per_slot, 2),
              "host_gb_per_s_hashed": round(slot_bytes / (us_per_slot * 1e-6) / 1e9, 2),
              "core_share_at_1024_per_s": round(1024 * us_per_slot * 1e-6, 4),
              "core_share_at_8192_per_s": round(8192 * us_per_slot * 1e-6, 4),
              "found": len(scrub.drain()), "scrubbed": scrub.slots_scrubbed}
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
