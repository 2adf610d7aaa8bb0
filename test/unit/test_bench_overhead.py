"""The side-by-side overhead benchmark's logic (no server), the docs generator, and the canary memory function.

The benchmark itself runs on the GPU host; ``benchmarks/bench_overhead.py --device cpu`` is its smoke run.
These tests pin what cannot be seen there: the summary arithmetic for every role (upstream included), the
shared-prefix prompts, the memory table and the storm verdict, and the doc regeneration.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kv_canary.memory import canary_memory_bytes
from script_loader import _load  # test/unit: on the path under pytest


overhead_plan = _load("overhead_plan")  # the modules bench_overhead imports, loaded first so it imports these same ones
overhead_client = _load("overhead_client")
overhead_summary = _load("overhead_summary")
bench = _load("bench_overhead")
report = _load("overhead_report")


def test_shared_prefix_prompts_share_the_system_prompt_and_nothing_else():
    src = overhead_client.PromptSource((1000, 128256), seed=0)
    row = overhead_plan.ROWS["shared_prefix"]
    warm, rep0 = src.batch(row, -1), src.batch(row, 0)
    system = warm[0][: row.shared_prefix_len]
    assert all(len(p) == row.input_len for p in warm + rep0)
    assert all(p[: row.shared_prefix_len] == system for p in warm + rep0)  # every request, every repetition
    own = {tuple(p[row.shared_prefix_len:][:2]) for p in warm + rep0}
    assert len(own) == 2 * row.batch  # each request's own part starts with a unique id
    fresh = src.batch(overhead_plan.ROWS["decode_bs64"], 0)
    assert len({tuple(p[:2]) for p in fresh}) == 64 and not any(p[:len(system)] == system for p in fresh)
    scaled = row.scaled(1 / 64)
    assert (scaled.shared_prefix_len, scaled.input_len, scaled.batch) == (64, 66, 64)


def test_kv_pool_counts_a_shared_prefix_once():
    rows = [overhead_plan.ROWS["shared_prefix"]]
    assert overhead_plan.needed_kv_tokens(rows) == 30720  # (4096 + 64 * (64 + 256)) * 1.25, a multiple of 1024


def test_the_pool_fill_writes_more_prompt_tokens_than_the_pool_has_slots_in_the_longest_rows_prompts():
    """--fill-pool: prefill-only requests of the longest row's prompt length, a sixteenth more tokens than the pool's
    slots (every slot written once), their prompts fresh (no radix hit, on the fill or on a row)."""
    rows = [overhead_plan.ROWS[n] for n in ("decode_bs1", "prefill_bs8", "shared_prefix")]
    fill = overhead_plan.fill_row(rows, 131072)
    assert (fill.input_len, fill.output_len, fill.shared_prefix_len) == (8192, 1, 0)
    assert 131072 * 17 // 16 <= fill.prompt_tokens() < 131072 * 17 // 16 + 8192
    prompts = bench.PromptSource((10, 30000), 0)
    fill_prompts = prompts.batch(fill, -1)
    assert len({tuple(p[:2]) for p in fill_prompts}) == fill.batch  # each its own head: no prefix shared
    row_prompt = prompts.batch(overhead_plan.ROWS["decode_bs1"], -1)[0]
    assert all(p[:64] != row_prompt[:64] for p in fill_prompts)
    assert bench.parse_args(["--device", "cpu", "--fill-pool"]).fill_pool
    assert not bench.parse_args(["--device", "cpu"]).fill_pool


def test_the_cli_takes_its_rows_and_configs_from_the_plan():
    """A row compared with another shape's off median brings that shape in; an upstream config needs its site."""
    args = bench.parse_args(["--device", "cpu", "--rows", "decode_bs64_sweep16", "--configs", "off,on"])
    assert args.row_names == ["decode_bs64", "decode_bs64_sweep16"] and args.config_names == ["off", "ours"]
    assert args.scale == overhead_plan.CPU_DEFAULT_SCALE and args.upstream_site is None
    assert bench.parse_args(["--device", "cpu"]).config_names == list(overhead_plan.CPU_DEFAULT_CONFIGS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--configs", "upstream"])


def test_host_timers_sample_each_server_process(tmp_path):
    """--host-timers: a process started with the server's env runs the sampler, whose files the row summary reads
    (the process's collections included); the flag parses and leaves the rows alone."""
    import os
    import subprocess
    import sys

    probes = _load("server_probes")
    assert bench.parse_args(["--device", "cpu", "--host-timers"]).host_timers
    assert not bench.parse_args(["--device", "cpu"]).host_timers
    stacks = tmp_path / "stacks-ours1"
    env = bench.host_timer_env({"PYTHONPATH": "/elsewhere"}, stacks)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(overhead_plan.SAMPLER_DIR)
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == "/elsewhere" and env["KVC_STACK_SAMPLE_DIR"] == str(stacks)
    assert env["KVC_STACK_SAMPLE_INTERVAL_S"] == "0.25"  # the timers alone: few samples
    full = overhead_plan.sampler_env({"PYTHONPATH": "/elsewhere"}, stacks)  # full sampling: the sampler's default
    assert "KVC_STACK_SAMPLE_INTERVAL_S" not in full and full["PYTHONPATH"] == env["PYTHONPATH"]
    code = "import gc, time\nfor _ in range(3):\n    gc.collect()\n    time.sleep(1.0)\n"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True, timeout=60)
    docs = probes.read_stacks(stacks)
    assert len(docs) == 1, f"the sampler wrote {sorted(p.name for p in stacks.glob('*'))}"
    (summary,) = probes.stack_summary(docs, {}).values()
    assert summary["gc"]["2"][0] >= 2  # the full collections above, counted by the sampler's gc callback


def test_cpu_set_pins_every_server_to_the_same_cpus_and_refuses_bad_sets():
    """--cpu-set: a list, a range or 'auto' (the fastest CPUs of the pinned speed loop, measured here on this host's
    real CPUs); a set this process may not run on, or that does not parse, is refused naming the flag."""
    import os

    probes = _load("server_probes")
    mine = sorted(os.sched_getaffinity(0))
    assert bench.parse_args(["--device", "cpu", "--cpu-set", str(mine[0])]).cpus == {mine[0]}
    assert bench.parse_args(["--device", "cpu"]).cpus == set()
    for bad in ("a,b", f"{max(mine) + 1000}"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", "--cpu-set", bad])
    assert probes.parse_cpu_set("0-2,5") == {0, 1, 2, 5}
    speeds = probes.cpu_speeds_ms()
    assert sorted(speeds) == mine and all(ms > 0 for ms in speeds.values())
    assert probes.fastest_cpus({0: 30.0, 1: 21.0, 2: 22.0, 3: 40.0}, 2) == {1, 2}
    assert probes.fastest_cpus(speeds, 1) <= set(mine)


def test_thread_cpu_counts_this_threads_cpu_time_moves_and_where_it_ran():
    """thread_cpu.snapshot reads every thread of a session from /proc: this test's own thread, after a busy loop,
    shows CPU time, a CPU it may run on, and non-negative switch and move counts in ``busiest``."""
    import os
    import threading

    thread_cpu = _load("thread_cpu")
    me = f"{os.getpid()}/{threading.get_native_id()}"
    before = thread_cpu.snapshot(os.getsid(0))
    assert me in before
    end = __import__("time").process_time() + 0.3
    while __import__("time").process_time() < end:
        pass
    rows = {r["id"]: r for r in thread_cpu.busiest(before, thread_cpu.snapshot(os.getsid(0)), top=1000)}
    mine = rows[me]
    assert mine["cpu_s"] >= 0.2 and mine["cpu"] in os.sched_getaffinity(0)
    assert min(mine["preempted"], mine["voluntary"], mine["migrations"]) >= 0


def _run(label, role, medians, **extra):
    rows = {name: {"median_s": m, "hit_rate": [0.98]} for name, m in medians.items()}
    return {"label": label, "role": role, "rows": rows, **extra}


def test_summary_compares_each_canary_with_the_off_server_of_its_own_stack():
    base = {"decode_bs1": 2.0, "decode_bs64": 4.0, "shared_prefix": 5.0}
    runs = [
        _run("off#1", "off", base),
        _run("ours#1", "ours", {"decode_bs1": 2.02, "decode_bs64": 4.0, "shared_prefix": 5.05}),
        _run("ours_sweep16#1", "ours", {"decode_bs64_sweep16": 4.04}),
        _run("upstream_off#1", "upstream_off", {"decode_bs1": 2.2, "decode_bs64": 4.4, "shared_prefix": 5.5}),
        _run("upstream#1", "upstream", {"decode_bs1": 2.266, "decode_bs64": 4.444, "shared_prefix": 5.5}),
        _run("upstream_sweep16#1", "upstream", {"decode_bs64_sweep16": 6.6}),
        _run("off#2", "off", {"decode_bs1": 2.01, "decode_bs64": 3.98, "shared_prefix": 5.0}),
    ]
    rows = [overhead_plan.ROWS[n] for n in ("decode_bs1", "decode_bs64", "shared_prefix", "decode_bs64_sweep16")]
    table, details = overhead_summary.summarize(runs, rows)
    assert table["decode_bs1"] == {"off_s": 2.0, "ours_pct": 1.0, "upstream_pct": 3.0, "noise_pct": 0.5}
    assert table["decode_bs64"] == {"off_s": 4.0, "ours_pct": 0.0, "upstream_pct": 1.0, "noise_pct": -0.5}
    assert table["decode_bs64_sweep16"] == {"off_s": 4.0, "ours_pct": 1.0, "upstream_pct": 50.0, "noise_pct": -0.5}
    assert set(table["shared_prefix"]) == {"off_s", "ours_pct", "upstream_pct", "noise_pct"}  # the issue's shape
    assert details["decode_bs1"]["upstream_baseline"] == "upstream_off#1"
    assert details["shared_prefix"]["hit_rate_ok"] is True
    # Without an upstream_off server, upstream is compared with 0.5.12 off; missing servers give None.
    table, _ = overhead_summary.summarize([runs[0], runs[4]], rows[:1])
    assert table["decode_bs1"] == {"off_s": 2.0, "ours_pct": None, "upstream_pct": 13.3, "noise_pct": None}


def test_the_layout_control_splits_the_canarys_work_from_its_presence():
    """ours_idle: the canary installed and idle (its sitecustomize first on PYTHONPATH); the details give ours
    against it (the work) and it against off (the presence), where it measured the row. It names `all`: the twin of
    ``ours_all_rows`` on every line (0.5.23's flag defaults to none)."""
    plan = {"env": {"SGLANG_EXTERNAL_MODEL_PACKAGE": ""}, "storm_warmup_forwards": 256}
    config = overhead_plan.CONFIGS["ours_idle"]
    env = overhead_plan.server_env(config, plan, None, {})
    assert env[overhead_plan.IDLE_ENV] == "1" and config.args == overhead_plan.CONFIGS["ours_all_rows"].args
    assert env["PYTHONPATH"].split(":")[0] == str(overhead_plan.SAMPLER_DIR)
    # a fresh interpreter with that environment gets an idle CanaryManager
    import os
    import subprocess
    import sys

    probe = ("from kv_canary.runner.manager import CanaryManager as M; "
             "print(getattr(M, 'kvc_diag_idle', False), M.pre_ops_maybe_inside_graph(None, None))")
    base = {k: v for k, v in os.environ.items() if k not in ("KVC_STACK_SAMPLE_DIR", "PYTHONPATH")}
    idle = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True,
                          timeout=300)
    assert idle.returncode == 0, idle.stderr[-2000:]
    assert idle.stdout.split() == ["True", "None"]
    assert "PYTHONPATH" not in overhead_plan.server_env(overhead_plan.CONFIGS["ours"], plan, None, {})
    runs = [
        _run("off#1", "off", {"decode_bs1": 2.0, "decode_bs64": 4.0}),
        _run("ours#1", "ours", {"decode_bs1": 2.02, "decode_bs64": 4.0}),
        _run("ours_idle#1", "variant", {"decode_bs1": 2.01}, config="ours_idle"),
        _run("ours_all_rows#1", "ours", {"decode_bs1_all": 2.03}, config="ours_all_rows"),
    ]
    rows = [overhead_plan.ROWS[n] for n in ("decode_bs1", "decode_bs64", "decode_bs1_all")]
    table, details = overhead_summary.summarize(runs, rows)
    assert table["decode_bs1"]["ours_pct"] == 1.0  # the table still compares with off
    assert details["decode_bs1"]["ours_vs_idle_pct"] == 0.5
    assert details["decode_bs1"]["idle_vs_off_pct"] == 0.5
    assert "ours_vs_idle_pct" not in details["decode_bs64"]  # the control did not measure it
    assert details["decode_bs1_all"]["ours_vs_idle_pct"] == 1.0  # every byte, against the control's bs1
    assert set(overhead_plan.CONFIGS["ours_idle"].rows) == set(overhead_plan.BASE_ROWS)


def test_low_radix_hit_rate_is_flagged():
    runs = [_run("off#1", "off", {"shared_prefix": 5.0})]
    runs[0]["rows"]["shared_prefix"]["hit_rate"] = [0.95, 0.5]
    _, details = overhead_summary.summarize(runs, [overhead_plan.ROWS["shared_prefix"]])
    assert details["shared_prefix"]["hit_rate_ok"] is False


def test_upstream_servers_get_the_upstream_site_first_and_refuse_without_it():
    plan = {"env": {"SGLANG_EXTERNAL_MODEL_PACKAGE": ""}, "storm_warmup_forwards": 256}
    env = overhead_plan.server_env(overhead_plan.CONFIGS["upstream"], plan, "/tmp/site-upstream",
                                   {"SGLANG_KV_CANARY_X": "1"})
    assert env["PYTHONPATH"].split(":")[0] == "/tmp/site-upstream"
    assert env["SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT"] == "1" and "SGLANG_KV_CANARY_X" not in env
    assert overhead_plan.CONFIGS["upstream"].args == ("--kv-canary", "raise", "--kv-canary-real-data", "partial")
    assert "--kv-canary-sweep-interval" in overhead_plan.CONFIGS["upstream_sweep16"].args
    with pytest.raises(ValueError, match="--upstream-site"):
        overhead_plan.server_env(overhead_plan.CONFIGS["upstream_off"], plan, None, {})
    ours = overhead_plan.server_env(overhead_plan.CONFIGS["ours"], plan, None, {"SGLANG_KV_CANARY_X": "1"})
    assert ours["SGLANG_KV_CANARY_X"] == "1" and "PYTHONPATH" not in ours
    storm = overhead_plan.server_env(overhead_plan.CONFIGS["storm"], plan, None, {})
    assert storm["SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS"] == "256"  # after the warmup repetition's decode
    assert storm["SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS"] == "1"


def test_memory_table_reads_the_install_line_and_uses_the_memory_function():
    line = ("kv_canary_installed=1 mode=raise ring_capacity=4096 token_oracle=1 pool=MHATokenToKVPool groups=full "
            "slots=131073 kernels=triton max_batch_size=66 max_context_len=16384 req_rows=65 canary_bytes=8651072 "
            "kv_pool_bytes=17179869184 canary_pct_of_kv_pool=0.050")
    memory = overhead_summary.memory_table([{"role": "ours", "canary_installed_line": line}])
    this, ctx128k, many_rows = memory["cases"]
    want = canary_memory_bytes(num_slots=131073, num_groups=1, req_rows=65, context_len=16384, ring_capacity=4096,
                               token_oracle=True, max_batch_size=66)
    assert this["canary_bytes"] == want.total and this["kv_pool_bytes"] == 17179869184
    assert ctx128k["context_len"] == 131072 and ctx128k["canary_bytes"] > this["canary_bytes"]
    assert many_rows["req_rows"] == overhead_summary.DEFAULT_REQ_ROWS
    assert overhead_summary.memory_table([{"role": "off", "canary_installed_line": None}]) is None


def test_memory_table_sizes_each_setting_with_its_own_buffers():
    """A run with the default and `all` servers: one set of cases per setting, `all`'s with the full-row state; this
    run's case equals what each install line logged (the H200 run of 2026-12-01c's lines; `all`'s with the full-row
    state's chunk tickets, 4 bytes a slot, added since)."""
    head = ("kv_canary_installed=1 mode=raise sweep_interval=0 real_data={rd} scrub_slots_per_forward={scrub} "
            "ring_capacity=4096 token_oracle=1 pool=MHATokenToKVPool groups=full slots=131073 kernels=triton "
            "max_batch_size=65 max_context_len=16388 max_tokens_per_forward=32837 req_rows=65 canary_bytes={b} "
            "kv_pool_bytes=17180000256")
    runs = [{"role": "off", "canary_installed_line": None},
            {"role": "ours", "canary_installed_line": head.format(rd="partial", scrub=0, b=5772056)},
            {"role": "ours", "canary_installed_line": head.format(rd="all", scrub=256, b=8491836)},
            {"role": "ours", "canary_installed_line": head.format(rd="all", scrub=256, b=8491836)}]
    memory = overhead_summary.memory_table(runs)
    cases = {c["case"]: c for c in memory["cases"]}
    assert len(cases) == 6 and memory["logged_canary_bytes"] == 5772056
    assert memory["logged_by_setting"] == {"real data partial": 5772056, "real data all, scrub 256": 8491836}
    partial, every = cases["this run (real data partial)"], cases["this run (real data all, scrub 256)"]
    assert partial["canary_bytes"] == 5772056 and partial["breakdown"]["full_row"] == 0
    assert every["canary_bytes"] == 8491836 and every["breakdown"]["full_row"] == 8491836 - 5772056
    text = report.memory_section(memory)
    assert "| this run (real data all, scrub 256) | 131,073 | 65 | 16,388 |" in text and "full-row state" in text


def test_storm_summary_checks_each_distinct_violation_is_logged_once():
    v = {"kind": "kv_hash", "group": "full", "slot": "7", "position": "12", "stored": "1", "expected": "2"}
    storm = _run("storm#1", "storm", {"shared_prefix": 5.1}, violations_logged=[v],
                 perturbations=[{"kv_canary_perturb": "real_kv_used", "position": "12"}],
                 canary_stats_last={"violations": "900", "violations_repeated": "899"}, violation_lines=1)
    runs = [_run("off#1", "off", {"shared_prefix": 5.0}), _run("ours#1", "ours", {"shared_prefix": 5.0}), storm]
    s = overhead_summary.storm_summary(runs)
    assert s["storm_vs_clean_ours_pct"] == 2.0 and s["injected_in_shared_prefix"]
    assert s["distinct_violations_logged_once"] and s["violations_repeated"] == 899
    storm["violations_logged"] = [v, dict(v)]
    assert not overhead_summary.storm_summary(runs)["distinct_violations_logged_once"]


def test_report_regenerates_the_doc_section_and_keeps_the_rest(tmp_path):
    results = tmp_path / "docs" / "results"
    (results / "run-a").mkdir(parents=True)
    doc = tmp_path / "performance.md"
    doc.write_text(f"# P\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\n## History\n\nkept\n")
    rows = [{"line": "0.5.12", "device": "H200", "date": "2026-11-22", "row": "decode_bs1", "config": "defaults",
             "off_s": 2.5, "ours_pct": 0.3, "ours_vs_idle_pct": 0.1, "upstream_pct": 3.4, "noise_pct": 0.02,
             "run": "docs/results/run-a/x.json"},
            {"line": "0.5.23", "device": "H200", "date": "2026-11-22", "row": "decode_bs64",
             "config": "sweep every 16 forwards", "off_s": 4.4, "ours_pct": 1.5, "upstream_pct": 55.0,
             "noise_pct": 0.1, "run": "docs/results/run-a/x.json"}]
    (results / "run-a" / "extra.json").write_text(json.dumps({"storm": {"storm_s": 1.0, "storm_vs_clean_ours_pct": 9.0}}))
    (results / "overhead.json").write_text(json.dumps(
        {"rows": rows, "goals_pct": {"defaults": 0.5, "sweep every 16 forwards": 1.0},
         "memory_and_storm": "docs/results/run-a/extra.json"}))
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 1
    assert report.main(["--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "old" not in text and "## History\n\nkept" in text and text.startswith("# P\n\nintro")
    assert "| 0.5.12 | H200 | decode bs1 (1k in, 512 out) | defaults | 2026-11-22 | 2.500 | +0.30% | +0.10% | +3.40% " \
           "| +0.02% | ≤ 0.5%: met | `run-a/x.json` |" in text
    assert "| 0.5.23 | H200 | decode bs64 (1k in, 256 out) | sweep every 16 forwards | 2026-11-22 | 4.400 | +1.50% " \
           "| n/a | +55.00% | +0.10% | ≤ 1%: **missed** |" in text  # no idle control in its run
    assert "(goal ≤ 5%: **missed**)" in text  # the storm row, from the run memory_and_storm names
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 0

    # the memory table from a run of its own (``memory``), the storm still from ``memory_and_storm``
    case = {"case": "this run", "slots": 131073, "req_rows": 65, "context_len": 16388, "kv_pool_bytes": 2**34,
            "canary_bytes": 7967544, "canary_pct_of_kv_pool": 0.046,
            "breakdown": {"records": 5242920, "token_table": 266872, "ring": 262144, "counters": 120,
                          "full_row": 2195488}}
    (results / "run-b").mkdir()
    (results / "run-b" / "memory.json").write_text(json.dumps({"about": "the default", "memory": {
        "logged_canary_bytes": 7967544, "reserved_before_kv_pool": 44791272, "cases": [case]}}))
    current = json.loads((results / "overhead.json").read_text())
    (results / "overhead.json").write_text(json.dumps({**current, "memory": "docs/results/run-b/memory.json"}))
    assert report.main(["--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "this run's line said 7,967,544 bytes" in text and "budget before sglang sized it: 44,791,272 bytes" in text
    assert "| this run | 131,073 | 65 | 16,388 | 5.0 MiB | 0.3 MiB | 0.3 MiB | 2.1 MiB | 7.6 MiB | 16.00 GiB |" in text
    assert "Memory: `docs/results/run-b/memory.json` (the default)." in text
    assert "(goal ≤ 5%: **missed**)" in text


def test_committed_performance_doc_is_up_to_date():
    assert report.main(["--check"]) == 0


def test_memory_function_matches_what_a_real_manager_allocates():
    from kv_canary.adapter.batch_adapter import SglangBatchAdapter
    from kv_canary.buffer_groups import PoolLayout, build_group
    from kv_canary.config import CanaryConfig, CanaryMode
    from kv_canary.kernels import select_kernels
    from kv_canary.runner import CanaryManager
    from kv_canary.views import LaunchCapacities

    device = torch.device("cpu")
    for token_oracle in (True, False):
        config = CanaryConfig(mode=CanaryMode.LOG, ring_capacity=64, token_oracle=token_oracle)
        group = build_group(PoolLayout("full", [torch.zeros(100, 2, 8)], [torch.zeros(100, 2, 8)]), config, device)
        r2t = torch.zeros(5, 48, dtype=torch.int32)
        m = CanaryManager(config=config, groups=[group], kernels=select_kernels(config.kernel_backend, device),
                          req_to_token=r2t, capacities=LaunchCapacities(6, 48, 1, max_tokens_per_forward=200),
                          batch_adapter=SglangBatchAdapter(max_batch_size=6, device=device), device=device)
        tensors = [g.records for g in m.groups] + [m.counters, m.ring]
        allocated = sum(t.numel() * t.element_size() for t in tensors)
        allocated += m.token_oracle.memory_bytes if m.token_oracle is not None else 0
        want = canary_memory_bytes(num_slots=100, num_groups=1, req_rows=5, context_len=48, ring_capacity=64,
                                   token_oracle=token_oracle, max_batch_size=6, max_tokens_per_forward=200)
        assert want.total == allocated
        assert want.pct_of(100 * 2 * 2 * 8 * 4) == pytest.approx(100.0 * allocated / 12800)


@pytest.mark.parametrize("context_len", [4096, 32768, 131072, 1 << 20])
@pytest.mark.parametrize("req_rows", [65, 4097])
def test_canary_memory_is_at_most_2_percent_of_the_kv_pool_at_any_context_length(context_len, req_rows):
    """Llama-3-8B KV rows (32 layers x K/V x 8 heads x 128 x bf16 = 128 KiB per slot), sweep on, a pool of
    one context's worth of slots at least: nothing grows with req rows x context any more."""
    per_slot = 32 * 2 * 8 * 128 * 2
    slots = max(131072, context_len) + 1
    m = canary_memory_bytes(num_slots=slots, num_groups=1, req_rows=req_rows, context_len=context_len + 4,
                            ring_capacity=4096, token_oracle=True, max_batch_size=req_rows + 1, sweep=True)
    assert m.pct_of(slots * per_slot) <= 2.0
    assert m.token_table < 64 * (context_len + 16384 + 8 * req_rows)


def test_eagle_configs_run_speculative_decoding_on_cuda_and_compare_eagle_with_eagle(tmp_path, monkeypatch):
    monkeypatch.setattr(overhead_plan, "default_cache_dir", lambda: tmp_path)
    rows = [overhead_plan.ROWS[n] for n in overhead_plan.EAGLE_ROWS]
    plan = overhead_plan.server_plan("cuda", 1.0, rows)
    args = plan["eagle_args"]
    assert args[args.index("--speculative-algorithm") + 1] == "EAGLE"
    assert args[args.index("--speculative-eagle-topk") + 1] == "1"  # spec v2: what the canary verifies
    draft = json.loads((Path(args[args.index("--speculative-draft-model-path") + 1]) / "config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle"] and draft["num_hidden_layers"] == 1
    assert draft["hidden_size"] == overhead_plan.LLAMA3_8B_CONFIG["hidden_size"]
    v1 = plan["eagle_v1_args"]  # spec v1: topk > 1 with the overlap scheduler off (sglang's EAGLEWorker)
    assert int(v1[v1.index("--speculative-eagle-topk") + 1]) > 1 and "--disable-overlap-schedule" in v1
    assert "eagle_args" not in overhead_plan.server_plan("cpu", 1 / 64, rows)
    eagle = [overhead_plan.CONFIGS[n] for n in overhead_plan.EAGLE_CONFIGS]
    assert all(c.eagle == "v2" and c.rows == overhead_plan.EAGLE_ROWS for c in eagle)
    assert [overhead_plan.CONFIGS[n].eagle for n in overhead_plan.EAGLE_V1_CONFIGS] == ["v1"] * 3
    assert "spec v1 (topk 2" in overhead_plan.CONFIGS["eagle_v1_ours"].describe()
    assert not any(c.eagle for c in overhead_plan.CONFIGS.values() if c.name in overhead_plan.DEFAULT_CONFIGS)
    # in an EAGLE run the summary roles pair EAGLE servers with EAGLE servers only
    runs = [{"label": f"{c.name}#{i}", "role": c.role, "rows": {"decode_bs1": {"median_s": m, "hit_rate": [0.0]}}}
            for i, (c, m) in enumerate(zip(eagle, (2.0, 2.01, 2.1, 2.12, 2.0)))]
    table, _ = overhead_summary.summarize(runs, [overhead_plan.ROWS["decode_bs1"]])
    assert table["decode_bs1"] == {"off_s": 2.0, "ours_pct": 0.5, "upstream_pct": 0.95, "noise_pct": 0.0}


def test_the_pd_pair_bench_sizes_both_sides_and_summarizes_against_its_first_off_pair():
    """benchmarks/bench_pd_overhead.py (issue 25): the plan's flags without its own memory fraction (PDCluster and
    the pair size the sides), one off pair as the base, the second as the noise; bad names refused."""
    pd = _load("bench_pd_overhead")
    plan = {"args": ["--skip-tokenizer-init", "--mem-fraction-static", "0.8", "--cuda-graph-max-bs", "64"]}
    assert pd.pd_args(plan, "cpu") == ["--skip-tokenizer-init", "--cuda-graph-max-bs", "64"]
    row = overhead_plan.ROWS["decode_bs1"]
    runs = [{"label": "pd_off#1", "role": "off", "rows": {"decode_bs1": {"median_s": 2.0}}},
            {"label": "pd_ours#1", "role": "ours", "rows": {"decode_bs1": {"median_s": 2.01}}},
            {"label": "pd_off#2", "role": "off", "rows": {"decode_bs1": {"median_s": 1.99}}}]
    got = pd.summarize(runs, [row])["decode_bs1"]
    assert (got["off_s"], got["ours_pct"], got["noise_pct"]) == (2.0, 0.5, -0.5)
    args = pd.parse_args(["--device", "cpu", "--rows", "decode_bs1"])
    assert args.config_names == ["pd_off", "pd_ours", "pd_off"] and args.scale == overhead_plan.CPU_DEFAULT_SCALE
    with pytest.raises(SystemExit):
        pd.parse_args(["--configs", "pd_off,ours"])


def test_the_gpu_flags_follow_the_installed_line(tmp_path, monkeypatch):
    """0.5.23 renamed --cuda-graph-max-bs (per phase) and needs its server warmup: the plan follows the line."""
    monkeypatch.setattr(overhead_plan, "default_cache_dir", lambda: tmp_path)
    rows = [overhead_plan.ROWS["decode_bs1"]]
    monkeypatch.setattr(overhead_plan, "_installed_line", lambda: "0.5.23")
    args = overhead_plan.server_plan("cuda", 1.0, rows)["args"]
    assert args[args.index("--cuda-graph-max-bs-decode") + 1] == str(overhead_plan.CUDA_GRAPH_MAX_BS)
    assert "--cuda-graph-max-bs" not in args and "--skip-server-warmup" not in args
    assert args[args.index("--mem-fraction-static") + 1] == str(overhead_plan.GPU_MEM_FRACTION_STATIC)
    monkeypatch.setattr(overhead_plan, "_installed_line", lambda: "0.5.12")
    args = overhead_plan.server_plan("cuda", 1.0, rows)["args"]
    assert args[args.index("--cuda-graph-max-bs") + 1] == str(overhead_plan.CUDA_GRAPH_MAX_BS)
    assert "--skip-server-warmup" in args
