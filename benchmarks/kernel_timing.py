"""Timing and device probes of the kernel microbenchmarks: ``Timer`` (CUDA: a graph replay after an L2 flush
between CUDA events, "cold", or replays back to back, "hot"; CPU: eager calls, wall clock), the graph floor, the
measured device-to-device copy bandwidth and the nominal HBM bandwidth by device name.

Shared by ``bench_kernels.py``, ``bench_full_row.py``, ``bench_hash_term.py`` and ``bench_fused_attention_hash.py``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

L2_FLUSH_MIN_BYTES = 256 << 20
L2_FLUSH_FACTOR = 4  # flush buffer = max(256 MiB, 4 x L2)
COPY_PROBE_BYTES = 1 << 30
COPY_PROBE_REPS = 10
GIB = 1 << 30

# Nominal HBM bandwidth (GB/s) by device-name substring, most specific first.
HBM_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM
    ("A100-SXM4-80GB", 2039.0),
    ("A100-SXM4-40GB", 1555.0),
    ("A100 80GB PCIe", 1935.0),
)


def nominal_hbm_gbps(name: str) -> Optional[float]:
    for key, gbps in HBM_GBPS:
        if key in name:
            return gbps
    return None


class Timer:
    """CUDA: graphs + events with an L2 flush before each timed replay. CPU: eager calls, wall clock."""

    def __init__(self, torch, device, iters: int, hot_launches: int, use_graphs: bool):
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.iters = iters
        self.hot_launches = hot_launches
        self.use_graphs = use_graphs and self.cuda
        self.flush_buf = None
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
            nbytes = max(L2_FLUSH_MIN_BYTES, L2_FLUSH_FACTOR * l2)
            self.flush_buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def _capture(self, fn: Callable[[], None], launches: int):
        torch = self.torch
        fn()  # compile / warm up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                fn()
        torch.cuda.synchronize()
        return graph.replay, graph

    def cold_us(self, fn: Callable[[], None]) -> float:
        """Median µs of one call after an L2 flush."""
        torch = self.torch
        if not self.cuda:
            fn()
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e6
        if self.use_graphs:
            run, keep = self._capture(fn, 1)
        else:
            run, keep = fn, None
            fn()  # compile / warm up
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            self.flush_buf.zero_()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        del keep
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3

    def hot_us(self, fn: Callable[[], None]) -> Optional[float]:
        """µs per call, ``hot_launches`` calls per graph replayed back to back (CUDA only)."""
        if not self.cuda:
            return None
        torch = self.torch
        if self.use_graphs:
            run, keep = self._capture(fn, self.hot_launches)
        else:
            keep = None

            def run():
                for _ in range(self.hot_launches):
                    fn()
        run()  # warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.iters):
            run()
        end.record()
        torch.cuda.synchronize()
        del keep
        return start.elapsed_time(end) * 1e3 / (self.iters * self.hot_launches)


def device_info(torch, device) -> dict:
    if device.type != "cuda":
        return {"device_name": "cpu (Triton interpreter)", "sms": None, "l2_bytes": None}
    p = torch.cuda.get_device_properties(device)
    return {"device_name": torch.cuda.get_device_name(device), "sms": p.multi_processor_count,
            "l2_bytes": getattr(p, "L2_cache_size", None), "memory_gib": round(p.total_memory / GIB, 1)}


def measured_copy_gbps(torch, device) -> Optional[float]:
    """Device-to-device copy bandwidth (read + write bytes / time): the practical HBM ceiling."""
    if device.type != "cuda":
        return None
    src = torch.empty(COPY_PROBE_BYTES // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPY_PROBE_REPS):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / COPY_PROBE_REPS
    del src, dst
    torch.cuda.empty_cache()
    return round(2 * COPY_PROBE_BYTES / seconds / 1e9, 1)


def graph_floor_us(torch, timer: Timer) -> Optional[float]:
    """Cold replay time of a graph holding one trivial kernel: the floor included in every cold number."""
    if not timer.cuda:
        return None
    x = torch.zeros(1, device=timer.device)
    return timer.cold_us(lambda: x.add_(1))


def bench_device(torch, smoke: bool):
    """CPU for a ``--smoke`` run (the Triton interpreter), else the GPU; none there exits saying what to do."""
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --smoke on CPU")
    return torch.device("cuda")
