"""The overhead benches' client and server helpers: the prompts (``PromptSource``), one batched ``/generate``
(``run_batch``), what a server log says (``log_facts``), waiting for the canary's settled stats line, the host's
versions and device (``probe_environment``) and the progress lines.

Shared by ``bench_overhead.py``, ``bench_hicache_overhead.py`` and ``bench_pd_overhead.py``.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from typing import List

import requests

from kv_canary.violations import PERTURB_PREFIX, STATS_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing.server import SglangServer
from overhead_plan import Row, fill_row

REQUEST_TIMEOUT_S = 900.0
SETTLE_TIMEOUT_S = 30.0  # wait for the canary's idle "settled=1" stats line
SETTLE_QUIET_S = 2.0
SETTLE_POLL_S = 0.25
STOP_GRACE_S = 10.0

CUDA_GRAPH_LINE = re.compile(r"Decode batch.*?(?:cuda|cpu) graph: (True|False)")
KV_ALLOC_LINE = re.compile(r"KV Cache is allocated\. #tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB")


class PromptSource:
    """Prompts for one server; the request-unique part starts with two tokens encoding a per-server counter."""

    def __init__(self, token_range: tuple, seed: int):
        self.lo, self.hi = token_range
        self.span = self.hi - self.lo
        self.seed = seed
        self.counter = 0

    def system_prompt(self, row: Row) -> List[int]:
        """The row's shared system prompt: the same on every repetition and every server."""
        rng = random.Random(f"{self.seed}/{row.name}/system")
        return [rng.randrange(self.lo, self.hi) for _ in range(row.shared_prefix_len)]

    def batch(self, row: Row, rep: int) -> List[List[int]]:
        """Prompts for repetition ``rep`` of ``row`` (rep -1 = warmup); same seed -> same ids on every server."""
        rng = random.Random(f"{self.seed}/{row.name}/{rep}")
        shared = self.system_prompt(row)
        own_len = row.input_len - row.shared_prefix_len
        out = []
        for _ in range(row.batch):
            c = self.counter
            self.counter += 1
            head = [self.lo + c % self.span, self.lo + (c // self.span) % self.span]
            body = [rng.randrange(self.lo, self.hi) for _ in range(own_len - len(head))]
            out.append(shared + (head + body)[:own_len])
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


def fill_pool(base_url: str, prompts: PromptSource, rows: List[Row], pool_tokens: int) -> dict:
    """``--fill-pool``: every slot of the server's KV pool written once (``overhead_plan.fill_row``) before ``rows``
    run; what was sent and how long it took."""
    fill = fill_row(rows, pool_tokens)
    done = run_batch(base_url, prompts.batch(fill, -1), fill.output_len)
    return {"prompt_tokens": fill.prompt_tokens(), "requests": fill.batch, "pool_tokens": pool_tokens,
            "wall_s": round(done["wall_s"], 2)}


# ---------------------------------------------------------------- a server's log and its host


def log_facts(text: str) -> dict:
    """What a server log says: canary install/stats lines, violations, injections, CUDA-graph use, KV pool size."""
    stats = parse_lines(text, STATS_PREFIX)
    graph = CUDA_GRAPH_LINE.findall(text)
    installed = [ln for ln in text.splitlines() if "kv_canary_installed=1" in ln]
    violations = parse_lines(text, VIOLATION_PREFIX)
    kv = KV_ALLOC_LINE.findall(text)
    return {
        "canary_installed_line": installed[-1].strip() if installed else None,
        "canary_off_line": "kv_canary_off=1" in text,
        "canary_stats_last": stats[-1] if stats else None,
        "canary_stats_lines": len(stats),
        "violation_lines": len(violations),
        "violations_logged": violations[:16],
        "perturbations": parse_lines(text, PERTURB_PREFIX)[:16],
        "upstream_canary_lines": sum(1 for ln in text.splitlines() if "[canary] step=" in ln),
        "kv_cache_allocated": ({"tokens": int(kv[-1][0]), "k_gb": float(kv[-1][1]), "v_gb": float(kv[-1][2])}
                               if kv else None),
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
