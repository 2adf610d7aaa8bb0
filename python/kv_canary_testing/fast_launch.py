"""``python -m kv_canary_testing.fast_launch ARGS``: sglang's ``launch_server`` whose child processes are forked from
the launcher instead of each importing sglang again (test servers on CPU; CI's time).

sglang starts its scheduler(s) and detokenizer with multiprocessing's ``spawn``: each child is a fresh interpreter
that imports sglang (~12-15 CPU-seconds on the 2-core CI machine, the detokenizer as much as the scheduler). Here
the launcher imports sglang's entry, scheduler and detokenizer (``PRELOAD``), forks multiprocessing's forkserver from
itself before it loads any plugin, and every process sglang spawns is forked from that forkserver. What a child
runs is what ``spawn`` runs: the same pickled target and arguments, the same ``__main__`` preparation, plugins
loaded by the child itself (``load_plugins`` has not run in the forkserver), and the launcher's environment as of the
child's start (``_run_in_environment``: what sglang set before it, or around it in its ``configure_subprocess``
helpers).

One difference is mended: a forked child's parent is the forkserver, not the launcher, and sglang's children send
SIGQUIT to their parent (``psutil.Process().parent()``) when they fail, so that the launcher takes the server down.
The forkserver passes that SIGQUIT on to the launcher.

``SglangServer`` uses this entry on CPU unless ``KVC_TEST_SPAWN=1`` or ``spawn_children=True`` (sglang's own
``spawn``, as operators run it: ``test_e2e_baseline``'s server, the GPU host, the demo; the startup refusals run the
plain entry too), and forks the launcher itself from a ``launcher_zygote`` (unless ``KVC_TEST_ZYGOTE=0``).
Measured on the 2-core CI machine (sglang 0.5.23, a canary server on CPU, CPU-seconds until it serves, while CI's
two lines ran): sglang's own entry 45 (launcher 15.8, scheduler 15.3, detokenizer 14.4); this entry 16.7 (launcher
11.7, scheduler 2.9, detokenizer 2.0); this entry forked from a zygote 6.7-7.5 (launcher 2.3-2.5).
"""

from __future__ import annotations

import functools
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import sys
from multiprocessing import connection, resource_tracker, spawn, util

# sglang's modules its children run: imported once, before the forkserver is forked from the launcher
PRELOAD = (
    "sglang.launch_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)

_FORKSERVER_PID = None


def _pass_sigquit_to_launcher(signum, frame):
    """In the forkserver: hand a child's SIGQUIT to the launching process. In a forked child (which inherits this
    handler): behave as if there were none (SIGQUIT's default)."""
    if os.getpid() == _FORKSERVER_PID:
        os.kill(os.getppid(), signal.SIGQUIT)
        return
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGQUIT)


def apply_environment(environ) -> None:
    """Make ``os.environ`` exactly ``environ``, setting only what differs (setproctitle names the process from the
    environ's memory: rewriting every variable lost sglang's process titles)."""
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _run_in_environment(environ, target, *args, **kwargs):
    """A child's target, run in the launcher's environment as of the child's start (what ``spawn`` gives it)."""
    apply_environment(environ)
    return target(*args, **kwargs)


def _popen_from_the_forkserver(process_obj):
    process_obj._target = functools.partial(_run_in_environment, dict(os.environ), process_obj._target)
    return multiprocessing.context.ForkServerProcess._Popen(process_obj)


def _fork_the_forkserver() -> None:
    """multiprocessing's ``ForkServer.ensure_running`` with the server forked from this process (which has imported
    ``PRELOAD`` and loaded no plugin) instead of started as a fresh interpreter that imports them again."""
    server = multiprocessing.forkserver._forkserver
    with server._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                pid = os.fork()
                if pid == 0:  # the forkserver: serves until the launcher's end of the alive pipe closes
                    global _FORKSERVER_PID
                    os.close(alive_w)
                    _FORKSERVER_PID = os.getpid()
                    signal.signal(signal.SIGQUIT, _pass_sigquit_to_launcher)
                    try:
                        multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
                    finally:
                        os._exit(0)
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
            server._forkserver_address = address
            server._forkserver_alive_fd = alive_w
            server._forkserver_pid = pid


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    _fork_the_forkserver()
    # sglang sets the start method to spawn (force=True) and some of its modules ask for the spawn context: either
    # way a process is started through SpawnProcess._Popen, which now goes through the forkserver
    multiprocessing.context.SpawnProcess._Popen = staticmethod(_popen_from_the_forkserver)
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # the helpers a child unpickles are this module's under its import name, not __main__'s
    from kv_canary_testing.fast_launch import main as _main

    _main()
