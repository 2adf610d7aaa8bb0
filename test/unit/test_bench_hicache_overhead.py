"""The HiCache overhead benchmark's logic (no server): ``benchmarks/bench_hicache_overhead.py``'s turns, summary and
paired rounds (``benchmarks/paired_rounds.py``: a cut-off log's rounds, rows of several hosts pooled), its time budget,
the idle ablation, and what its diagnostics sum up (stack samples, ``benchmarks/trace_summary.py``, the host timers of
``benchmarks/stack_sampler``). The main benchmark's logic: ``test_bench_overhead``.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from script_loader import ROOT, _load  # test/unit: on the path under pytest


def test_the_hicache_bench_sends_every_turn_of_every_conversation_and_summarizes_against_its_first_off_server():
    """benchmarks/bench_hicache_overhead.py (issue 24): a repetition is turn by turn, ``group`` conversations a batch,
    each prompt its conversation's system prompt and turns so far (fresh per repetition); the first off server is
    the base, the second the noise; bad values refused."""
    hc = _load("bench_hicache_overhead")
    args = hc.parse_args(["--device", "cpu", "--conversations", "5", "--group", "2", "--turns", "2",
                          "--system-len", "3", "--turn-len", "2"])
    assert args.config_names == ["hc_off", "hc_ours", "hc_off"] and args.output_len == hc.SHAPES["cpu"][4]
    batches = hc.repetition(args, (100, 200), 0)
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    first, second = batches[0][0], batches[3][0]  # conversation 0, turns 1 and 2
    assert len(first) == 3 + 2 and second[:5] == first and len(second) == 3 + 2 * 2
    assert all(100 <= t < 200 for b in batches for p in b for t in p)
    assert hc.repetition(args, (100, 200), 1)[0][0][:3] != first[:3]  # no cross-repetition hits
    off = [2.0, 2.1, 1.9]
    runs = [{"label": "hc_off#1", "role": "off", "median_s": 2.0,
             "reps": [{"rep": i, "wall_s": w, "turn_s": [w / 2, w / 2], "load_back_tokens": 7}
                      for i, w in enumerate(off)]},
            {"label": "hc_ours#1", "role": "ours", "median_s": 2.02,  # +1%, +2%, -1% against the same round's off
             "reps": [{"rep": i, "wall_s": w * f, "turn_s": [w / 2, w / 2 * (2 * f - 1)], "load_back_tokens": 7}
                      for i, (w, f) in enumerate(zip(off, (1.01, 1.02, 0.99)))]},  # all of it in the second turn
            {"label": "hc_off#2", "role": "off", "median_s": 1.98, "reps": []}]
    got = hc.summarize(runs)
    assert (got["off_s"], got["ours_pct"], got["noise_pct"]) == (2.0, 1.0, -1.0)
    pair = got["paired"]["hc_ours#1"]  # --interleave: round by round against the first off server
    assert pair["pair_pct"] == [1.0, 2.0, -1.0] and pair["median_pct"] == 1.0 and pair["mean_pct"] == 0.667
    assert -1.0 <= pair["ci90_pct"][0] <= 1.0 <= pair["ci90_pct"][1] <= 2.0 and list(got["paired"]) == ["hc_ours#1"]
    assert pair["turn_median_pct"] == [0.0, 2.0]  # per turn: the second turn carries the difference
    assert got["pooled"] == {}  # one ours server: nothing to pool
    # a second off process 5% slower, a second ours process as fast as it: each configuration's mean cancels the
    # offsets; one hc_ours_d2h4 server: against the offs' mean (its own offset stays)
    for r, config in zip(runs, ("hc_off", "hc_ours", "hc_off")):
        r["config"] = config
    runs[2]["reps"] = [{"rep": i, "wall_s": w, "load_back_tokens": 7} for i, w in enumerate((2.2, 2.1, 2.3))]
    runs.append({"label": "hc_ours#2", "config": "hc_ours", "role": "ours", "median_s": 2.2,
                 "reps": [{"rep": i, "wall_s": w, "load_back_tokens": 7} for i, w in enumerate((2.2, 2.1, 2.3))]})
    runs.append({"label": "hc_ours_d2h4#1", "config": "hc_ours_d2h4", "role": "ours", "median_s": 2.0,
                 "reps": [{"rep": i, "wall_s": 2.0, "load_back_tokens": 7} for i in range(3)]})
    pools = hc.summarize(runs)["pooled"]  # per round: mean(ours) against mean(offs)
    assert list(pools) == ["hc_ours", "hc_ours_d2h4"]
    assert pools["hc_ours_d2h4"]["pair_pct"] == [-4.762] * 3  # 2.0 against 2.1 (the two offs' mean) each round
    pool = pools["hc_ours"]
    assert pool["servers"] == {"off": ["hc_off#1", "hc_off#2"], "hc_ours": ["hc_ours#1", "hc_ours#2"]}
    assert pool["pair_pct"] == [0.476, 1.0, -0.452] and pool["median_pct"] == 0.476
    assert -0.452 <= pool["ci90_pct"][0] <= 0.476 <= pool["ci90_pct"][1] <= 1.0
    assert pool["turn_median_pct"] == []  # the repetitions carry no per-turn times
    for r in runs:  # per turn: the offs' mean against the ours servers' mean; the second turn carries it
        slow = 1.1 if r["config"] == "hc_ours" else 1.0
        for x in r["reps"]:
            x["turn_s"] = [1.0, slow + 0.1 * (r["label"] == "hc_off#2")]
    assert hc.summarize(runs)["pooled"]["hc_ours"]["turn_median_pct"] == [0.0, 4.762]  # 1.1 against 1.05
    assert hc.parse_args(["--interleave", "--parallel-start"]).parallel_start
    assert hc.parse_args(["--interleave", "--mem-fraction-static", "0.3"]).interleave
    assert hc.parse_args(["--configs", "hc_off,hc_ours_d2h4"]).config_names == ["hc_off", "hc_ours_d2h4"]
    orders = ["".join(hc.round_order("ABC", r)) for r in range(6)]
    assert sorted(orders) == sorted({"ABC", "ACB", "BAC", "BCA", "CAB", "CBA"})  # each in each position, twice
    assert ["".join(hc.round_order("AB", r)) for r in range(-1, 4)] == ["AB", "AB", "BA", "BA", "AB"]
    for bad in (["--configs", "hc_off,ours"], ["--group", "0"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            hc.parse_args(bad)


def test_a_cut_off_hicache_row_still_pairs_its_complete_rounds_and_a_time_budget_stops_between_rounds(monkeypatch):
    """A device call can end before the bench's report: its progress log alone gives the pooled rows
    (``paired_rounds.runs_from_log``: roles from ``--kv-canary``, each repetition's turns, only rounds every server
    finished); ``--time-budget-s`` starts no round that would end past it, so the report is written in time."""
    hc = _load("bench_hicache_overhead")
    pr = sys.modules["paired_rounds"]
    lines = ["[00:00:00] [hc_off#1] starting a HiCache server (--kv-canary none) ...",
             "[00:00:00] [hc_ours#1] starting a HiCache server (--kv-canary raise) ...",
             "[00:00:00] [hc_ours#2] starting a HiCache server (--kv-canary raise) ..."  # servers started in
             "[00:00:00] [hc_off#2] starting a HiCache server (--kv-canary none) ...",  # parallel: one line, two
             "[00:00:01] [hc_ours#1] rep warmup:    9.000s cached_tokens=1 load_back_tokens=1 turn_s=3.0,3.0,3.0"]
    walls = {"hc_off#1": (2.0, 2.0, 2.0), "hc_off#2": (2.2, 2.2), "hc_ours#1": (2.2, 2.31, 2.0),
             "hc_ours#2": (2.2, 2.31)}
    for label, ws in walls.items():
        for rep, w in enumerate(ws):
            lines.append(f"[00:00:02] [{label}] rep {rep}:    {w:.3f}s cached_tokens=5 load_back_tokens=5 "
                         f"turn_s={w / 2:.4f},{w / 2:.4f}")
    lines.append("[00:00:03] [hc_off#1] rep 3:    2.000s cached_tokens=5 load_back_tokens=5")  # an older log line
    runs = pr.runs_from_log("\n".join(lines))
    assert [(r["label"], r["role"], [x["rep"] for x in r["reps"]]) for r in runs] == [
        ("hc_off#1", "off", [0, 1]), ("hc_ours#1", "ours", [0, 1]), ("hc_ours#2", "ours", [0, 1]),
        ("hc_off#2", "off", [0, 1])]
    got = pr.pooled(runs, seed=len(runs))["hc_ours"]
    assert got["pair_pct"] == [4.762, 10.0] and got["turn_median_pct"] == [7.381, 7.381]

    clock = [0.0]  # each repetition takes 10 s; the servers are up at 100 s
    monkeypatch.setattr(hc.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hc, "start_server", lambda label, name, plan, args, log_dir: (
        object(), {"label": label, "error": None, "reps": []}))

    def rep_of(server, result, args, plan, rep):
        clock[0] += 10.0
        result["reps"].append(rep)
    monkeypatch.setattr(hc, "time_repetition", rep_of)
    monkeypatch.setattr(hc, "finish_server", lambda server, result, args, plan, log_dir: result)
    args = hc.parse_args(["--interleave", "--reps", "50", "--time-budget-s", "175"])
    args.t0, clock[0] = 0.0, 100.0
    done = hc.run_interleaved([("hc_off#1", "hc_off"), ("hc_ours#1", "hc_ours")], {}, args, None)
    assert [r["reps"] for r in done] == [[-1, 0, 1]] * 2  # 100 + 3 rounds of 20 s = 160; a fourth would end at 180
    for bad in (["--time-budget-s", "100"], ["--interleave", "--time-budget-s", "-1"]):
        with pytest.raises(SystemExit):
            hc.parse_args(bad)


def test_the_stack_summary_counts_samples_after_the_base_and_the_trace_summary_unions_busy_time(tmp_path):
    """bench_hicache_overhead --sample-stacks: per process, the samples after the warmup's base; the canary's share is
    the samples whose innermost sglang/canary frame is the canary's. trace_summary: the GPU's busy time is the union
    of its events over every stream (overlaps counted once)."""
    hc = _load("bench_hicache_overhead")
    doc = {"pid": 7, "title": "sglang::scheduler", "samples": 100,
           "owners": {"sglang/srt/managers/scheduler.py:recv_requests": 70, "kv_canary/d2h.py:snapshot": 30},
           "canary_paths": {"adapter/hooks.py:around_forward > d2h.py:snapshot": 30}}
    (tmp_path / "7.json").write_text(json.dumps(doc))
    base = {7: {"samples": 40, "owners": {"sglang/srt/managers/scheduler.py:recv_requests": 30,
                                          "kv_canary/d2h.py:snapshot": 10}}}
    got = hc.stack_summary(hc.read_stacks(tmp_path), base)["sglang::scheduler (pid 7)"]
    assert (got["samples"], got["canary_samples"], got["canary_pct"]) == (60, 20, 33.33)
    assert list(got["top_owners"]) == ["sglang/srt/managers/scheduler.py:recv_requests", "kv_canary/d2h.py:snapshot"]
    assert got["canary_paths"] == {"adapter/hooks.py:around_forward > d2h.py:snapshot": 30}  # no base: all of them
    ts = _load("trace_summary")
    assert ts._union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0 and ts._union([]) == 0.0
    gaps = ts.idle_gaps(ts._busy_runs([(0, 2), (1, 3), (13, 14), (614, 700), (5.5, 5.7)]))
    assert [(g["count"], g["us"]) for g in gaps] == [(2, 9.8), (0, 0.0), (1, 600.0), (0, 0.0), (0, 0.0)]
    line = hc.profile_line({"window_us": 1500.0, "gpu_busy_us": 1200.0, "gpu_canary_kernel_us": 30.0,
                            "gpu_canary_kernel_launches": 8, "gpu_idle_gaps": gaps})  # the bench log's line
    assert line.startswith("profile: window 1.5 ms, GPU busy 1.2 ms, canary kernels 0.0 ms in 8 launches; ")
    assert "<=20.0us 2 / 0.0 ms" in line and "<=1000.0us 1 / 0.6 ms" in line
    assert hc.profile_line({"error": "no trace"}) == "profile: ERROR no trace"


def test_trace_summary_splits_a_step_into_the_graphs_gpu_span_the_gap_after_it_and_the_hosts_lead():
    """trace_summary.graph_steps: a model graph's replays are the graph launches with many kernels (by correlation
    id); per replay its GPU span, the gap to the next one, and how far ahead the host launched it. busy_run_lengths:
    the long busy runs and the gap after each. runtime_calls: per thread, what it asked the driver."""
    ts = _load("trace_summary")

    def launch(ts_, corr, start, n=60, dur=1000.0):  # one graph launch and its n kernels back to back
        kern = [{"ph": "X", "cat": "kernel", "name": "k", "ts": start + i * dur / n, "dur": dur / n + 0.01,
                 "args": {"correlation": corr}} for i in range(n)]
        return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts_, "dur": 5.0, "pid": 1,
                 "tid": 2, "args": {"correlation": corr}}] + kern

    small = launch(50.0, 9, 1500.0, n=1, dur=3.0)  # a one-kernel graph (a counter publish): not a model replay
    events = launch(0.0, 1, 400.0) + launch(500.0, 2, 1500.0) + launch(900.0, 3, 2600.0) + small
    got = ts.graph_steps(events)
    assert got == {"replays": 3, "span_median_us": 1000.0, "gap_after_median_us": 100.0, "gap_after_max_us": 100.0,
                   "lead_median_us": 1000.0}
    runs = ts._busy_runs((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    assert ts.busy_run_lengths(runs)["count"] == 3
    calls = ts.runtime_calls(events)
    assert calls == {"1/2": [{"name": "cudaGraphLaunch", "us": 20.0, "count": 4}]}


def test_host_timers_split_a_batch_boundary_and_the_summary_counts_what_came_after_the_base():
    """benchmarks/stack_sampler/host_timers.py: a wrapped scheduler times its methods per forward mode (a method
    without a batch inside ``run_batch`` takes that batch's mode) and each boundary's segments (last decode launch
    -> first request -> extend launch -> first decode launch); bench_hicache_overhead sums what came after the
    warmup's snapshot, the garbage collections too."""
    spec = importlib.util.spec_from_file_location("host_timers", ROOT / "benchmarks" / "stack_sampler" / "host_timers.py")
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    clock = [0.0]
    ht.time = type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])})

    class Mode:
        def __init__(self, extend):
            self.extend = extend

        def is_extend(self):
            return self.extend

        def is_decode(self):
            return not self.extend

    def batch(extend):
        return type("Batch", (), {"forward_mode": Mode(extend)})()

    class Oracle:
        def stage(self):
            clock[0] += 0.001

    class Scheduler:
        def __init__(self):
            self.arrived = []

        def run_batch(self, b):
            if b.forward_mode.is_extend():
                Oracle().stage()
            clock[0] += 0.004

        def recv_requests(self):
            clock[0] += 0.0005
            return self.arrived

    module = type(sys)("sglang.srt.managers.scheduler")
    module.Scheduler = Scheduler
    oracle_module = type(sys)("kv_canary.token_oracle")
    oracle_module.TokenOracle = Oracle
    sys.modules.update({module.__name__: module, oracle_module.__name__: oracle_module})
    try:
        ht.patch_ready()
        assert Scheduler.run_batch.__wrapped__ is not None and Oracle.stage.__wrapped__ is not None
        s = Scheduler()

        def boundary():
            s.run_batch(batch(False))  # the last decode launch, 4 ms
            s.arrived = []
            s.recv_requests()  # nothing yet
            clock[0] += 0.010
            s.arrived = ["r"]
            s.recv_requests()  # the first request, 10.5 + 0.5 ms after the decode launch ended
            s.recv_requests()  # more: not a new first request
            clock[0] += 0.002
            s.run_batch(batch(True))  # 2.5 ms after the first request; a 5 ms launch (1 ms of it staging)
            clock[0] += 0.0007
            s.run_batch(batch(False))  # the first decode, 0.7 ms after

        boundary()
        then = ht.snapshot()
        boundary()
        boundary()
        got = _load("server_probes").timer_summary(ht.snapshot(), then)
    finally:
        del sys.modules[module.__name__], sys.modules[oracle_module.__name__]
    assert got["boundaries"] == {
        "decode_to_recv": {"n": 2, "median_ms": 11.0, "mean_ms": 11.0},
        "recv_to_extend": {"n": 2, "median_ms": 2.5, "mean_ms": 2.5},
        "extend_launch": {"n": 2, "median_ms": 5.0, "mean_ms": 5.0},
        "extend_to_decode": {"n": 2, "median_ms": 0.7, "mean_ms": 0.7}}
    assert got["calls"]["TokenOracle.stage:e"] == {"calls": 2, "ms": 2.0, "us_per_call": 1000.0}
    assert got["calls"]["Scheduler.run_batch:e"]["calls"] == 2 and got["calls"]["Scheduler.run_batch:d"]["calls"] == 4
    assert got["calls"]["Scheduler.recv_requests"]["calls"] == 6
    hc = _load("server_probes")
    assert hc.gc_summary({"0": [12, 0.5, 0.01], "2": [1, 0.3, 0.3]}, {"0": [2, 0.1, 0.01]}) == {
        "0": [10, 0.4, 0.01], "2": [1, 0.3, 0.3]}


def test_host_timers_key_the_layers_span_by_prefix_and_the_summary_subtracts_syncs_and_spans():
    """--sync-debug / the layers' GPU span (bench only): an extend's span is keyed by whether it has a cached prefix
    (a load-back turn), a sync by its innermost sglang / canary frames, and the summary counts what came after the
    warmup's snapshot (the CUDA parts run on the GPU host only)."""
    spec = importlib.util.spec_from_file_location("host_timers", ROOT / "benchmarks" / "stack_sampler" / "host_timers.py")
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    fb = lambda prefix: type("FB", (), {"extend_prefix_lens_cpu": prefix})()  # noqa: E731
    assert ht._span_key("LlamaModel.forward", "e", (None, None, fb([0, 0])), {}) == "LlamaModel.forward:e0"
    assert ht._span_key("LlamaModel.forward", "e", (None, None), {"forward_batch": fb([0, 1088])}) == \
        "LlamaModel.forward:ep"
    assert ht._span_key("LlamaModel.forward", "d", (), {}) == "LlamaModel.forward:d"
    then = {"calls": {}, "boundaries": {}, "syncs": {"e|a:f:1": 2}, "gpu_spans": {"L:ep": [2, 50.0]}}
    now = {"calls": {"x": [1, 0.001, 0.001]}, "boundaries": {}, "syncs": {"e|a:f:1": 5, "-|b:g:2": 1},
           "gpu_spans": {"L:ep": [4, 110.0], "L:e0": [1, 186.0]}}
    got = _load("server_probes").timer_summary(now, then)
    assert got["syncs"] == {"e|a:f:1": 3, "-|b:g:2": 1}
    assert got["gpu_spans"] == {"L:ep": {"spans": 2, "ms_per_span": 30.0}, "L:e0": {"spans": 1, "ms_per_span": 186.0}}


def test_idle_ablation_skips_the_managers_per_forward_work_only_when_asked():
    """``hc_ours_idle``: with KVC_DIAG_CANARY_IDLE=1 the sampler directory's sitecustomize makes a fresh
    interpreter's CanaryManager skip its per-forward flow once its module is imported; without it, nothing changes."""
    import os
    import subprocess

    hc = _load("bench_hicache_overhead")
    role, args, env = hc.CONFIGS["hc_ours_idle"]
    assert role == "ours" and args == hc.OURS == ("--kv-canary", "raise", "--kv-canary-real-data", "partial") and env == {hc.IDLE_ENV: "1"}
    probe = ("from kv_canary.runner.manager import CanaryManager as M; "
             "print(getattr(M, 'kvc_diag_idle', False), M.pre_ops_maybe_inside_graph(None, None), "
             "M.record_sampled(None, None), M.post_ops_maybe_inside_graph.__name__)")
    path = os.pathsep.join([str(ROOT / "benchmarks" / "stack_sampler"), str(ROOT / "python")])
    base = {k: v for k, v in os.environ.items() if k not in (hc.IDLE_ENV, "KVC_STACK_SAMPLE_DIR")}
    idle = subprocess.run([sys.executable, "-c", probe], env={**base, "PYTHONPATH": path, hc.IDLE_ENV: "1"},
                          capture_output=True, text=True, timeout=300)
    assert idle.returncode == 0, idle.stderr[-2000:]
    assert idle.stdout.split() == ["True", "None", "None", "_idle"]
    busy = subprocess.run([sys.executable, "-c", "from kv_canary.runner.manager import CanaryManager as M; "
                           "print(getattr(M, 'kvc_diag_idle', False), M.post_ops_maybe_inside_graph.__name__)"],
                          env={**base, "PYTHONPATH": path}, capture_output=True, text=True, timeout=300)
    assert busy.returncode == 0, busy.stderr[-2000:]
    assert busy.stdout.split() == ["False", "post_ops_maybe_inside_graph"]


def test_rows_on_several_hosts_pool_each_round_against_its_own_hosts_off_servers():
    """``paired_rounds.across_hosts``: each log's rounds against that log's off servers, then all rounds together
    (a slow host's seconds never meet a fast host's); per turn the ms a repetition the canary's servers add; a log
    without the configuration adds no rounds."""
    _load("bench_hicache_overhead")
    pr = sys.modules["paired_rounds"]

    def log(walls):
        lines = [f"[00:00:00] [{label}] starting a HiCache server (--kv-canary {'none' if 'off' in label else 'raise'})"
                 for label in walls]
        for label, ws in walls.items():
            lines += [f"[00:00:01] [{label}] rep {rep}:    {w:.3f}s cached_tokens=5 load_back_tokens=5 "
                      f"turn_s={w / 2:.4f},{w / 2:.4f}" for rep, w in enumerate(ws)]
        return pr.runs_from_log("\n".join(lines))

    fast = log({"hc_off#1": (2.0, 2.0), "hc_off#2": (2.0, 2.0), "hc_ours#1": (2.02, 2.0), "hc_ours#2": (2.02, 2.04)})
    slow = log({"hc_off#1": (4.0, 4.0, 4.0), "hc_off#2": (4.0, 4.0, 4.0), "hc_ours#1": (4.0, 4.08, 4.0),
                "hc_ours#2": (4.0, 4.0, 4.0)})
    no_ours = log({"hc_off#1": (3.0,), "hc_off#2": (3.0,)})
    got = pr.across_hosts([fast, slow, no_ours], seed=0)["hc_ours"]
    # fast: +1%, +1%; slow: 0%, +1%, 0% (each against its own off servers, never 2 s against 4 s)
    assert got["rounds"] == 5 and got["logs"] == 2 and got["per_log_median_pct"] == [1.0, 0.0]
    assert got["median_pct"] == 1.0 and got["mean_pct"] == 0.6
    assert got["ci90_pct"][0] <= 1.0 <= got["ci90_pct"][1]
    # per turn, ms a repetition: fast rounds +10 / +10 ms a turn, slow 0 / +20 / 0
    assert got["turn_ms_per_rep"] == [10.0, 10.0]
