#!/usr/bin/env python3
"""Run the registered e2e tests (``register_cpu_ci`` / ``register_cuda_ci``) with pytest.

    python scripts/run_suite.py --hw cpu  [--suite kv-canary-cpu]  [--with-unit]  [-- PYTEST ARGS]
    python scripts/run_suite.py --hw cuda [--suite kv-canary-cuda] [-- PYTEST ARGS]

Files under test/registered/ are parsed with sglang's own ``collect_tests`` (the
registration calls are AST markers); the selected files run in one pytest
process, longest estimate first. ``--hw cuda`` sets ``KVC_TEST_DEVICE=cuda`` so
the same tests drive a GPU server (they skip with a reason where there is none).
``--with-unit`` adds test/unit to the same pytest run. Failed tests run once more (``--no-rerun``: not): a
failure that repeats fails the suite; one that passes the second time is printed as FLAKY.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collect(hw: str, suite: str | None):
    from sglang.test.ci.ci_register import HWBackend, collect_tests

    files = sorted(glob.glob(str(ROOT / "test" / "registered" / "**" / "test_*.py"), recursive=True))
    backend = {"cpu": HWBackend.CPU, "cuda": HWBackend.CUDA}[hw]
    regs = [r for r in collect_tests(files, sanity_check=True) if r.backend == backend and not r.disabled]
    if suite:
        regs = [r for r in regs if r.effective_suite == suite]
    from kv_canary_testing.line_suites import not_on_this_line

    skipped = not_on_this_line()  # files that drive another sglang line's adapter only
    for r in [r for r in regs if os.path.relpath(r.filename, ROOT / "test") in skipped]:
        print(f"run_suite: not on this sglang line: {os.path.relpath(r.filename, ROOT)} "
              f"({skipped[os.path.relpath(r.filename, ROOT / 'test')]})")
    regs = [r for r in regs if os.path.relpath(r.filename, ROOT / "test") not in skipped]
    regs.sort(key=lambda r: (-r.est_time, r.filename))
    return regs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hw", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--suite", default=None, help="only this suite (default: every suite of --hw)")
    parser.add_argument("--with-unit", action="store_true", help="also run test/unit in the same pytest run")
    parser.add_argument("--list", action="store_true", help="print the selected files and exit")
    parser.add_argument("--no-rerun", action="store_true", help="do not run failed tests a second time")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    regs = collect(args.hw, args.suite)
    if not regs:
        print(f"run_suite: no registered test for --hw {args.hw} --suite {args.suite}", file=sys.stderr)
        return 2
    est = sum(r.est_time for r in regs)
    print(f"run_suite: {len(regs)} registered file(s) for {args.hw} (estimated {est:.0f}s):")
    for r in regs:
        print(f"  {os.path.relpath(r.filename, ROOT)}  suite={r.effective_suite}  est={r.est_time:.0f}s")
    if args.list:
        return 0
    env = dict(os.environ)
    env["KVC_TEST_DEVICE"] = args.hw
    targets = (["test/unit"] if args.with_unit else []) + [os.path.relpath(r.filename, ROOT) for r in regs]
    # -rsfE: the summary ends with the FAILED / ERROR lines, so the tail of a CI log names what failed. A cache
    # of this run's own (two lines run side by side in one checkout) records what failed for the rerun.
    cache = tempfile.mkdtemp(prefix="kvc-pytest-cache-")
    cmd = [sys.executable, "-m", "pytest", "-v", "-rsfE", "--durations=60", "-o", f"cache_dir={cache}", *targets,
           *args.pytest_args]
    print("run_suite: $ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc != 1 or args.no_rerun:  # 1: tests failed (not an interrupted run, a usage error, nothing collected)
        return rc
    return rerun_failed(cmd, cache, env, rc)


def rerun_failed(cmd, cache: str, env, rc: int) -> int:
    """Run the failed tests once more (on a 2-core CI machine a server test can miss a deadline it meets when
    run again): a failure that repeats fails the suite; one that passes is named in a FLAKY line, its first
    failure's output stays above."""
    record = Path(cache) / "v" / "cache" / "lastfailed"
    if not record.is_file():  # no record (pytest ran with -p no:cacheprovider): the first result stands
        return rc
    failed = sorted(json.loads(record.read_text() or "{}"))
    if not failed:
        return rc
    print(f"run_suite: {len(failed)} failed; running them once more: {' '.join(failed)}", flush=True)
    rc2 = subprocess.call([*cmd, "--lf", "--lfnf=none"], cwd=ROOT, env=env)
    if rc2 == 0:
        print(f"run_suite: FLAKY (failed once, passed when run again): {' '.join(failed)}", flush=True)
        return 0
    return rc2 if rc2 != 5 else rc  # 5: nothing collected for the rerun: the first result stands


if __name__ == "__main__":
    raise SystemExit(main())
