"""The overhead benches' workload and servers: the rows (``Row``, ``ROWS``), the server configs (``ServerConfig``,
``CONFIGS``), the Llama-3-8B-shaped dummy model and each device's server flags (``server_plan``, ``server_env``).

Shared by ``bench_overhead.py`` (whose docstring describes the rows and configs), ``bench_hicache_overhead.py``
and ``bench_pd_overhead.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from kv_canary_testing import default_cache_dir
from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS, write_model_dir

# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Row:
    """``batch`` concurrent requests of ``input_len`` prompt and ``output_len`` new tokens.

    ``shared_prefix_len``: the first that many prompt tokens are one system prompt shared by every
    request of every repetition (radix hits); the rest are the request's own. ``baseline_row``: the
    row of the off servers this row is compared with (default itself).
    """

    name: str
    batch: int
    input_len: int
    output_len: int
    shared_prefix_len: int = 0
    baseline_row: str = ""

    @property
    def baseline(self) -> str:
        return self.baseline_row or self.name

    def scaled(self, scale: float) -> "Row":
        own = self.input_len - self.shared_prefix_len
        prefix = _scale_len(self.shared_prefix_len, scale) if self.shared_prefix_len else 0
        return Row(self.name, self.batch, prefix + _scale_len(own, scale), _scale_len(self.output_len, scale),
                   prefix, self.baseline_row)

    def describe(self) -> str:
        shared = f" ({self.shared_prefix_len} shared)" if self.shared_prefix_len else ""
        return f"bs={self.batch} in={self.input_len}{shared} out={self.output_len}"

    def prompt_tokens(self) -> int:
        return self.batch * self.input_len


MIN_SCALED_LEN = 2  # a scaled prompt still holds the 2-token unique request id


def _scale_len(n: int, scale: float) -> int:
    return n if n <= 1 else max(MIN_SCALED_LEN, round(n * scale))


SHARED_PREFIX_LEN = 4096
SHARED_OWN_LEN = 64

ROWS: Dict[str, Row] = {
    r.name: r
    for r in (
        Row("decode_bs1", batch=1, input_len=1024, output_len=512),
        Row("decode_bs32", batch=32, input_len=1024, output_len=256),
        Row("decode_bs64", batch=64, input_len=1024, output_len=256),
        Row("prefill_bs8", batch=8, input_len=8192, output_len=1),
        Row("shared_prefix", batch=64, input_len=SHARED_PREFIX_LEN + SHARED_OWN_LEN, output_len=256,
            shared_prefix_len=SHARED_PREFIX_LEN),
        Row("decode_bs64_sweep16", batch=64, input_len=1024, output_len=256, baseline_row="decode_bs64"),
        # issue 22: --kv-canary-real-data all (ours and upstream's) and the scrub, each against its stack's off
        Row("decode_bs1_all", batch=1, input_len=1024, output_len=512, baseline_row="decode_bs1"),
        Row("decode_bs32_all", batch=32, input_len=1024, output_len=256, baseline_row="decode_bs32"),
        Row("decode_bs64_all", batch=64, input_len=1024, output_len=256, baseline_row="decode_bs64"),
        Row("prefill_bs8_all", batch=8, input_len=8192, output_len=1, baseline_row="prefill_bs8"),
        # issue 60: every row with every byte
        Row("shared_prefix_all", batch=64, input_len=SHARED_PREFIX_LEN + SHARED_OWN_LEN, output_len=256,
            shared_prefix_len=SHARED_PREFIX_LEN, baseline_row="shared_prefix"),
        Row("decode_bs64_scrub", batch=64, input_len=1024, output_len=256, baseline_row="decode_bs64"),
    )
}
BASE_ROWS = ("decode_bs1", "decode_bs32", "decode_bs64", "prefill_bs8", "shared_prefix")
SWEEP_ROWS = ("decode_bs64_sweep16",)
SWEEP_INTERVAL = 16
ALL_ROWS = ("decode_bs1_all", "decode_bs32_all", "decode_bs64_all", "prefill_bs8_all", "shared_prefix_all")
SCRUB_ROWS = ("decode_bs64_scrub",)
DEFAULT_ROWS = tuple(r for r in ROWS if r not in ALL_ROWS + SCRUB_ROWS)  # issue 22's rows: --rows, ALL_CONFIGS
SCRUB_ROW_SLOTS = 132  # the decode_bs64_scrub row's slots per forward (every slot of 131,072 within 993 forwards)
# issue 22's side-by-side run: off / ours all / scrub / upstream off / upstream all / off
ALL_CONFIGS = ("off", "ours_all_rows", "ours_scrub_rows", "upstream_off", "upstream_all", "off")

# ---------------------------------------------------------------- server configs

def _installed_sglang() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - only names the stack in the report
        return "?"


# the software stacks: the installed sglang with this project's plugin, upstream 0.5.14 from --upstream-site, and
# the installed sglang's own in-tree canary (0.5.13+, chosen with SGLANG_KV_CANARY_IMPL=in-tree)
OURS, UPSTREAM = f"sglang-{_installed_sglang()}+kv_canary", "sglang-0.5.14"
IN_TREE = f"sglang-{_installed_sglang()} in-tree canary"
IN_TREE_ENV = (("SGLANG_KV_CANARY_IMPL", "in-tree"),)
STORM_ENV = (  # one corruption of a slot a forward reads, never repeated: read again by every later request
    ("SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB", "1"),
    ("SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS", "1"),
    # inside the window partial hashes: a flip anywhere else in the slot is not seen by the default settings
    ("SGLANG_KV_CANARY_PERTURB_KV_BYTES", "hashed"),
)
# The storm's injection waits this many forwards: at least the warmup repetition's decode steps, so the
# system prompt is in the radix cache and every request reads the cached copy (in the first batch, the
# few requests prefilled together compute private copies; a flip there would be read by one request only).
STORM_WARMUP_ENV = "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS"
# The layout control (``ours_idle``): the canary installed (plugin, hooks, its device buffers and the bytes held back
# before the KV pool), its per-forward work skipped (``stack_sampler/canary_idle.py``, through that directory's
# sitecustomize, first on PYTHONPATH). The process's memory layout is then ours; its work is not. On an H200 the
# decode bs1 step's gate_up GEMM ran 3% slower or 7% faster with the canary installed, by host, with or without
# its work (docs/history/performance.md, 2026-12-01): ours vs this server is what the canary's work costs.
IDLE_ENV = "KVC_DIAG_CANARY_IDLE"
DEVICE_BYTES_ENV = "KVC_DIAG_DEVICE_BYTES"  # the layout probe for a server without the canary (device_bytes.py)
DIAG_PREFIX = "KVC_DIAG_"  # every bench ablation (idle, device bytes, layout_ablations.py): the sampler's sitecustomize
SAMPLER_DIR = Path(__file__).resolve().parent / "stack_sampler"
LAYOUT_ROWS = BASE_ROWS  # every row; the ``*_all`` rows compare with it through their baseline rows
# upstream 0.5.14 ships its own kv_canary; the plugin (installed in the same site) refuses 0.5.14 unless handed over
UPSTREAM_CANARY_ENV = (("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1"), ("SGLANG_KV_CANARY_IMPL", "in-tree"))


@dataclass(frozen=True)
class ServerConfig:
    """One server: the software stack, its canary flags/env, the rows it measures and its role in the summary."""

    name: str
    stack: str
    args: Tuple[str, ...]
    role: str  # off | ours | upstream_off | upstream | storm | variant
    rows: Tuple[str, ...] = BASE_ROWS
    env: Tuple[Tuple[str, str], ...] = ()
    eagle: str = ""  # EAGLE on: "v2" (the plan's ``eagle_args``) or "v1" (``eagle_v1_args``: topk > 1, spec v1)

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        spec = {"": "", "v2": f" + EAGLE (topk {EAGLE_TOPK}, {EAGLE_STEPS} steps, {EAGLE_DRAFT_TOKENS} draft tokens)",
                "v1": f" + EAGLE spec v1 (topk {EAGLE_V1_TOPK}, {EAGLE_STEPS} steps, {EAGLE_DRAFT_TOKENS} draft "
                      "tokens, overlap scheduler off)"}[self.eagle]
        return f"{self.stack} {' '.join(self.args) or '(no canary flags)'}{spec}{' ' + env if env else ''}"


_SWEEP = ("--kv-canary-sweep-interval", str(SWEEP_INTERVAL))
EAGLE_ROWS = ("decode_bs1", "decode_bs32")
EAGLE_CONFIGS = ("eagle_off", "eagle_ours", "upstream_eagle_off", "upstream_eagle", "eagle_off")
EAGLE_V1_CONFIGS = ("eagle_v1_off", "eagle_v1_ours", "eagle_v1_off")
VARIANT_ROWS = ("decode_bs1", "decode_bs64", "prefill_bs8")
SCRUB_SLOTS = 4096  # slots per forward whose every byte the scrub checks
_UP_CANARY = ("--kv-canary", "raise", "--kv-canary-real-data", "partial")
CONFIGS: Dict[str, ServerConfig] = {
    c.name: c
    for c in (
        ServerConfig("off", OURS, ("--kv-canary", "none"), "off"),
        ServerConfig("ours", OURS, ("--kv-canary", "raise"), "ours"),
        ServerConfig("ours_sweep16", OURS, ("--kv-canary", "raise") + _SWEEP, "ours", SWEEP_ROWS),
        ServerConfig("upstream_off", UPSTREAM, (), "upstream_off"),
        ServerConfig("upstream", UPSTREAM, _UP_CANARY, "upstream", env=UPSTREAM_CANARY_ENV),
        ServerConfig("upstream_sweep16", UPSTREAM, _UP_CANARY + _SWEEP, "upstream", SWEEP_ROWS,
                     env=UPSTREAM_CANARY_ENV),
        ServerConfig("storm", OURS, ("--kv-canary", "log"), "storm", ("shared_prefix",), env=STORM_ENV),
        # on a line that ships its own canary (0.5.13+): ours and that canary (in the plugin's place) with the same
        # flags (upstream's rows' flags; real data defaults to none there), against the same sglang without canary
        ServerConfig("ours_same_flags", OURS, _UP_CANARY, "ours"),
        ServerConfig("ours_same_flags_sweep16", OURS, _UP_CANARY + _SWEEP, "ours", SWEEP_ROWS),
        ServerConfig("intree", IN_TREE, _UP_CANARY, "upstream", env=UPSTREAM_CANARY_ENV + IN_TREE_ENV),
        ServerConfig("intree_sweep16", IN_TREE, _UP_CANARY + _SWEEP, "upstream", SWEEP_ROWS,
                     env=UPSTREAM_CANARY_ENV + IN_TREE_ENV),
        # issue 7's cost of full coverage: every byte on every read, or the budgeted scrub (not in the summary
        # table; their medians are in the full report, compared with the same run's off server)
        ServerConfig("ours_all", OURS, ("--kv-canary", "raise", "--kv-canary-real-data", "all"), "variant",
                     VARIANT_ROWS),
        ServerConfig("ours_scrub", OURS, ("--kv-canary", "raise"), "variant", VARIANT_ROWS,
                     env=(("SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD", str(SCRUB_SLOTS)),)),
        # issue 22: the same in the summary table (role ours / upstream), each against its own stack's off server
        ServerConfig("ours_all_rows", OURS, ("--kv-canary", "raise", "--kv-canary-real-data", "all"), "ours",
                     ALL_ROWS),
        ServerConfig("upstream_all", UPSTREAM, ("--kv-canary", "raise", "--kv-canary-real-data", "all"), "upstream",
                     ALL_ROWS, env=UPSTREAM_CANARY_ENV),
        ServerConfig("intree_all_rows", IN_TREE, ("--kv-canary", "raise", "--kv-canary-real-data", "all"), "upstream",
                     ALL_ROWS, env=UPSTREAM_CANARY_ENV + IN_TREE_ENV),
        # issue 60: how much of ``all``'s serving cost is the scrub (its default 256 slots per forward vs 64)
        ServerConfig("ours_all_scrub64", OURS, ("--kv-canary", "raise", "--kv-canary-real-data", "all"), "variant",
                     ALL_ROWS, env=(("SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD", "64"),)),
        # the layout control: installed, idle (not a setting to run: it verifies nothing); `all` named, so that on a
        # line whose flag defaults to none (0.5.23) it holds what ``ours_all_rows`` holds (0.5.12's default is all)
        ServerConfig("ours_idle", OURS, ("--kv-canary", "raise", "--kv-canary-real-data", "all"), "variant",
                     LAYOUT_ROWS, env=((IDLE_ENV, "1"),)),
        ServerConfig("ours_scrub_rows", OURS, ("--kv-canary", "raise"), "ours", SCRUB_ROWS,
                     env=(("SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD", str(SCRUB_ROW_SLOTS)),)),
        # issue 8: the same decode rows with EAGLE on (target + draft pool verified), in a run of their own
        # (--configs EAGLE_CONFIGS --rows EAGLE_ROWS --results-dir docs/results/eagle): the summary's roles
        # then compare EAGLE servers with EAGLE servers only
        ServerConfig("eagle_off", OURS, ("--kv-canary", "none"), "off", EAGLE_ROWS, eagle="v2"),
        ServerConfig("eagle_ours", OURS, ("--kv-canary", "raise"), "ours", EAGLE_ROWS, eagle="v2"),
        ServerConfig("upstream_eagle_off", UPSTREAM, (), "upstream_off", EAGLE_ROWS, eagle="v2"),
        ServerConfig("upstream_eagle", UPSTREAM, _UP_CANARY, "upstream", EAGLE_ROWS, env=UPSTREAM_CANARY_ENV,
                     eagle="v2"),
        # spec v1 (sglang's EAGLEWorker: a draft tree, the target's tree verify, both pools under CUDA graphs),
        # ours only (--configs EAGLE_V1_CONFIGS --rows EAGLE_ROWS, a results dir of its own)
        ServerConfig("eagle_v1_off", OURS, ("--kv-canary", "none"), "off", EAGLE_ROWS, eagle="v1"),
        ServerConfig("eagle_v1_ours", OURS, ("--kv-canary", "raise"), "ours", EAGLE_ROWS, eagle="v1"),
    )
}
# Off first and again near the end (noise and drift), upstream after ours (its site is installed last).
DEFAULT_CONFIGS = ("off", "ours", "ours_sweep16", "upstream_off", "upstream", "upstream_sweep16", "off", "storm")
CPU_DEFAULT_CONFIGS = ("off", "ours", "ours_sweep16", "off", "storm")
# a line with its own in-tree canary (the GPU host's newest, 0.5.17): off / ours / its in-tree canary, one sglang
IN_TREE_CONFIGS = ("off", "ours_same_flags", "intree", "ours_all_rows", "intree_all_rows", "ours_same_flags_sweep16",
                   "intree_sweep16", "off")

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
# The EAGLE draft of the EAGLE rows: sglang's LlamaForCausalLMEagle, one layer of the target's shape, dummy
# weights (accept rate ~0: every round drafts, verifies and extends; the tokens per round are the same on
# every server, so the rows compare equal work)
LLAMA3_8B_EAGLE_CONFIG = dict(LLAMA3_8B_CONFIG, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
EAGLE_STEPS, EAGLE_TOPK, EAGLE_DRAFT_TOKENS = 3, 1, 4
EAGLE_V1_TOPK = 2  # topk > 1 selects spec v1 (with the overlap scheduler off)
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
DEFAULT_UPSTREAM_SITE = "/tmp/site-upstream"

GPU_STARTUP_TIMEOUT_S = 600.0
CPU_STARTUP_TIMEOUT_S = 300.0


def write_llama_dir(path: Path, config: Optional[dict] = None) -> Path:
    """Write a Llama-3-8B-shaped model folder (config only; weights are dummy, no tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or LLAMA3_8B_CONFIG, indent=2) + "\n")
    gen = {"bos_token_id": LLAMA3_8B_CONFIG["bos_token_id"], "eos_token_id": LLAMA3_8B_CONFIG["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return path


def fill_row(rows: Sequence[Row], pool_tokens: int) -> Row:
    """Prefill-only requests (one new token each) of the longest prompt among ``rows``, in all more prompt tokens
    than the pool has slots (a sixteenth more): every slot of the KV pool written once (sglang hands out its
    never-used slots before any freed one), so a scrub's window then holds whole rows to hash, as in a server that
    has run a while (``bench_overhead.py --fill-pool``). Fresh random prompts: no radix hit, none on a row."""
    input_len = max(r.input_len for r in rows)
    return Row("fill_pool", -(-(pool_tokens + pool_tokens // 16) // input_len), input_len, 1)


def needed_kv_tokens(rows: Sequence[Row]) -> int:
    """KV slots the largest row needs at once (a shared prefix once), with headroom, rounded up."""
    peak = max(r.shared_prefix_len + r.batch * (r.input_len - r.shared_prefix_len + r.output_len) for r in rows)
    return -(-int(peak * KV_HEADROOM) // KV_ROUND) * KV_ROUND


def eagle_args(topk: int) -> List[str]:
    """EAGLE flags of the bench's GPU servers: the one-layer dummy draft, ``EAGLE_STEPS`` steps, ``topk``."""
    return [
        "--speculative-algorithm", "EAGLE",
        "--speculative-draft-model-path",
        str(write_llama_dir(default_cache_dir() / "bench-llama3-8b-eagle-dummy", LLAMA3_8B_EAGLE_CONFIG)),
        "--speculative-draft-load-format", "dummy",
        "--speculative-num-steps", str(EAGLE_STEPS),
        "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(EAGLE_DRAFT_TOKENS),
    ]


def plan_eagle_args(plan: dict, eagle: str) -> List[str]:
    """The plan's EAGLE flags for ``ServerConfig.eagle`` ("" none, "v2", "v1"); GPU plans only."""
    return list(plan[{"v2": "eagle_args", "v1": "eagle_v1_args"}[eagle]]) if eagle else []


# the GPU flags on a line whose sglang renamed or cannot take one (the installed sglang's line): flag -> its
# replacement, or None to leave it out. 0.5.23: the decode graphs' batch cap has its phase in its name, and its
# server warmup must run (skipped, its post-warmup /freeze_gc call fails: kv_canary_testing.server.NOT_ON_LINE).
# Upstream 0.5.14 servers (--upstream-site) run beside a 0.5.12 install only: they keep 0.5.12's flags.
GPU_FLAGS_ON_LINE = {"0.5.23": {"--cuda-graph-max-bs": "--cuda-graph-max-bs-decode", "--skip-server-warmup": None}}


def flags_for_line(args: Sequence[str], line: Optional[str]) -> List[str]:
    """``args`` with each flag ``GPU_FLAGS_ON_LINE[line]`` names renamed or left out (its value with it)."""
    renames = GPU_FLAGS_ON_LINE.get(line or "", {})
    out: List[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        kept = renames.get(flag, flag)
        if kept is not None:
            out += [kept, args[i + 1]] if has_value else [kept]
        i += 2 if has_value else 1
    return out


def _installed_line() -> Optional[str]:
    from kv_canary_testing.line_suites import installed_line

    return installed_line()


def server_plan(device: str, scale: float, rows: Sequence[Row]) -> dict:
    """Model path, token id range, pool size, extra flags and env of the servers for ``device``."""
    common = ["--skip-tokenizer-init", "--max-running-requests", str(MAX_RUNNING_REQUESTS)]
    if device == "cuda":
        return {
            "model_path": write_llama_dir(default_cache_dir() / "bench-llama3-8b-dummy"),
            "token_range": (LLAMA_FIRST_TOKEN_ID, LLAMA3_8B_CONFIG["vocab_size"]),
            "max_total_tokens": max(GPU_MAX_TOTAL_TOKENS, needed_kv_tokens(rows)),
            "args": flags_for_line(common + [
                "--cuda-graph-max-bs", str(CUDA_GRAPH_MAX_BS),
                "--skip-server-warmup",
                "--mem-fraction-static", str(GPU_MEM_FRACTION_STATIC),
                "--chunked-prefill-size", str(GPU_CHUNKED_PREFILL),
                "--max-prefill-tokens", str(GPU_MAX_PREFILL_TOKENS),
            ], _installed_line()),
            "eagle_args": eagle_args(EAGLE_TOPK),
            "eagle_v1_args": eagle_args(EAGLE_V1_TOPK) + ["--disable-overlap-schedule"],
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


def server_env(config: ServerConfig, plan: dict, upstream_site: Optional[str],
               extra_canary_env: Dict[str, str]) -> Dict[str, str]:
    """Environment of one server: the plan's, the config's canary env, upstream's site first on PYTHONPATH."""
    env = dict(plan["env"])
    env.update(dict(config.env))
    if config.role == "storm":
        env[STORM_WARMUP_ENV] = str(plan["storm_warmup_forwards"])
    if config.stack == UPSTREAM:
        if not upstream_site:
            raise ValueError(f"config {config.name} needs --upstream-site (sglang 0.5.14 installed there)")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (upstream_site, os.environ.get("PYTHONPATH", "")) if p)
    elif config.role in ("ours", "storm", "variant"):
        env.update(extra_canary_env)
    if any(value and name.startswith(DIAG_PREFIX) for name, value in env.items()):  # the sampler's sitecustomize
        env["PYTHONPATH"] = sampler_pythonpath(env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")))
    return env


def sampler_pythonpath(rest: str) -> str:
    """``rest`` (a PYTHONPATH) with the sampler directory first (its ``sitecustomize`` applies the ``KVC_DIAG_*`` and
    ``KVC_STACK_SAMPLE_*`` settings) and this checkout's canary package next; empty entries left out."""
    from kv_canary_testing.server import PACKAGE_PARENT

    return os.pathsep.join(p for p in (str(SAMPLER_DIR), PACKAGE_PARENT, rest) if p)


HOST_TIMER_INTERVAL_S = 0.25  # --host-timers alone: the sampler's stack samples, seldom


def sampler_env(env: Dict[str, str], stacks_dir: Path, interval_s: Optional[float] = None) -> Dict[str, str]:
    """``env`` for a server whose processes run the stack sampler (``stack_sampler/sitecustomize``): the sampler
    directory first on its PYTHONPATH, its files in ``stacks_dir``, a stack sample every ``interval_s`` (None: the
    sampler's default). The host timers alone want few samples: 0.25 s."""
    out = {**env, "PYTHONPATH": sampler_pythonpath(env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))),
           "KVC_STACK_SAMPLE_DIR": str(stacks_dir)}
    if interval_s is not None:
        out["KVC_STACK_SAMPLE_INTERVAL_S"] = str(interval_s)
    return out
