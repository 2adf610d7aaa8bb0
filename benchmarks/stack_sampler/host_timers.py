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

``KVC_SYNC_DEBUG=1``: inside ``run_batch`` and ``get_next_batch_to_run`` torch's sync debug mode is on, and every
synchronizing torch call there is counted by its call site (``syncs``: "mode|innermost sglang / canary frames").
"""

import collections
import os
import sys
import time
import traceback
import warnings

_SYNC_DEBUG = os.environ.get("KVC_SYNC_DEBUG") == "1"
_SYNC_METHODS = ("run_batch", "get_next_batch_to_run")
syncs = collections.Counter()  # "mode|site" -> synchronizing torch calls seen there
# the model's layers (``LlamaModel.forward``) of an extend with a cached prefix ("ep": a load-back turn) or without
# ("e0"), on the GPU: the span between events recorded on the forward's stream before and after their launch
gpu_spans = {}  # key -> [spans, ms]
_pending_spans = []  # (key, start event, end event) not landed yet
_SPANNED = {("LlamaModel", "forward")}


def _resolve_spans() -> None:
    keep = []
    for k, a, b in _pending_spans:
        if b.query():
            row = gpu_spans.setdefault(k, [0, 0.0])
            row[0] += 1
            row[1] += a.elapsed_time(b)
        else:
            keep.append((k, a, b))
    _pending_spans[:] = keep


def _span_key(key: str, mode, args, kwargs) -> str:
    if mode != "e":
        return f"{key}:{mode}"
    fb = args[2] if len(args) > 2 else kwargs.get("forward_batch")
    prefix = getattr(fb, "extend_prefix_lens_cpu", None)
    return f"{key}:e{'p' if prefix and sum(prefix) else '0'}"

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
    # inside run_batch: the worker, the runner's forward (with the canary's bracket) and extend path, the attention
    # metadata, the model's layers alone, the logits processor (the canary's early TAIL is its pre-hook, outside)
    ("sglang.srt.managers.tp_worker", "TpModelWorker", "forward_batch_generation", False),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward", False),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward_extend", False),
    ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend", "init_forward_metadata", False),
    ("sglang.srt.models.llama", "LlamaModel", "forward", False),
    ("sglang.srt.layers.logits_processor", "LogitsProcessor", "forward", False),
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
    ("kv_canary.runner.host_copies", "HostCopies", "stage_load", False),
    # inside the ones above: the bookkeeping an eager step leaves for later, the oracle's parts, HEAD's verify and
    # TAIL's write launches, the batch view
    ("kv_canary.runner.manager", "CanaryManager", "_catch_up", False),
    ("kv_canary.runner.manager", "CanaryManager", "poll", False),
    ("kv_canary.token_oracle", "TokenOracle", "remember_fed", False),
    ("kv_canary.token_oracle", "TokenOracle", "_prefix_chains", False),
    ("kv_canary.token_oracle", "TokenOracle", "stage_admissions", False),
    ("kv_canary.token_oracle", "TokenOracle", "init_row", False),
    ("kv_canary.token_oracle", "TokenOracle", "record_sampled", False),
    ("kv_canary.runner.single_forward", "SingleForwardManager", "_verify", False),
    ("kv_canary.runner.single_forward", "SingleForwardManager", "_write", False),
    ("kv_canary.adapter.batch_adapter", "SglangBatchAdapter", "view", False),
    ("kv_canary.adapter.batch_adapter", "SglangBatchAdapter", "extend_requests", False),
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


def _site() -> str:
    """The innermost three sglang / canary frames of the current stack."""
    out = []
    for f in reversed(traceback.extract_stack()[:-2]):
        for pkg in ("/kv_canary/", "/sglang/"):
            i = f.filename.rfind(pkg)
            if i >= 0 and not f.filename.endswith("host_timers.py"):
                out.append(f"{f.filename[i + 1:]}:{f.name}:{f.lineno}")
                break
        if len(out) == 3:
            break
    return " < ".join(out)


def _call_watching_syncs(fn, mode, args, kwargs):
    """``fn(*args, **kwargs)`` with torch's sync debug mode on, each synchronizing call counted by its site."""
    import torch

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            syncs[f"{mode}|{_site()}"] += 1

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        torch.cuda.set_sync_debug_mode(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(prev)


def _wrap(cls_name: str, name: str, fn, batch_arg: bool):
    key = f"{cls_name}.{name}"
    watch = _SYNC_DEBUG and name in _SYNC_METHODS
    spanned = (cls_name, name) in _SPANNED

    def timed(self, *args, **kwargs):
        mode = _mode(args[0]) if batch_arg and args else _state["mode"]
        if name == "run_batch":
            _state["mode"] = mode
        span = None
        if spanned and mode == "e":  # eager extends only (never inside a graph capture)
            import torch

            span = (_span_key(key, mode, args, kwargs), torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True))
            span[1].record()
        elif name == "run_batch":
            _resolve_spans()
        t0 = time.perf_counter()
        if name == "run_batch" and mode == "d" and _state["extend_end"] is not None:
            boundaries["extend_to_decode"].append(round((t0 - _state["extend_end"]) * 1e3, 3))
            _state["extend_end"] = None
        if name == "run_batch" and mode == "e":
            if _state["first_recv"] is not None:
                boundaries["recv_to_extend"].append(round((t0 - _state["first_recv"]) * 1e3, 3))
        try:
            result = (_call_watching_syncs(fn, mode or "-", (self, *args), kwargs) if watch else
                      fn(self, *args, **kwargs))
        finally:
            if name == "run_batch":
                _state["mode"] = None
        t1 = time.perf_counter()
        if span is not None:
            span[2].record()
            _pending_spans.append(span)
        k = span[0] if span is not None else key if mode is None else f"{key}:{mode}"
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
            "boundaries": {k: list(v) for k, v in boundaries.items()},
            "syncs": dict(syncs.most_common(40)),
            "gpu_spans": {k: [n, round(ms, 3)] for k, (n, ms) in gpu_spans.items()}}

