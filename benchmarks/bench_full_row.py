#!/usr/bin/env python3
"""Microbenchmark of full-byte verification (issue 22): the whole-row hash (``kernels/full_row.py``: split over
(slot block, row) programs, 32-bit per-word mix), no server. The first version's numbers (int64 per-word mix,
one slot tile for every launch) and the original one-program-per-slot kernels' are in
docs/results/gpu-h200-2026-11-25/bench_full_row.json.

Pool: the Llama-3-8B shape, every layer allocated (32 layers x K and V, 8 KV heads x 128 dims bf16: 128 KiB
per slot), slots shuffled over the pool. Only torch + triton + this repo's python are needed.

Rows printed (each a CUDA-graph replay after an L2 flush, median; see kernel_timing.Timer):

* ``tail_full``: TAIL (write kernel + FULL_HASH of the new slots) for decode bs1, bs64 and prefill bs8 x 8k:
  ``write`` (the write kernel alone, partial records) vs ``new`` (write + split hash; the program completing a
  slot finalizes it).
* ``head_all``: HEAD of one decode step of ``--kv-canary-real-data all`` at bs1 x 1k and bs64 x 1k.
  old: every byte of every read slot (the previous ``all``); new: the window + metadata of every read slot,
  plus every byte of the one slot per request the previous step wrote (its first read; the graph re-marks
  those slots unverified before each replay, so every replay does a steady-state step's work).
* ``scrub``: N slots per forward, N = 132 (every slot of a 131,072-slot pool within 993 forwards), 256, 1024, 4096.

Bytes verified per step counts the K/V bytes hashed; GB/s is that over the time (and % of nominal HBM).

    PYTHONPATH=$PWD/python python3 benchmarks/bench_full_row.py --out bench_full_row.json
    PYTHONPATH=$PWD/python python3 benchmarks/bench_kernels.py --full-row --out bench_full_row.json   # the same
    TRITON_INTERPRET=1 PYTHONPATH=$PWD/python python3 benchmarks/bench_full_row.py --smoke   # CPU: runs, no timings
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
SLOT_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, a tiny pool: proves it runs")
    p.add_argument("--pool-slots", type=int, default=0, help="pool slots (default: 70,000; smoke 400)")
    p.add_argument("--iters", type=int, default=0, help="timed replays (default 30; smoke 1)")
    p.add_argument("--scrub-slots", default="132,256,1024,4096")
    p.add_argument("--out", default="bench_full_row.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kernel_timing import Timer, device_info, graph_floor_us, measured_copy_gbps, nominal_hbm_gbps
    from kv_canary import fingerprint as fp
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.config import CanaryConfig, RealData
    from kv_canary.kernels import triton_kernels as tk
    from kv_canary.views import ForwardView

    device = torch.device("cpu" if args.smoke else "cuda")
    layers, heads, dim = (2, 2, 16) if args.smoke else (LAYERS, KV_HEADS, HEAD_DIM)
    slot_bytes = layers * 2 * heads * dim * 2
    n = args.pool_slots or (400 if args.smoke else 70_000)
    iters = args.iters or (1 if args.smoke else 30)
    shapes = ({"decode_bs1": (1, 16), "decode_bs64": (3, 16), "prefill_bs8x8k": (2, 64)} if args.smoke else
              {"decode_bs1": (1, 1024), "decode_bs64": (64, 1024), "prefill_bs8x8k": (8, 8192)})
    gen = torch.Generator(device=device).manual_seed(0)

    def buf():
        b = torch.empty((n, heads, dim), dtype=torch.bfloat16, device=device)
        b.view(torch.int16).random_(generator=gen)
        return b

    k, v = [buf() for _ in range(layers)], [buf() for _ in range(layers)]
    layout = PoolLayout("full", k, v)
    new = build_group(layout, CanaryConfig(real_data=RealData.ALL, scrub_slots_per_forward=256), device)
    partial = build_group(layout, CanaryConfig(), device)  # partial: the write kernel alone
    old_all = build_group(layout, CanaryConfig(kv_hash_layers=tuple(range(layers)), kv_hash_bytes=1 << 20), device)
    counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=device)
    counters[fp.C_REPORT_ENABLED] = 1
    ring = torch.zeros(4096, fp.RING_WIDTH, dtype=torch.int64, device=device)
    info = device_info(torch, device)
    hbm = nominal_hbm_gbps(info["device_name"])
    timer = Timer(torch, device, iters, 5, use_graphs=True)
    floor = graph_floor_us(torch, timer)
    print(f"device: {info['device_name']}  nominal HBM {hbm} GB/s  copy {measured_copy_gbps(torch, device)} GB/s  "
          f"graph floor {floor} µs  pool {n} slots x {slot_bytes} B", flush=True)
    perm = torch.randperm(n - 1, generator=gen, device=device) + 1
    results = []

    def row(name, shape, path, us, nbytes):
        gbps = nbytes / (us * 1e-6) / 1e9 if us and not args.smoke else None
        r = {"row": name, "shape": shape, "path": path, "us": round(us, 2), "bytes_verified": nbytes,
             "gbps": None if gbps is None else round(gbps, 1),
             "pct_hbm": None if gbps is None or not hbm else round(100 * gbps / hbm, 1)}
        results.append(r)
        print(f"{name:10} {shape:16} {path:4} {us:10.1f} µs  {nbytes / 1e6:10.1f} MB  "
              f"{'' if gbps is None else f'{gbps:8.0f} GB/s'}", flush=True)

    def view(bs, new_len, seq, slots):
        return ForwardView(
            input_ids=torch.ones(bs * new_len, dtype=torch.int64, device=device),
            positions=(torch.arange(new_len, device=device) + (seq - new_len)).repeat(bs),
            out_cache_loc=slots.to(torch.int64).contiguous(),
            req_pool_indices=torch.arange(bs, dtype=torch.int64, device=device),
            seq_lens=torch.full((bs,), seq, dtype=torch.int64, device=device),
            new_starts=torch.arange(bs, dtype=torch.int64, device=device) * new_len,
            new_lens=torch.full((bs,), new_len, dtype=torch.int64, device=device), batch_size=bs, max_new_len=new_len)

    # TAIL: FULL_HASH of the new slots (write kernel alone vs with the whole-row hash)
    for name, (bs, ctx) in shapes.items():
        new_len = ctx if name.startswith("prefill") else 1
        slots = perm[: bs * new_len]
        r2t = torch.zeros(bs, ctx + 1, dtype=torch.int32, device=device)
        tv = view(bs, new_len, new_len, slots)
        for path, group in (("write", partial), ("new", new)):
            fn = lambda g=group: tk.launch_write(g, tv, r2t, counters, ring, False, check_fed=False)  # noqa: E731
            row("tail_full", f"{name}", path, timer.cold_us(fn), bs * new_len * slot_bytes)

    # HEAD of `all`, one decode step
    for name in ("decode_bs1", "decode_bs64"):
        bs, ctx = shapes[name]
        slots = perm[: bs * (ctx + 1)].view(bs, ctx + 1)
        r2t = slots.to(torch.int32).contiguous()
        prefill = view(bs, ctx, ctx, slots[:, :ctx].reshape(-1))
        tk.launch_write(new, prefill, r2t, counters, ring, False, check_fed=False)
        tk.launch_write(old_all, prefill, r2t, counters, ring, False, check_fed=False)  # KV_HASH of every byte
        step = view(bs, 1, ctx + 1, slots[:, ctx])
        last_read = slots[:, ctx - 1].contiguous()
        programs = max(1, min(-(-ctx // 256), 2 * (info.get("sms") or 1) // bs))
        while int(new.full_row.tags[slots[:, :ctx].reshape(-1)].eq(0).sum()):  # the first reads after prefill
            tk.launch_verify(new, step, r2t, counters, ring, programs, 256)

        def head_new():
            new.full_row.tags.index_fill_(0, last_read, 0)  # as if the previous step's TAIL had written them
            tk.launch_verify(new, step, r2t, counters, ring, programs, 256)

        before = int(counters[fp.C_VIOLATIONS])
        row("head_all", name + "x1k", "new", timer.cold_us(head_new), bs * slot_bytes)
        row("head_all", name + "x1k", "old", timer.cold_us(
            lambda: tk.launch_verify(old_all, step, r2t, counters, ring, programs, 256)), bs * ctx * slot_bytes)
        if int(counters[fp.C_VIOLATIONS]) != before:
            raise SystemExit("head_all: a clean pool reported violations")

    # the scrub, N slots per forward
    for per_forward in (int(x) for x in args.scrub_slots.split(",")):
        per_forward = min(per_forward, n - 1)
        fn = lambda p=per_forward: tk.launch_scrub(new, counters, ring, p)  # noqa: E731
        row("scrub", f"{per_forward} slots", "new", timer.cold_us(fn), per_forward * slot_bytes)

    report = {"benchmark": "kv_canary full-row hashing (issue 22)", "date": dt.datetime.now(dt.timezone.utc)
              .isoformat(timespec="seconds"), "command": " ".join([sys.executable, *sys.argv]), "device": info,
              "nominal_hbm_gbps": hbm, "graph_floor_us": floor, "pool_slots": n, "slot_bytes": slot_bytes,
              "smoke_interpreter": args.smoke, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
