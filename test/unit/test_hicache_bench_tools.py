"""The HiCache row's measuring tools (no server): the bench's per-turn profiles, the trace's batch boundaries
(``scripts/trace_boundaries.py``) and sglang's decode lines as windows (``scripts/decode_windows.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_loader import _load  # the scripts' loader (test/unit: on the path under pytest)


def test_the_hicache_bench_profiles_each_asked_turn_from_its_first_batch_with_prompts_no_other_run_sent(
        monkeypatch, tmp_path):
    """--profile-turn 0,1: one trace a turn (sglang's /start_profile before the turn's first batch, /stop_profile
    after --profile-batches of them), each from a repetition of its own (after the timed ones'), the turns before
    it sent too (they fill the host tier); bad turn lists refused."""
    hc = _load("bench_hicache_overhead")
    args = hc.parse_args(["--device", "cpu", "--conversations", "4", "--group", "2", "--turns", "3", "--reps", "2",
                          "--profile-batches", "2", "--profile-turn", "1,0"])
    assert args.profile_turns == [0, 1]
    calls = []

    class Session:
        trust_env = True

        def post(self, url, json=None, timeout=None):
            calls.append(url.rsplit("/", 1)[1])
            Path(json["output_dir"], "x.trace.json.gz").write_text("") if json else None
            return type("R", (), {"raise_for_status": lambda self: None})()
    monkeypatch.setattr(hc.requests, "Session", Session)
    monkeypatch.setattr(hc, "run_batch", lambda url, batch, n: calls.append(len(batch[0])))
    monkeypatch.setattr(hc, "summarize_trace", lambda path: {"trace": path.name})
    for turn in args.profile_turns:
        calls.clear()
        assert hc.profile_batches("http://x", args, {"token_range": (1, 9)}, turn, tmp_path / str(turn)) == {
            "trace": "x.trace.json.gz"}
        turn_len = [len(b[0]) for b in hc.repetition(args, (1, 9), args.reps + turn)]
        assert calls == turn_len[:2 * turn] + ["start_profile"] + turn_len[2 * turn:2 * turn + 2] + ["stop_profile"]
    assert hc.repetition(args, (1, 9), 2) != hc.repetition(args, (1, 9), 1)  # not a timed repetition's prompts
    for bad in ("3", "0,x", "", "-1"):
        with pytest.raises(SystemExit):
            hc.parse_args(["--profile-batches", "1", "--profile-turn", bad])
    with pytest.raises(SystemExit):  # turn 2 has 6 batches from its first on
        hc.parse_args(["--profile-batches", "7", "--profile-turn", "0,2"])


def test_trace_boundaries_finds_each_batchs_load_tail_and_first_decode_gap(tmp_path):
    """scripts/trace_boundaries.py on a synthetic trace: two batches (a prefill of two layers, then decode
    replays of > 100 kernels each); the second loads two layers from the host, its first layer launched after
    that layer's load landed (host-bound), its last layer's load ending 50 us before the attention; the canary's
    kernels of its eager part listed from the load's start."""
    tb = _load("trace_boundaries")
    events, corr = [], [0]

    def kernel(name, ts, dur, launch_ts=None, graph=None, stream=7):
        corr[0] += 1
        c = graph if graph is not None else corr[0]
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                       "args": {"correlation": c, "stream": stream}})
        if graph is None:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                           "ts": ts - 5 if launch_ts is None else launch_ts, "dur": 1, "args": {"correlation": c}})

    def replay(ts):  # one decode step: 101 kernels of one cudaGraphLaunch, 1,000 us
        corr[0] += 1
        g = corr[0]
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts - 100, "dur": 5,
                       "args": {"correlation": g}})
        for i in range(101):
            kernel("decode_k", ts + i * 9.91, 9, graph=g)
        return ts + 1000
    kernel("_fwd_kernel", 0, 100)  # batch 0: two layers, no load
    kernel("_fwd_kernel", 200, 100)
    t = replay(900)  # its tail: 900 - 300 = 600 us
    t = replay(t + 300)  # 300 us after the first decode step
    t0 = t + 10000  # batch 1: loads of 2 layers, 1 ms each
    kernel("void hicache_transfer_per_layer<long>", t0, 1000, stream=9)
    kernel("void hicache_transfer_per_layer<long>", t0 + 1000, 1000, stream=9)
    kernel("verify_kernel", t0 + 100, 10)
    kernel("_fwd_kernel", t0 + 1200, 100, launch_ts=t0 + 1100)  # launched after layer 0 landed: host-bound
    kernel("_fwd_kernel", t0 + 2050, 100, launch_ts=t0 + 1500)  # launched before layer 1 landed
    kernel("row_hash_kernel", t0 + 2010, 30)
    t = replay(t0 + 2500)
    replay(t + 1200)
    rows = tb.boundaries(_write_trace(tmp_path, events))
    assert rows[0] == {"decode_replays": 2, "tail_us": 600.0, "after_first_decode_us": 300.0, "canary_us": []}
    assert rows[1] == {"decode_replays": 2, "tail_us": 350.0, "after_first_decode_us": 1200.0, "load_ms": 2.0,
                       "host_bound_layers": 1, "last_load_to_decode_us": 500.0,
                       "canary_us": [("verify_kernel", 0.1, 10), ("row_hash_kernel", 2.01, 30)]}


def _write_trace(tmp_path, events):
    import gzip

    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_decode_windows_splits_sglangs_decode_lines_into_decode_boundary_and_fresh_windows(tmp_path):
    """scripts/decode_windows.py: each ``gen throughput`` line is interval x running requests / throughput; split
    by length into decode-only, boundary and fresh-prefill windows (medians, counts); a 0 throughput is skipped."""
    dw = _load("decode_windows")
    line = ("[2026-11-28 08:59:38] Decode batch, #running-req: {r}, #token: 9336, token usage: 0.57, cuda graph: True, "
            "gen throughput (token/s): {t}, #queue-req: 0")
    text = "\n".join(line.format(r=8, t=t) for t in (1600.0, 1280.0, 640.0, 512.0, 256.0, 0.0))
    ms = dw.windows(text, 8)
    assert ms == [40.0, 50.0, 100.0, 125.0, 250.0]
    assert dw.split(ms, 60.0, 150.0) == {"decode": {"n": 2, "median_ms": 45.0},
                                         "boundary": {"n": 2, "median_ms": 112.5},
                                         "fresh_boundary": {"n": 1, "median_ms": 250.0}}
    assert dw.split([], 60.0, 150.0)["decode"] == {"n": 0, "median_ms": None}
