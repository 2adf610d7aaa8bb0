#!/usr/bin/env python3
"""End-to-end serving overhead of the kv-canary: the same batches against servers with the canary off and on.

One run starts a real sglang server once per entry of ``--configs`` (default
``off,on,off``: ``--kv-canary none``, ``--kv-canary raise`` with the default
``SGLANG_KV_CANARY_*`` settings, ``none`` again to show run-to-run noise) and,
on each, times every row: one ``/generate`` request carrying a batch of
``input_ids`` (exact concurrency), ``ignore_eos``, temperature 0, fixed
``max_new_tokens``. Every repetition uses fresh random prompts whose first two
tokens encode a per-server request counter (with the 8B vocabulary the first
token alone is unique), so there are no radix-cache hits (the cached tokens
reported by sglang are recorded as proof). One untimed warmup repetition per
row precedes ``--reps`` timed ones.

GPU (default): sglang's own ``LlamaForCausalLM`` with the Llama-3-8B shape and
dummy weights (a model folder holding only config.json and
generation_config.json), no tokenizer (``--skip-tokenizer-init``). CPU
(``--device cpu``): the bundled tiny model, sizes scaled down by ``--scale``;
the canary's Triton kernels run under ``TRITON_INTERPRET=1``. CPU timings only
prove the script works.

Reported per row: the median wall time per config, the overhead of each "on"
config against the first "off" one, and the spread of later "off" configs
against the first (noise). Also, per server: the last ``kv_canary_stats=``
line (proof the canary ran), whether decode steps ran from CUDA graphs, and
violation lines. A markdown table goes to stdout; everything goes to ``--out``
(JSON, rewritten after each server so an interrupted run keeps its results).

    export PYTHONPATH=/tmp/site:$PWD/python
    python scripts/bench_overhead.py --out bench_overhead.json
    python scripts/bench_overhead.py --device cpu                      # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import requests

from kv_canary.violations import STATS_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing import default_cache_dir
from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS, write_model_dir
from kv_canary_testing.server import SglangServer

# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Row:
    """One measured shape: ``batch`` concurrent requests of ``input_len`` prompt and ``output_len`` new tokens."""

    name: str
    batch: int
    input_len: int
    output_len: int

    def scaled(self, scale: float) -> "Row":
        return Row(self.name, self.batch, _scale_len(self.input_len, scale), _scale_len(self.output_len, scale))

    def describe(self) -> str:
        return f"bs={self.batch} in={self.input_len} out={self.output_len}"


MIN_SCALED_LEN = 2  # a scaled prompt still holds the 2-token unique request id


def _scale_len(n: int, scale: float) -> int:
    return n if n <= 1 else max(MIN_SCALED_LEN, round(n * scale))


ROWS: Dict[str, Row] = {
    r.name: r
    for r in (
        Row("decode_bs1", batch=1, input_len=1024, output_len=512),
        Row("decode_bs32", batch=32, input_len=1024, output_len=256),
        Row("decode_bs64", batch=64, input_len=1024, output_len=256),
        Row("prefill_bs8", batch=8, input_len=8192, output_len=1),
    )
}

CONFIG_MODES = {"off": "none", "on": "raise"}  # --configs entry -> --kv-canary value

# ---------------------------------------------------------------- models and server flags

LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 16384,  # room for the 8k-token prompts
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
}
LLAMA_FIRST_TOKEN_ID = 1000  # random prompt ids are drawn from [this, vocab_size)

MAX_RUNNING_REQUESTS = 64
CUDA_GRAPH_MAX_BS = 64
GPU_CHUNKED_PREFILL = 8192
GPU_MAX_PREFILL_TOKENS = 16384
GPU_MEM_FRACTION_STATIC = 0.8
GPU_MAX_TOTAL_TOKENS = 131072  # 16 GiB of Llama-3-8B KV: fits H100 and H200 next to 16 GB of weights
CPU_MAX_TOTAL_TOKENS = 4096
CPU_MIN_CHUNKED_PREFILL = 256
CPU_DEFAULT_SCALE = 1 / 64  # CPU smoke: the Triton interpreter verifies slowly
KV_HEADROOM = 1.25  # pool size over the largest row's tokens
KV_ROUND = 1024

GPU_STARTUP_TIMEOUT_S = 600.0
CPU_STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0
SETTLE_TIMEOUT_S = 30.0  # wait for the canary's idle "settled=1" stats line
SETTLE_QUIET_S = 2.0
SETTLE_POLL_S = 0.25
STOP_GRACE_S = 10.0

CUDA_GRAPH_LINE = re.compile(r"Decode batch.*?(?:cuda|cpu) graph: (True|False)")


def write_llama_dir(path: Path) -> Path:
    """Write a Llama-3-8B-shaped model folder (config only; weights are dummy, no tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG, indent=2) + "\n")
    gen = {"bos_token_id": LLAMA3_8B_CONFIG["bos_token_id"], "eos_token_id": LLAMA3_8B_CONFIG["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return path


def needed_kv_tokens(rows: Sequence[Row]) -> int:
    """KV slots the largest row needs at once, with headroom, rounded up."""
    peak = max(r.batch * (r.input_len + r.output_len) for r in rows)
    return -(-int(peak * KV_HEADROOM) // KV_ROUND) * KV_ROUND


def server_plan(device: str, scale: float, rows: Sequence[Row]) -> dict:
    """Model path, token id range, pool size, extra flags and env of the servers for ``device``."""
    common = ["--skip-tokenizer-init", "--max-running-requests", str(MAX_RUNNING_REQUESTS)]
    if device == "cuda":
        return {
            "model_path": write_llama_dir(default_cache_dir() / "bench-llama3-8b-dummy"),
            "token_range": (LLAMA_FIRST_TOKEN_ID, LLAMA3_8B_CONFIG["vocab_size"]),
            "max_total_tokens": max(GPU_MAX_TOTAL_TOKENS, needed_kv_tokens(rows)),
            "args": common + [
                "--cuda-graph-max-bs", str(CUDA_GRAPH_MAX_BS),
                "--skip-server-warmup",
                "--mem-fraction-static", str(GPU_MEM_FRACTION_STATIC),
                "--chunked-prefill-size", str(GPU_CHUNKED_PREFILL),
                "--max-prefill-tokens", str(GPU_MAX_PREFILL_TOKENS),
            ],
            # SglangServer defaults this to the tiny model's package; the 8B run uses sglang's own Llama.
            "env": {"SGLANG_EXTERNAL_MODEL_PACKAGE": ""},
            "startup_timeout": GPU_STARTUP_TIMEOUT_S,
        }
    chunk = max(CPU_MIN_CHUNKED_PREFILL, round(GPU_CHUNKED_PREFILL * scale))
    return {
        "model_path": write_model_dir(),
        "token_range": (FIRST_WORD_ID, FIRST_WORD_ID + NUM_WORDS),
        "max_total_tokens": max(CPU_MAX_TOTAL_TOKENS, needed_kv_tokens(rows)),
        "args": common + [
            "--chunked-prefill-size", str(chunk),
            "--max-prefill-tokens", str(2 * chunk),
        ],
        "env": {"TRITON_INTERPRET": "1"},  # the canary's Triton kernels on CPU
        "startup_timeout": CPU_STARTUP_TIMEOUT_S,
    }


class PromptSource:
    """Fresh random prompts; each request's first two tokens encode a counter unique for the server's life."""

    def __init__(self, token_range: tuple, seed: int):
        self.lo, self.hi = token_range
        self.span = self.hi - self.lo
        self.seed = seed
        self.counter = 0

    def batch(self, row: Row, rep: int) -> List[List[int]]:
        """Prompts for repetition ``rep`` of ``row`` (rep -1 = warmup); same seed -> same ids on every server."""
        rng = random.Random(f"{self.seed}/{row.name}/{rep}")
        out = []
        for _ in range(row.batch):
            c = self.counter
            self.counter += 1
            head = [self.lo + c % self.span, self.lo + (c // self.span) % self.span]
            body = [rng.randrange(self.lo, self.hi) for _ in range(row.input_len - len(head))]
            out.append((head + body)[: row.input_len])
        return out


def run_batch(base_url: str, prompts: List[List[int]], max_new_tokens: int) -> dict:
    """POST one batched /generate; return wall seconds, output and cached token counts."""
    payload = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    session = requests.Session()
    session.trust_env = False  # loopback only
    t0 = time.perf_counter()
    r = session.post(base_url + "/generate", json=payload, timeout=REQUEST_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"/generate HTTP {r.status_code}: {r.text[:500]}")
    body = r.json()
    items = body if isinstance(body, list) else [body]
    if len(items) != len(prompts):
        raise RuntimeError(f"/generate returned {len(items)} results for {len(prompts)} prompts")
    cached = 0
    for item in items:
        meta = item.get("meta_info") or {}
        got = int(meta.get("completion_tokens") or len(item.get("output_ids") or []))
        if got != max_new_tokens:
            raise RuntimeError(f"a request produced {got} tokens, not {max_new_tokens}: {meta}")
        cached += int(meta.get("cached_tokens") or 0)
    return {"wall_s": wall, "cached_tokens": cached, "output_tokens": max_new_tokens * len(items)}


# ---------------------------------------------------------------- one server


def log_facts(text: str) -> dict:
    """What a server log says: canary install/stats lines, violations, CUDA-graph use of decode steps."""
    stats = parse_lines(text, STATS_PREFIX)
    graph = CUDA_GRAPH_LINE.findall(text)
    installed = [ln for ln in text.splitlines() if "kv_canary_installed=1" in ln]
    return {
        "canary_installed_line": installed[-1].strip() if installed else None,
        "canary_off_line": "kv_canary_off=1" in text,
        "canary_stats_last": stats[-1] if stats else None,
        "canary_stats_lines": len(stats),
        "violation_lines": len(parse_lines(text, VIOLATION_PREFIX)),
        "decode_log_lines_cuda_graph": {"True": graph.count("True"), "False": graph.count("False")},
    }


def wait_settled(server: SglangServer, timeout: float) -> None:
    """Wait for the canary's final ``settled=1`` stats line (written by its idle drain after the last request).

    An earlier idle gap also logs one, so the last stats line must be settled and unchanged for
    ``SETTLE_QUIET_S`` (the server is idle now: a newer line would come within milliseconds).
    """
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline and server.is_running():
        stats = parse_lines(server.log_text(), STATS_PREFIX)
        line = stats[-1] if stats else None
        if line != last:
            last, since = line, time.monotonic()
        elif line is not None and line.get("settled") == "1" and time.monotonic() - since >= SETTLE_QUIET_S:
            return
        time.sleep(SETTLE_POLL_S)


def run_config(label: str, mode: str, plan: dict, args, rows: Sequence[Row], log_dir: Path,
               extra_env: Dict[str, str]) -> dict:
    """Start one server, time every row on it, stop it; return its results (``error`` set on failure)."""
    env = dict(plan["env"])
    if mode != "none":
        env.update(extra_env)
    server = SglangServer(
        ["--kv-canary", mode, *plan["args"]],
        env=env,
        log_path=log_dir / f"{label.replace('#', '')}.log",
        device=args.device,
        model_path=plan["model_path"],
        max_total_tokens=plan["max_total_tokens"],
    )
    result = {"label": label, "kv_canary": mode, "command": server.command(), "env": env,
              "log_path": str(server.log_path), "rows": {}, "error": None}
    prompts = PromptSource(plan["token_range"], args.seed)
    _progress(f"[{label}] starting server (--kv-canary {mode}) ...")
    try:
        server.start(timeout=plan["startup_timeout"])
        result["startup_s"] = round(server.startup_seconds or 0.0, 1)
        _progress(f"[{label}] up in {result['startup_s']:.0f}s on {server.base_url}")
        for row in rows:
            run_batch(server.base_url, prompts.batch(row, -1), row.output_len)  # warmup, untimed
            reps = [run_batch(server.base_url, prompts.batch(row, rep), row.output_len) for rep in range(args.reps)]
            times = [r["wall_s"] for r in reps]
            result["rows"][row.name] = {
                "times_s": [round(t, 4) for t in times],
                "median_s": round(statistics.median(times), 4),
                "min_s": round(min(times), 4),
                "max_s": round(max(times), 4),
                "cached_tokens": [r["cached_tokens"] for r in reps],
                "output_tokens_per_rep": reps[0]["output_tokens"],
            }
            _progress(f"[{label}] {row.name:<12} {row.describe():<28} median {statistics.median(times):8.3f}s "
                      f"(reps {', '.join(f'{t:.3f}' for t in times)})")
        if mode != "none":
            wait_settled(server, SETTLE_TIMEOUT_S)
    except Exception as exc:  # keep the other configs' results: record and go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        _progress(f"[{label}] FAILED: {result['error'][:2000]}")
    finally:
        server.stop(grace=STOP_GRACE_S)
    result.update(log_facts(server.log_text()))
    return result


# ---------------------------------------------------------------- report


def pct(value: float, base: float) -> Optional[float]:
    """100 * (value - base) / base, or None when base is not positive."""
    return None if not base or base <= 0 else round(100.0 * (value - base) / base, 2)


def summarize(runs: Sequence[dict], rows: Sequence[Row]) -> dict:
    """Per row: medians per config, overhead of "on" configs and spread of later "off" configs vs the first "off"."""
    baseline = next((r for r in runs if r["kv_canary"] == "none"), None)
    out = {}
    for row in rows:
        medians = {r["label"]: r["rows"].get(row.name, {}).get("median_s") for r in runs}
        base = baseline["rows"].get(row.name, {}).get("median_s") if baseline else None
        entry = {"medians_s": medians, "baseline": baseline["label"] if baseline else None,
                 "overhead_pct": {}, "off_spread_pct": {}}
        for r in runs:
            m = medians[r["label"]]
            if r is baseline or m is None or base is None:
                continue
            key = "overhead_pct" if r["kv_canary"] != "none" else "off_spread_pct"
            entry[key][r["label"]] = pct(m, base)
        out[row.name] = entry
    return out


def _fmt_pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:+.1f}%"


def markdown_table(runs: Sequence[dict], rows: Sequence[Row], summary: dict) -> str:
    labels = [r["label"] for r in runs]
    on_labels = [r["label"] for r in runs if r["kv_canary"] != "none"]
    base = next((s["baseline"] for s in summary.values() if s["baseline"]), None)
    spread_labels = [r["label"] for r in runs if r["kv_canary"] == "none" and r["label"] != base]
    if base is None:  # no "off" config: nothing to compare against
        on_labels = spread_labels = []
    head = (["row", "shape"] + [f"{lb} median s" for lb in labels]
            + [f"{lb} vs {base}" for lb in on_labels] + [f"{lb} vs {base} (noise)" for lb in spread_labels])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        s = summary[row.name]
        cells = [row.name, row.describe()]
        cells += ["n/a" if s["medians_s"][lb] is None else f"{s['medians_s'][lb]:.3f}" for lb in labels]
        cells += [_fmt_pct(s["overhead_pct"].get(lb)) for lb in on_labels]
        cells += [_fmt_pct(s["off_spread_pct"].get(lb)) for lb in spread_labels]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ENV_PROBE = r"""
import json, platform
info = {"python": platform.python_version()}
try:
    import importlib.metadata as md
    info["sglang"] = md.version("sglang")
    info["kv_canary_plugin_entry_point"] = any(
        ep.name == "kv_canary" for ep in md.entry_points(group="sglang.srt.plugins"))
except Exception as e:
    info["metadata_error"] = repr(e)
try:
    import torch, triton
    info["torch"] = torch.__version__
    info["triton"] = triton.__version__
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["device_name"] = torch.cuda.get_device_name(0)
        info["device_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["device_count"] = torch.cuda.device_count()
    else:
        info["device_name"] = "cpu"
except Exception as e:
    info["torch_error"] = repr(e)
print(json.dumps(info))
"""


def probe_environment(device: str) -> dict:
    """Versions and device name, read in a child process so this one never holds a CUDA context."""
    env = dict(os.environ)
    if device == "cpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    proc = subprocess.run([sys.executable, "-c", ENV_PROBE], capture_output=True, text=True, env=env, timeout=300)
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        info = {"probe_error": (proc.stderr or proc.stdout)[-2000:]}
    info["hostname"] = platform.node()
    return info


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _parse_env_pairs(pairs: Sequence[str]) -> Dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key.startswith("SGLANG_KV_CANARY_"):
            raise SystemExit(f"--canary-env expects SGLANG_KV_CANARY_NAME=VALUE, got {p!r}")
        out[key] = value
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: Llama-3-8B-shaped dummy model; cpu: tiny model smoke run (default cuda)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated rows to run, in order (default all: {','.join(ROWS)})")
    p.add_argument("--configs", default="off,on,off",
                   help="comma-separated server configs in order: off = --kv-canary none, on = --kv-canary raise "
                        "(default off,on,off)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per row, after one warmup (default 3)")
    p.add_argument("--scale", type=float, default=None,
                   help=f"multiply prompt/output lengths (default 1 on cuda, {CPU_DEFAULT_SCALE:g} on cpu)")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed (same prompts on every server)")
    p.add_argument("--canary-env", action="append", default=[], metavar="SGLANG_KV_CANARY_X=V",
                   help="extra canary env var for the 'on' servers (repeatable; default: none, i.e. defaults)")
    p.add_argument("--out", default="bench_overhead.json", help="JSON results file (default bench_overhead.json)")
    p.add_argument("--log-dir", default=None, help="server logs folder (default: <out stem>_logs next to --out)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.scale is None:
        args.scale = 1.0 if args.device == "cuda" else CPU_DEFAULT_SCALE
    if args.scale <= 0:
        p.error("--scale must be > 0")
    args.row_names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.row_names if r not in ROWS]
    if unknown or not args.row_names:
        p.error(f"--rows: unknown {unknown or 'empty'}; choose from {', '.join(ROWS)}")
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_names if c not in CONFIG_MODES]
    if bad or not args.config_names:
        p.error(f"--configs: unknown {bad or 'empty'}; use off and on")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    out_path = Path(args.out).resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else out_path.with_name(out_path.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    stray = sorted(k for k in os.environ if k.startswith("SGLANG_KV_CANARY_"))
    if stray:
        raise SystemExit(f"unset {', '.join(stray)} first (the 'on' config is the default canary configuration); "
                         "pass non-default settings with --canary-env")
    canary_env = _parse_env_pairs(args.canary_env)
    rows = [ROWS[n].scaled(args.scale) for n in args.row_names]
    plan = server_plan(args.device, args.scale, rows)

    host = probe_environment(args.device)
    if host.get("kv_canary_plugin_entry_point") is False:
        raise SystemExit("the sglang plugin entry point 'kv_canary' is not installed in this environment "
                         "(pip install -e . or add its dist-info); --kv-canary would be an unknown flag")
    _progress(f"device={host.get('device_name')} sglang={host.get('sglang')} torch={host.get('torch')} "
              f"rows={','.join(r.name for r in rows)} configs={','.join(args.config_names)} reps={args.reps} "
              f"scale={args.scale:g}")
    report = {
        "benchmark": "kv_canary end-to-end serving overhead",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "host": host,
        "device": args.device,
        "model": dict(LLAMA3_8B_CONFIG) if args.device == "cuda" else "kv_canary_testing tiny model",
        "model_path": str(plan["model_path"]),
        "scale": args.scale,
        "reps": args.reps,
        "warmup_reps": 1,
        "seed": args.seed,
        "canary_env": canary_env,
        "max_total_tokens": plan["max_total_tokens"],
        "rows": {r.name: asdict(r) for r in rows},
        "timing": "wall time of one batched /generate request (all prompts at once); median of the timed reps",
        "runs": [],
    }

    counts: Dict[str, int] = {}
    for name in args.config_names:
        counts[name] = counts.get(name, 0) + 1
        label = f"{name}#{counts[name]}"
        report["runs"].append(run_config(label, CONFIG_MODES[name], plan, args, rows, log_dir, canary_env))
        report["summary"] = summarize(report["runs"], rows)
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    table = markdown_table(report["runs"], rows, report["summary"])
    report["table_markdown"] = table
    out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    print(f"\n## kv-canary serving overhead ({host.get('device_name')}, sglang {host.get('sglang')}, "
          f"reps={args.reps}, scale={args.scale:g})\n")
    print(table)
    print()
    for run in report["runs"]:
        st = run.get("canary_stats_last") or {}
        graph = run.get("decode_log_lines_cuda_graph", {})
        canary = (f"slots_verified={st.get('slots_verified')} slots_written={st.get('slots_written')} "
                  f"verify_launches={st.get('verify_launches')} graph_forwards={st.get('graph_forwards')} "
                  f"violations={st.get('violations')}" if st else "no kv_canary_stats line")
        print(f"- {run['label']} (--kv-canary {run['kv_canary']}): startup {run.get('startup_s', 'n/a')}s; "
              f"decode log lines with cuda graph True/False: {graph.get('True', 0)}/{graph.get('False', 0)}; "
              f"{canary}; violation lines={run.get('violation_lines')}"
              + (f"; ERROR {run['error'][:300]}" if run.get("error") else ""))
    if args.device == "cpu":
        print("\nnote: CPU smoke run (tiny model, Triton interpreter): the timings say nothing about GPU overhead.")
    print(f"\nresults: {out_path}  logs: {log_dir}  elapsed: {report['elapsed_s']:.0f}s")
    return 1 if any(r.get("error") for r in report["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
