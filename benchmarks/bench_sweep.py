#!/usr/bin/env python3
"""Cost of one cache sweep (``--kv-canary-sweep-interval``), host and device, with no server.

Builds a real ``CanaryManager`` on a synthetic Llama-3-8B-row pool (``--slots`` slots,
K/V rows of 8 heads x 128 bf16), writes records for ``--held`` slots as sequences of
``--seq`` tokens (TAIL kernel, as prefill would), reports each sequence to the sweep's
cached-slot index as a radix node would (``CachedSlotIndex.add`` with the key's token
list), then times:

* ``apply_us``: host time of replaying those adds into the device index (one batch),
  measured while the device is busy with a ~100 ms sleep kernel: a host wait for the
  device inside the apply shows as ``apply_us`` near 100 ms and
  ``device_busy_after_apply_us`` near 0 (and torch's sync debug mode, set to "error"
  around the apply and the sweep, fails the run at the operation that waits);
* ``sweep_host_us``: host time of ``CanaryManager.sweep()`` with nothing pending
  (what every sweep pays on the scheduler's thread);
* ``sweep_device_us``: device time of the same, from CUDA events.

    export PYTHONPATH=$PWD/python
    python benchmarks/bench_sweep.py [--slots 131072] [--held 120000] [--seq 1280] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=131072)
    p.add_argument("--held", type=int, nargs="+", default=[0, 16384, 120000])
    p.add_argument("--seq", type=int, default=1280)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import logging

    import torch

    logging.getLogger("kv_canary").setLevel(logging.CRITICAL)
    from kv_canary import fingerprint as fp
    from kv_canary.adapter.batch_adapter import SglangBatchAdapter
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.config import CanaryConfig, CanaryMode
    from kv_canary.kernels import select_kernels
    from kv_canary.runner import CanaryManager
    from kv_canary.views import ForwardView, LaunchCapacities

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    n = args.slots
    k = [torch.randn(n, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.randn(n, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2)]
    config = CanaryConfig(mode=CanaryMode.LOG, sweep_interval=16)
    group = build_group(PoolLayout("full", k, v), config, device)
    seq = args.seq
    r2t = torch.zeros(2, seq, dtype=torch.int32, device=device)
    caps = LaunchCapacities(max_batch_size=2, max_context_len=seq, verify_programs_target=264 if on_gpu else 1)
    m = CanaryManager(config=config, groups=[group], kernels=select_kernels(config.kernel_backend, device),
                      req_to_token=r2t, capacities=caps,
                      batch_adapter=SglangBatchAdapter(max_batch_size=2, device=device), device=device)
    m.mark_init_finished()
    index = m.cache_index

    @contextlib.contextmanager
    def no_host_sync():
        """CUDA: any operation that waits for the device raises (torch's sync debug mode)."""
        if on_gpu:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode(0)

    results = []
    for held in args.held:
        m.counters[fp.C_SLOTS_SWEPT] = 0
        m.counters[fp.C_VIOLATIONS] = 0
        m.sweeps = 0
        index.clear()
        index.apply_pending()
        seqs = []
        for first in range(1, held + 1, seq):
            slots = torch.arange(first, min(first + seq, held + 1), device=device)
            tokens = torch.randint(1, 1000, (len(slots),)).tolist()
            view = ForwardView(
                input_ids=torch.tensor(tokens, device=device), positions=torch.arange(len(slots), device=device),
                out_cache_loc=slots, req_pool_indices=torch.ones(1, dtype=torch.int64, device=device),
                seq_lens=torch.tensor([len(slots)], device=device),
                new_starts=torch.zeros(1, dtype=torch.int64, device=device),
                new_lens=torch.tensor([len(slots)], device=device), batch_size=1, max_new_len=len(slots))
            m.kernels.write(group, view, r2t, m.counters, m.ring, False, check_fed=False)
            seqs.append((slots, tokens))
        sync()
        if on_gpu:  # keep the device busy (~100 ms): a host wait inside the apply would show as its time
            torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for slots, tokens in seqs:
            index.add(slots, tokens, 0, None)
        with no_host_sync():
            index.apply_pending()
        apply_us = (time.perf_counter() - t0) * 1e6
        t1 = time.perf_counter()
        sync()
        busy_left_us = (time.perf_counter() - t1) * 1e6
        for _ in range(5):
            m.sweep()
        sync()
        host, dev = [], []
        for _ in range(args.iters):
            if on_gpu:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            with no_host_sync():
                m.sweep()
            host.append((time.perf_counter() - t0) * 1e6)
            if on_gpu:
                b.record()
                b.synchronize()
                dev.append(a.elapsed_time(b) * 1e3)
        counters = m.counters.cpu()
        row = {"slots": n, "held": held, "nodes": len(seqs), "apply_us": round(apply_us, 1),
               "device_busy_after_apply_us": round(busy_left_us, 1) if on_gpu else None,
               "sweep_host_us": round(statistics.median(host), 1),
               "sweep_device_us": round(statistics.median(dev), 1) if dev else None,
               "slots_swept_per_sweep": int(counters[fp.C_SLOTS_SWEPT]) // max(1, m.sweeps),
               "violations": int(counters[fp.C_VIOLATIONS])}
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu (interpreter: meaningless)",
           "rows": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
