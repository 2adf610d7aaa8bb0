"""DelayedDeviceHostHandler: each snapshot holds the counters as they were after its forward, whatever the
forward's stream does next (CPU; CUDA where a captured kernel writes the pinned host slot itself, ``publish``,
and CUDA with copies on a side stream), delivered after the delay."""

from __future__ import annotations

import platform

import pytest
import torch

from kv_canary.d2h import IN_ORDER_LOAD_HOSTS, DelayedDeviceHostHandler

DEVICES = ["cpu"] + (["cuda", "cuda-copy"] if torch.cuda.is_available() else [])


def handler(counters, delay, *, copy=False, **kw):
    d2h = DelayedDeviceHostHandler(counters, delay, publish=not copy, **kw)
    if counters.is_cuda and platform.machine() in IN_ORDER_LOAD_HOSTS:  # the kernel path unless asked for copies
        assert (d2h._publish is None) == copy, "the publish kernel did not build (see kv_canary_d2h=copy)"
    return d2h


def _on(device):
    return ("cuda" if device.startswith("cuda") else "cpu"), {"copy": device == "cuda-copy"}
DELAY = 2


@pytest.mark.parametrize("device", DEVICES)
def test_each_snapshot_is_the_counters_after_its_forward(device):
    device, kw = _on(device)
    counters = torch.zeros(8, dtype=torch.int64, device=device)
    d2h = handler(counters, DELAY, **kw)
    got = []
    for step in range(12):  # more steps than slots: every staging buffer and host slot is reused
        if device == "cuda":
            torch.cuda._sleep(200_000)  # a slow "forward": the copies queue behind it
        counters.fill_(step * 10)
        counters[3] = step
        d2h.snapshot(step)
        counters.fill_(-1)  # the next forward changes the counters right away, on the same stream
        got += d2h.ready(step)
    got += d2h.drain()
    assert [s for s, _ in got] == sorted({s for s, _ in got})
    for step, values in got:
        assert values == [step * 10] * 3 + [step] + [step * 10] * 4
    assert got[-1][0] == 11  # the last forward's snapshot is never lost


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_is_not_ready_before_the_delay(device):
    device, kw = _on(device)
    counters = torch.ones(4, dtype=torch.int64, device=device)
    d2h = handler(counters, DELAY, **kw)
    d2h.snapshot(5)
    if device == "cuda":
        torch.cuda.synchronize()
    assert d2h.ready(5 + DELAY - 1) == []
    assert d2h.ready(5 + DELAY) == [(5, [1, 1, 1, 1])]


@pytest.mark.parametrize("device", DEVICES)
def test_an_interval_copies_every_nth_forward_and_a_flush_the_last_one_once(device):
    """SGLANG_KV_CANARY_D2H_INTERVAL=3: forwards 3, 6, 9 are copied; the flush before an idle drain copies the last
    forward (10) once, however often it is called; after a restart of the count, forward 0 is copied again."""
    device, kw = _on(device)
    counters = torch.zeros(4, dtype=torch.int64, device=device)
    d2h = handler(counters, DELAY, interval=3, **kw)
    got = []
    for step in range(1, 11):
        counters.fill_(step)
        d2h.snapshot(step)
        got += d2h.ready(step)
    for _ in range(3):  # the idle hook drains again and again: one copy of forward 10
        d2h.flush(10)
        got += d2h.drain()
    assert [(s, v[0]) for s, v in got] == [(3, 3), (6, 6), (9, 9), (10, 10)]
    d2h.restart_steps()
    counters.fill_(0)
    d2h.flush(0)
    assert d2h.drain() == [(0, [0, 0, 0, 0])]
    with pytest.raises(ValueError, match="interval"):
        DelayedDeviceHostHandler(counters, DELAY, interval=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel path writes pinned host memory from a CUDA "
                    "kernel: needs a GPU (the GPU host runs it)")
def test_publish_does_not_wait_for_the_forward_in_flight():
    """The snapshot returns while a 1 s GPU sleep runs; the slot is not ready until the kernel behind it wrote it."""
    counters = torch.full((4,), 7, dtype=torch.int64, device="cuda")
    d2h = handler(counters, 0)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_500_000_000)  # ~1 s at ~1.5 GHz
    import time
    t0 = time.monotonic()
    d2h.snapshot(1)
    assert time.monotonic() - t0 < 0.2
    assert d2h.ready(10) == []  # still behind the sleep
    assert d2h.drain() == [(1, [7, 7, 7, 7])]
