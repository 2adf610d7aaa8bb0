"""sglang's HiCache (``--enable-hierarchical-cache``) under the canary: the startup gate (docs/history/hicache.md 3.13).

What is verified (``test_e2e_hicache.py``, sglang 0.5.12: on CPU through the test shim, on a GPU with sglang's own
pinned host pool, transfer kernels or direct copies, and layer-wise load overlap under CUDA graphs): an MHA pool
(one buffer group), ``--page-size`` 1 or 16, the write policies in ``VERIFIED_WRITE_POLICIES``, both
``--hicache-io-backend`` choices, the ``layer_first`` host layout (``page_first`` on CPU), no storage backend or
``file`` (``layer_first`` only; the records ride inside each page object: ``hicache_storage``; ``contain`` poisons
the storage keys of the pages it evicts), one TP rank, ``--kv-canary log|raise|contain`` with
``--kv-canary-real-data partial``. sglang 0.5.23 (``LINE_LIMITS``): the same on CPU through the test shim and on a GPU
with sglang's own host pool and transfer engine (GPU host, 2026-11-30 and -30c), ``page_first`` on the GPU too, and
``contain`` with the Python tree core only (``contain_hicache_0_5_23``; the ``file`` tier through ``hicache_0_5_23``'s
page get/set). Everything else is refused at startup naming the flag and its value.

The hook bodies are shared by the lines; what a line reads differently (0.5.23's transfer streams, fences and
host pool group) comes in as small functions from that line's adapter (``hicache_0_5_23``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from ..config import FLAG_MODE, FLAG_REAL_DATA, FLAG_SWEEP_INTERVAL, CanaryConfig, CanaryConfigError
from .hicache_pool import FLAG, _refuse, host_pool_0_5_12  # noqa: F401 - host_pool_0_5_12: named here too

VERIFIED_LINES = ("0.5.12", "0.5.23")
VERIFIED_MODES = ("log", "raise", "contain")
VERIFIED_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
VERIFIED_LAYOUTS = ("layer_first", "page_first")  # host_layer_rows reads both (page_first_direct: not run)
VERIFIED_PAGE_SIZES = (1, 16)
VERIFIED_DEVICES = ("cpu", "cuda")
VERIFIED_IO_BACKENDS = ("kernel", "direct")
VERIFIED_POOLS = ("MHATokenToKVPool",)
CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"  # sglang 0.5.23's tree core: rust (default) or python
VERIFIED_STORAGE_BACKENDS = ("file",)  # sglang's generic page path (adapter/hicache_storage)
# what a line verified less of than 0.5.12 (docs/history/hicache.md 1.4): (allowed, why the rest is refused)
LINE_LIMITS = {
    "0.5.23": {
        # contain: only on the Python tree core (contain_hicache_0_5_23)
        "contain_core": (CORE_ENV, "python", "sglang 0.5.23's Rust tree core (its default) has no per-node host drop, "
                         "so a bad host copy could not be evicted; its Python tree core has one"),
        # page_first (0.5.23's default host layout) ran on its GPU too (without storage)
        "gpu_layouts": VERIFIED_LAYOUTS,
    },
}


def check_hicache(server_args: Any, config: CanaryConfig, line: Optional[str] = None) -> None:
    """Refuse (``CanaryConfigError``) a HiCache configuration the canary does not verify; no-op without HiCache.

    ``line``: the running sglang line's name (default: ``adapter.lines.current_line()``)."""
    storage = getattr(server_args, "hicache_storage_backend", None)
    if not config.enabled:
        return
    if config.perturb_storage_page_prob > 0 and storage != "file":
        raise CanaryConfigError(f"SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB corrupts pages of HiCache's file "
                                f"storage tier, but --hicache-storage-backend is {storage or 'unset'}: pass "
                                f"--hicache-storage-backend file or unset it")
    if not getattr(server_args, "enable_hierarchical_cache", False):
        if storage:
            raise CanaryConfigError(f"{FLAG_MODE} {config.mode.value} cannot verify --hicache-storage-backend "
                                    f"{storage} without {FLAG}: the canary verifies storage pages as HiCache's "
                                    f"third tier only; add {FLAG}, drop it, or run with {FLAG_MODE} none")
        return
    if line is None:
        from .lines import current_line

        line = current_line().name
    if line not in VERIFIED_LINES:
        _refuse(f"sglang {line}", f"HiCache is verified on sglang {', '.join(VERIFIED_LINES)} only",
                f"drop {FLAG}")
    limits = LINE_LIMITS.get(line, {})
    modes, why = limits.get("modes", (VERIFIED_MODES, "only these modes were run"))
    if config.mode.value not in modes:
        _refuse(f"--kv-canary {config.mode.value} on sglang {line}", why, f"use --kv-canary {' or '.join(modes)}")
    if config.mode.value == "contain" and "contain_core" in limits:
        env, value, why = limits["contain_core"]
        core = os.environ.get(env, "rust") or "rust"
        if core != value:
            _refuse(f"--kv-canary contain on sglang {line} with {env}={core}", why,
                    f"set {env}={value} or use --kv-canary log or raise")
    backends, why = limits.get("storage_backends", (VERIFIED_STORAGE_BACKENDS, (
        f"the records ride inside page objects of sglang's generic page path, verified with "
        f"{', '.join(VERIFIED_STORAGE_BACKENDS)} only (zero-copy backends write host memory directly and cannot "
        "carry them)")))
    if storage and storage not in backends:
        _refuse(f"--hicache-storage-backend {storage}", why,
                f"use --hicache-storage-backend {backends[0]} or drop it" if backends else
                "drop --hicache-storage-backend")
    device = str(getattr(server_args, "device", None) or "cuda")
    devices, why = limits.get("devices", (VERIFIED_DEVICES, "HiCache with the canary is verified on "
                                                            f"{', '.join(VERIFIED_DEVICES)} only"))
    if device not in devices:
        _refuse(f"--device {device}", why, f"drop {FLAG}")
    # page_first never ran with storage; on a GPU only where the line says so (0.5.12: through the CPU test shim only)
    layouts = ("layer_first",) if storage else (
        VERIFIED_LAYOUTS if device == "cpu" else limits.get("gpu_layouts", ("layer_first",)))
    checks = (
        (FLAG_REAL_DATA, config.real_data.value, ("partial",), "only partial was run with HiCache"),
        ("--page-size", getattr(server_args, "page_size", None) or 1, VERIFIED_PAGE_SIZES,
         "only these page sizes were run"),
        ("--hicache-write-policy", getattr(server_args, "hicache_write_policy", "write_through"),
         *limits.get("write_policies", (VERIFIED_WRITE_POLICIES, "only these write policies were run"))),
        ("--hicache-mem-layout", getattr(server_args, "hicache_mem_layout", "layer_first"), layouts,
         "only these host layouts were run" + (" with the storage tier" if storage else "")
         + (f" on --device {device} (page_first: on CPU through the test shim)" if device != "cpu" else "")),
        ("--hicache-io-backend", getattr(server_args, "hicache_io_backend", "kernel"), VERIFIED_IO_BACKENDS,
         "only these transfer paths were run"),
        ("--tp-size", getattr(server_args, "tp_size", None) or 1, (1,), "host copies per TP rank are not verified"),
    )
    for flag, value, allowed, why in checks:
        if value not in allowed:
            _refuse(f"{flag} {value}", f"{why} (verified: {', '.join(map(str, allowed))})",
                    f"use {flag} {allowed[0]}")
    for flag, field, off in (("--speculative-algorithm", "speculative_algorithm", (None,)),
                             ("--disaggregation-mode", "disaggregation_mode", (None, "null")),
                             (FLAG_SWEEP_INTERVAL, "kv_canary_sweep_interval", (None, 0))):
        value = getattr(server_args, field, None)
        if value not in off:
            _refuse(f"{flag} {value}", "HiRadixCache's host tier is not verified with it", f"drop {flag}")


def check_hicache_pool(pool_name: str, group_names: Sequence[str]) -> None:
    """At install: HiCache is verified on a one-group MHA pool only."""
    if pool_name not in VERIFIED_POOLS or len(group_names) != 1:
        _refuse(f"the KV pool {pool_name} (groups: {', '.join(group_names)})",
                f"host copies are verified for {', '.join(VERIFIED_POOLS)} (one buffer group) only",
                f"drop {FLAG}")


# ---------------------------------------------------------------- attach (scheduler init) and the hooks
# Hook bodies read sglang by attribute; the core (host_records, runner/host_copies) sees tensors and callables.
# The manager is kept on the objects whose methods are hooked: the cache controller, its host pool, the tree.


def attach_hicache(scheduler, manager) -> None:
    """After ``Scheduler.__init__``: a host record store beside the tree's host pool; the install log line."""
    import logging

    import torch

    from ..host_records import HostRecordStore
    from ..memory import host_record_bytes
    from ..violations import format_line

    from .lines import current_line

    tree = getattr(scheduler, "tree_cache", None)
    controller = getattr(tree, "cache_controller", None)
    # the line's reader: 0.5.12 ``controller.mem_pool_host``, 0.5.23 the host pool group's anchor entry's pool
    host = current_line().hicache_host_pool(controller) if controller is not None else None
    if host is None:
        raise CanaryConfigError(f"{FLAG} is on but the prefix cache {type(tree).__name__} has no host pool; run "
                                f"this server with {FLAG_MODE} none")
    if type(host).__name__ != "MHATokenToKVPoolHost":
        _refuse(f"the host pool {type(host).__name__}", "host copies are verified for MHATokenToKVPoolHost "
                "(no draft pool) only", f"drop {FLAG}")
    if host.layout not in VERIFIED_LAYOUTS:
        _refuse(f"--hicache-mem-layout {host.layout}", f"only the {' and '.join(VERIFIED_LAYOUTS)} host layouts were "
                "run", "use --hicache-mem-layout layer_first")
    store = HostRecordStore(int(host.size), manager.counters.device)
    rows = {(layer, half): host_layer_rows(buf, host.layout, layer).view(torch.uint8)
            for layer in range(int(host.layer_num)) for half, buf in (("k", host.k_buffer), ("v", host.v_buffer))}
    manager.attach_host_records(store, rows, storage=bool(getattr(controller, "enable_storage", False)))
    for obj in (controller, host, tree):
        obj.kv_canary_manager = manager
    host_bytes = int(host.kv_buffer.numel() * host.kv_buffer.element_size())
    record_bytes = host_record_bytes(int(host.size))
    args = scheduler.server_args
    logging.getLogger("kv_canary").info(format_line("kv_canary_hicache", 1, {
        "host_slots": int(host.size), "host_pool_bytes": host_bytes, "host_record_bytes": record_bytes,
        "host_record_device": str(store.records.device),
        "host_record_pct_of_host_pool": f"{100.0 * record_bytes / max(1, host_bytes):.3f}",
        "host_record_ops": "batched" if manager.defer_host_ops else "immediate", "layout": host.layout,
        "write_policy": getattr(args, "hicache_write_policy", "?"),
        "storage": getattr(args, "hicache_storage_backend", None) or "none"}))


def host_layer(buf, layout: str, layer: int):
    """One layer of a host pool's K or V buffer, ``[host slots, heads, head_dim]`` (a view; strided over slots with
    ``page_first``): ``layer_first`` buffers are ``[layers, host slots, heads, dim]``, ``page_first`` ones
    ``[host slots, layers, heads, dim]`` (sglang 0.5.12 ``memory_pool_host``, 0.5.23 ``pool_host/mha``)."""
    if layout == "layer_first":
        return buf[layer]
    if layout == "page_first":
        return buf[:, layer]
    raise ValueError(f"kv-canary: the host layout {layout} is not read (layer_first, page_first)")


def host_layer_rows(buf, layout: str, layer: int):
    """``host_layer`` as rows, ``[host slots, heads x head_dim]``."""
    rows = host_layer(buf, layout, layer)
    return rows.reshape(rows.shape[0], -1)


def _manager(obj):
    return getattr(obj, "kv_canary_manager", None)


def _queued(queue):
    """(host indices, device indices) of a controller's queued ``CacheOperation``s, concatenated (None if empty)."""
    import torch

    if not queue:
        return None
    if len(queue) == 1:  # sglang queues one op per write / load and starts it at once: nothing to concatenate
        return queue[0].host_indices.reshape(-1), queue[0].device_indices.reshape(-1)
    host = torch.cat([op.host_indices.reshape(-1) for op in queue])
    device = torch.cat([op.device_indices.reshape(-1) for op in queue])
    return host, device


def _wait_for(fence) -> None:
    """CUDA: the current stream waits for ``fence`` (a line's own transfer fence, e.g. 0.5.23's forward stream)."""
    import torch

    if fence is not None:
        torch.cuda.current_stream().wait_stream(fence)


def start_writing_body(original, controller, args, kwargs, *, d2h_stream: Callable[[Any], Any],
                       fence: Callable[[Any], Any] = lambda controller: None):
    """Backup (every line): the records of the queued device slots go to their host slots' rows on the current
    stream, before sglang's K/V copy is queued (its start waits for this stream, so its write ack covers them), or
    batched until sglang's next ack check (``backup_records``). On a GPU the records' gather first waits for
    ``fence(controller)`` (the stream sglang fences its own copy on, None: none), where a forward may still be
    writing the records. ``d2h_stream(controller)``: sglang's D2H stream, where the host-copy perturbation learns
    when a copy landed."""
    manager = _manager(controller)
    ops = _queued(controller.write_queue) if manager is not None else None
    if ops is not None:
        host_idx, device_idx = ops
        manager.backup_records(device_idx, host_idx, wait_for=fence(controller) if device_idx.is_cuda else None)
    result = original(controller, *args, **kwargs)
    if ops is not None:
        manager.backup_queued(ops[0], d2h_stream(controller) if ops[1].is_cuda else None)
    return result


def start_loading_body(original, controller, args, kwargs, *,
                       fence: Callable[[Any], Any] = lambda controller: None):
    """Load-back (every line): after sglang queued the K/V copy into new device slots, their records follow from the
    host store and their first-read tags are zeroed (the consumer forward hashes every byte once). The host slot
    ids go to the device before sglang queues its copy (``stage_load``: behind it they would hold the forward for
    the whole load). On a GPU the records' copy (queued behind the current stream) first waits for
    ``fence(controller)``, as sglang's copy does."""
    manager = _manager(controller)
    ops = _queued(controller.load_queue) if manager is not None else None
    host_dev = manager.stage_load(ops[0]) if ops is not None else None
    producer_id = original(controller, *args, **kwargs)
    if ops is not None and producer_id is not None and producer_id >= 0:
        host_idx, device_idx = ops
        if device_idx.is_cuda:
            _wait_for(fence(controller))
        manager.load_records(host_idx, device_idx, load_id=producer_id, host_dev=host_dev)
    return producer_id


def around_start_writing(original, controller, *args, **kwargs):
    """sglang 0.5.12's ``HiCacheController.start_writing``: the D2H stream is ``write_stream``, no fence."""
    return start_writing_body(original, controller, args, kwargs, d2h_stream=lambda c: c.write_stream)


def around_start_loading(original, controller, *args, **kwargs):
    """sglang 0.5.12's ``HiCacheController.start_loading`` (no load fence)."""
    return start_loading_body(original, controller, args, kwargs)


def around_writing_check(original, tree, *args, **kwargs):
    """sglang's write-ack check (every scheduler step; write-back: blocking, before it frees evicted device slots):
    when it acked a backup (its controller's ``ack_write_queue`` shrank) or blocked on them all (``write_back``),
    the batched backups and frees land right after it (``flush_host_records``), before the scheduler can evict
    and reuse the acked device slots (until the ack they stay locked, their records unchanged); then the host-copy
    perturbation may flip a byte of a copy that landed. A check that acked nothing leaves them batched: the step
    after a prefill, whose host work is the GPU's critical path, no longer pays the flush for backups whose copy
    has not landed (a fresh batch's ~8.7k slots: ~20 ms over PCIe)."""
    manager = _manager(tree)
    if manager is None:
        return original(tree, *args, **kwargs)
    queue = getattr(getattr(tree, "cache_controller", None), "ack_write_queue", None)
    before = len(queue) if queue is not None else -1
    result = original(tree, *args, **kwargs)
    write_back = kwargs.get("write_back", args[0] if args else False)
    if write_back or queue is None or len(queue) < before:  # unknown queue: every check flushes
        manager.flush_host_records()
    manager.host_backups_acked()
    return result


def after_host_free(_result, host_pool, indices, *args, **kwargs) -> None:
    manager = _manager(host_pool)
    if manager is not None:
        manager.free_host_slots(indices)


def after_host_clear(_result, host_pool, *args, **kwargs) -> None:
    """sglang reset the tree (``HiRadixCache.reset``: ``/flush_cache``): every host copy is gone. (The host pool's
    own ``__init__`` calls ``clear`` too, before the manager is attached: nothing to do then.)"""
    manager = _manager(host_pool)
    if manager is not None:
        import logging

        from ..violations import format_line

        manager.clear_host_records()
        logging.getLogger("kv_canary").info(format_line("kv_canary_hicache_clear", 1,
                                                        {"host_slots": int(host_pool.size)}))


def note_load_consumer(manager, model_runner) -> None:
    """Before a forward: if it consumes a HiCache load (sglang set the layer counter's consumer to the load's
    producer index), hand the load over (its HEAD waits for the hashed layers; its full-row hashing runs after
    it). sglang sets the consumer from the batch's ``hicache_consumer_index``, which the decode batches that
    follow a load-back prefill keep: the manager hands a load over to its first forward only."""
    pool = getattr(model_runner, "token_to_kv_pool", None)
    counter = getattr(pool, "layer_transfer_counter", None)
    if counter is not None and counter.consumer_index >= 0:
        manager.load_in_flight(counter.wait_until, load_id=counter.consumer_index)
