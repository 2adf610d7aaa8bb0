"""Run sglang's real server entry many times cheaply: one process imports sglang once, each run forks it.

Importing sglang's server entry takes 10-15 s on a small CPU machine, and a
startup refusal is decided in the first second after that. ``EntryForker``
starts one process (``python -m kv_canary_testing.entry_fork``) that imports
sglang's modules but applies no plugin; each ``run(argv, env)`` forks it and
the child executes the entry exactly as the command line would: the
``python -m sglang.launch_server`` module as ``__main__`` (or ``sglang serve``'s
``main``) with ``sys.argv`` set, so ``load_plugins()``, argument parsing and the
canary's hooks run in the child as in a fresh process. The child gets its own
session (its process group is killed on timeout) and its output goes to a file.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Mapping, Sequence, Tuple

ENTRIES = ("launch_server", "serve")


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (it was started with ``start_new_session``) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


class EntryForker:
    """The parent side: ``run(argv, env)`` -> (exit code, combined stdout+stderr of that run)."""

    def __init__(self, env: Mapping[str, str], python: str = sys.executable, timeout: float = 300.0):
        self._proc = subprocess.Popen(
            [python, "-u", "-m", "kv_canary_testing.entry_fork"], env=dict(env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        line = self._readline(timeout)
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"entry_fork did not start: {line!r}")

    def _readline(self, timeout: float) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self._proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"entry_fork: no answer within {timeout}s")
        return self._proc.stdout.readline()

    def run(self, argv: Sequence[str], env: Mapping[str, str] = (), *, entry: str = "launch_server",
            prelude: str = "", timeout: float = 120.0) -> Tuple[int, str]:
        """``prelude``: Python source the child runs before the entry (e.g. to make sglang fail a hook)."""
        if entry not in ENTRIES:
            raise ValueError(f"entry must be one of {ENTRIES}")
        fd, log = tempfile.mkstemp(prefix="kvc-entry-", suffix=".log")
        os.close(fd)
        try:
            request = {"argv": list(argv), "env": dict(env), "entry": entry, "log": log, "timeout": timeout,
                       "prelude": prelude}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            reply = json.loads(self._readline(timeout + 30))
            with open(log, errors="replace") as f:
                return int(reply["code"]), f.read()
        finally:
            os.unlink(log)

    def close(self) -> None:
        kill_session(self._proc)

    def __enter__(self) -> "EntryForker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(request) -> int:
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(request["env"])
    try:
        if request.get("prelude"):
            exec(compile(request["prelude"], "<prelude>", "exec"), {})
        if request["entry"] == "serve":
            from sglang.cli.main import main

            sys.argv = ["sglang", "serve", *request["argv"]]
            main()
        else:
            sys.argv = ["sglang.launch_server", *request["argv"]]
            runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _serve() -> None:
    # The entry's imports, without loading plugins or applying hooks (each child does that itself).
    import sglang.cli.main  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.model_executor.cuda_graph_runner  # noqa: F401
    import sglang.srt.model_executor.model_runner  # noqa: F401
    import sglang.srt.server_args  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os._exit(_child(request))
        deadline = time.monotonic() + float(request["timeout"])
        code = None
        while code is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                code = -9
            else:
                time.sleep(0.05)
        print(json.dumps({"code": code}), flush=True)


if __name__ == "__main__":
    _serve()
