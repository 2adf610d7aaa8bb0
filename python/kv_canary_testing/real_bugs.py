"""Put a real sglang bug back, for one test server only (issue 53).

Each patch in ``real_bug_patches/`` is the *fix* of a real sglang PR as a diff whose paths start with
``python/sglang/srt/`` (copied from the project's shared ``realbugs`` folder; its README has the table).
``buggy_sglang(name)`` copies the ``sglang`` package of a Python's site-packages into a cache folder, applies
the patch reversed there (``git apply -R -p2``: the bug is back) and returns that folder; ``buggy_env(name)``
returns the ``PYTHONPATH`` that puts it first for a ``SglangServer`` (``env=``), so that one server imports the
buggy copy while the venv, its sglang and the product stay as they are. Copies are cached per (sglang version,
patch content); a patch that does not reverse on the installed release is an error naming both.

A bug the installed release *ships* (fixed in a later release) has its patch in ``APPLIES_ON`` instead: the release as
installed is the buggy sglang, and ``fixed_sglang(name)`` / ``fixed_env(name)`` build the copy with the fix applied
forward (``git apply -p2``), for the fixed run. ``run_env(name, bug_in)`` picks the right one for either kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional

from kv_canary_testing import default_cache_dir
from kv_canary_testing.server import PACKAGE_PARENT, _prepend_path

PATCH_DIR = Path(__file__).resolve().parent / "real_bug_patches"
# which patch reverses on which release (real_bug_patches/README.md); others fail the check with a clear error
REVERSES_ON = {
    "swa_evict_boundary_pr22470": ("0.5.12",),
    "hybrid_swa_chunked_stash_pr24318": ("0.5.12",),
    "cudagraph_swa_pad_loc_pr24743": ("0.5.12",),
    "fa3_mla_embedding_skip_kv_pr24097": ("0.5.12",),
    "fa3_mla_embedding_skip_kv_pr24097_v0.5.23form": ("0.5.23",),
    "pd_swa_tail_stale_mapping_pr25805": ("0.5.23",),
    "hicache_loadback_fence_pr36738": ("0.5.23",),
    "swa_bigram_evict_frontier_pr34870": ("0.5.23",),
    "swa_match_tombstone_reset_pr17061": ("0.5.12",),  # step 3 (issue 53): 0.5.23 has no SWARadixCache file
    "swa_recover_locked_full_pr29352": ("0.5.23",),  # step 3: UnifiedRadixCache's SWA component
    "priority_preempt_finished_pr18694": ("0.5.12",),  # step 3: priority preemption of a finished request
    "swa_repoint_short_match_0523": ("0.5.23",),  # step 3: a 0.5.22 -> 0.5.23 fix, found by diffing the releases
    "eagle_draft_decode_positions_pr25015": ("0.5.23",),  # step 3 (PD/spec pass): EAGLE draft decode positions
    "eagle_chunked_tail_token_pr26800": ("0.5.23",),  # step 3 (PD/spec pass): EAGLE chunk-end draft token
    "score_embed_override_radix_insert_0522": ("0.5.23",),  # step 3: /v1/score's embedding overrides cached (#27472)
}
# fixes applied forward: the release named ships the bug (a later release fixed it); the venv is the buggy run
APPLIES_ON = {
    "swa_recover_locked_full_legacy_0512": ("0.5.12",),  # #29352's SWARadixCache half (in 0.5.15), on 0.5.12
    "hicache_loadback_protect_host_0512": ("0.5.12",),  # HiRadixCache load_back's host protection (in 0.5.15)
}
MARKER = "KVC_REAL_BUG.json"  # written beside the patched package: which bug, on which release


class RealBugError(RuntimeError):
    """A patch is unknown, does not reverse on the installed sglang, or the copy is not what a server imports."""


def patch_path(name: str) -> Path:
    """The fix diff of bug ``name`` (a file stem of ``real_bug_patches/``)."""
    path = PATCH_DIR / f"{name}.patch"
    if not path.is_file():
        known = sorted(p.stem for p in PATCH_DIR.glob("*.patch"))
        raise RealBugError(f"no real-bug patch {name!r} in {PATCH_DIR}; known: {known}")
    return path


def _clean_env() -> Dict[str, str]:
    env = dict(os.environ)
    # the venv's own sglang, never an earlier buggy copy; other entries stay (the GPU host's sglang is on PYTHONPATH)
    kept = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and "real-bugs" not in Path(p).parts]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def installed_sglang(python: Optional[str] = None) -> tuple[str, Path]:
    """(version, package folder) of the sglang installed for ``python`` (default this interpreter); no import."""
    code = ("import importlib.util, importlib.metadata as m, json, os; s = importlib.util.find_spec('sglang'); "
            "print(json.dumps([m.version('sglang'), os.path.dirname(s.origin)]))")
    out = subprocess.run([python or sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise RealBugError(f"cannot locate sglang for {python or sys.executable}: {out.stderr.strip()[-500:]}")
    version, folder = json.loads(out.stdout.strip().splitlines()[-1])
    return version, Path(folder)


def _git_apply(root: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # --unsafe-paths is not needed: the paths are relative to root; GIT_DIR unset so git acts as plain `patch`
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "apply", "-p2", *flags, str(patch)], cwd=root, env=env,
                          capture_output=True, text=True)


def _patched_copy(name: str, forward: bool, python: Optional[str], cache_dir: Optional[Path]) -> Path:
    """A copy of ``python``'s sglang with patch ``name`` reversed (``forward=False``: the bug put back) or applied
    (``forward=True``: the fix put in). Built once per (sglang version, patch sha256, direction)."""
    patch = patch_path(name)
    version, package = installed_sglang(python)
    digest = hashlib.sha256(patch.read_bytes()).hexdigest()[:12]
    kind = "fixed-" if forward else ""
    root = Path(cache_dir or default_cache_dir() / "real-bugs") / f"sglang-{version}-{kind}{name}-{digest}"
    if (root / MARKER).is_file() and (root / "sglang").is_dir():
        return root
    apply, undo = ((), ("-R",)) if forward else (("-R",), ())
    what = "apply" if forward else "reverse"
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        shutil.copytree(package, tmp / "sglang", ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
        check = _git_apply(tmp, patch, "--check", *apply)
        if check.returncode != 0:
            on = (APPLIES_ON if forward else REVERSES_ON).get(name, ())
            raise RealBugError(
                f"patch {name} does not {what} on the installed sglang {version} ({package}): "
                f"{check.stderr.strip()[-800:]}\n(it was checked against sglang {', '.join(on) or '?'})")
        done = _git_apply(tmp, patch, *apply)
        if done.returncode != 0:
            raise RealBugError(f"git apply {' '.join(apply)} of {name} failed on sglang {version}: "
                               f"{done.stderr.strip()[-800:]}")
        if _git_apply(tmp, patch, "--check", *undo).returncode != 0:  # the step must be undoable: it happened
            raise RealBugError(f"{name}: after the {what} the patch does not {what} back; copy in {tmp}")
        (tmp / MARKER).write_text(json.dumps({"bug": name, "sglang": version, "from": str(package),
                                              "fix_applied" if forward else "fix_reversed": True,
                                              "patch_sha256_12": digest}) + "\n")
        try:
            os.rename(tmp, root)
        except OSError:  # another process built it first
            if not (root / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def buggy_sglang(name: str, python: Optional[str] = None, cache_dir: Optional[Path] = None) -> Path:
    """Return a folder holding a copy of ``python``'s sglang package with bug ``name`` put back.

    Built once per (sglang version, patch sha256) under ``cache_dir`` (default ``<cache>/real-bugs``).
    """
    if name in APPLIES_ON:
        raise RealBugError(f"{name} is a fix applied forward (the installed release ships the bug): use fixed_sglang")
    return _patched_copy(name, False, python, cache_dir)


def fixed_sglang(name: str, python: Optional[str] = None, cache_dir: Optional[Path] = None) -> Path:
    """Return a folder holding a copy of ``python``'s sglang with the fix ``name`` applied forward (``APPLIES_ON``:
    the installed release ships the bug)."""
    if name not in APPLIES_ON:
        raise RealBugError(f"{name} is not a forward fix (APPLIES_ON); the installed release has its fix")
    return _patched_copy(name, True, python, cache_dir)


def _env_for(root: Path, python: Optional[str]) -> Dict[str, str]:
    path = _prepend_path(_prepend_path(os.environ.get("PYTHONPATH"), PACKAGE_PARENT), str(root))
    code = "import importlib.util; print(importlib.util.find_spec('sglang').origin)"
    out = subprocess.run([python or sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path},
                         capture_output=True, text=True)
    origin = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-300:]
    if not origin.startswith(str(root)):
        raise RealBugError(f"with PYTHONPATH={path} sglang resolves to {origin}, not the patched copy in {root}")
    return {"PYTHONPATH": path}


def fixed_env(name: str, python: Optional[str] = None, cache_dir: Optional[Path] = None) -> Dict[str, str]:
    """``env=`` for a server running the fixed copy of a forward fix (as ``buggy_env``)."""
    return _env_for(fixed_sglang(name, python, cache_dir), python)


def run_env(name: str, bug_in: bool, python: Optional[str] = None) -> Dict[str, str]:
    """The env of one run: a reversed fix's buggy copy when the bug is in; a forward fix's fixed copy when it is
    not; otherwise the venv as is ({})."""
    if name in APPLIES_ON:
        return {} if bug_in else fixed_env(name, python)
    return buggy_env(name, python) if bug_in else {}


def buggy_env(name: str, python: Optional[str] = None, cache_dir: Optional[Path] = None) -> Dict[str, str]:
    """``env=`` for a ``SglangServer`` running ``python`` with bug ``name``: the buggy copy first on PYTHONPATH.

    The server adds this package's parent to PYTHONPATH before applying ``env``, so it is kept here too (the
    tiny model package and the canary's editable checkout stay importable). Checks that the server's
    interpreter resolves ``sglang`` to the copy.
    """
    return _env_for(buggy_sglang(name, python, cache_dir), python)
