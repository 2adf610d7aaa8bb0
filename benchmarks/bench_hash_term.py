#!/usr/bin/env python3
"""What a FULL_HASH word term costs at memory speed: one read-only pass over a buffer of int32 words (1 GiB on a
GPU), each program summing its words' terms into an int64, with the term

* ``read``: the word itself (the read alone, the ceiling);
* ``mix32``: ``mix32(word ^ key_w)``, the term the canary hashes (``kernels/full_row.py``'s word loop, its keys
  advanced by one add a tile);
* ``linear``: ``word x (key_w | 1)`` in 64 bits, the cheaper term ``docs/design.md`` weighs for hashing inside
  attention ("every byte at every read").

The achieved read rate of each, against ``read``'s and the device's copy rate, says whether the term could ride
inside a bandwidth-bound kernel without slowing it. Each term runs at a few launch shapes (words per program step,
programs per SM, warps) and reports its best; every pass's sum is checked against the torch reference, so a
shape that computes the wrong term fails the run. CUDA-event medians of passes after an L2 flush
(``kernel_timing.Timer``).

    PYTHONPATH=$PWD/python python benchmarks/bench_hash_term.py --out hash_term.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD/python python benchmarks/bench_hash_term.py --smoke   # CPU: runs only
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TERMS = {"read": 0, "mix32": 1, "linear": 2}
GPU_SHAPES = ((1024, 4, 4), (2048, 4, 8), (4096, 8, 8), (4096, 4, 8))  # (words a step, programs per SM, warps)
SMOKE_SHAPES = ((256, 2, 4),)  # two programs: each steps its keys once


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="buffer size in MiB (default 1024)")
    p.add_argument("--iters", type=int, default=20, help="timed passes per term and shape (default 20)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, a tiny buffer: proves it runs")
    p.add_argument("--out", default="hash_term.json")
    args = p.parse_args(argv)
    if args.mib < 1 or args.iters < 1:
        p.error(f"--mib {args.mib} / --iters {args.iters}: both must be >= 1")
    return args


def build_kernel():
    """The term-sum kernel (imported late: ``--smoke`` sets the interpreter before Triton loads)."""
    import triton
    import triton.language as tl

    @triton.jit
    def term_sum_kernel(words, n_words, out, TERM: tl.constexpr, BLOCK: tl.constexpr, KEY: tl.constexpr,
                        M1: tl.constexpr, M2: tl.constexpr):
        """out += SUM over this program's words (steps of BLOCK, strided by the grid) of the TERM of each;
        ``n_words`` a multiple of BLOCK (no masks in the loop, as full_row's EVEN path). KEY, M1, M2: the
        fingerprint's word key and mix32 multipliers."""
        pid = tl.program_id(0)
        stride = tl.num_programs(0) * BLOCK
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.int64)
        key = (pid * BLOCK + cols + 1).to(tl.uint32) * KEY
        step = stride.to(tl.uint32) * KEY  # the next step's keys: one add a word (mod 2^32)
        for start in range(pid * BLOCK, n_words, stride):
            x = tl.load(words + start + cols).to(tl.uint32, bitcast=True)
            if TERM == 0:
                acc += x.to(tl.int64)
            elif TERM == 1:
                y = x ^ key
                y = y ^ (y >> 16)
                y = y * M1
                y = y ^ (y >> 15)
                y = y * M2
                acc += (y ^ (y >> 16)).to(tl.int64)
            else:
                acc += (x.to(tl.uint64) * (key | 1).to(tl.uint64)).to(tl.int64, bitcast=True)
            key += step
        tl.atomic_add(out, tl.sum(acc, axis=0), sem="relaxed")

    return term_sum_kernel


def reference_sum(torch, words, term: str) -> int:
    """The torch reference of one pass's sum (int64, wrapping)."""
    from kv_canary import fingerprint as fp

    x = words.to(torch.int64) & fp.MASK_32
    key = ((torch.arange(words.numel(), device=words.device, dtype=torch.int64) + 1) * fp.FULL_WORD_KEY) & fp.MASK_32
    if term == "read":
        t = x
    elif term == "mix32":
        t = fp.mix32(x ^ key)
    else:
        t = x * (key | 1)  # < 2^64 as unsigned; int64 multiplication wraps alike
    return int(t.sum())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kernel_timing import Timer, bench_device, device_info, measured_copy_gbps, nominal_hbm_gbps
    from kv_canary import fingerprint as fp

    device = bench_device(torch, args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else GPU_SHAPES
    unit = max(b for b, _, _ in shapes)
    n_words = (4 * unit if args.smoke else (args.mib << 20) // 4) // unit * unit
    words = torch.randint(-(1 << 31), 1 << 31, (n_words,), dtype=torch.int32, device=device)
    info = device_info(torch, device)
    sms = info["sms"] or 1
    kernel = build_kernel()
    timer = Timer(torch, device, 2 if args.smoke else args.iters, 1, use_graphs=True)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    results = {}
    for term, code in TERMS.items():
        want = reference_sum(torch, words, term)
        runs = []
        for block, per_sm, warps in shapes:
            grid = (min(sms * per_sm, n_words // block),)

            def one_pass():
                out.zero_()
                kernel[grid](words, n_words, out, TERM=code, BLOCK=block, KEY=fp.FULL_WORD_KEY, M1=fp.MIX32_M1,
                             M2=fp.MIX32_M2, num_warps=warps)

            one_pass()
            if int(out.item()) != want:
                raise SystemExit(f"{term} at {block} words x {grid[0]} programs: sum {int(out.item())} != reference "
                                 f"{want}")
            us = timer.cold_us(one_pass)
            runs.append({"block_words": block, "programs": grid[0], "warps": warps, "us": round(us, 2),
                         "read_gbps": round(n_words * 4 / us / 1e3, 1)})
        best = max(runs, key=lambda r: r["read_gbps"])
        results[term] = {"best_read_gbps": best["read_gbps"], "best": best, "runs": runs}
        print(f"{term:7s} best {best['read_gbps']:8.1f} GB/s read ({best})", flush=True)
    base = results["read"]["best_read_gbps"]
    for term in TERMS:
        results[term]["vs_read"] = round(results[term]["best_read_gbps"] / base, 3) if base else None
    copy = measured_copy_gbps(torch, device)
    report = {"device": info, "bytes": n_words * 4, "copy_gbps_read_plus_write": copy,
              "nominal_hbm_gbps": nominal_hbm_gbps(info["device_name"]), "terms": results,
              "timing": "one pass over the buffer after an L2 flush, CUDA graph replay, CUDA-event median"}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
