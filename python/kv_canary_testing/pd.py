"""A PD-disaggregated sglang deployment for tests: prefill + decode + router, loopback only.

``PDCluster`` starts a ``--disaggregation-mode prefill`` and a ``decode``
``SglangServer`` (mooncake transfer over TCP on 127.0.0.1) and sglang-router's
mini load balancer in front of them, which sends every ``/generate`` to both
with the same bootstrap room. Facts from the project's runbook: both servers
need ``SGLANG_HOST_IP=127.0.0.1`` (else mooncake binds the machine's interface
address) and ``MC_TCP_ENABLE_CONNECTION_POOL=true`` (as sglang's own PD fixture).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Optional, Sequence

import requests

from kv_canary_testing import pd_cpu
from kv_canary_testing.server import ServerError, SglangServer, free_port

PD_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MC_TCP_ENABLE_CONNECTION_POOL": "true"}
TRANSFER_BACKEND = "mooncake"
# GPU host: the folder of the libraries mooncake's CUDA build links and the host lacks (scripts/gpu_host.sh
# install-pd links them there from Ubuntu debs)
PD_LIBS = os.environ.get("KVC_PD_LIBS", "/tmp/pd-libs/lib")
GPU_PD_HINT = ("on the GPU host: scripts/gpu_host.sh bundle-pd here, then install-pd-part 1..N and install-pd "
               "there (its header lists the calls)")


def pd_env(device: str = "cpu") -> dict:
    """Both servers' env: mooncake on loopback; on GPU also TCP only (no RDMA NIC) and the PD libraries."""
    env = dict(PD_ENV)
    if device == "cpu":
        env[pd_cpu.ENV] = "1"  # sglang 0.5.23's prefill sends host-computed page indices (kv_canary_testing.pd_cpu)
    if device == "cuda":
        env["MC_FORCE_TCP"] = "true"
        if os.path.isdir(PD_LIBS):
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (PD_LIBS, os.environ.get("LD_LIBRARY_PATH")) if p)
    return env


@functools.lru_cache(maxsize=None)
def pd_skip_reason(device: str = "cpu") -> Optional[str]:
    """Why a PD deployment cannot start here (None when it can): the PD extras are missing or do not load."""
    missing = [m for m in ("mooncake", "sglang_router") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"PD extras not installed ({', '.join(missing)}): "
                + (GPU_PD_HINT if device == "cuda" else "scripts/setup_env.sh installs "
                   "mooncake-transfer-engine-non-cuda and sglang-router"))
    if device == "cuda":
        from importlib import metadata

        try:
            metadata.distribution("mooncake-transfer-engine-non-cuda")
        except metadata.PackageNotFoundError:
            pass
        else:
            return ("the installed mooncake is the non-CUDA build (mooncake-transfer-engine-non-cuda), which cannot "
                    "transfer GPU memory: install the CUDA build " + GPU_PD_HINT)
        # the servers' own environment (torch first: it loads the CUDA runtime engine.so links)
        r = subprocess.run([sys.executable, "-c", "import torch, mooncake.engine"],
                           env={**os.environ, **pd_env(device)}, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            return f"mooncake's CUDA build does not load ({last}; libraries from {PD_LIBS}): {GPU_PD_HINT}"
    return None


def device_args(device: str, mode: str, drop_default_args: Sequence[str] = ()) -> list:
    """Both servers share one host: on GPU each takes a modest share of memory, the decode the second GPU if any.

    On GPU also ``--skip-server-warmup`` (the CPU flags have it) unless the test drops it or the installed line
    needs its warmup (``server.NOT_ON_LINE``: 0.5.18 and later fail their post-warmup ``/freeze_gc`` call with a
    traceback without it): the perturbation runs count forwards and arrivals from the start, and sglang's warmup
    request would be one outside the workload.
    """
    if device != "cuda":
        return pd_cpu.server_args(mode) + line_args(mode)
    import torch

    from kv_canary_testing.line_suites import installed_line
    from kv_canary_testing.server import NOT_ON_LINE

    args = ["--mem-fraction-static", "0.35"]
    skip = "--skip-server-warmup"
    if skip not in drop_default_args and skip not in NOT_ON_LINE.get(installed_line(), ()):
        args.append(skip)
    if mode == "decode" and torch.cuda.device_count() > 1:
        args += ["--base-gpu-id", "1"]
    return args + line_args(mode)


def line_args(mode: str) -> list:
    """What the canary needs of a PD side on the installed line. On 0.5.23: both sides name the real-data mode
    (sglang's default there is ``none``; PD is verified with ``partial`` on both sides, so the prefill's records
    hash what the decode side hashes), and a decode server names its retraction backup (unset resolves to
    ``host_pool``, which the canary refuses; ``cpu_tensor`` carries the records)."""
    from kv_canary_testing.line_suites import installed_line

    if installed_line() != "0.5.23":
        return []
    args = ["--kv-canary-real-data", "partial"]
    if mode == "decode":
        args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return args


class PDCluster:
    """Prefill + decode + mini router; ``base_url`` is the router's. Usable as a context manager."""

    def __init__(
        self,
        *,
        log_dir: Path,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        prefill_env: Optional[Mapping[str, str]] = None,
        decode_env: Optional[Mapping[str, str]] = None,
        device: str = "cpu",
        max_total_tokens: Optional[int] = None,
        python: Optional[str] = None,
        decode_drop_default_args: Sequence[str] = (),
        model_path: Optional[os.PathLike] = None,
        probe_payload: Optional[Mapping] = None,
    ):
        """``model_path``: both servers' model (default: the tiny model); ``probe_payload``: the /generate body of
        the startup request end to end (default: a short text prompt; pass ``input_ids`` with
        ``--skip-tokenizer-init``)."""
        self.log_dir = Path(log_dir)
        self.probe_payload = dict(probe_payload or {
            "text": "w1 w2 w3", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap_port = free_port()
        self.python = python or sys.executable

        def side(mode: str, args: Sequence[str], env: Optional[Mapping[str, str]]) -> SglangServer:
            drop = decode_drop_default_args if mode == "decode" else ()
            flags = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", TRANSFER_BACKEND,
                     "--disaggregation-bootstrap-port", str(self.bootstrap_port), *device_args(device, mode, drop),
                     *args]
            return SglangServer(flags, env={**pd_env(device), **(env or {})}, log_path=self.log_dir / f"{mode}.log",
                                device=device, max_total_tokens=max_total_tokens, python=self.python,
                                drop_default_args=drop, model_path=model_path)

        self._side = side
        self.prefill = side("prefill", prefill_args, prefill_env)
        self.decode = side("decode", decode_args, decode_env)
        self.router_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.router_port}"
        self.router_log_path = self.log_dir / "router.log"
        self.router: Optional[subprocess.Popen] = None
        self.startup_seconds: Optional[float] = None

    def router_command(self) -> list:
        return [self.python, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
                "--prefill", self.prefill.base_url, str(self.bootstrap_port),
                "--decode", self.decode.base_url, "--host", "127.0.0.1", "--port", str(self.router_port)]

    def start(self, timeout: float = 600.0) -> "PDCluster":
        """Start both servers, then the router; wait for one request to pass end to end."""
        t0 = time.monotonic()
        try:
            # Both servers start at once (neither needs the other until a request comes); they become
            # healthy without a transfer, and /health_generate needs the router, so it is skipped here.
            with ThreadPoolExecutor(max_workers=2) as pool:
                starts = [pool.submit(srv.start, timeout=timeout, check_generate=False)
                          for srv in (self.prefill, self.decode)]
                for f in starts:
                    f.result()
            self._start_router(t0 + timeout)
            self._wait_generate(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _start_router(self, deadline: float) -> None:
        env = dict(os.environ)
        env.setdefault("NO_PROXY", "127.0.0.1,localhost")
        env.setdefault("no_proxy", "127.0.0.1,localhost")
        log = open(self.router_log_path, "ab", buffering=0)
        self.router = subprocess.Popen(self.router_command(), stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        session = requests.Session()
        session.trust_env = False
        while True:
            if self.router.poll() is not None:
                raise ServerError(f"router exited with {self.router.returncode}:\n{self.router_log()[-3000:]}")
            if time.monotonic() > deadline:
                raise ServerError(f"router not ready:\n{self.router_log()[-3000:]}")
            try:
                if session.get(self.base_url + "/health", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)

    def _wait_generate(self, deadline: float) -> None:
        """One request end to end (prefill -> transfer -> decode) before the tests start."""
        session = requests.Session()
        session.trust_env = False
        last = ""
        while time.monotonic() < deadline:
            for srv in (self.prefill, self.decode):
                if not srv.is_running():
                    raise ServerError(f"{srv.log_path.name} exited during startup:\n{srv.log_tail()}")
            try:
                r = session.post(self.base_url + "/generate", timeout=120, json=self.probe_payload)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except requests.RequestException as e:
                last = repr(e)
            time.sleep(1.0)
        raise ServerError(f"PD /generate never succeeded ({last}); decode log:\n{self.decode.log_tail()}")

    def restart_decode(self, decode_args: Sequence[str], decode_env: Optional[Mapping[str, str]] = None,
                       timeout: float = 600.0, wait_generate: bool = True) -> SglangServer:
        """Replace the decode server by one with other flags/env on the same port (prefill and router stay).

        ``wait_generate=False``: return once the new server is healthy, without a request
        end to end (the caller's first request must be the first one, e.g. under perturbation).
        """
        old = self.decode
        old.stop()
        new = self._side("decode", decode_args, decode_env)
        new.port, new.base_url = old.port, old.base_url
        new.log_path = old.log_path.with_name(f"decode-{int(time.time())}.log")
        self.decode = new
        new.start(timeout=timeout, check_generate=False)
        if wait_generate:
            self._wait_generate(time.monotonic() + timeout)
        return new

    def router_log(self) -> str:
        try:
            return self.router_log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            SglangServer._signal_group(self.router.pid, 15)
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                SglangServer._signal_group(self.router.pid, 9)
                self.router.wait(timeout=10)
        for srv in (self.decode, self.prefill):
            srv.stop()

    def __enter__(self) -> "PDCluster":
        if self.router is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
