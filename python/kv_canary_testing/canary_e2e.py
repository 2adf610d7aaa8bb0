"""Shared pieces of the kv-canary e2e tests: server flags per device and log readers.

A canary server is an ``SglangServer`` with ``--kv-canary MODE`` and the
``SGLANG_KV_CANARY_*`` env vars. On CPU a server runs the canary's torch kernels (the reference the Triton
kernels are unit-tested bit-equal to; about 13x faster than the Triton interpreter on the tiny model), unless
its test asks for the Triton kernels (``cpu_kernels="triton"``, under the interpreter) or
``KVC_E2E_CPU_KERNELS=triton|torch`` sets every CPU server's. ``TRITON_INTERPRET=1`` either way (sglang's own
Triton kernels). Everything the tests assert on comes from the server log:
``kv_canary_violation=`` / ``kv_canary_perturb=`` / ``kv_canary_stats=`` lines.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

try:  # registration markers for sglang's CI collector (AST-parsed; no-ops at run time)
    from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
except ImportError:  # pragma: no cover - sglang 0.5.12 ships them

    def register_cpu_ci(*args, **kwargs):
        return None

    register_cuda_ci = register_cpu_ci

from kv_canary.violations import PERTURB_PREFIX, STATS_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing.server import SglangServer

CHUNKED_PREFILL_SIZE = 128
MAX_TOTAL_TOKENS = {"cpu": 2048, "cuda": 8192}


CPU_KERNELS = ("torch", "triton")


def cpu_kernel_env(cpu_kernels: str) -> Dict[str, str]:
    """The env of a CPU server's canary kernels: ``torch`` (the reference) or ``triton`` (the interpreter).

    ``KVC_E2E_CPU_KERNELS`` (torch | triton), when set, overrides every test's choice."""
    choice = os.environ.get("KVC_E2E_CPU_KERNELS") or cpu_kernels
    if choice not in CPU_KERNELS:
        raise ValueError(f"KVC_E2E_CPU_KERNELS / cpu_kernels={choice!r}: choose torch or triton")
    # sglang's own Triton kernels (EAGLE's tree building, ...) run under the interpreter either way
    return {"TRITON_INTERPRET": "1", "SGLANG_KV_CANARY_KERNEL_BACKEND": choice}


def contain_evictor_gap() -> str:
    """On a release of the 0.5.23 line whose UnifiedRadixCache lacks what contain's evictor uses (0.5.22): what
    (``--kv-canary contain`` is refused there); "" where contain runs."""
    from kv_canary.adapter.lines import current_choice

    line = current_choice().line
    if line is None or line.name != "0.5.23":
        return ""
    from kv_canary.adapter.contain_unified import contain_evictor_gap as gap

    return gap()


def e2e_device() -> str:
    """``cpu`` unless ``KVC_TEST_DEVICE=cuda`` (set by the CUDA suite runner)."""
    return os.environ.get("KVC_TEST_DEVICE", "cpu")


def cuda_skip_reason() -> Optional[str]:
    """Why the CUDA flavour cannot run here (None when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (the CUDA suite runs on the GPU host)"
    return None


def canary_server(
    mode: str,
    *,
    log_path,
    env: Optional[Mapping[str, str]] = None,
    extra_args: Sequence[str] = (),
    device: Optional[str] = None,
    stats_every: int = 20,
    max_total_tokens: Optional[int] = None,
    model_path=None,
    cpu_kernels: str = "torch",
    spawn_children: Optional[bool] = None,
) -> SglangServer:
    """``model_path``: another tiny model folder (e.g. ``write_swa_model_dir()``); default the tiny model.
    ``cpu_kernels``: the canary's kernels on a CPU server (``cpu_kernel_env``); a GPU server runs Triton's.
    ``spawn_children``: ``SglangServer``'s (default: sglang's own spawn on the GPU host, forked children on CPU)."""
    device = device or e2e_device()
    full_env: Dict[str, str] = {"SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(stats_every)}
    if device == "cpu":
        full_env.update(cpu_kernel_env(cpu_kernels))
    full_env.update(env or {})
    args = ["--kv-canary", mode, "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE), *extra_args]
    return SglangServer(args, env=full_env, log_path=log_path, device=device, model_path=model_path,
                        max_total_tokens=max_total_tokens or MAX_TOTAL_TOKENS[device], spawn_children=spawn_children)


def canary_env_and_args(mode: str, env: Optional[Mapping[str, str]], extra_args: Sequence[str], device: str,
                        stats_every: int, cpu_kernels: str = "torch"):
    """(env, args) of a canary server: stats cadence, the CPU kernels (``cpu_kernel_env``), --kv-canary MODE."""
    full_env: Dict[str, str] = {"SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(stats_every)}
    if device == "cpu":
        full_env.update(cpu_kernel_env(cpu_kernels))
    full_env.update(env or {})
    return full_env, ["--kv-canary", mode, "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE), *extra_args]


def canary_pd_cluster(
    prefill_mode: str,
    decode_mode: str,
    *,
    log_dir,
    prefill_env: Optional[Mapping[str, str]] = None,
    decode_env: Optional[Mapping[str, str]] = None,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    device: Optional[str] = None,
    stats_every: int = 20,
    max_total_tokens: Optional[int] = None,
    decode_drop_default_args: Sequence[str] = (),
    cpu_kernels: str = "torch",
):
    """A prefill + decode + router deployment (``kv_canary_testing.pd.PDCluster``), canary flags on each side."""
    from kv_canary_testing.pd import PDCluster

    device = device or e2e_device()
    p_env, p_args = canary_env_and_args(prefill_mode, prefill_env, prefill_args, device, stats_every, cpu_kernels)
    d_env, d_args = canary_env_and_args(decode_mode, decode_env, decode_args, device, stats_every, cpu_kernels)
    return PDCluster(log_dir=log_dir, prefill_args=p_args, decode_args=d_args, prefill_env=p_env, decode_env=d_env,
                     device=device, max_total_tokens=max_total_tokens or MAX_TOTAL_TOKENS[device],
                     decode_drop_default_args=decode_drop_default_args)


def restart_canary_decode(cluster, decode_mode: str, *, decode_env: Optional[Mapping[str, str]] = None,
                          decode_args: Sequence[str] = (), stats_every: int = 20, wait_generate: bool = True,
                          cpu_kernels: str = "torch"):
    """Replace a ``canary_pd_cluster``'s decode server by one with another canary mode/env (same port)."""
    env, args = canary_env_and_args(decode_mode, decode_env, decode_args, cluster.decode.device, stats_every,
                                    cpu_kernels)
    return cluster.restart_decode(args, env, wait_generate=wait_generate)


@dataclass(frozen=True)
class CanaryLog:
    """What a server log says about the canary."""

    violations: List[Dict[str, str]]
    perturbations: List[Dict[str, str]]
    stats: List[Dict[str, str]]
    text: str

    @classmethod
    def read_settled(cls, server: SglangServer, timeout: float = 60.0, quiet: float = 1.5,
                     canary_lines_only: bool = False) -> "CanaryLog":
        """Wait until the server went idle and its canary read every device counter, then read.

        The last stats line must say ``settled=1`` *and* the log must stay unchanged for ``quiet``
        seconds: a server that idled mid-workload (a PD decode server waiting for transfers does) has an
        older ``settled=1`` line, and sglang's overlap loop sends the last response one iteration before
        the idle drain that logs the last forwards' violations. ``canary_lines_only``: only the canary's
        lines must stay unchanged (a server scraped every second logs each ``GET /metrics``).
        """
        deadline = time.monotonic() + timeout
        stable_since, last_len = time.monotonic(), -1
        while True:
            log = cls.read(server)
            now = time.monotonic()
            size = log.text.count("kv_canary_") if canary_lines_only else len(log.text)
            if size != last_len:
                stable_since, last_len = now, size
            last = log.stats[-1] if log.stats else None
            if last is not None and last.get("settled") == "1" and now - stable_since >= quiet:
                return log
            if now > deadline or not server.is_running():
                return log
            time.sleep(0.25)

    @classmethod
    def read(cls, server: SglangServer) -> "CanaryLog":
        text = server.log_text()
        return cls(
            violations=parse_lines(text, VIOLATION_PREFIX),
            perturbations=parse_lines(text, PERTURB_PREFIX),
            stats=parse_lines(text, STATS_PREFIX),
            text=text,
        )

    def last_stat(self, key: str) -> int:
        if not self.stats:
            raise AssertionError("no kv_canary_stats= line in the server log")
        return int(self.stats[-1][key])

    @property
    def installed(self) -> bool:
        return "kv_canary_installed=1" in self.text and "kv_canary_ready=1" in self.text

    def unmatched_injections(self) -> List[Dict[str, str]]:
        """Injections with no violation naming the same slot at or after the injection's forward."""
        detected = {}
        for v in self.violations:
            key = (v["group"], v["slot"])
            detected.setdefault(key, []).append(int(v["forward"]))
        missing = []
        for p in self.perturbations:
            forwards = detected.get((p["group"], p["slot"]), [])
            if not any(f >= int(p["forward"]) for f in forwards):
                missing.append(p)
        return missing

    @staticmethod
    def explains(injection: Dict[str, str], violation: Dict[str, str]) -> bool:
        """A violation naming the injection's (group, slot) at or after the injection's forward."""
        return ((violation["group"], violation["slot"]) == (injection["group"], injection["slot"])
                and int(violation["forward"]) >= int(injection["forward"]))

    def injections_by_mode(self, key: Optional[Callable[[Dict[str, str]], Any]] = None
                           ) -> Tuple[Dict[Any, List[int]], List[Dict[str, str]]]:
        """({key(injection), default its mode: [injected, detected]}, the violations no injection explains)."""
        key = key or (lambda p: p["kv_canary_perturb"])
        by_mode: Dict[Any, List[int]] = {}
        for p in self.perturbations:
            counts = by_mode.setdefault(key(p), [0, 0])
            counts[0] += 1
            counts[1] += any(self.explains(p, v) for v in self.violations)
        unexplained = [v for v in self.violations if not any(self.explains(p, v) for p in self.perturbations)]
        return by_mode, unexplained

    def scrub_bound(self) -> int:
        """The startup line's ``every_slot_within_forwards=`` (the scrub's bound; 0 when the scrub is off)."""
        import re

        found = re.search(r"every_slot_within_forwards=(\d+)", self.text)
        return int(found.group(1)) if found else 0

    def detection_latencies(self) -> List[int]:
        """Forwards from each injection to the first violation on its slot."""
        out = []
        for p in self.perturbations:
            fs = [int(v["forward"]) for v in self.violations
                  if (v["group"], v["slot"]) == (p["group"], p["slot"]) and int(v["forward"]) >= int(p["forward"])]
            if fs:
                out.append(min(fs) - int(p["forward"]))
        return out


def serve_requests(srv: SglangServer, requests, *, concurrency: int = 8, timeout: float = 300,
                   temperature: float = 0.0):
    """Start ``srv``, send ``requests`` (``workload.build_workload``) at ``temperature``, read the settled log and
    stop it.

    Returns (result, log, running, exit code: None while it still ran)."""
    from kv_canary_testing.workload import run_requests

    srv.start(timeout=600)
    try:
        result = run_requests(srv.base_url, requests, concurrency=concurrency, timeout=timeout,
                              temperature=temperature)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
        code = None if running else srv.wait_exit(timeout=60)
    finally:
        srv.stop()
    return result, log, running, code
