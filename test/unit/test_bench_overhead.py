"""The side-by-side overhead benchmark's logic (no server), the docs generator, and the canary memory function.

The benchmark itself runs on the GPU host; ``scripts/bench_overhead.py --device cpu`` is its smoke run.
These tests pin what cannot be seen there: the summary arithmetic for every role (upstream included), the
shared-prefix prompts, the memory table and the storm verdict, and the doc regeneration.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kv_canary.memory import canary_memory_bytes
from script_loader import ROOT, _load  # test/unit: on the path under pytest


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


def test_the_cli_takes_its_rows_and_configs_from_the_plan():
    """A row compared with another shape's off median brings that shape in; an upstream config needs its site."""
    args = bench.parse_args(["--device", "cpu", "--rows", "decode_bs64_sweep16", "--configs", "off,on"])
    assert args.row_names == ["decode_bs64", "decode_bs64_sweep16"] and args.config_names == ["off", "ours"]
    assert args.scale == overhead_plan.CPU_DEFAULT_SCALE and args.upstream_site is None
    assert bench.parse_args(["--device", "cpu"]).config_names == list(overhead_plan.CPU_DEFAULT_CONFIGS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--configs", "upstream"])


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
    results = tmp_path / "results"
    results.mkdir()
    doc = tmp_path / "performance.md"
    doc.write_text(f"# P\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\n## History\n\nkept\n")
    rows = {"decode_bs1": {"off_s": 2.5, "ours_pct": 0.3, "upstream_pct": 3.4, "noise_pct": 0.02},
            "decode_bs64_sweep16": {"off_s": 4.4, "ours_pct": 1.5, "upstream_pct": 55.0, "noise_pct": 0.1}}
    (results / "overhead.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "date": "2026-11-22", "command": "python3 scripts/bench_overhead.py", "rows": rows}))
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 1
    assert report.main(["--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "old" not in text and "## History\n\nkept" in text and text.startswith("# P\n\nintro")
    assert "| +0.30% | +3.40% | +0.02% | ≤ 0.5%: met |" in text
    assert "+1.50% | +55.00% | +0.10% | ≤ 1%: **missed** |" in text
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 0


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
    """scripts/bench_pd_overhead.py (issue 25): the plan's flags without its own memory fraction (PDCluster and
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


def test_the_hicache_bench_sends_every_turn_of_every_conversation_and_summarizes_against_its_first_off_server():
    """scripts/bench_hicache_overhead.py (issue 24): a repetition is turn by turn, ``group`` conversations a batch,
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
    """scripts/stack_sampler/host_timers.py: a wrapped scheduler times its methods per forward mode (a method
    without a batch inside ``run_batch`` takes that batch's mode) and each boundary's segments (last decode launch
    -> first request -> extend launch -> first decode launch); bench_hicache_overhead sums what came after the
    warmup's snapshot, the garbage collections too."""
    spec = importlib.util.spec_from_file_location("host_timers", ROOT / "scripts" / "stack_sampler" / "host_timers.py")
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
    spec = importlib.util.spec_from_file_location("host_timers", ROOT / "scripts" / "stack_sampler" / "host_timers.py")
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
    assert role == "ours" and args == ("--kv-canary", "raise") and env == {hc.IDLE_ENV: "1"}
    probe = ("from kv_canary.runner.manager import CanaryManager as M; "
             "print(getattr(M, 'kvc_diag_idle', False), M.pre_ops_maybe_inside_graph(None, None), "
             "M.record_sampled(None, None), M.post_ops_maybe_inside_graph.__name__)")
    path = os.pathsep.join([str(ROOT / "scripts" / "stack_sampler"), str(ROOT / "python")])
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
