"""scripts/run_suite.py runs failed tests once more: a test that fails then passes is named FLAKY and the suite
passes; a test that fails twice fails it (real pytest runs of a small test file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import run_suite  # noqa: E402

FILE = '''
import pathlib

def test_passes_the_second_time():
    seen = pathlib.Path(__file__).with_name("seen")
    if not seen.exists():
        seen.write_text("1")
        raise AssertionError("first run")

def test_always_passes():
    pass
'''


@pytest.mark.parametrize("always_fails", [False, True])
def test_a_failure_reruns_once_and_only_a_repeated_one_fails_the_suite(tmp_path, capfd, always_fails):
    test_file = tmp_path / "test_flaky_once.py"
    test_file.write_text(FILE + ("\ndef test_always_fails():\n    raise AssertionError('every run')\n"
                                 if always_fails else ""))
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--rootdir", str(tmp_path),
           "-o", f"cache_dir={cache}", str(test_file)]
    rc = subprocess.call(cmd, cwd=tmp_path)
    assert rc == 1
    rc = run_suite.rerun_failed(cmd, str(cache), None, rc)
    out = capfd.readouterr().out
    assert "running them once more" in out and "test_passes_the_second_time" in out
    if always_fails:
        assert rc == 1 and "FLAKY" not in out
    else:
        assert rc == 0 and "FLAKY (failed once, passed when run again)" in out


def test_without_a_failure_record_the_first_result_stands(tmp_path):
    """The GPU host runs the suite with -p no:cacheprovider: no record, no rerun."""
    assert run_suite.rerun_failed(["false"], str(tmp_path / "none"), None, 1) == 1
