"""benchmarks/profile_decode.py's trace reduction (no server, no GPU): a synthetic torch-profiler trace of four
decode steps, each a forward graph replay followed by the canary's one-kernel publish graph, with sglang's own
work between them, reduces to the per-step numbers the benchmark reports; a bad ``--configs`` or ``--rows`` entry
is refused before any server starts."""

from __future__ import annotations

import gzip
import json

import pytest

from script_loader import _load  # test/unit: on the path under pytest

_load("overhead_plan")
_load("overhead_client")
profile_decode = _load("profile_decode")

STEP_US = 1000.0
GEMM_US = 30.0  # one of the forward's 24 kernels, each followed by a 1 us gap
KERNELS_PER_GRAPH = 24


def _trace(path, steps=4, canary=True):
    events, corr = [], 0

    def launch(ts, name="cudaGraphLaunch"):
        nonlocal corr
        corr += 1
        events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 5.0,
                       "args": {"correlation": corr}})
        return corr

    def kernel(c, ts, dur, name, stream=7):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                       "args": {"correlation": c, "stream": stream}})

    for s in range(steps):
        t = s * STEP_US
        c = launch(t)
        k0 = t + 100.0
        for i in range(KERNELS_PER_GRAPH):
            kernel(c, k0 + i * (GEMM_US + 1.0), GEMM_US, "gemm_gate_up" if i % 2 else "attention")
        end = k0 + KERNELS_PER_GRAPH * (GEMM_US + 1.0) - 1.0
        if canary:  # the TAIL's write beside the last kernel (another stream of the graph), then the publish graph
            kernel(c, end - 10.0, 8.0, "write_kernel", stream=9)
            kernel(launch(t + 10.0), end + 2.0, 3.0, "_publish_kernel")
        kernel(launch(t + 20.0, "cudaLaunchKernel"), end + 10.0, 20.0, "argmax")  # sampling, outside the graph
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_a_step_is_the_forward_graph_and_the_publish_graph_is_outside_work(tmp_path):
    got = profile_decode.analyze_trace(_trace(tmp_path / "ours.trace.json.gz"))
    assert got["graph_replays"] == 4 and got["small_graph_replays"] == 4
    assert got["device_period_us"]["median"] == STEP_US
    assert got["graph_kernels"]["median"] == KERNELS_PER_GRAPH + 1
    span = KERNELS_PER_GRAPH * (GEMM_US + 1.0) - 1.0
    assert got["graph_span_us"]["median"] == span
    assert got["graph_kernel_us"]["median"] == KERNELS_PER_GRAPH * GEMM_US + 8.0
    assert got["graph_gaps_us"]["median"] == KERNELS_PER_GRAPH - 1  # the write ran inside the last kernel
    assert got["canary_kernel_us"] == {"stream9": {"n": 4, "median": 8.0, "mean": 8.0, "p10": 8.0, "p90": 8.0}}
    assert got["small_graph_kernel_us_per_step"] == 3.0
    assert got["between_busy_us"]["median"] == 3.0 + 20.0  # the publish kernel and sampling
    assert got["device_idle_us"]["median"] == STEP_US - span - 23.0
    assert got["graph_kernels_by_name_us_per_step"]["gemm_gate_up"] == [KERNELS_PER_GRAPH / 2 * GEMM_US, 12.0]
    # the write ran beside the graph's last kernel (and it beside the write): 8 us each
    assert got["overlapped_us_per_step"] == {"gemm_gate_up": 8.0, "write_kernel": 8.0}
    assert "s7:argmax" in got["outside_kernels_by_name_us_per_step"]


def test_without_the_canary_there_is_no_publish_graph(tmp_path):
    got = profile_decode.analyze_trace(_trace(tmp_path / "off.trace.json.gz", canary=False))
    assert got["graph_replays"] == 4 and got["small_graph_replays"] == 0
    assert got["canary_kernel_us"] == {} and got["overlapped_us_per_step"] == {}
    assert got["graph_kernels"]["median"] == KERNELS_PER_GRAPH


def test_a_config_entry_names_its_config_env_and_path_or_is_refused():
    name, config, env, path = profile_decode.parse_config("nowit:ours;SGLANG_KV_CANARY_WRITE_WITNESS=0;@/tmp/x")
    assert (name, config.name, env, path) == ("nowit", "ours", {"SGLANG_KV_CANARY_WRITE_WITNESS": "0"}, "/tmp/x")
    assert profile_decode.parse_config("ours_idle")[1].name == "ours_idle"
    for bad in ("nosuch", "x:nosuch", "ours;NOEQUALS", "ours;@"):
        with pytest.raises(SystemExit, match="--configs"):
            profile_decode.parse_config(bad)


def test_rows_are_the_benchs_named_rows_or_decode_rows_per_batch_size():
    assert [(r.name, r.batch, r.input_len, r.output_len) for r in profile_decode.select_rows("1,32", "")] == [
        ("decode_bs1", 1, 1024, 512), ("decode_bs32", 32, 1024, 256)]
    shared = profile_decode.select_rows("1,32", "shared_prefix")
    assert [(r.name, r.batch, r.shared_prefix_len) for r in shared] == [("shared_prefix", 64, 4096)]
    with pytest.raises(SystemExit, match="--rows 'shared_prefix,nosuch': nosuch not among"):
        profile_decode.select_rows("32", "shared_prefix,nosuch")
