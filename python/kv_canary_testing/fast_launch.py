"""``python -m kv_canary_testing.fast_launch ARGS``: sglang's ``launch_server`` whose child processes are forked from
one pre-imported process instead of each importing sglang again (test servers on CPU; CI's time).

sglang starts its scheduler(s) and detokenizer with multiprocessing's ``spawn``: each child is a fresh interpreter
that imports sglang (~12-15 CPU-seconds on a 2-core CI machine, the detokenizer as much as the scheduler; a CPU test
server took ~45 CPU-seconds to start, a third of it each child's import). Here every process sglang spawns is
started by multiprocessing's forkserver instead, which imports sglang's scheduler and detokenizer modules once
(``PRELOAD``) and forks each child from that. What a child runs is what ``spawn`` runs: the same pickled target
and arguments, the same ``__main__`` preparation, plugins loaded by the child itself (the forkserver imports sglang
but never calls ``load_plugins``), the environment of the launching process as of the first child it starts (sglang
sets its environment before that; the per-child environment of its ``configure_subprocess`` helpers, memory saver
and NUMA binding, is for GPUs and not used on CPU).

One difference is mended: a forked child's parent is the forkserver, not the launching process, and sglang's
children send SIGQUIT to their parent (``psutil.Process().parent()``) when they fail, so that the launching process
takes the server down. The forkserver passes that SIGQUIT on to the launching process.

``SglangServer`` uses this entry on CPU unless ``KVC_TEST_SPAWN=1`` or ``spawn_children=True`` (sglang's own
``spawn``, as operators run it: ``test_e2e_baseline``'s server, the GPU host, the demo; the startup refusals run the
plain entry too). Measured on the 2-core CI machine (sglang 0.5.23, a canary server on CPU, while CI's two lines ran):
45 CPU-seconds to serve with the plain entry (launcher 15.8, scheduler 15.3, detokenizer 14.4), 26.5 with this one
(launcher 10.6, forkserver 10.2, scheduler 3.3, detokenizer 2.4).
"""

from __future__ import annotations

import multiprocessing.context
import os
import runpy
import signal
import sys

# sglang's modules its children run: imported once, in the forkserver
PRELOAD = (
    "kv_canary_testing.fast_launch",  # this module first: the forkserver's SIGQUIT hand-off and the start-method patch
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


def _start_spawned_children_from_the_forkserver() -> None:
    # sglang sets the start method to spawn (force=True) and some of its modules ask for the spawn context: either
    # way a process is started through SpawnProcess._Popen, which now goes through the forkserver.
    multiprocessing.context.SpawnProcess._Popen = multiprocessing.context.ForkServerProcess._Popen
    multiprocessing.set_forkserver_preload(list(PRELOAD))


_start_spawned_children_from_the_forkserver()
if __name__ != "__main__":  # imported by the forkserver (PRELOAD), before it forks any child
    _FORKSERVER_PID = os.getpid()
    signal.signal(signal.SIGQUIT, _pass_sigquit_to_launcher)

if __name__ == "__main__":
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
