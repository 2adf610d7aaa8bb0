#!/usr/bin/env python3
"""Launch-shape sweep of the whole-row hash kernel (issue 22; GPU only): slot tile SB, word tile WT, rows per
program and warps for the scrub (256 / 4,096 slots), a decode bs64 TAIL and a prefill 8 x 8k TAIL, on a
70,000-slot Llama-3-8B pool; each the hash launch alone (no finalize), a CUDA-graph replay after an L2 flush.
``kernels/full_row.py``'s GPU_SHAPE comes from its result
(docs/results/gpu-h100-2026-11-25-issue22/sweep_full_row_tiles.json: that run also swept a per-step reduction
against the tile accumulation now built in, the ``acc2`` field).

    PYTHONPATH=$PWD/python python3 scripts/sweep_full_row_tiles.py    # sweep.json into $OUT or .
"""
import itertools, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, triton
from kernel_timing import Timer
from kv_canary import fingerprint as fp
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig, RealData
from kv_canary.kernels import full_row as fr
from kv_canary.views import ForwardView

dev = torch.device("cuda")
n, layers = 70000, 32
gen = torch.Generator(device=dev).manual_seed(0)
def buf():
    b = torch.empty((n, 8, 128), dtype=torch.bfloat16, device=dev); b.view(torch.int16).random_(generator=gen); return b
k, v = [buf() for _ in range(layers)], [buf() for _ in range(layers)]
g = build_group(PoolLayout("full", k, v), CanaryConfig(real_data=RealData.ALL, scrub_slots_per_forward=256), dev)
g.records[:, fp.F_CHAIN] = 1
counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=dev)
timer = Timer(torch, dev, 20, 5, use_graphs=True)
st = g.full_row
perm = torch.randperm(n - 1, generator=gen, device=dev) + 1
out = []
def tail_view(bs, new_len):
    slots = perm[: bs * new_len]
    return ForwardView(input_ids=torch.ones(bs * new_len, dtype=torch.int64, device=dev),
        positions=torch.arange(new_len, device=dev).repeat(bs), out_cache_loc=slots.to(torch.int64).contiguous(),
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=dev), seq_lens=torch.full((bs,), new_len, dtype=torch.int64, device=dev),
        new_starts=torch.arange(bs, dtype=torch.int64, device=dev) * new_len, new_lens=torch.full((bs,), new_len, dtype=torch.int64, device=dev),
        batch_size=bs, max_new_len=new_len)
def run(case, mode, lanes, sb, wt, rpp, warps, view=None, grid0=None):
    chunks = triton.cdiv(64, rpp)
    if mode == fr.SCRUB:
        grid = (min(grid0 or 64, triton.cdiv(lanes, sb)), chunks, 1)
        loc = (counters,) * 3
    else:
        splits = max(1, min(triton.cdiv(view.max_new_len, sb), 4096 // (view.batch_size * chunks)))
        grid = (view.batch_size, chunks, splits)
        loc = (view.out_cache_loc, view.new_starts, view.new_lens)
    def fn():
        fr.row_hash_kernel[grid](st.acc, g.full_base, g.full_table, 64, rpp, g.records, g.num_slots, counters, lanes,
            st.work, st.work_state, st.work.shape[0], *loc, g.records, 0, counters, 1, MODE=mode,
            TRANSLATE=False, SB=sb, WT=wt, FUSED=False, GROUP_BITS=0, FBLOCK=128, num_warps=warps)
    try:
        us = timer.cold_us(fn)
    except Exception as e:
        print(case, sb, wt, rpp, warps, "ERR", str(e)[:80], flush=True); return
    gb = lanes * 131072 / us / 1e3
    r = dict(case=case, sb=sb, wt=wt, rpp=rpp, warps=warps, grid0=grid0, us=round(us, 1), gbps=round(gb))
    out.append(r); print(json.dumps(r), flush=True)
t0 = time.time()
for lanes in (256, 4096):
    for sb, wt, rpp, warps in itertools.product((2, 4, 8, 16), (128, 256, 512), (1, 2, 4), (4, 8)):
        if sb * wt > 4096 or sb * wt < 512: continue
        if time.time() - t0 > 250: break
        run(f"scrub{lanes}", fr.SCRUB, lanes, sb, wt, rpp, warps, grid0=64 if lanes == 256 else 128)
for case, bs, nl in (("tail_bs64", 64, 1), ("tail_prefill8x8k", 8, 8192)):
    view = tail_view(bs, nl)
    for sb, wt, rpp, warps in itertools.product((1, 4, 8, 16), (256, 512), (1, 2, 4), (4, 8)):
        if nl == 1 and sb != 1: continue
        if nl > 1 and sb == 1: continue
        if sb * wt > 4096: continue
        if time.time() - t0 > 400: break
        run(case, fr.TAIL, bs * nl, sb, wt, rpp, warps, view=view)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w"), indent=1)
for case in sorted({r["case"] for r in out}):
    best = sorted((r for r in out if r["case"] == case), key=lambda r: r["us"])[:5]
    print("BEST", case, [(r["sb"], r["wt"], r["rpp"], r["warps"], r["us"], r["gbps"]) for r in best])
