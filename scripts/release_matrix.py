"""Run a CPU smoke of the plugin on sglang releases its cached venvs do not hold, one JSON row per release.

For each release: the wheel (``pip download sglang==X --no-deps``, reused from ``--wheels``) is installed with
``--no-deps`` into an overlay folder (``~/.cache/sglang-kv-canary/matrix/sglang-X``, reused); the overlay goes first
on ``PYTHONPATH`` in front of a cached venv whose release pins the same torch (the venv itself is never touched:
its own sglang stays behind the overlay; a cached venv of the release itself, as ``KVC_SGLANG=0.5.18`` builds, runs
it with no overlay). The smoke is ``scripts/run_suite.py --hw cpu --no-rerun -- -k SMOKE`` (``SMOKES``: the line's);
the row (release, line, base venv, torch pin, pins that differ from the base release, smoke, rc, date) is
appended to ``--out``. A release with no base venv of its torch pin, or whose wheel cannot be downloaded, gets a
row saying so.

    python scripts/release_matrix.py 0.5.12.post1 [0.5.22 ...] [--smoke EXPR] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from typing import Dict, Optional, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.expanduser("~/.cache/sglang-kv-canary")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from release_targets import fetch_wheel  # noqa: E402

from kv_canary.adapter.lines import LINE_MODULES, load_line  # noqa: E402


def requirements(wheel: str) -> Set[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return {line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line}


def torch_pin(reqs: Set[str]) -> Optional[str]:
    return next((r.split("==", 1)[1].split(";")[0].strip() for r in reqs if re.match(r"torch\s*==", r)), None)


def base_venvs() -> Dict[str, str]:
    """sglang release -> cached venv holding it."""
    out = {}
    for venv in sorted(glob.glob(os.path.join(CACHE, "venv-*"))):
        for dist in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "sglang-*.dist-info")):
            out[os.path.basename(dist)[len("sglang-"):-len(".dist-info")]] = venv
    return out


# The smoke per line (issue 58): a clean `raise` mixed workload, perturbations of three kinds caught in `log`, and
# `contain` aborting the readers. The 0.5.12 line's suite has no test_e2e_perturb_modes (line_suites): its three
# kinds come from real_kv_used and the fed positions / tokens (position_shift, next_token_swap).
# (on a release whose tree lacks what contain evicts through, the refusal's test runs in its place: test_e2e_contain)
_CONTAIN = "test_contain_aborts_exactly_the_readers or test_contain_is_refused_where_the_evictor_interface_is_missing"
SMOKES = {
    "0.5.12": ("test_e2e_baseline or test_log_mode_reports_every_injection_and_keeps_serving or "
               f"test_log_mode_catches_shifted_positions_and_wrong_tokens or {_CONTAIN}"),
    "0.5.13": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.15": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.17": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.18": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.19": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.20": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.21": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
    "0.5.23": f"test_e2e_baseline or (test_log_mode_detects_every_injection and all) or {_CONTAIN}",
}


RUN_ENV = "KVC_RELEASE_MATRIX_RUN"


def _kill_marked(token: str) -> None:
    """Kill the process group of every process whose environment carries ``RUN_ENV=token`` (left by a smoke)."""
    mark = f"{RUN_ENV}={token}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def line_of(release: str) -> str:
    return next((name for name, m in LINE_MODULES.items()
                 if release in load_line(m).versions + load_line(m).untested_versions), "refused")


def run(release: str, smoke: Optional[str], wheels: str, timeout_s: int = 1500) -> dict:
    line = line_of(release)
    smoke = smoke or SMOKES.get(line, "test_e2e_baseline")
    row = {"release": release, "line": line, "smoke": smoke,
           "date": datetime.date.today().isoformat()}
    wheel = fetch_wheel(release, wheels)
    if wheel is None:
        return {**row, "result": "wheel download failed"}
    reqs = requirements(wheel)
    pin = torch_pin(reqs)
    venvs = base_venvs()
    bases = {v: venv for v, venv in venvs.items() if v != release}
    base = next(((v, venv) for v, venv in bases.items()
                 if torch_pin(requirements(fetch_wheel(v, wheels) or wheel)) == pin), None)
    if release in venvs:  # a venv of the release itself (setup_env.sh's line): no overlay
        base = (release, venvs[release])
    row["torch"] = pin
    if base is None:
        return {**row, "result": f"no cached venv pins torch {pin}"}
    base_release, venv = base
    overlay = os.path.join(CACHE, "matrix", f"sglang-{release}")
    if base_release != release and not os.path.isdir(os.path.join(overlay, "sglang")):
        subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--no-deps", "--target",
                        overlay, wheel], check=True)
    base_reqs = requirements(fetch_wheel(base_release, wheels) or wheel)
    row.update(base_venv=os.path.basename(venv), base_release=base_release,
               pins_not_swapped=sorted(reqs - base_reqs))
    path = ([overlay] if base_release != release else []) + [os.path.join(ROOT, "python")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), RUN_ENV: f"{release}-{os.getpid()}-{time.time()}"}
    start = time.time()
    # its own session, so a smoke past the limit is stopped with its server (0.5.18 off its pins once hung)
    proc = subprocess.Popen([os.path.join(venv, "bin", "python"), "scripts/run_suite.py", "--hw", "cpu", "--no-rerun",
                             "--", "-k", smoke, "-q"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, rc = proc.communicate(timeout=timeout_s)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, rc = proc.communicate()[0] + f"\ntimed out after {timeout_s} s (stopped)", 124
    finally:  # the test's sglang server runs in a process group of its own: found by the run's env token
        _kill_marked(env[RUN_ENV])
    log = os.path.join(CACHE, "matrix", f"smoke-{release}-{time.strftime('%Y%m%dT%H%M%S')}.log")  # the whole output
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write(out)
    tail = out.strip().splitlines()
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)|timed out", line)), "")
    print(f"release_matrix: {release}: output in {log}", file=sys.stderr)
    return {**row, "rc": rc, "summary": summary.strip("= "), "wall_s": round(time.time() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="+")
    parser.add_argument("--smoke", default=None, help="a pytest -k expression (default: the line's, SMOKES)")
    parser.add_argument("--wheels", default="/tmp/sgl-wheels")
    parser.add_argument("--timeout", type=int, default=1500, help="seconds per release's smoke (then stopped, rc 124)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "release-matrix.jsonl"))
    args = parser.parse_args()
    for release in args.releases:
        row = run(release, args.smoke, args.wheels, args.timeout)
        print(json.dumps(row), flush=True)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
