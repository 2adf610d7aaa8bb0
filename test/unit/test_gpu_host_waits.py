"""scripts/gpu_host.sh's waits stop before the device call's limit (a wait after an install in the same call ran the
call past its 600 s, and the bench's results went back with the host: docs/results/gpu-h200-2026-12-02e-pinned-0.5.12).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_wait(tmp_path, call_limit: int, shell_ran_s: int) -> subprocess.CompletedProcess:
    """``bench-wait 540`` from a shell that had already run ``shell_ran_s`` seconds (the device call's shell)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), KVC_CALL_LIMIT_S=str(call_limit),
               KVC_BENCH_DIR=str(tmp_path / "no-bench"))
    script = f"sleep {shell_ran_s}; bash {ROOT / 'scripts' / 'gpu_host.sh'} bench-wait 540; echo rc=$?"
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_a_wait_is_capped_by_what_is_left_of_the_call(tmp_path):
    r = _bench_wait(tmp_path, call_limit=100, shell_ran_s=2)
    m = re.search(r"wait capped at (\d+) s \(asked 540 s\): this call has run (\d+) s of 100 s", r.stderr)
    assert m, r.stderr
    ran = int(m.group(2))
    assert 2 <= ran <= 10 and int(m.group(1)) == 100 - 45 - ran
    # then the step goes on as before: here no bench was started, which it says (exit 3)
    assert "NO_BENCH" in r.stderr and "rc=3" in r.stdout


def test_a_wait_that_fits_the_call_is_not_capped(tmp_path):
    r = _bench_wait(tmp_path, call_limit=600, shell_ran_s=1)
    assert "wait capped" not in r.stderr and "NO_BENCH" in r.stderr


def test_a_parent_older_than_any_call_does_not_cap(tmp_path):
    # the shell ran 3 s, more than a 2 s call could have: it is not the call's shell, and the wait is left alone
    r = _bench_wait(tmp_path, call_limit=2, shell_ran_s=3)
    assert "wait capped" not in r.stderr and "NO_BENCH" in r.stderr
