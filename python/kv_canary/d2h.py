"""Delayed device->host copies of the canary counters: no forward waits for the host.

After each forward, ``snapshot()`` copies the counters tensor (int64[n]) into
one of ``delay + 2`` pinned host slots and records an event. On CUDA the copy
is in two parts: a device-to-device copy into a staging buffer on the current
stream (ordered after the forward that produced the counters, before the next
one changes them) and the device-to-host copy of that buffer on a side stream.
The forward's stream never waits for the copy engine: a device-to-host copy
between a decode graph and sampling held sampling back ~10 us on an H200
(docs/history/performance.md).
``ready()`` returns, oldest first, the snapshots whose copy has finished
(``event.query()``, never a blocking wait) and that are at least ``delay``
forwards old. So the host learns of a violation from forward N while handling
forward N + delay (or a little later if the copy is still in flight, bounded by
``delay + 2`` slots: the oldest is waited for rather than overwritten).

On CPU the copy is immediate and ``delay`` still applies, so the step at which
``raise`` fires is the same on both devices.

``interval`` (``SGLANG_KV_CANARY_D2H_INTERVAL``): ``snapshot`` copies after every ``interval``-th forward only
(the counters are cumulative: a skipped copy loses nothing but time), and ``flush`` copies the last forward's
counters if no copy has (before an idle drain, so what the host settles on is current): the host learns of a
violation up to ``delay + interval - 1`` forwards after it, and the scheduler thread pays for 1/``interval`` of
the copies (~25 us each on an H100 host as copies, docs/history/hicache.md 7.4; ~5 us as the kernel write below).

On CUDA with Triton, on an x86 host, the copy is a write, not a copy (``PublishGraphs``): per slot, a CUDA graph of one kernel
that writes the counters straight into the slot's pinned host memory through its mapped address and then a
serial number into the slot's flag (system scope, released after the counters). ``snapshot`` replays the slot's
graph on the forward's stream (one call on the scheduler thread, in place of two copies, two event records, a
stream wait and two stream switches); ``ready`` reads the flag from host memory (no ``event.query()``). The
forward's stream runs the kernel in order, so the snapshot is the counters after the forward, with no staging
buffer; the serial (a device counter the kernel bumps) tells one replay from an older one in the same slot.
"""

from __future__ import annotations

import logging
import platform
import time
from collections import deque
from typing import Deque, List, Optional, Tuple

import torch

logger = logging.getLogger("kv_canary")
# ``ready`` reads a slot's flag, then its counters, with plain loads: x86 keeps loads in order; on a host that may
# reorder them (Arm, e.g. Grace) the counters could be read before the flag, so the copies stay there
IN_ORDER_LOAD_HOSTS = ("x86_64", "AMD64")
WAIT_TIMEOUT_S = 300.0  # a snapshot that has not landed by then: the device is hung, not slow

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the copy path
    triton = None

if triton is not None:
    @triton.jit
    def _publish_kernel(src, dst, flag, serial, n, BLOCK: tl.constexpr):
        """dst[:n] = src[:n] (dst: pinned host memory, through its mapped address); serial[0] += 1; then
        flag[0] = serial[0], released at system scope after every thread's stores. One program."""
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
        value = tl.load(serial) + 1
        tl.store(serial, value)
        tl.debug_barrier()
        tl.atomic_xchg(flag, value, sem="release", scope="sys")


class PublishGraphs:
    """CUDA: per host slot, a captured one-kernel graph that publishes ``source`` (int64[n], device) into
    ``slots[i]`` (pinned int64[n]) and a serial number into ``flags[i]`` (pinned int64). Built (compiled and
    captured) at install, never on the serving path."""

    def __init__(self, source: torch.Tensor, num_slots: int):
        n = source.numel()
        self.slots = torch.zeros((num_slots, n), dtype=torch.int64).pin_memory()
        self.flags = torch.zeros(num_slots, dtype=torch.int64).pin_memory()
        self.flags_np = self.flags.numpy()  # read by ``landed`` without a torch call
        self._serial = torch.zeros(1, dtype=torch.int64, device=source.device)
        self.published = 0  # replays queued so far: the serial the last one writes
        block = triton.next_power_of_2(max(1, n))

        def launch(i: int) -> None:
            _publish_kernel[(1,)](source, self.slots[i], self.flags[i:i + 1], self._serial, n, BLOCK=block)

        with torch.cuda.device(source.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                launch(0)  # compile; this serial (1) is reset below
            side.synchronize()
            self._serial.zero_()
            self.flags.zero_()
            self._graphs = []
            for i in range(num_slots):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    launch(i)
                self._graphs.append(graph)
            torch.cuda.synchronize(source.device)

    def publish(self, i: int) -> int:
        """Queue slot ``i``'s kernel on the current stream; the serial its flag will show."""
        self._graphs[i].replay()
        self.published += 1
        return self.published

    def landed(self, i: int, serial: int) -> bool:
        return int(self.flags_np[i]) == serial


class DelayedDeviceHostHandler:
    def __init__(self, source: torch.Tensor, delay: int, interval: int = 1, publish: bool = True):
        """``publish``: on CUDA with Triton, the kernel path (``PublishGraphs``); False: copies everywhere."""
        if interval < 1:
            raise ValueError(f"kv-canary: the counter copy interval must be >= 1 forward, not {interval}")
        self._source = source
        self._delay = delay
        self._interval = interval
        self._copied_step = None  # the forward of the last copy queued
        self._is_cuda = source.device.type == "cuda"
        n = delay + 2
        # CUDA + Triton: the kernel writes the host slots itself (PublishGraphs); else copies
        self._publish: Optional[PublishGraphs] = None
        if self._is_cuda and triton is not None and publish:
            if platform.machine() not in IN_ORDER_LOAD_HOSTS:
                logger.info("kv_canary_d2h=copy reason=host_%s_may_reorder_loads", platform.machine())
            else:
                try:
                    self._publish = PublishGraphs(source, n)
                except Exception as exc:  # a driver or Triton that cannot write mapped host memory: the copies
                    logger.info("kv_canary_d2h=copy reason=%s",
                                f"{type(exc).__name__}: {exc}".replace(" ", "_")[:200])
        copying = self._is_cuda and self._publish is None
        if self._publish is not None:
            self._slots = list(self._publish.slots)
        else:
            self._slots = [torch.zeros_like(source, device="cpu").pin_memory() if copying else
                           torch.zeros_like(source, device="cpu") for _ in range(n)]
        self._events = [torch.cuda.Event() if copying else None for _ in range(n)]
        # CUDA copies: per slot, the device copy the side stream reads; reused only after that read finished
        self._staging = [torch.empty_like(source) for _ in range(n)] if copying else []
        self._copy_stream = torch.cuda.Stream(device=source.device) if copying else None
        # CUDA copies: per slot, marks the staging copy on the forward's stream (the side stream's copy waits for it)
        self._staged = [torch.cuda.Event() for _ in range(n)] if copying else []
        self._used = [False] * n
        self._pending: Deque[Tuple[int, int, int]] = deque()  # (step, slot index, publish serial or 0)
        self._next_slot = 0

    def snapshot(self, step: int, *, force: bool = False) -> None:
        """Queue a copy of the counters as they are after forward ``step``: every ``interval``-th forward, or
        ``force``."""
        if not force and step % self._interval:
            return
        self._copied_step = step
        if len(self._pending) == len(self._slots):
            # All slots in flight: wait for the oldest (only when the host runs far ahead).
            self._wait(*self._pending[0][1:])
        idx = self._next_slot
        self._next_slot = (idx + 1) % len(self._slots)
        if self._pending and self._pending[0][1] == idx:
            # Counters are cumulative: dropping an unread snapshot loses nothing.
            self._pending.popleft()
        if self._publish is not None:
            self._pending.append((step, idx, self._publish.publish(idx)))
            return
        if self._is_cuda:
            # The copy path (no kernel write): every forward pays this on the scheduler thread: few torch calls,
            # preallocated events, no stream context manager (38-58 us a call before on an H100 host,
            # bench_hicache_host_ops.py ``snapshot``).
            main = torch.cuda.current_stream(self._source.device)
            if self._used[idx]:  # the last read of this staging buffer (n forwards ago: long finished)
                main.wait_event(self._events[idx])
            self._staging[idx].copy_(self._source, non_blocking=True)
            staged = self._staged[idx]  # re-recorded: a wait binds to the record before it, not to later ones
            staged.record(main)
            self._copy_stream.wait_event(staged)
            torch.cuda.set_stream(self._copy_stream)
            try:
                self._slots[idx].copy_(self._staging[idx], non_blocking=True)
                self._events[idx].record(self._copy_stream)
            finally:
                torch.cuda.set_stream(main)
            self._used[idx] = True
        else:
            self._slots[idx].copy_(self._source)
        self._pending.append((step, idx, 0))

    def _landed(self, idx: int, serial: int) -> bool:
        if self._publish is not None:
            return self._publish.landed(idx, serial)
        event = self._events[idx]
        return event is None or event.query()

    def _wait(self, idx: int, serial: int) -> None:
        """Block until slot ``idx``'s snapshot landed (never on the per-forward path but when every slot is in
        flight, and in ``drain``)."""
        if self._publish is not None:
            deadline = time.monotonic() + WAIT_TIMEOUT_S
            while not self._publish.landed(idx, serial):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kv-canary: the counters' snapshot {serial} did not land in "
                                       f"{WAIT_TIMEOUT_S:.0f} s (is the device hung?)")
                time.sleep(0)
        elif self._events[idx] is not None:
            self._events[idx].synchronize()

    @property
    def full(self) -> bool:
        """Every slot holds an unread copy: the next ``snapshot`` would wait for the oldest to land."""
        return len(self._pending) >= len(self._slots)

    def ready(self, current_step: int) -> List[Tuple[int, List[int]]]:
        """(step, counters as a list of ints) for each finished copy at least ``delay`` forwards old."""
        out = []
        while self._pending:
            step, idx, serial = self._pending[0]
            if current_step - step < self._delay or not self._landed(idx, serial):
                break
            out.append((step, self._slots[idx].tolist()))
            self._pending.popleft()
        return out

    def flush(self, step: int) -> None:
        """Queue a copy after forward ``step`` unless one was (an interval's skipped forwards, before a drain)."""
        if self._copied_step != step:
            self.snapshot(step, force=True)

    def restart_steps(self) -> None:
        """The forward count starts again from 0 (init finished): no copy is of the new count's forwards yet."""
        self._copied_step = None

    def drain(self) -> List[Tuple[int, List[int]]]:
        """Wait for every queued copy (shutdown, tests)."""
        for _, idx, serial in self._pending:
            self._wait(idx, serial)
        return self.ready(current_step=1 << 62)
