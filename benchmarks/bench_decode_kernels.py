#!/usr/bin/env python3
"""The canary's kernels of one decode forward, as the HiCache row runs them (no server): HEAD and TAIL timed.

Builds a Llama-3-8B-shaped pool (32 layers, K and V rows of 8 heads x 128 dims bf16, every layer allocated:
the TAIL's whole-row hash and the witness read all of them), fingerprints ``ctx`` cached slots per request
with the real TAIL kernels (prefill), then captures one decode forward's HEAD
(``SingleForwardManager.pre_ops_maybe_inside_graph``: verify, the first-read LIST, the witness stamp) and
TAIL (``post_ops_maybe_inside_graph``: the witness check, the write, the whole-row hash) in two CUDA graphs,
as the server's decode graphs hold them. Between them a third graph stores the new token's K/V rows (the
"attention"); it is not timed. Each timed replay follows an L2 flush (as after the model's layers), CUDA
events, median of ``--iters``. The profiler then gives each kernel's mean duration over the same replays (a kernel
launched k times a step also per launch, ``name[j]`` in step order). Reported besides: the slots each step hashed in
full per path (first read, scrub, written; the canary's counters) and the device's copy rate (GB/s read), for scale.

First reads (``all``): steady decode by default, the prefill's slots already verified, so a step's first reads are
the ``bs`` slots the step before wrote (the untimed store graph marks each prefix's last slot unverified again);
``--prefill-backlog``: the prefill's slots left unverified, the timed steps
draining them at the list's capacity (every run before 2026-11-30f).

``--shared-prefix N``: every request's first N positions are one copy of slots (written once), as the overhead
bench's ``shared_prefix`` row reads them (``--cases 64x4160 --shared-prefix 4096``): HEAD then verifies the same
slot once per reader.

The canary's settings are the server's (``CanaryConfig.build``, default ``--kv-canary raise`` with
``--enable-hierarchical-cache``; ``--canary-env`` overrides). Every timed step must stay clean: the script
fails on any violation, and checks that HEAD verified every cached slot.

    PYTHONPATH=$PWD/python python benchmarks/bench_decode_kernels.py --out decode_kernels.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD/python python benchmarks/bench_decode_kernels.py --smoke   # CPU: runs only
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time

from decode_lm_head import time_lm_head

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
L2_FLUSH_BYTES = 512 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="48x2048,16x1024,1x512",
                   help="comma-separated BSxCTX decode cases (default 48x2048,16x1024,1x512)")
    p.add_argument("--pool-slots", type=int, default=131072, help="slots in the pool (default 131072)")
    p.add_argument("--iters", type=int, default=200, help="timed replays per graph (default 200)")
    p.add_argument("--canary-env", action="append", default=[], metavar="SGLANG_KV_CANARY_X=V")
    p.add_argument("--no-hicache", action="store_true", help="the canary's settings without HiCache")
    p.add_argument("--real-data", default="partial", choices=("none", "partial", "all"),
                   help="--kv-canary-real-data of the canary's settings (default partial; all: every byte at a "
                        "slot's first read, and the scrub)")
    p.add_argument("--prefill-backlog", action="store_true",
                   help="leave the prefill's slots unverified, so the timed steps drain their first reads (as "
                        "right after a prefill; every run before 2026-11-30f); default: steady decode, the prefill's "
                        "slots already verified and each step's first reads the slots the step before wrote")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every request's first N positions read the same slots (a shared system prompt, the "
                        "overhead bench's shared_prefix row: --cases 64x4160 --shared-prefix 4096); N < every ctx")
    p.add_argument("--label", default="", help="a name for this run in the json")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: proves it runs")
    p.add_argument("--lm-head", type=int, default=0, metavar="VOCAB",
                   help="also time the step with the model's last GEMM (hidden 4096 x VOCAB bf16, e.g. 128256): "
                        "TAIL after it (today) and TAIL on a side stream beside it (fork/join inside the graph)")
    p.add_argument("--full-row-shape", action="append", default=[], metavar="FIELD=N[,N,N]",
                   help="a field of kernels.full_row.SHAPE replaced (launch-shape sweeps), e.g. "
                        "persistent_programs=0,128,16 or target_programs=1024")
    p.add_argument("--out", default="decode_kernels.json")
    args = p.parse_args(argv)
    args.shape = {}
    for pair in args.full_row_shape:
        key, sep, value = pair.partition("=")
        nums = tuple(int(v) for v in value.split(",") if v.strip().isdigit())
        if not sep or not nums or len(nums) != len(value.split(",")):
            p.error(f"--full-row-shape expects FIELD=N or FIELD=N,N,N (non-negative integers), got {pair!r}")
        args.shape[key] = nums[0] if len(nums) == 1 else nums
    args.case_list = []
    for item in args.cases.split(","):
        bs, _, ctx = item.partition("x")
        try:
            args.case_list.append((int(bs), int(ctx)))
        except ValueError:
            p.error(f"--cases: expected BSxCTX, got {item!r}")
    if args.shared_prefix < 0 or any(args.shared_prefix >= ctx for _, ctx in args.case_list):
        p.error(f"--shared-prefix {args.shared_prefix}: must be >= 0 and below every case's ctx ({args.cases})")
    env = {}
    for pair in args.canary_env:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("SGLANG_KV_CANARY_"):
            p.error(f"--canary-env expects SGLANG_KV_CANARY_NAME=VALUE, got {pair!r}")
        env[key] = value
    args.environ = env
    return args


class DecodeRig:
    """A pool, its records after a prefill of ``bs`` x ``ctx`` tokens, and the decode step's three graphs."""

    def __init__(self, torch, device, bs, ctx, args, layers, heads, dim, pool_slots):
        from kv_canary import fingerprint as fp
        from kv_canary.buffer_groups import PoolLayout, build_group
        from kv_canary.config import CanaryConfig, KernelBackend
        from kv_canary.kernels import select_kernels
        from kv_canary.runner import SingleForwardManager
        from kv_canary.token_oracle import TokenOracle
        from kv_canary.views import ForwardView, LaunchCapacities

        self.torch, self.fp, self.bs, self.ctx = torch, fp, bs, ctx
        self.config = CanaryConfig.build(mode="raise", real_data=args.real_data, environ=args.environ,
                                         hicache=not args.no_hicache)
        gen = torch.Generator(device=device).manual_seed(0)
        n = pool_slots
        if n < bs * (ctx + 1) + 1:
            raise SystemExit(f"--pool-slots {n} < the {bs * (ctx + 1) + 1} slots of bs={bs} ctx={ctx}")

        def buf():
            b = torch.empty((n, heads, dim), dtype=torch.bfloat16, device=device)
            b.view(torch.int16).random_(-2 ** 14, 2 ** 14, generator=gen)  # no NaN pattern: never a stamp
            return b

        self.k = [buf() for _ in range(layers)]
        self.v = [buf() for _ in range(layers)]
        self.slot_bytes = 2 * layers * heads * dim * 2  # K and V rows of every layer, bf16
        self.group = build_group(PoolLayout("full", self.k, self.v), self.config, device)
        slots = (torch.randperm(n - 1, generator=gen, device=device) + 1)[: bs * (ctx + 1)].view(bs, ctx + 1)
        width = ctx + 1
        r2t = torch.zeros((bs + 1, width), dtype=torch.int32, device=device)
        rows = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
        shared = min(args.shared_prefix, ctx - 1)
        slots[1:, :shared] = slots[0, :shared]  # one copy of the shared prefix, read by every request
        r2t[1:] = slots.to(torch.int32)
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=device)
        self.counters[fp.C_REPORT_ENABLED] = 1
        ring = torch.zeros((self.config.ring_capacity, fp.RING_WIDTH), dtype=torch.int64, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        capacities = LaunchCapacities(max_batch_size=bs + 1, max_context_len=width,
                                      verify_programs_target=2 * sms if sms else 1)
        kernels = select_kernels(KernelBackend.TRITON, device)

        def oracle():
            return (TokenOracle(rows=bs + 1, max_batch_size=bs + 1, max_tokens_per_forward=bs * ctx, device=device,
                                verify_reads=self.config.verify_tokens, check_fed=self.config.write_input_assert)
                    if self.config.uses_token_oracle else None)

        def manager(o):
            return SingleForwardManager(
                index=0, groups=[self.group], kernels=kernels, req_to_token=r2t, counters=self.counters,
                ring=ring, capacities=capacities, on_tail=lambda: None, token_oracle=o,
                scrub_slots_per_forward=self.config.scrub_slots_per_forward, check_fed=False,
                write_witness=self.config.write_witness)

        # HEAD and TAIL of the replayed step each see a clean oracle (the step repeats at the same positions)
        self.head_mgr, self.tail_mgr = manager(oracle()), manager(oracle())
        ids = torch.randint(1, 128000, (bs * ctx + bs,), generator=gen, device=device)

        def prefill(first, last, start):  # requests [first, last) write positions [start, ctx) of their rows
            m, n = last - first, ctx - start
            return ForwardView(
                input_ids=ids[: m * n], positions=torch.arange(start, ctx, device=device).repeat(m),
                out_cache_loc=slots[first:last, start:ctx].reshape(-1).contiguous(),
                req_pool_indices=rows[first:last], seq_lens=torch.full((m,), ctx, device=device),
                new_starts=torch.arange(m, device=device) * n, new_lens=torch.full((m,), n, device=device),
                batch_size=m, max_new_len=n)

        # with a shared prefix: request 0 writes it, then the others write their own tokens after it
        for first, last, start in ((0, bs, 0),) if not shared else ((0, 1, 0), (1, bs, shared)):
            if first < last:
                kernels.write(self.group, prefill(first, last, start), r2t, self.counters, ring, True,
                              check_fed=False)
        if self.group.full_row is not None and not args.prefill_backlog:
            # steady decode: the prefill's slots had their first read long ago (their tag is the FULL_HASH it
            # verified); each timed step's first reads are the slots the step before wrote (its TAIL clears them)
            cached = slots[:, :ctx].reshape(-1).unique()
            self.group.full_row.tags[cached] = self.group.records[cached, fp.F_FULL_HASH]
            # the step repeats at one position, so the slot it writes is never in its own prefix: the untimed store
            # graph marks the prefix's last slot unverified again, the slot the step before would have written
            self.relisted = slots[:, ctx - 1].contiguous()
        else:
            self.relisted = None
        for mgr in (self.head_mgr, self.tail_mgr):
            if mgr._oracle is not None:
                mgr._oracle.row_chain[rows] = self.group.records[slots[:, ctx - 1], fp.F_CHAIN]
                mgr._oracle.next_token[rows] = ids[bs * ctx:]
        self.view = ForwardView(
            input_ids=ids[bs * ctx:], positions=torch.full((bs,), ctx, device=device),
            out_cache_loc=slots[:, ctx].contiguous(), req_pool_indices=rows,
            seq_lens=torch.full((bs,), ctx + 1, device=device), new_starts=torch.arange(bs, device=device),
            new_lens=torch.ones(bs, dtype=torch.int64, device=device), batch_size=bs, max_new_len=1)
        self.new_rows = [torch.randint(-2 ** 14, 2 ** 14, (bs, heads, dim), generator=gen, device=device,
                                       dtype=torch.int16).view(torch.bfloat16) for _ in range(2 * layers)]

    def head(self):
        self.head_mgr.pre_ops_maybe_inside_graph(self.view)

    def store(self):
        for i, b in enumerate(self.k + self.v):
            b[self.view.out_cache_loc] = self.new_rows[i]
        if self.relisted is not None:
            self.group.full_row.tags.index_fill_(0, self.relisted, 0)  # graph-capturable: no host scalar copy

    def tail(self):
        self.tail_mgr.post_ops_maybe_inside_graph(self.view)

    def step(self):
        self.head()
        self.store()
        self.tail()

    def check(self, steps_before):
        """No violation; the decode slots' FULL_HASH is the torch reference's (a TAIL that raced would differ);
        returns the slots verified since ``steps_before``."""
        fp = self.fp
        c = self.counters.tolist()
        if c[fp.C_VIOLATIONS]:
            raise SystemExit(f"bs={self.bs} ctx={self.ctx}: {c[fp.C_VIOLATIONS]} violation(s) in a clean step")
        if self.group.full_row is not None:
            slots = self.view.out_cache_loc
            want = fp.full_hash_from_words(self.group.all_words(slots))
            if not self.torch.equal(self.group.records[slots, fp.F_FULL_HASH], want):
                raise SystemExit(f"bs={self.bs} ctx={self.ctx}: the TAIL's FULL_HASH differs from the reference")
            if int(self.group.full_row.acc.abs().sum()) or int(self.group.full_row.work_state.abs().sum()):
                raise SystemExit(f"bs={self.bs} ctx={self.ctx}: the whole-row state is not left zeroed")
        return c[fp.C_SLOTS_VERIFIED] - steps_before


def time_case(torch, device, rig, iters):
    """Cold HEAD / TAIL µs (CUDA graphs, L2 flushed before each), or wall clock in the interpreter."""
    fp = rig.fp
    before = int(rig.counters[fp.C_SLOTS_VERIFIED])
    rig.step()  # compile and warm up, eager; must verify every cached slot
    verified = rig.check(before)
    if verified != rig.bs * rig.ctx:
        raise SystemExit(f"bs={rig.bs} ctx={rig.ctx}: HEAD verified {verified} slots, expected {rig.bs * rig.ctx}")
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            rig.step()
        rig.check(0)
        return {"step_wall_ms": round((time.perf_counter() - t0) * 1e3 / iters, 2)}, {}
    graphs = {}
    torch.cuda.synchronize()
    for name in ("head", "store", "tail"):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            getattr(rig, name)()
        graphs[name] = g
    torch.cuda.synchronize()
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    ev = {k: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
          for k in ("head", "tail")}
    counted = rig.counters.tolist()
    for i in range(iters):
        for name in ("head", "store", "tail"):
            if name != "store":
                flush.zero_()
                ev[name][i][0].record()
            graphs[name].replay()
            if name != "store":
                ev[name][i][1].record()
    torch.cuda.synchronize()
    rig.check(0)
    out = {f"{k}_us": round(statistics.median(s.elapsed_time(e) for s, e in ev[k]) * 1e3, 2) for k in ev}
    # the mean too (a step whose cost varies between replays: the median alone hides it)
    out.update({f"{k}_mean_us": round(statistics.mean(s.elapsed_time(e) for s, e in ev[k]) * 1e3, 2) for k in ev})
    out["forward_us"] = round(out["head_us"] + out["tail_us"], 2)
    out.update(bytes_per_step(rig, counted, iters))
    kernels = {}
    try:  # each kernel's mean device time over profiled replays (no flush: the profile's own numbers are hot)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                for name in ("head", "store", "tail"):
                    graphs[name].replay()
            torch.cuda.synchronize()
        per = collections.defaultdict(list)
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            if "CUDA" in str(e.device_type) and "index" not in e.name and "elementwise" not in e.name:
                per[e.name].append(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0))
        kernels = {}
        for name, v in sorted(per.items()):
            kernels[name] = {"launches_per_step": len(v) / 50, "mean_us": round(statistics.mean(v), 2)}
            k = len(v) // 50
            if k > 1 and len(v) == 50 * k:  # a kernel launched k times a step: each launch's mean, in step order
                for j in range(k):
                    kernels[f"{name}[{j}]"] = {"launches_per_step": 1, "mean_us": round(statistics.mean(v[j::k]), 2)}
    except Exception as exc:  # the timings above stand without the breakdown
        kernels = {"profiler_error": {"launches_per_step": 0, "mean_us": 0.0, "error": repr(exc)[:200]}}
    rig.check(0)
    return out, kernels


def bytes_per_step(rig, before, iters):
    """Slots and K/V bytes a timed step hashed in full, per path (from the canary's counters over the timed
    replays): the first reads (``all``), the scrub, and the TAIL's whole-row hash of the slots written (``all``)."""
    fp = rig.fp
    after = rig.counters.tolist()
    per = {name: (after[c] - before[c]) // iters for name, c in (
        ("first_read", fp.C_SLOTS_FIRST_READ), ("scrub", fp.C_SLOTS_SCRUBBED), ("written", fp.C_SLOTS_WRITTEN))}
    if rig.group.full_row is None:
        per["written"] = 0  # partial: the TAIL hashes 16 bytes of layer 0, not the row
    slot_bytes = rig.slot_bytes
    return {"slot_bytes": slot_bytes, "full_row_slots_per_step": per,
            "full_row_mib_per_step": round(sum(per.values()) * slot_bytes / 2 ** 20, 2)}


def copy_bandwidth(torch, device, mib=1024, iters=20):
    """Device-to-device copy of ``mib`` MiB: GB/s of bytes read (the hash reads each byte once, writes nothing)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return round((mib << 20) / statistics.median(times) / 1e9, 1)


def shape_override(shape, fields):
    """``shape`` (a ``full_row.LaunchShape``) with ``fields`` replaced; an unknown field, or a value whose arity is
    not the field's (an int, or one per mode), exits naming the flag."""
    for key, value in fields.items():
        old = getattr(shape, key, None)
        if old is None or len(old if isinstance(old, tuple) else (old,)) != len(value if isinstance(value, tuple)
                                                                              else (value,)):
            names = ", ".join(f"{f.name} ({getattr(shape, f.name)!r})" for f in dataclasses.fields(shape))
            raise SystemExit(f"--full-row-shape {key}: expected one of {names}, with that value's arity")
    return dataclasses.replace(shape, **fields)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from kv_canary.kernels import full_row

    before = full_row.SHAPE
    full_row.SHAPE = shape_override(before, args.shape)
    try:
        return _run(args, full_row.SHAPE)
    finally:
        full_row.SHAPE = before


def _run(args, shape):
    import torch

    if args.smoke:
        device, layers, heads, dim, pool = torch.device("cpu"), 2, 2, 16, 256
        cases, iters = [(2, 8), (1, 5)], 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke on CPU")
        device, layers, heads, dim, pool = torch.device("cuda"), LAYERS, KV_HEADS, HEAD_DIM, args.pool_slots
        cases, iters = args.case_list, args.iters
    results = []
    for bs, ctx in cases:
        rig = DecodeRig(torch, device, bs, ctx, args, layers, heads, dim, pool)
        times, kernels = time_case(torch, device, rig, iters)
        if args.lm_head and device.type == "cuda":
            times.update(time_lm_head(torch, device, rig, iters, args.lm_head))
        results.append({"bs": bs, "ctx": ctx, **times, "kernels": kernels})
        print(f"[{args.label}] bs={bs} ctx={ctx} {times}", flush=True)
        for name, k in kernels.items():
            print(f"    {k['mean_us']:7.2f} us x{k['launches_per_step']:g}  {name[:90]}", flush=True)
        del rig
    report = {"label": args.label, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "copy_read_gbps": copy_bandwidth(torch, device) if device.type == "cuda" else None,
              "config": {"hicache": not args.no_hicache, "real_data": args.real_data, "env": args.environ,
                         "pool_slots": pool, "first_reads": "prefill backlog" if args.prefill_backlog else "steady",
                         "shared_prefix": args.shared_prefix, "full_row_shape": dataclasses.asdict(shape)},
              "timing": "CUDA graph replay after an L2 flush, CUDA events, median (cold); kernels: profiler mean "
                        "over 50 replays without flush (hot)", "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
