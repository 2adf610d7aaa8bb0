"""Bench-only statistical profiler of every Python process of a server (no py-spy on the GPU host).

Put this directory first on ``PYTHONPATH`` and set ``KVC_STACK_SAMPLE_DIR``: every Python process then starts a
daemon thread that samples its main thread's stack every ``KVC_STACK_SAMPLE_INTERVAL_S`` (default 0.002 s) and
every second rewrites ``<dir>/<pid>.json``: the process title, the sample count and, per function, how many samples
had it as the *owner*: the innermost frame that belongs to sglang or the canary (torch, numpy, zmq frames below it
count for it). Samples whose owner is a canary frame are the canary's host time on that thread (by path, and by the
line its innermost canary frame was on: ``canary_lines``); owners in sglang
show where the rest goes (``benchmarks/bench_hicache_overhead.py --sample-stacks`` sums them per server). A sample
costs the sampled process ~10-30 us of GIL time: the numbers attribute time, they do not time a row. ``gc``: the
process's garbage collections per generation (count, seconds, longest), timed by a ``gc.callbacks`` entry (time the
samples attribute to whatever frame triggered the collection).

``KVC_DIAG_CANARY_IDLE=1`` (no sampling needed): the bench ablation ``hc_ours_idle``, the canary installed with its
per-forward work skipped (``canary_idle.py``). ``KVC_DIAG_DEVICE_BYTES=N``: the layout probe, N device bytes held
after the KV pool of a server without the canary (``device_bytes.py``). ``KVC_DIAG_RESERVE_BYTES``,
``KVC_DIAG_SKIP_PRECOMPILE``: one step of the canary's install at a time (``layout_ablations.py``).
"""

import os

_DIR = os.environ.get("KVC_STACK_SAMPLE_DIR")


def _start(out_dir: str) -> None:
    import collections
    import json
    import sys
    import threading
    import time

    interval = float(os.environ.get("KVC_STACK_SAMPLE_INTERVAL_S", "0.002"))
    owners = collections.Counter()  # "pkg/module.py:function" of the innermost sglang/canary frame
    canary_paths = collections.Counter()  # canary samples: its two outermost frames and its innermost one
    canary_lines = collections.Counter()  # canary samples: the innermost canary frame's line ("file:function:line")
    state = {"samples": 0, "no_owner": 0}
    # Python's garbage collector in this process (any thread): per generation [collections, seconds, longest s]
    gc_time = {g: [0, 0.0, 0.0] for g in ("0", "1", "2")}
    gc_start = {}

    def on_gc(phase, info):
        gen = str(info.get("generation", "?"))
        if phase == "start":
            gc_start[gen] = time.perf_counter()
        elif gen in gc_time and gen in gc_start:
            dt = time.perf_counter() - gc_start.pop(gen)
            row = gc_time[gen]
            row[0] += 1
            row[1] += dt
            row[2] = max(row[2], dt)

    import gc
    gc.callbacks.append(on_gc)
    import host_timers  # this directory's: sglang scheduler methods timed once imported

    def owner_of(frame):
        chain, owner, line = [], None, None
        while frame is not None:
            path = frame.f_code.co_filename
            for pkg in ("/kv_canary/", "/sglang/"):
                i = path.rfind(pkg)
                if i >= 0:
                    name = f"{path[i + 1:]}:{frame.f_code.co_name}"
                    if owner is None:
                        owner = name
                    if pkg == "/kv_canary/":
                        chain.append(name.replace("kv_canary/", ""))
                        if line is None:
                            line = f"{chain[-1]}:{frame.f_lineno}"
                    break
            frame = frame.f_back
        return owner, chain, line

    def dump() -> None:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except OSError:
            title = "?"
        doc = {"pid": os.getpid(), "title": title, "interval_s": interval, **state,
               "owners": dict(owners.most_common(80)), "canary_paths": dict(canary_paths.most_common(60)),
               "canary_lines": dict(canary_lines.most_common(60)),
               "gc": {g: [n, round(t, 6), round(m, 6)] for g, (n, t, m) in gc_time.items()},
               "timers": host_timers.snapshot()}
        tmp = os.path.join(out_dir, f".{os.getpid()}.json")
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(out_dir, f"{os.getpid()}.json"))

    def run() -> None:
        main = threading.main_thread().ident
        last = patched = time.monotonic()
        while True:
            if time.monotonic() - patched > 1.0:
                patched = time.monotonic()
                host_timers.patch_ready()
            time.sleep(interval)
            frame = sys._current_frames().get(main)
            if frame is None:
                continue
            owner, chain, line = owner_of(frame)
            state["samples"] += 1
            if owner is None:
                state["no_owner"] += 1
            else:
                owners[owner] += 1
                if owner.startswith("kv_canary/"):
                    outer = list(reversed(chain[-2:]))  # the two outermost canary frames, then the innermost
                    canary_paths[" > ".join(outer + ([chain[0]] if len(chain) > 2 else []))] += 1
                    canary_lines[line] += 1
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                dump()

    os.makedirs(out_dir, exist_ok=True)
    threading.Thread(target=run, name="kvc-stack-sampler", daemon=True).start()


if os.environ.get("KVC_DIAG_CANARY_IDLE") == "1":  # bench ablation hc_ours_idle: the canary's per-forward work off
    import canary_idle

    canary_idle.install()

if os.environ.get("KVC_DIAG_DEVICE_BYTES"):  # bench ablation: the layout probe (device_bytes.py)
    import device_bytes

    device_bytes.install()

import layout_ablations  # noqa: E402 - light: os, sys, functools

if any(os.environ.get(name) for name in layout_ablations.ENVS):  # one step of the install at a time
    layout_ablations.install()

if _DIR:
    _start(_DIR)
