"""DelayedDeviceHostHandler: each snapshot holds the counters as they were after its forward, whatever the
forward's stream does next (CPU, and CUDA where the host copy runs on a side stream), delivered after the delay."""

from __future__ import annotations

import pytest
import torch

from kv_canary.d2h import DelayedDeviceHostHandler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DELAY = 2


@pytest.mark.parametrize("device", DEVICES)
def test_each_snapshot_is_the_counters_after_its_forward(device):
    counters = torch.zeros(8, dtype=torch.int64, device=device)
    d2h = DelayedDeviceHostHandler(counters, DELAY)
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
    counters = torch.ones(4, dtype=torch.int64, device=device)
    d2h = DelayedDeviceHostHandler(counters, DELAY)
    d2h.snapshot(5)
    if device == "cuda":
        torch.cuda.synchronize()
    assert d2h.ready(5 + DELAY - 1) == []
    assert d2h.ready(5 + DELAY) == [(5, [1, 1, 1, 1])]


@pytest.mark.parametrize("device", DEVICES)
def test_an_interval_copies_every_nth_forward_and_a_flush_the_last_one_once(device):
    """SGLANG_KV_CANARY_D2H_INTERVAL=3: forwards 3, 6, 9 are copied; the flush before an idle drain copies the last
    forward (10) once, however often it is called; after a restart of the count, forward 0 is copied again."""
    counters = torch.zeros(4, dtype=torch.int64, device=device)
    d2h = DelayedDeviceHostHandler(counters, DELAY, interval=3)
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
