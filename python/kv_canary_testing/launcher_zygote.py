"""CPU test servers' launchers forked from one pre-imported process per environment (CI's time).

``fast_launch`` forks sglang's children from the launcher, but each launcher still imports sglang (~12 CPU-seconds
on the 2-core CI machine). A ``LauncherZygote`` is a long-lived process (``python -m
kv_canary_testing.launcher_zygote``) that imports what ``fast_launch`` imports (``fast_launch.PRELOAD``: sglang's
entry, scheduler and detokenizer, no plugin loaded) once; each ``launch(argv, env, log)`` forks it, and the child
is the launcher ``python -m kv_canary_testing.fast_launch ARGV`` would have been: its own session, stdout and
stderr into the log, exactly ``env`` as its environment, ``fast_launch.main()`` (plugins, arguments, sglang's
server) from there.

A zygote serves only servers whose environment equals its own but for the canary's ``SGLANG_KV_CANARY_*``
variables (read by the plugin, which the zygote never imports): what sglang or the tiny model read while being
imported is read in the same environment. ``zygote_for(python, env)`` keeps one per such environment (at most
``MAX_ZYGOTES``, the least recently used closed first). The parent's handle (``ZygoteChild``) is the part of
``subprocess.Popen`` that ``SglangServer`` uses; the zygote reaps its children and reports each exit code.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, Mapping, Optional, Sequence, Tuple

CANARY_ENV_PREFIX = "SGLANG_KV_CANARY_"
MAX_ZYGOTES = 3


def zygote_key(python: str, env: Mapping[str, str]) -> Tuple[str, Tuple[Tuple[str, str], ...]]:
    """Servers with the same key share a zygote: the interpreter and the environment less the canary's variables."""
    return python, tuple(sorted((k, v) for k, v in env.items() if not k.startswith(CANARY_ENV_PREFIX)))


class ZygoteChild:
    """A launcher forked by a zygote: ``pid``, ``poll()``, ``wait(timeout)``, ``send_signal(sig)``, ``returncode``."""

    def __init__(self, zygote: "LauncherZygote", pid: int, args: Sequence[str]):
        self._zygote, self.pid, self.args = zygote, pid, list(args)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class LauncherZygote:
    """The parent side: one zygote process and a thread reading what it reports."""

    def __init__(self, python: str, env: Mapping[str, str], timeout: float = 300.0):
        from kv_canary_testing import default_cache_dir

        log_dir = default_cache_dir() / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"launcher-zygote-{os.getpid()}-{time.time_ns()}.log"  # its own errors, if any
        with open(self.log_path, "wb") as err:
            self._proc = subprocess.Popen([python, "-u", "-m", "kv_canary_testing.launcher_zygote"], env=dict(env),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                          start_new_session=True)
        self._cond = threading.Condition()
        self._exits: Dict[int, int] = {}
        self._started: Dict[int, int] = {}  # request id -> the launcher's pid
        self._requests = 0
        self._ready = False
        self._reader = threading.Thread(target=self._read, name="launcher-zygote", daemon=True)
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._proc.poll() is not None, timeout):
                self.close()
                raise RuntimeError(f"launcher_zygote: not ready within {timeout} s")
        if not self._ready:
            raise RuntimeError(f"launcher_zygote exited with code {self._proc.poll()} before it was ready; "
                               f"its log {self.log_path}")

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                elif "started" in msg:
                    self._started[msg["id"]] = msg["started"]
                self._cond.notify_all()
        with self._cond:  # the zygote is gone: so are the exit codes it had not reported yet
            self._ready = False
            self._cond.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def launch(self, argv: Sequence[str], env: Mapping[str, str], log_path: str, cwd: str,
               timeout: float = 60.0) -> ZygoteChild:
        """Fork a launcher of ``fast_launch`` with ``argv`` in ``env``; its output is appended to ``log_path``."""
        with self._cond:
            self._requests += 1
            rid = self._requests
            request = {"id": rid, "argv": list(argv), "env": dict(env), "log": str(log_path), "cwd": cwd}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: rid in self._started or not self.alive(), timeout):
                raise RuntimeError(f"launcher_zygote: no launcher started within {timeout} s")
            if rid not in self._started:
                raise RuntimeError(f"launcher_zygote exited (code {self._proc.poll()})")
            pid = self._started.pop(rid)
        return ZygoteChild(self, pid, ["kv_canary_testing.fast_launch", *argv])

    def exit_code(self, pid: int) -> Optional[int]:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        from kv_canary_testing.entry_fork import kill_session

        kill_session(self._proc)


_ZYGOTES: Dict[tuple, LauncherZygote] = {}
_LOCK = threading.Lock()


def zygote_for(python: str, env: Mapping[str, str]) -> LauncherZygote:
    """The zygote for servers of this interpreter and environment (started on first use)."""
    key = zygote_key(python, env)
    with _LOCK:
        zygote = _ZYGOTES.pop(key, None)
        if zygote is None or not zygote.alive():
            while len(_ZYGOTES) >= MAX_ZYGOTES:  # the least recently used first (dicts keep insertion order)
                _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
            zygote = LauncherZygote(python, {k: v for k, v in env.items() if not k.startswith(CANARY_ENV_PREFIX)})
        _ZYGOTES[key] = zygote
        return zygote


@atexit.register
def _close_all() -> None:
    for zygote in list(_ZYGOTES.values()):
        zygote.close()
    _ZYGOTES.clear()


# ---- the zygote process ---------------------------------------------------------------------------------------

def _send(msg) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _child(request, closing: Sequence[int]) -> int:
    """The forked launcher: what ``python -m kv_canary_testing.fast_launch ARGV`` runs, in ``env``."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in closing:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    from kv_canary_testing.fast_launch import apply_environment, main

    apply_environment(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["kv_canary_testing.fast_launch", *request["argv"]]
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        import atexit as _atexit

        _atexit._run_exitfuncs()  # what the interpreter runs at the end of a launcher started as a process
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _serve() -> None:
    from kv_canary_testing.fast_launch import PRELOAD

    for name in PRELOAD:
        __import__(name)
    import sglang.srt.plugins

    if sglang.srt.plugins._plugins_loaded:  # each launcher loads them, in its own environment
        raise SystemExit("launcher_zygote: importing sglang loaded its plugins: a zygote must not")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    _send({"ready": True})
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is sys.stdin:
                line = sys.stdin.readline()
                if not line:  # the parent is gone
                    return
                request = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    os._exit(_child(request, (wake_r, wake_w)))
                _send({"id": request["id"], "started": pid})
            else:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
        while True:  # reap every launcher that ended, and say how
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    _serve()
