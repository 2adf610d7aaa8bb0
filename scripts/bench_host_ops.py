#!/usr/bin/env python3
"""Per-decode-step host cost of the canary (no server): the outside-graph ops around a graph replay.

Builds a real ``CanaryManager`` on a synthetic Llama-3-8B-row pool, captures the
canary's HEAD+TAIL for a decode batch into a CUDA graph (as sglang's decode
graphs do), then times on the host, per step:

* ``replay``: a graph replay of one small kernel (the step without the canary);
* ``bracketed_sample``: the canary's graph replayed inside ``with_ops_outside_graph`` +
  ``with_active_single_forward_manager`` (what the ModelRunner.forward hook adds: bracket
  checks, forward accounting, the async counter copy, reading landed copies), then the
  ``ModelRunner.sample`` hook's work (``record_sampled``: the token oracle's copy of the
  sampled ids), so every step is clean (``clean``: no violation row is read);
* ``sample``: ``record_sampled`` alone;
* ``neighbour_us_per_iter``: another component's eager host ops (``NeighbourOps``) before the canary exists in the
  process and after it ran: whether its presence slows the rest of the process's host work; and, torch alone,
  while a side stream is busy with blocks freed behind it, and while a captured graph on one stream or forked to
  two is in flight.

The difference ``bracketed_sample - replay`` is the canary's host work per decode step
(``canary_host_us_per_step``); ``sample_hook_us_per_step`` is its sample hook's share. GPU
time of the canary kernels per step is in ``bench_kernels.py``.

    export PYTHONPATH=/tmp/site:$PWD/python
    python scripts/bench_host_ops.py [--steps 3000] [--bs 1] [--ctx 1536]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_output import emit


class _Mode:
    name = "DECODE"

    @staticmethod
    def is_idle() -> bool:
        return False


class DecodeBatch:
    """The ForwardBatch fields the canary's adapter reads, for a decode step."""

    forward_mode = _Mode()
    extend_seq_lens = None
    extend_prefix_lens_cpu = None

    def __init__(self, torch, bs, ctx, device):
        self.batch_size = bs
        self.input_ids = torch.randint(1, 1000, (bs,), device=device)
        # request i's next slot: the one after its prefix (see the req_to_token layout in main)
        self.out_cache_loc = torch.arange(bs, device=device) * (ctx + 1) + 1 + ctx
        self.req_pool_indices = torch.arange(1, bs + 1, device=device)
        self.seq_lens = torch.full((bs,), ctx + 1, device=device)
        self.positions = torch.full((bs,), ctx, device=device)
        self.rids = [f"r{i}" for i in range(bs)]


class NeighbourOps:
    """Another component's eager host work in the same process (allocations, views, a small GEMM, a gather, a cat:
    ~6 launches an iteration, like an engine's eager layer): timed before the canary exists and after it ran, to see
    whether its presence slows the process's other host work (streams, events, graphs, mapped memory it holds)."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.a = torch.randn(8, 1024, device=device)
        self.w = torch.randn(1024, 256, device=device)
        self.idx = torch.arange(8, device=device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        # GPU cycles of a 20 ms sleep: the busy side stream or graph the CUDA-only timings run against
        self.sleep_cycles = (int(20e-3 * torch.cuda.get_device_properties(device).clock_rate * 1e3)
                             if device.type == "cuda" else 0)

    def _iter(self) -> None:
        torch = self.torch
        x = torch.empty(8, 1024, device=self.device)
        y = x.view(-1)[:512]
        z = torch.mm(self.a, self.w)
        q = z.index_select(0, self.idx)
        torch.cat([q, q]).add_(y[:1])

    def pending_free_us(self, iters: int, frees: int, runs: int = 5) -> float:
        """``median_us`` while a side stream's work is pending (a 20 ms sleep, like a load-back's transfers) and
        ``frees`` blocks used on that stream were freed (``record_stream``: the caching allocator keeps one event
        each until the stream passes it, and checks its events in every allocation). CUDA only."""
        torch = self.torch
        side = torch.cuda.Stream(device=self.device)

        def busy_side_stream() -> None:
            with torch.cuda.stream(side):
                torch.cuda._sleep(self.sleep_cycles)
                for _ in range(frees):
                    t = torch.empty(4096, device=self.device)
                    t.fill_(0)
                    t.record_stream(side)
                    del t

        return self.median_us(iters, runs, before_run=busy_side_stream)

    def graph_in_flight_us(self, iters: int, forked: bool, runs: int = 5) -> float:
        """``median_us`` while a captured graph runs (a 20 ms sleep, like a forward), its work on one stream or
        forked to a side stream and joined back (as the canary's TAIL beside the LM head is): does a graph with two
        streams in flight make the host's next launches dearer? CUDA only."""
        torch = self.torch
        side, scratch = torch.cuda.Stream(device=self.device), torch.zeros(1, device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.cuda._sleep(self.sleep_cycles)
            if forked:  # fork, a small kernel on the side stream, join
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    scratch.add_(1)
                torch.cuda.current_stream().wait_stream(side)
            scratch.add_(1)
        return self.median_us(iters, runs, before_run=graph.replay)

    def median_us(self, iters: int, runs: int = 5, before_run=lambda: None) -> float:
        """Median over ``runs`` of the host time per iteration (us), the device drained between runs and
        ``before_run()`` called before each (untimed)."""
        times = []
        for _ in range(runs + 1):  # the first run warms the allocator and the kernels
            self.sync()
            before_run()
            t0 = time.perf_counter()
            for _ in range(iters):
                self._iter()
            times.append((time.perf_counter() - t0) / iters * 1e6)
        self.sync()
        return round(statistics.median(times[1:]), 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--ctx", type=int, default=1536)
    p.add_argument("--out", default=None)
    p.add_argument("--neighbour-iters", type=int, default=400,
                   help="iterations of the neighbour workload (an engine's eager host ops) timed before and after")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: eager, TRITON_INTERPRET=1, only proves the script runs")
    p.add_argument("--host-only", action="store_true",
                   help="replace the replay by a no-op (as if the graph ran): times the canary's host bookkeeping "
                        "alone, without device work (relative numbers on CPU)")
    args = p.parse_args()

    import logging

    import torch

    logging.getLogger("kv_canary").setLevel(logging.CRITICAL)  # replay-only steps desync the health check
    from kv_canary import fingerprint as fpc
    from kv_canary.adapter.batch_adapter import SglangBatchAdapter
    from kv_canary.config import CanaryConfig, CanaryMode
    from kv_canary.kernels import select_kernels
    from kv_canary.views import LaunchCapacities
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.runner import CanaryManager

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    bs, ctx = args.bs, args.ctx
    slots = bs * (ctx + 2) + 1
    k = [torch.randn(slots, 8, 128, device=device, dtype=torch.bfloat16)]
    v = [torch.randn(slots, 8, 128, device=device, dtype=torch.bfloat16)]
    neighbour = NeighbourOps(torch, device)
    neighbour_before = neighbour.median_us(args.neighbour_iters)  # no canary in the process yet
    # torch alone: the same workload while a side stream is busy, with 0 / 1 / 16 of its blocks freed behind it
    neighbour_pending = ({str(n): neighbour.pending_free_us(args.neighbour_iters // 4, n) for n in (0, 1, 16)}
                         if on_gpu else {})
    neighbour_graph = ({kind: neighbour.graph_in_flight_us(args.neighbour_iters // 4, kind == "forked")
                        for kind in ("one_stream", "forked")} if on_gpu else {})
    config = CanaryConfig(mode=CanaryMode.LOG)
    group = build_group(PoolLayout("full", k, v), config, device)
    r2t = torch.zeros(bs + 1, 16384, dtype=torch.int32, device=device)
    for i in range(bs):
        r2t[i + 1, : ctx + 1] = torch.arange(1 + i * (ctx + 1), 1 + (i + 1) * (ctx + 1), device=device)
    caps = LaunchCapacities(max_batch_size=bs + 1, max_context_len=r2t.shape[1],
                            verify_programs_target=2 * torch.cuda.get_device_properties(device).multi_processor_count
                            if on_gpu else 1)
    m = CanaryManager(config=config, groups=[group], kernels=select_kernels(config.kernel_backend, device),
                      req_to_token=r2t, capacities=caps, batch_adapter=SglangBatchAdapter(max_batch_size=bs + 1,
                      device=device), device=device)
    fb = DecodeBatch(torch, bs, ctx, device)
    # One decode step replayed at fixed positions advances each row's expected chain but not its prefix: the
    # HEAD's chain compare (one lane per request) is left out so the replays stay clean (no ring reads).
    m.token_oracle.verify_reads = False

    new_rows = torch.randn(bs, 8, 128, device=device, dtype=torch.bfloat16)

    def head_tail():  # HEAD, the step's K/V store (attention's, which the write witness checks), TAIL
        view = m.pre_ops_maybe_inside_graph(fb)
        for buf in (*k, *v):
            buf.index_copy_(0, fb.out_cache_loc, new_rows)
        m.post_ops_maybe_inside_graph(view)

    with m.capturing(), m.with_active_single_forward_manager(0):
        head_tail()
        if on_gpu:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                head_tail()
    replay = graph.replay if on_gpu else head_tail  # CPU: eager, counted as eager forwards
    if args.host_only:
        # The host path of a graph replay, minus the kernels: the counters move as HEAD + TAIL would move them
        # (so the health check sees a healthy device); both timed loops pay for this one add.
        bump = torch.zeros_like(m.counters)
        for c, v in ((fpc.C_FORWARD_INDEX, 1), (fpc.C_VERIFY_LAUNCHES, 1), (fpc.C_WRITE_LAUNCHES, 1),
                     (fpc.C_SLOTS_WRITTEN, bs), (fpc.C_SLOTS_VERIFIED, bs * ctx)):
            bump[c] = v
        replay = lambda: m.counters.add_(bump)  # noqa: E731
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    # Records for the prefix (one extend-like TAIL pass per request; before init finishes, which zeroes the
    # counters: the health check then counts only the timed forwards), then the token oracle's view of each
    # request: its own prompt (the chain) and its next (decode) token, as a PD arrival would set them.
    from kv_canary.views import ForwardView
    prompts = []
    for i in range(bs):
        prompt = torch.randint(1, 1000, (ctx,), device=device)
        view = ForwardView(
            input_ids=prompt, positions=torch.arange(ctx, device=device),
            out_cache_loc=r2t[i + 1, :ctx].to(torch.int64), req_pool_indices=fb.req_pool_indices[i:i + 1],
            seq_lens=torch.tensor([ctx], device=device), new_starts=torch.zeros(1, dtype=torch.int64, device=device),
            new_lens=torch.tensor([ctx], device=device), batch_size=1, max_new_len=ctx)
        m.kernels.write(group, view, r2t, m.counters, m.ring, False, check_fed=False)
        prompts.append(prompt.tolist())
    m.mark_init_finished()
    for i, prompt in enumerate(prompts):
        m.token_oracle.init_row(i + 1, prompt, [int(fb.input_ids[i])])
    m.token_oracle.stage([])
    sampled = fb.input_ids.to(torch.int32)  # what the engine "samples" each step: the token fed next
    sync()

    # the step without the canary: a graph replay of one small kernel (the same launch, no canary state moved, so
    # the bracketed steps stay clean: every forward counted, every fed token the sampled one, no ring reads)
    scratch = torch.zeros(1, device=device)
    if on_gpu and not args.host_only:
        base_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(base_graph):
            scratch.add_(1)
        base_replay = base_graph.replay
    else:
        base_replay = lambda: scratch.add_(1)  # noqa: E731

    def run(what: str) -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            if what == "bracketed_sample":
                with m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
                    with m.with_active_single_forward_manager(0):
                        replay()
                m.record_sampled(sampled)
            elif what == "sample":
                m.record_sampled(sampled)
            else:
                base_replay()
        cpu = (time.perf_counter() - t0) / args.steps * 1e6
        sync()
        return cpu

    m.poll(drain=True)  # the prefix's setup writes are not forwards: what the health check says of them is not timed
    health_before = m.health_violations
    samples = {"replay": [], "bracketed_sample": [], "sample": []}
    if on_gpu:  # the canary's per-step host path never waits for the device: any operation that would, raises
        torch.cuda.set_sync_debug_mode("error")
    for _ in range(5):
        for what in samples:
            samples[what].append(run(what))
    if on_gpu:
        torch.cuda.set_sync_debug_mode(0)
    m.poll(drain=True)
    neighbour_after = neighbour.median_us(args.neighbour_iters)  # the canary installed, its graphs replayed
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu (interpreter: meaningless)", "bs": bs, "ctx": ctx, "steps": args.steps,
        "host_us_per_step_replay_only": round(med["replay"], 2),
        "host_us_per_step_bracketed_sample": round(med["bracketed_sample"], 2),
        "canary_host_us_per_step": round(med["bracketed_sample"] - med["replay"], 2),
        "sample_hook_us_per_step": round(med["sample"], 2),
        # the same eager workload of other code (an engine's host ops), before and after the canary joined the process
        "neighbour_us_per_iter": {"before": neighbour_before, "after": neighbour_after,
                                  "side_stream_busy_by_blocks_freed_on_it": neighbour_pending,
                                  "graph_in_flight": neighbour_graph},
        "stats": m.stats_line(),
        "clean": int((m.last_counters or [0] * (fpc.C_VIOLATIONS + 1))[fpc.C_VIOLATIONS]) == 0
        and m.health_violations == health_before,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
