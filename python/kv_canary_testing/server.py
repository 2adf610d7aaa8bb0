"""Launch a real sglang HTTP server (0.5.12 or 0.5.23) (``python -m sglang.launch_server``) for tests.

``SglangServer`` picks a free loopback port, starts the server in its own process
group with stdout+stderr going to a log file, waits until it answers, and kills
the whole process tree on ``stop()``. Default arguments depend on the device:

* ``device="cpu"``: the tiny external model with dummy weights, torch_native
  attention, no CUDA graphs, and a stand-in ``libcuda.so.1`` on LD_LIBRARY_PATH
  (see ``libcuda_stub``); flags from the project's sglang 0.5.12 runbook.
* ``device="cuda"``: triton attention with CUDA graphs on (piecewise graphs off).
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import requests

from kv_canary_testing import default_cache_dir
from kv_canary_testing.libcuda_stub import ensure_libcuda_stub
from kv_canary_testing.model_dir import write_model_dir

TINY_MODEL_PACKAGE = "kv_canary_testing.tiny_model"
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)

DEVICE_ARGS = {
    "cpu": [
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        # Not auto-disabled on CPU unless SGLANG_USE_CPU_ENGINE=1 (which we can't
        # use); with --chunked-prefill-size set it would try to capture graphs.
        "--disable-piecewise-cuda-graph",
        "--sampling-backend", "pytorch",
        "--load-format", "dummy",
        "--skip-server-warmup",
        "--dtype", "float32",
        # sglang's scheduler busy-polls when idle (a full core per idle server, measured on 0.5.12 and 0.5.23):
        # a module-scoped server waiting between tests, or beside a test that starts its own server, took a core
        # from that startup and from the other line's run. This sleeps in a zmq poll only when fully idle.
        "--sleep-on-idle",
    ],
    "cuda": [
        "--attention-backend", "triton",
        "--sampling-backend", "pytorch",
        "--grammar-backend", "none",
        "--disable-piecewise-cuda-graph",
        "--load-format", "dummy",
    ],
}

DEFAULT_MAX_TOTAL_TOKENS = {"cpu": 4096, "cuda": 65536}
# default flags left out on a later sglang line (0.5.23: no piecewise flag (off on CPU anyway); its server warmup
# must run, else its post-warmup /freeze_gc call fails with a traceback: 0.5.18 and later)
NOT_ON_LINE = {"0.5.17": ("--disable-piecewise-cuda-graph",),
               "0.5.18": ("--disable-piecewise-cuda-graph", "--skip-server-warmup"),
               "0.5.19": ("--disable-piecewise-cuda-graph", "--skip-server-warmup"),
               "0.5.20": ("--disable-piecewise-cuda-graph", "--skip-server-warmup"),
               "0.5.21": ("--disable-piecewise-cuda-graph", "--skip-server-warmup"),
               "0.5.23": ("--disable-piecewise-cuda-graph", "--skip-server-warmup")}
# default flags added on a line, per device (0.5.17: prefill CUDA graphs, breakable by default on CUDA, replaced the
# piecewise ones; the canary needs them off)
# (0.5.14 and 0.5.15 take the piecewise flag as their alias of prefill graphs off, and have no other flag for it)
ADDED_ON_LINE = {("0.5.17", "cuda"): ("--disable-prefill-cuda-graph",),
                 ("0.5.18", "cuda"): ("--disable-prefill-cuda-graph",),
                 ("0.5.19", "cuda"): ("--disable-prefill-cuda-graph",),
                 ("0.5.20", "cuda"): ("--disable-prefill-cuda-graph",)}


def installed_sglang_version() -> str:
    """The sglang release installed beside this package (the one the servers run)."""
    from importlib.metadata import version

    return version("sglang")


def _line() -> str:
    """The line serving the installed release (0.5.22 -> 0.5.23): the flags follow the line."""
    from .line_suites import installed_line

    return installed_line() or installed_sglang_version()


class ServerError(RuntimeError):
    """The server failed to start or died."""


class PortTaken(ServerError):
    """Another process bound the server's port between ``free_port`` and sglang's bind (uvicorn logs the error;
    sglang 0.5.23 then hangs, 0.5.12 exits with code 3)."""


BIND_ERROR = "error while attempting to bind on address"


# sglang 0.5.12 derives a gRPC port as --port + 10000 and rejects the server if it
# exceeds 65535, so ports come from a range below the usual ephemeral one.
PORT_RANGE = (20000, 32000)


def free_port(host: str = "127.0.0.1", port_range: tuple[int, int] = PORT_RANGE) -> int:
    """Return a TCP port in ``port_range`` that is free on ``host`` right now."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*port_range)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port found in {port_range} on {host}")


def _flag_given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _prepend_path(value: str | None, entry: str) -> str:
    parts = [p for p in (value or "").split(os.pathsep) if p]
    return os.pathsep.join([entry] + [p for p in parts if p != entry])


class SglangServer:
    """A sglang server process for tests; usable as a context manager.

    ``extra_args`` go after the defaults; a flag given there replaces the default
    of the same name (for ``--max-total-tokens``, ``--dtype``, ... ), and flags in
    ``drop_default_args`` (e.g. ``"--skip-server-warmup"``) are left out. ``env``
    updates the inherited environment. ``model_path`` defaults to the tiny model
    folder written by ``write_model_dir``.
    """

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        port: int | None = None,
        *,
        device: str = "cpu",
        model_path: str | os.PathLike | None = None,
        max_total_tokens: int | None = None,
        python: str | None = None,
        host: str = "127.0.0.1",
        drop_default_args: Sequence[str] = (),
        spawn_children: bool | None = None,
    ):
        """``spawn_children``: True runs ``python -m sglang.launch_server`` (its children spawned, as operators run
        it); None (default) does that on the GPU host and with ``KVC_TEST_SPAWN=1``, and on CPU otherwise runs
        ``kv_canary_testing.fast_launch`` (the same entry, its children forked from one pre-imported process)."""
        if device not in DEVICE_ARGS:
            raise ValueError(f"device must be one of {sorted(DEVICE_ARGS)}, not {device!r}")
        self.device = device
        self.host = host
        self.port = port if port is not None else free_port(host)
        self._picked_port = None if port is not None else self.port  # a port start() may replace if it is taken
        self.base_url = f"http://{host}:{self.port}"
        self.model_path = Path(model_path) if model_path is not None else None
        self.extra_args = list(extra_args)
        self.drop_default_args = set(drop_default_args)
        if spawn_children is None:
            spawn_children = device != "cpu" or os.environ.get("KVC_TEST_SPAWN", "0") == "1"
        self.spawn_children = spawn_children
        self.max_total_tokens = (
            max_total_tokens if max_total_tokens is not None else DEFAULT_MAX_TOTAL_TOKENS[device]
        )
        self.python = python or sys.executable
        self.user_env = dict(env or {})
        if log_path is None:
            log_dir = default_cache_dir() / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            log_path = log_dir / f"sglang-{device}-{self.port}-{int(time.time())}.log"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._log_file = None

    # ---- command and environment -------------------------------------------------

    def command(self) -> list[str]:
        """Return the full server command line."""
        model_path = self.model_path or write_model_dir()
        defaults = [
            "--model-path", str(model_path),
            "--host", self.host,
            "--port", str(self.port),
            *DEVICE_ARGS[self.device],
            *ADDED_ON_LINE.get((_line(), self.device), ()),
            "--max-total-tokens", str(self.max_total_tokens),
        ]
        # Drop defaults that the caller overrides in extra_args.
        merged: list[str] = []
        i = 0
        while i < len(defaults):
            flag = defaults[i]
            has_value = i + 1 < len(defaults) and not defaults[i + 1].startswith("--")
            dropped = flag in self.drop_default_args or flag in NOT_ON_LINE.get(_line(), ())
            if not _flag_given(self.extra_args, flag) and not dropped:
                merged.append(flag)
                if has_value:
                    merged.append(defaults[i + 1])
            i += 2 if has_value else 1
        # KVC_TEST_SERVER_ARGS: flags added to every test server (e.g. a CUDA graph backend the GPU host verifies)
        added = shlex.split(os.environ.get("KVC_TEST_SERVER_ARGS", ""))
        return [self.python, "-m", self.entry_module(), *merged, *self.extra_args, *added]

    def entry_module(self) -> str:
        """The module ``python -m`` runs: sglang's entry, or ``fast_launch`` (``spawn_children``)."""
        return "sglang.launch_server" if self.spawn_children else "kv_canary_testing.fast_launch"

    def environment(self) -> dict[str, str]:
        """Return the environment the server process runs with."""
        env = dict(os.environ)
        env["PYTHONPATH"] = _prepend_path(env.get("PYTHONPATH"), PACKAGE_PARENT)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", TINY_MODEL_PACKAGE)
        if self.device == "cpu":
            env["LD_LIBRARY_PATH"] = _prepend_path(
                env.get("LD_LIBRARY_PATH"), str(ensure_libcuda_stub())
            )
            env.pop("SGLANG_USE_CPU_ENGINE", None)  # needs a CPU sgl_kernel build
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
            # One intra-op thread per process: on a small machine the scheduler's
            # OpenMP threads otherwise fight the HTTP/tokenizer processes and the
            # client, and step times swing by 5-10x.
            env.setdefault("OMP_NUM_THREADS", "1")
            # sglang 0.5.23 sleeps 5 s before its crash diagnostics (py-spy of the schedulers, CUDA coredump) on
            # every SIGTERM/SIGQUIT of the server: each stop() and each raise-mode exit. Neither has a use on CPU.
            env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
            env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
            env.setdefault("NO_PROXY", "127.0.0.1,localhost")
            env.setdefault("no_proxy", "127.0.0.1,localhost")
        env.update(self.user_env)
        return env

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, timeout: float = 300.0, check_generate: bool = True) -> "SglangServer":
        """Launch the server and wait until it serves; raise ServerError with the log tail. A port this object
        picked that another process took before sglang bound it is replaced by a new one (twice at most)."""
        retries = 2
        while True:
            try:
                return self._start_once(timeout, check_generate)
            except PortTaken:
                if retries == 0 or self.port != self._picked_port:
                    raise
                retries -= 1
                self.port = self._picked_port = free_port(self.host)
                self.base_url = f"http://{self.host}:{self.port}"
                self.proc = None

    def _start_once(self, timeout: float, check_generate: bool) -> "SglangServer":
        if self.proc is not None:
            raise ServerError("server already started")
        cmd = self.command()
        env = self.environment()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        t0 = time.monotonic()
        self.proc = self._launch_from_zygote(cmd, env) if self._zygote_launches() else None
        if self.proc is None:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() kills the tree
            )
        try:
            self._wait_ready(t0 + timeout, check_generate)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _zygote_launches(self) -> bool:
        """A ``fast_launch`` server's launcher is forked from a ``launcher_zygote`` unless ``KVC_TEST_ZYGOTE=0``."""
        return not self.spawn_children and os.environ.get("KVC_TEST_ZYGOTE", "1") != "0"

    def _launch_from_zygote(self, cmd: list[str], env: Mapping[str, str]):
        """The launcher forked from the zygote of this environment (its own session, output into the log), or None
        (said in the log and on stderr) when no zygote could start it: then the command runs as a process."""
        from kv_canary_testing.launcher_zygote import zygote_for

        try:
            return zygote_for(self.python, env).launch(cmd[3:], env, str(self.log_path), os.getcwd())
        except RuntimeError as e:
            note = f"kvc-test: launcher zygote failed ({e}); starting the command as a process\n"
            self._log_file.write(note.encode())
            sys.stderr.write(note)
            return None

    def _wait_ready(self, deadline: float, check_generate: bool) -> None:
        session = requests.Session()
        session.trust_env = False
        path = "/health"
        while True:
            code = self.proc.poll()
            log = self.log_text()  # the bind error before the exit code: 0.5.12 exits on it, 0.5.23 hangs
            if BIND_ERROR in log and f"'{self.host}', {self.port})" in log:
                raise PortTaken(f"port {self.port} was taken before the server bound it; log {self.log_path}")
            if code is not None:
                raise ServerError(
                    f"sglang server exited with code {code} during startup; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"sglang server not ready before timeout; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )

            try:
                r = session.get(self.base_url + path, timeout=30)
                if r.status_code == 200:
                    if path == "/health" and check_generate:
                        path = "/health_generate"
                        continue
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)

    def is_running(self) -> bool:
        """True while the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float | None = None) -> int:
        """Wait for the server process to exit by itself; return its exit code."""
        if self.proc is None:
            raise ServerError("server was never started")
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ServerError(
                f"sglang server still running after {timeout}s; log tail:\n{self.log_tail()}"
            ) from e

    def stop(self, grace: float = 10.0, graceful: bool = False) -> int | None:
        """Stop the server and every process of its group; return the leader's exit code.

        Default: SIGTERM to the whole group (about 1 s; sglang's scheduler then
        exits -15 and the leader kills the tree, so the code is usually -9).
        ``graceful=True``: SIGTERM to the leader only, letting sglang drain
        requests (it polls every 5 s) before the group is killed after ``grace``.
        Either way the group gets SIGKILL at the end, so nothing is left behind.
        """
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.proc.poll() is None:
            if graceful:
                self.proc.send_signal(signal.SIGTERM)
            else:
                self._signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Kill leftovers (scheduler/detokenizer children) in the group either way.
        self._signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._wait_group_gone(pgid, grace)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode

    @staticmethod
    def _wait_group_gone(pgid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # ---- logs ----------------------------------------------------------------------

    def log_text(self) -> str:
        """Return the whole server log (stdout + stderr) so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """Return the last ``lines`` lines of the server log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> "SglangServer":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
