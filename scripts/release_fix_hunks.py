"""Print the KV-relevant hunks between consecutive sglang releases that a reversal could put back (issue 53).

A real-bug patch must reverse on an installed release, so a fix found between releases A and B is only usable if its
added lines are still in the target release (default 0.5.23). For each consecutive pair of the releases given, this
diffs the KV-relevant files of the unzipped wheels (``WHEELS/<ver>/sglang-*.whl``, unzipped once under ``--src``) and
prints each small hunk whose added code lines all survive in the target and whose changed lines touch frees, locks,
eviction or KV bookkeeping. docs/real-bugs.md (the fourth pass) records what reading them found.

    python scripts/release_fix_hunks.py 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23 [--wheels /tmp/sgl-wheels]
        [--src /tmp/sgl-src] [--target 0.5.23] [--max-lines 14] [--hicache]

``--hicache`` (the sixth pass) also reads ``managers/cache_controller.py`` and keeps the hunks that name HiCache
(the default skips them) and the host-tier words (host, load_back, backup, prefetch).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import zipfile

FILES = ("mem_cache", "managers/schedule_batch.py", "managers/schedule_policy.py", "managers/scheduler.py",
         "speculative", "disaggregation/decode.py")
KV_WORDS = re.compile(r"free|lock|evict|protected|seqlen|prefix_len|kv_committed|kv_allocated|req_to_token|"
                      r"out_cache_loc|last_loc|swa_|release|retract|page_floor|ceil_align|// page|% page")
SKIP = re.compile(r"mamba|hicache|dllm|dsv4|deepseek|npu|hip|lora|multimodal|mm_|logger|metrics|profil|import ", re.I)
HICACHE_FILES = ("managers/cache_controller.py",)
HICACHE_WORDS = re.compile(r"host|load_back|backup|prefetch|write_through|write_back")
HICACHE_SKIP = re.compile(r"mamba|dllm|dsv4|deepseek|npu|hip|lora|multimodal|mm_|logger|metrics|profil|import |"
                          r"mooncake|nixl|hf3fs|eic|hisparse", re.I)


def unzip(wheels: str, src: str, version: str) -> str:
    root = os.path.join(src, version)
    if not os.path.isdir(os.path.join(root, "sglang")):
        wheel = glob.glob(os.path.join(wheels, version, "sglang-*.whl"))
        if not wheel:
            raise SystemExit(f"no wheel for sglang {version} under {wheels}/{version}")
        with zipfile.ZipFile(wheel[0]) as z:
            z.extractall(root, [n for n in z.namelist() if n.startswith("sglang/srt/")])
    return os.path.join(root, "sglang", "srt")


def hunks(old: str, new: str, files=FILES):
    """(file relative to srt, hunk text) of ``diff -ruN old new`` over ``files``."""
    for part in files:
        out = subprocess.run(["diff", "-ruN", os.path.join(old, part), os.path.join(new, part)],
                             capture_output=True, text=True).stdout
        for chunk in re.split(r"(?m)^diff -ruN ", out)[1:]:
            rel = chunk.splitlines()[0].split()[-1].split("/sglang/srt/", 1)[-1]
            for h in re.split(r"(?m)^(?=@@)", chunk)[1:]:
                yield rel, h


def code(lines, sign):
    return [l[1:] for l in lines if l.startswith(sign) and l[1:].strip() and not l[1:].strip().startswith("#")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="+")
    ap.add_argument("--wheels", default="/tmp/sgl-wheels")
    ap.add_argument("--src", default="/tmp/sgl-src")
    ap.add_argument("--target", default="0.5.23")
    ap.add_argument("--max-lines", type=int, default=14)
    ap.add_argument("--hicache", action="store_true", help="HiCache hunks too (cache_controller, host-tier words)")
    a = ap.parse_args()
    files, skip, words = FILES, SKIP, KV_WORDS
    if a.hicache:
        files, skip = FILES + HICACHE_FILES, HICACHE_SKIP
        words = re.compile(KV_WORDS.pattern + "|" + HICACHE_WORDS.pattern)
    target = unzip(a.wheels, a.src, a.target)
    srt = {v: unzip(a.wheels, a.src, v) for v in a.versions}
    count = 0
    for old, new in zip(a.versions, a.versions[1:]):
        for rel, h in hunks(srt[old], srt[new], files):
            lines = h.splitlines()
            plus, minus = code(lines, "+"), code(lines, "-")
            if not plus or not minus or len(plus) + len(minus) > a.max_lines or skip.search(h):
                continue
            if not any(words.search(l) for l in plus + minus):
                continue
            path = os.path.join(target, rel)
            text = open(path).read() if os.path.isfile(path) else ""
            if not all(l in text for l in plus):  # a reversal must find the fix in the target release
                continue
            count += 1
            print(f"=== {old} -> {new} {rel}\n" + "\n".join(l for l in lines if l[:1] in "+-@"))
    print(f"# {count} hunks")


if __name__ == "__main__":
    main()
