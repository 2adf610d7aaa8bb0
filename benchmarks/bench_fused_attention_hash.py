#!/usr/bin/env python3
"""What hashing every byte at every read would cost inside attention (docs/design.md, "every byte at every read"):
one layer of a decode attention kernel (GQA, 32 query heads over 8 KV heads of 128 dims, bf16, slots gathered
through ``req_to_token``, split over the context as sglang's Triton decode kernel splits it, its dot products on
tensor cores), timed as it is and with each K and V word's hash term added where the kernel has just loaded it:

* ``none``: attention alone;
* ``mix32``: ``mix32(word ^ key_w)``, the canary's term, summed per read lane (request, position) into an int64;
* ``linear``: ``word x (key_w | 1)`` in 64 bits, the cheaper term.

The lane sums land with one atomic add per lane and KV head: a check after the last layer would mix and compare
them. This kernel is the project's own, written for the measurement (not sglang's); it is checked against a torch
reference (the output within bf16 tolerance, every lane's sum exactly) before it is timed. CUDA-event medians after
an L2 flush (``kernel_timing.Timer``); each variant against ``none`` of the same case.

    PYTHONPATH=$PWD/python python benchmarks/bench_fused_attention_hash.py --out fused_attention_hash.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD/python python benchmarks/bench_fused_attention_hash.py --smoke  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HASHES = {"none": 0, "mix32": 1, "linear": 2}
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
BLOCK_N, BLOCK_H = 32, 16  # positions a step; query heads a program (tl.dot needs 16 rows: 4 real, as sglang pads)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x4096,16x2048,64x1024,64x4096", help="BSxCTX decode cases")
    p.add_argument("--splits", type=int, default=16, help="KV splits per request (sglang's default max: 16)")
    p.add_argument("--iters", type=int, default=50, help="timed replays per variant (default 50)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: proves it runs")
    p.add_argument("--out", default="fused_attention_hash.json")
    args = p.parse_args(argv)
    try:
        args.case_list = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    except ValueError:
        p.error(f"--cases: expected BSxCTX[,BSxCTX...], got {args.cases!r}")
    if args.splits < 1 or any(len(c) != 2 or min(c) < 1 for c in args.case_list):
        p.error(f"--cases {args.cases} / --splits {args.splits}: sizes must be >= 1")
    return args


def reference(torch, fp, q, k_buf, v_buf, r2t, sm_scale):
    """(out float32[bs, H, D], lane sums per hash int64[bs, ctx]) in torch: the kernels' definitions."""
    bs, ctx = r2t.shape
    group = Q_HEADS // KV_HEADS
    slots = r2t.long()
    k, v = k_buf[slots].float(), v_buf[slots].float()  # [bs, ctx, KVH, D]
    kh = k.repeat_interleave(group, dim=2)  # [bs, ctx, H, D]
    vh = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bchd->bhc", q.float(), kh) * sm_scale
    out = torch.einsum("bhc,bchd->bhd", scores.softmax(-1), vh)
    words = {n: b[slots].view(torch.int32).to(torch.int64) & fp.MASK_32 for n, b in (("k", k_buf), ("v", v_buf))}
    half = HEAD_DIM // 2
    w = torch.arange(half, device=q.device, dtype=torch.int64)
    sums = {}
    for name, code in HASHES.items():
        total = torch.zeros((bs, ctx), dtype=torch.int64, device=q.device)
        for h in range(KV_HEADS if code else 0):
            for j, part in enumerate(("k", "v")):
                key = ((h * 2 * half + j * half + w + 1) * fp.FULL_WORD_KEY) & fp.MASK_32
                x = words[part][:, :, h, :]
                total += (fp.mix32(x ^ key) if code == 1 else x * (key | 1)).sum(-1)
        sums[name] = total
    return out, sums


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kernel_timing import Timer, bench_device, device_info
    from kv_canary import fingerprint as fp

    device = bench_device(torch, args.smoke)
    cases, splits = ([(2, 40)], 2) if args.smoke else (args.case_list, args.splits)
    if splits & (splits - 1):
        raise SystemExit(f"--splits {splits}: a power of two (the merge's lanes)")
    from fused_attention_kernels import stage1, stage2
    timer = Timer(torch, device, 1 if args.smoke else args.iters, 1, use_graphs=True)
    gen = torch.Generator(device=device).manual_seed(0)
    sm_scale = HEAD_DIM ** -0.5
    results = []
    for bs, ctx in cases:
        pool = bs * ctx + 1
        k_buf, v_buf = (torch.randn((pool, KV_HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
                        for _ in range(2))
        q = torch.randn((bs, Q_HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
        r2t = (1 + torch.randperm(bs * ctx, generator=gen, device=device)).to(torch.int32).view(bs, ctx)
        split_len = -(-(-(-ctx // splits)) // BLOCK_N) * BLOCK_N
        part_o = torch.empty((bs * Q_HEADS * splits, HEAD_DIM), dtype=torch.float32, device=device)
        part_lse = torch.empty(bs * Q_HEADS * splits, dtype=torch.float32, device=device)
        out = torch.empty((bs, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
        lane = torch.zeros((bs, ctx), dtype=torch.int64, device=device)
        want_out, want_sums = reference(torch, fp, q, k_buf, v_buf, r2t, sm_scale)
        row = {"bs": bs, "ctx": ctx, "splits": splits, "kv_bytes_per_layer": 2 * bs * ctx * KV_HEADS * HEAD_DIM * 2}
        for name, code in HASHES.items():
            def attend(code=code):
                lane.zero_()
                stage1[(bs, KV_HEADS, splits)](q, k_buf, v_buf, r2t, ctx, part_o, part_lse, lane, sm_scale, split_len,
                                               HASH=code, KEY=fp.FULL_WORD_KEY, M1=fp.MIX32_M1, M2=fp.MIX32_M2,
                                               GROUP=Q_HEADS // KV_HEADS, KVH=KV_HEADS, D=HEAD_DIM, BN=BLOCK_N,
                                               BH=BLOCK_H, DOT_F32=args.smoke, num_warps=4)
                stage2[(bs * Q_HEADS,)](part_o, part_lse, out, NSPLIT=splits, D=HEAD_DIM)

            attend()
            err = (out.float() - want_out).abs().max().item()
            if err > 0.05 or not torch.equal(lane, want_sums[name]):
                raise SystemExit(f"{name} at bs={bs} ctx={ctx}: output off by {err:.3g} or its lane sums differ "
                                 "from the torch reference")
            row[f"{name}_us"] = round(timer.cold_us(attend), 2)
        for name in HASHES:
            row[f"{name}_vs_none_pct"] = round((row[f"{name}_us"] / row["none_us"] - 1) * 100, 1)
        if device.type == "cuda":
            row["none_read_gbps"] = round(row["kv_bytes_per_layer"] / row["none_us"] / 1e3, 1)
        results.append(row)
        print(row, flush=True)
    report = {"device": device_info(torch, device), "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "block_n": BLOCK_N, "block_h": BLOCK_H}, "results": results,
              "timing": "one layer's two attention launches after an L2 flush, CUDA graph replay, CUDA-event median"}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
