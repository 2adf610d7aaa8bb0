"""The three runs of a real sglang bug on one workload (issue 53; docs/real-bugs.md), shared by its e2e tests.

``three_runs(bug, args, env, workload, pool)`` starts three CPU servers one after the other on the same
workload: (a) the bug in (``real_bugs.buggy_env``), ``--kv-canary none``; (b) the bug in, ``--kv-canary log``;
(c) the fixed sglang (the venv as is), ``--kv-canary raise``. For a fix the installed release lacks
(``real_bugs.APPLIES_ON``: the release ships the bug), (a) and (b) run the venv as is and (c) the copy with the fix
applied forward. Each run gives ``Run(result, log, running)``:
``workload(server)``'s result, the settled ``CanaryLog`` and whether the server was still up after the workload.
sglang's idle pool check warns instead of raising (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0``) in all
three, so a run that trips it keeps serving and the warning is the evidence (``pool_leaks``).
"""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, e2e_device
from kv_canary_testing.model_dir import write_swa_model_dir
from kv_canary_testing.real_bugs import APPLIES_ON, run_env
from kv_canary_testing.server import installed_sglang_version

BY_HAND_ENV = "KVC_REAL_BUGS_TIMING"  # the by-hand flag: real bugs whose servers are kept out of CI (time, timing)
QUIET_IDLE_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}
SWA_ARGS = ("--swa-full-tokens-ratio", "1.0")  # test_e2e_swa: torch_native reads SWA layers untranslated on CPU
LEAK = re.compile(r"pool memory leak detected! \[full\] total=(\d+), available=(\d+), evictable=(\d+).*?\n"
                  r"\[swa\] total=(\d+), available=(\d+), evictable=(\d+)")
# (name, --kv-canary, bug in?); "b2": (b) again, for a rerun with other canary flags (``three_runs``' run_args)
RUNS = (("a", "none", True), ("b", "log", True), ("c", "raise", False), ("b2", "log", True))


class Run(NamedTuple):
    result: object  # what the workload returned
    log: CanaryLog
    running: bool  # the server was still up after the workload


def pool_leaks(text: str):
    """sglang's idle pool-check warnings (hybrid SWA): [(full total, available, evictable, swa total, available,
    evictable)]."""
    return [tuple(int(x) for x in m.groups()) for m in LEAK.finditer(text)]


def serve(mode: str, bug: Optional[str], tmp_path_factory, args: Sequence[str], env: Mapping[str, str],
          workload: Callable, pool: int, model_path=None, python: Optional[str] = None, bug_in: bool = True) -> Run:
    """Run ``workload(server)`` on one server with bug ``bug`` in (``bug_in``) or fixed (a reversed fix: the venv as
    is; a forward fix, ``APPLIES_ON``: the copy with the fix applied); default model: the hybrid-SWA tiny model with
    ``SWA_ARGS``."""
    full_env = {**QUIET_IDLE_CHECK, **env, **run_env(bug, bug_in, python)}
    log_path = tmp_path_factory.mktemp(f"{mode}-{'bug' if bug_in else 'fixed'}") / "server.log"
    swa = model_path is None
    srv = canary_server(mode, log_path=log_path, env=full_env, model_path=write_swa_model_dir() if swa else model_path,
                        extra_args=[*(SWA_ARGS if swa else ()), *args], max_total_tokens=pool)
    with srv:
        result = workload(srv)
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    return Run(result, log, running)


def three_runs(bug: str, args: Sequence[str], env: Mapping[str, str], workload: Callable, pool: int,
               tmp_path_factory, *, model_path=None, describe: Optional[Callable[[Run], str]] = None,
               runs: Sequence[str] = ("a", "b", "c"),
               run_args: Optional[Mapping[str, Sequence[str]]] = None) -> Dict[str, Run]:
    """{"a": bug in, canary off; "b": bug in, log; "c": fixed, raise} on the same workload, args, env and pool.

    ``describe(run)`` adds to the ``kv_canary_real_bug`` line printed per run (what the record in
    docs/real-bugs.md is read from); ``runs`` picks a subset (a by-hand rerun of one) or adds ``"b2"`` (bug in,
    ``log``, again); ``run_args`` adds flags to one run's server (``{"b2": ["--kv-canary-real-data", "all"]}``).
    """
    out: Dict[str, Run] = {}
    for name, mode, bug_in in RUNS:
        if name not in runs:
            continue
        these = [*args, *(run_args or {}).get(name, ())]
        run = serve(mode, bug, tmp_path_factory, these, env, workload, pool, model_path, bug_in=bug_in)
        out[name] = run
        print(f"kv_canary_real_bug {bug} run={name} mode={mode} bug_in={bug_in} forward_fix={bug in APPLIES_ON} "
              f"running={run.running} run_args={list((run_args or {}).get(name, ()))} "
              f"pool_leaks={pool_leaks(run.log.text)} violations={len(run.log.violations)} "
              f"{describe(run) if describe else ''}", flush=True)
    return out


class ViolationSummary(NamedTuple):
    """What a (b) run's violations name: sorted kinds, positions and forwards, and one printable line."""

    kinds: list
    positions: list
    forwards: list
    line: str


def summarize_violations(bug: str, log: CanaryLog) -> ViolationSummary:
    """The (b) run's violations of ``bug`` (``log.violations`` must not be empty), for its assertions and its line."""
    vs = log.violations
    kinds = sorted({v["kind"] for v in vs})
    positions = sorted({int(v["position"]) for v in vs})
    forwards = sorted({int(v["forward"]) for v in vs})
    line = (f"kv_canary_real_bug {bug} b: {len(vs)} violations (counted {log.last_stat('violations')}) kinds={kinds} "
            f"groups={sorted({v['group'] for v in vs})} rids={sorted({v['rid'] for v in vs})} "
            f"hicache={sorted({str(v.get('hicache')) for v in vs})} slots={sorted({int(v['slot']) for v in vs})[:12]} "
            f"positions={positions[0]}..{positions[-1]} ({len(positions)}) forwards={forwards[0]}..{forwards[-1]} "
            f"first={vs[0]}")
    return ViolationSummary(kinds, positions, forwards, line)


def needs_gpu_and_line(lines: Sequence[str], why: str) -> None:
    """Skip (pytest) unless on the GPU host (``why``: what CPU servers cannot run) and on one of ``lines``."""
    import pytest

    if e2e_device() != "cuda":
        pytest.skip(f"GPU host: {why}")
    line = installed_sglang_version()
    if line not in lines:
        pytest.skip(f"the patch reverses on sglang {', '.join(lines)}, this is {line}")


def skip_unless_by_hand(reason: str) -> None:
    """Skip (pytest, naming ``reason``) unless ``KVC_REAL_BUGS_TIMING`` is set: a bug run by hand, not in CI."""
    import pytest

    if not os.environ.get(BY_HAND_ENV):
        pytest.skip(reason)
