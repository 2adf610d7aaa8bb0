"""Bench-only host timers of a server's scheduler (imported by this directory's ``sitecustomize``).

Wraps a few sglang scheduler methods, once their modules are imported, with wall-clock timers, the same in a
server with and without the canary, to say where a batch boundary's host time goes (``--sample-stacks``):

* per method (and, where its first argument is a batch, per forward mode ``e``/``d``): calls, seconds, longest;
* per batch boundary (the last decode launch of one batch to the first decode launch of the next), a list of
  milliseconds for each segment: ``decode_to_recv`` (the last decode's launch end to the first request received
  after it: the last steps, the responses, the client's round trip), ``recv_to_extend`` (to the extend's launch:
  scheduling, the load-back's start), ``extend_launch`` (the extend's ``run_batch``: its eager forward's launches),
  ``extend_to_decode`` (to the next decode's launch: the extend's result and the first decode's scheduling).

A method's time includes what runs inside it (the canary's hooks in ``run_batch``: HEAD and TAIL's launches).
A method without a batch argument called inside ``run_batch`` is keyed with that batch's mode.
"""

import sys
import time

# (module, class, method, the first argument is a batch with a forward_mode)
TARGETS = (
    ("sglang.srt.managers.scheduler", "Scheduler", "run_batch", True),
    ("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result", True),
    ("sglang.srt.managers.scheduler", "Scheduler", "get_next_batch_to_run", False),
    ("sglang.srt.managers.scheduler", "Scheduler", "process_input_requests", False),
    ("sglang.srt.managers.scheduler", "Scheduler", "recv_requests", False),
    ("sglang.srt.managers.scheduler", "Scheduler", "on_idle", False),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "start_loading", False),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "start_writing", False),
    ("sglang.srt.mem_cache.hiradix_cache", "HiRadixCache", "writing_check", False),
    ("sglang.srt.mem_cache.hiradix_cache", "HiRadixCache", "init_load_back", False),
    # the canary's per-forward host work (absent in a server without it): the outer bracket, plan + HEAD, the
    # TAIL (at the anchor or after the forward), and parts of HEAD and of the HiCache hooks
    ("kv_canary.runner.brackets", "OutsideBracket", "__enter__", False),
    ("kv_canary.runner.brackets", "OutsideBracket", "__exit__", False),
    ("kv_canary.runner.manager", "CanaryManager", "pre_ops_maybe_inside_graph", False),
    ("kv_canary.runner.single_forward", "SingleForwardManager", "post_ops_maybe_inside_graph", False),
    ("kv_canary.token_oracle", "TokenOracle", "stage", False),
    ("kv_canary.runner.load_hashing", "LoadHashing", "start", False),
    ("kv_canary.runner.host_copies", "HostCopies", "load_records", False),
    ("kv_canary.runner.host_copies", "HostCopies", "flush_host_records", False),
)

calls = {}  # "Class.method[:mode]" -> [calls, seconds, longest]
boundaries = {k: [] for k in ("decode_to_recv", "recv_to_extend", "extend_launch", "extend_to_decode")}
_state = {"last_decode_end": None, "first_recv": None, "extend_end": None, "mode": None}
_patched = set()


def _mode(batch) -> str:
    fm = getattr(batch, "forward_mode", None)
    if fm is None:
        return "-"
    return "e" if fm.is_extend() else ("d" if fm.is_decode() else "o")


def _wrap(cls_name: str, name: str, fn, batch_arg: bool):
    key = f"{cls_name}.{name}"

    def timed(self, *args, **kwargs):
        mode = _mode(args[0]) if batch_arg and args else _state["mode"]
        if name == "run_batch":
            _state["mode"] = mode
        t0 = time.perf_counter()
        if name == "run_batch" and mode == "d" and _state["extend_end"] is not None:
            boundaries["extend_to_decode"].append(round((t0 - _state["extend_end"]) * 1e3, 3))
            _state["extend_end"] = None
        if name == "run_batch" and mode == "e":
            if _state["first_recv"] is not None:
                boundaries["recv_to_extend"].append(round((t0 - _state["first_recv"]) * 1e3, 3))
        try:
            result = fn(self, *args, **kwargs)
        finally:
            if name == "run_batch":
                _state["mode"] = None
        t1 = time.perf_counter()
        k = key if mode is None else f"{key}:{mode}"
        row = calls.setdefault(k, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += t1 - t0
        row[2] = max(row[2], t1 - t0)
        if name == "run_batch" and mode == "d":
            _state["last_decode_end"], _state["first_recv"] = t1, None
        elif name == "run_batch" and mode == "e":
            boundaries["extend_launch"].append(round((t1 - t0) * 1e3, 3))
            _state["extend_end"], _state["first_recv"] = t1, None
        elif name == "recv_requests" and result and _state["first_recv"] is None and (
                _state["last_decode_end"] is not None):
            _state["first_recv"] = t1
            boundaries["decode_to_recv"].append(round((t1 - _state["last_decode_end"]) * 1e3, 3))
        return result

    timed.__wrapped__ = fn
    return timed


def patch_ready() -> None:
    """Wrap every target whose module is imported by now (called from the sampler thread every second)."""
    for mod, cls_name, name, batch_arg in TARGETS:
        key = (mod, cls_name, name)
        if key in _patched or mod not in sys.modules:
            continue
        cls = getattr(sys.modules[mod], cls_name, None)
        fn = getattr(cls, name, None) if cls is not None else None
        if fn is None:
            continue
        setattr(cls, name, _wrap(cls_name, name, fn, batch_arg))
        _patched.add(key)


def snapshot() -> dict:
    return {"calls": {k: [n, round(t, 6), round(m, 6)] for k, (n, t, m) in calls.items()},
            "boundaries": {k: list(v) for k, v in boundaries.items()}}

