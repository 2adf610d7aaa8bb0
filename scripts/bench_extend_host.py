#!/usr/bin/env python3
"""Host cost of the canary in one eager EXTEND forward (no server): where the scheduler thread's time goes.

An eager extend's launch is the HiCache row's critical path at a batch boundary (docs/hicache-results.md 7.11),
so every host microsecond the canary adds there delays the batch. This builds a real ``CanaryManager`` with the
HiCache row's settings (``CanaryConfig.build(hicache=True)``, the variant tracker as ``install_canary`` wraps the
kernels) on a synthetic pool (``--layers`` layers of [slots, 8, 128] bf16 K and V), then times, per extend of
``--bs`` requests of the HiCache row's multi-turn workload (``--conversations`` conversations behind one
``--system``-token system prompt, ``--turns`` turns of ``--new`` new tokens then ``--out-tokens`` generated ones;
every turn's cached prefix is the conversation so far, each request a new admission; ``--workload row``: the
HiCache row's exact shape instead, each conversation its own fresh system prompt, a turn's prompt the system prompt
and the turns so far without the generated tokens, turn 0 uncached):

* ``outside_pre``: the outside bracket's entry (the token oracle's staging and admission chains);
* ``head``: plan + HEAD (``pre_ops_maybe_inside_graph``); ``tail``: TAIL (``post_ops_maybe_inside_graph``);
* ``outside_post``: the bracket's exit; ``sample``: ``record_sampled``;
* per canary kernel function (``verify``, ``write``, ...): host us per call, and ``triton_run``: the time inside
  Triton's ``JITFunction.run`` (binding, cache lookup, the launch) per launch, with the launches per extend.

The device is synchronized between iterations (untimed), so nothing waits for a busy GPU.

    export PYTHONPATH=$PWD/python
    python scripts/bench_extend_host.py [--iters 200] [--out F]
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import dataclasses
import pstats
import statistics
import time

from bench_output import emit


def _profile_top(prof, n: int, iters: int) -> list:
    """The ``n`` functions with the most own time: (us own per extend, us cumulative per extend, calls per extend,
    where)."""
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [[round(tt / iters * 1e6, 1), round(ct / iters * 1e6, 1), round(nc / iters, 2),
             f"{fn.rsplit('/', 2)[-1] if '/' in fn else fn}:{line}({name})"]
            for (fn, line, name), (_, nc, tt, ct, _) in rows]


class _Mode:
    name = "EXTEND"

    @staticmethod
    def is_idle() -> bool:
        return False


class Req:
    """The scheduler Req fields the batch adapter reads."""

    def __init__(self, rid, row, prompt):
        self.rid, self.req_pool_idx, self.origin_input_ids, self.output_ids = rid, row, prompt, []


class ExtendBatch:
    """The ForwardBatch fields the canary's adapter reads, for an extend of ``new`` tokens after ``prefix``."""

    forward_mode = _Mode()

    def __init__(self, torch, reqs, prefix, new, slot_of, device):
        bs = len(reqs)
        self.batch_size = bs
        self.kv_canary_reqs = reqs
        self.rids = [r.rid for r in reqs]
        self.extend_seq_lens_cpu = [new] * bs
        self.extend_prefix_lens_cpu = [prefix] * bs
        self.extend_seq_lens = torch.full((bs,), new, dtype=torch.int32, device=device)
        self.extend_start_loc = torch.arange(bs, dtype=torch.int32, device=device) * new
        ids = [t for r in reqs for t in r.origin_input_ids[prefix:prefix + new]]
        self.input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        self.positions = torch.arange(prefix, prefix + new, device=device).repeat(bs)
        self.out_cache_loc = torch.cat([slot_of(r.req_pool_idx, prefix, new) for r in reqs])
        self.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], device=device)
        self.seq_lens = torch.full((bs,), prefix + new, device=device)


def _op_counter():
    """``--count-ops``: a TorchDispatchMode counting the aten ops dispatched per phase (``phase``, set by
    ``_PhaseClock``; None: not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase, self.counts = None, collections.defaultdict(collections.Counter)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.phase is not None:
                self.counts[self.phase][str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

        def per_extend(self, iters):
            return {ph: {"total": round(sum(c.values()) / iters, 2),
                         **{op: round(n / iters, 2) for op, n in c.most_common(12)}}
                    for ph, c in self.counts.items() if ph != "forward"}

    return OpCounter()


class _PhaseClock(list):
    """The phase boundaries' ``perf_counter`` stamps; with ``--count-ops`` each stamp starts the next phase."""

    def __init__(self, ops, names, timed):
        super().__init__([time.perf_counter()])
        self.ops, self.names, self.timed = ops, names, timed
        self._set(0)

    def _set(self, i):
        if self.ops is not None:
            self.ops.phase = self.names[i] if self.timed and i < len(self.names) else None

    def append(self, stamp):
        super().append(stamp)
        self._set(len(self) - 1)


def calibrate_launch(torch, triton, device, calls: int = 2000) -> dict:
    """Host us per launch of a kernel with the write kernel's shape of arguments (14 tensors, 10 ints, 4
    constexprs): ``kernel[grid](...)``, and the compiled kernel's launcher called directly with the same bound
    arguments (what binding once would save)."""
    import triton.language as tl

    @triton.jit
    def many_args(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, i0, i1, i2, i3, i4, i5, i6, i7, i8,
                  i9, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(a1 + offs, mask=offs < i0, other=0)
        tl.store(a0 + offs, x + C0 + C1 + C2, mask=offs < i0)

    ts = [torch.zeros(64, dtype=torch.int64, device=device) for _ in range(14)]
    ints = [64, 3, 5, 7, 9, 11, 13, 15, 17, 19]
    kw = dict(C0=1, C1=2, C2=3, BLOCK=64)
    compiled = many_args[(1,)](*ts, *ints, **kw)
    torch.cuda.synchronize()
    out = {}
    t0 = time.perf_counter()
    for _ in range(calls):
        many_args[(4, 1)](*ts, *ints, **kw)
    out["jit_launch_us"] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    torch.cuda.synchronize()
    from triton.runtime import driver
    dev = driver.active.get_current_device()
    args = (*ts, *ints, *kw.values())
    t0 = time.perf_counter()
    for _ in range(calls):
        stream = driver.active.get_current_stream(dev)
        compiled.run(4, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
    out["direct_launch_us"] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        ts[0].add_(1)
    out["torch_add_us"] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    torch.cuda.synchronize()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--out-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--workload", default="shared", choices=["shared", "row"],
                   help="shared: one system prompt, outputs in the next prefix; row: bench_hicache_overhead's prompts")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only proves the script runs")
    p.add_argument("--triton-launch", action="store_true",
                   help="launch every canary kernel through Triton's kernel[grid] (no bound launchers)")
    p.add_argument("--count-ops", action="store_true",
                   help="count the aten ops each phase dispatches (a GPU launch or a copy each; adds host time)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile the timed phases with cProfile (adds host time): the N costliest functions by "
                        "own time, with their calls per extend and cumulative time")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import logging

    import torch
    import triton

    logging.getLogger("kv_canary").setLevel(logging.CRITICAL)
    from kv_canary import fingerprint as fpc
    from kv_canary.adapter.batch_adapter import SglangBatchAdapter
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.config import CanaryConfig
    from kv_canary.kernels import select_kernels
    from kv_canary.kernels.triton_kernels import tail_variant
    from kv_canary.kernels.variants import VariantTracker, track
    from kv_canary.runner import CanaryManager
    from kv_canary.views import ForwardView, LaunchCapacities

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    bound = 0
    if args.triton_launch:  # every bound kernel of the canary's kernel modules (all imported by now)
        import sys

        from kv_canary.kernels import accept, index_sweep, witness  # noqa: F401 - imported later by select_kernels
        from kv_canary.kernels.launch import BoundKernel
        for name, mod in list(sys.modules.items()):
            if name.startswith("kv_canary.kernels."):
                for attr in vars(mod).values():
                    if isinstance(attr, BoundKernel):
                        attr._direct, bound = False, bound + 1
    bs, new = args.bs, args.new
    ctx = args.system + args.turns * (new + args.out_tokens)
    row_mode = args.workload == "row"
    batches = max(1, args.conversations // bs)
    slots = bs * ctx + 1
    k = [torch.randn(slots, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(args.layers)]
    v = [torch.randn(slots, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(args.layers)]
    config = CanaryConfig.build(mode="log", environ={}, hicache=True)
    group = build_group(PoolLayout("full", k, v), config, device)
    r2t = torch.zeros(bs + 1, 4096, dtype=torch.int32, device=device)
    for i in range(bs):
        r2t[i + 1, :ctx] = torch.arange(1 + i * ctx, 1 + (i + 1) * ctx, device=device)

    def slot_of(row, start, n):
        return r2t[row, start:start + n].to(torch.int64)

    tracker = VariantTracker()
    timed_calls = collections.defaultdict(list)  # kernel function -> host us per call

    def timing(name, fn):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            fn(*a, **kw)
            timed_calls[name].append((time.perf_counter() - t0) * 1e6)
        return wrapped

    kernels = track(select_kernels(config.kernel_backend, device), tracker, tail_variant)
    kernels = dataclasses.replace(kernels, **{f.name: timing(f.name, getattr(kernels, f.name))
                                              for f in dataclasses.fields(kernels)
                                              if callable(getattr(kernels, f.name))})
    caps = LaunchCapacities(max_batch_size=bs + 1, max_context_len=r2t.shape[1],
                            max_tokens_per_forward=max(bs * new, ctx, bs * (args.system + new) if row_mode else 0),
                            verify_programs_target=2 * torch.cuda.get_device_properties(device).multi_processor_count
                            if on_gpu else 1)
    m = CanaryManager(config=config, groups=[group], kernels=kernels, req_to_token=r2t, capacities=caps,
                      batch_adapter=SglangBatchAdapter(max_batch_size=bs + 1, device=device), device=device,
                      variant_tracker=tracker)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(1, 150000, (args.system,), generator=gen).tolist()
    convs = []

    def write_prefixes(prefixes):  # each request's cached prefix: the records of its tokens' slots
        for i, tokens in enumerate(prefixes):
            n = len(tokens)
            view = ForwardView(
                input_ids=torch.tensor(tokens, device=device), positions=torch.arange(n, device=device),
                out_cache_loc=slot_of(i + 1, 0, n), req_pool_indices=torch.tensor([i + 1], device=device),
                seq_lens=torch.tensor([n], device=device), new_starts=torch.zeros(1, dtype=torch.int32, device=device),
                new_lens=torch.tensor([n], dtype=torch.int32, device=device), batch_size=1, max_new_len=n)
            m.kernels.write(group, view, r2t, m.counters, m.ring, False, check_fed=False)

    m.mark_init_finished()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sampled = torch.randint(1, 30000, (bs,), device=device)
    run_time = {"us": 0.0, "n": 0}
    jit_run = triton.runtime.jit.JITFunction.run

    def timed_run(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return jit_run(self, *a, **kw)
        finally:
            run_time["us"] += (time.perf_counter() - t0) * 1e6
            run_time["n"] += 1

    ops = _op_counter() if args.count_ops else None
    prof = cProfile.Profile() if args.cprofile else None
    phases = collections.defaultdict(list)
    by_turn = collections.defaultdict(list)  # turn -> the canary's host us of each extend (all phases)
    launches_per_extend = []
    for it in range(args.iters + 5):
        turn, b = divmod(it % (batches * args.turns), batches)
        if turn == 0 and b == 0:  # new conversations: behind one system prompt, or (row) each behind its own
            convs = [torch.randint(1, 150000, (args.system,), generator=gen).tolist() if row_mode else list(system)
                     for _ in range(batches * bs)]
        mine = convs[b * bs:(b + 1) * bs]
        prefix = 0 if row_mode and turn == 0 else len(mine[0])
        if prefix:
            write_prefixes(mine)
        for conv in mine:  # the turn's new tokens
            conv += torch.randint(1, 150000, (new,), generator=gen).tolist()
        fed = len(mine[0]) - prefix
        reqs = [Req(f"it{it}-r{i}", i + 1, list(conv)) for i, conv in enumerate(mine)]
        fb = ExtendBatch(torch, reqs, prefix, fed, slot_of, device)
        if not row_mode:  # what the turn generates: the next turn's prefix (row: the next prompt leaves it out)
            for conv in mine:
                conv += torch.randint(1, 150000, (args.out_tokens,), generator=gen).tolist()
        new_rows = torch.randn(bs * fed, 8, 128, device=device, dtype=torch.bfloat16)
        if it < 5:  # warmup iterations: not timed
            for c in timed_calls.values():
                c.clear()
        sync()
        triton.runtime.jit.JITFunction.run = timed_run
        n0 = run_time["n"]
        t = _PhaseClock(ops, ("outside_pre", "head", "forward", "tail", "outside_post", "sample"), it >= 5)
        if ops is not None:
            ops.__enter__()
        if prof is not None and it >= 5:
            prof.enable()
        bracket = m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb)
        bracket.__enter__()
        t.append(time.perf_counter())
        with m.with_active_single_forward_manager(0):
            view = m.pre_ops_maybe_inside_graph(fb)
            t.append(time.perf_counter())
            for buf in (*k, *v):  # the forward's K/V stores (untimed)
                buf.index_copy_(0, fb.out_cache_loc, new_rows)
            t.append(time.perf_counter())
            m.post_ops_maybe_inside_graph(view)
            t.append(time.perf_counter())
        bracket.__exit__(None, None, None)
        t.append(time.perf_counter())
        m.record_sampled(sampled)
        t.append(time.perf_counter())
        if prof is not None:
            prof.disable()
        if ops is not None:
            ops.__exit__(None, None, None)
        triton.runtime.jit.JITFunction.run = jit_run
        launches_per_extend.append(run_time["n"] - n0)
        if it >= 5:
            for name, start, end in (("outside_pre", 0, 1), ("head", 1, 2), ("tail", 3, 4), ("outside_post", 4, 5),
                                     ("sample", 5, 6)):
                phases[name].append((t[end] - t[start]) * 1e6)
            by_turn[turn].append((t[6] - t[0] - (t[3] - t[2])) * 1e6)  # less the untimed K/V stores
        else:
            run_time.update(us=0.0, n=0)
        m.poll(drain=True)
    sync()
    m.poll(drain=True)
    med = {name: round(statistics.median(xs), 1) for name, xs in phases.items()}
    counters = m.last_counters or [0] * (fpc.C_VIOLATIONS + 1)
    result = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu (interpreter: meaningless)",
        "label": args.label, "bound_launchers_off": bound,
        "bs": bs, "conversations": batches * bs, "turns": args.turns, "system": args.system, "new": new,
        "layers": args.layers, "iters": args.iters,
        "host_us_median": med,
        "canary_host_us_per_extend": round(sum(med.values()), 1),
        "workload": args.workload,
        "canary_host_us_per_extend_by_turn": {t: round(statistics.median(xs), 1) for t, xs in sorted(by_turn.items())},
        "kernel_fn_us_median": {n: round(statistics.median(xs), 1) for n, xs in timed_calls.items() if xs},
        "kernel_fn_calls_per_extend": {n: round(len(xs) / args.iters, 2) for n, xs in timed_calls.items() if xs},
        "triton_launches_per_extend": statistics.median(launches_per_extend),
        "triton_run_us_per_launch": round(run_time["us"] / max(1, run_time["n"]), 1),
        "violations": int(counters[fpc.C_VIOLATIONS]),
        "jit_after_startup": sum(tracker.after_startup.values()),
        "stats": m.stats_line(),
        **({"aten_ops_per_extend": ops.per_extend(args.iters)} if ops is not None else {}),
        **({"cprofile_top": _profile_top(prof, args.cprofile, args.iters)} if prof is not None else {}),
        "launch_calibration": calibrate_launch(torch, triton, device) if on_gpu else {},
    }
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
