"""HiCache on sglang 0.5.23 (``UnifiedRadixCache`` + ``HybridCacheController`` + ``L2TransferEngine``): what this
line reads differently from 0.5.12, one small function each; the hook bodies are ``adapter/hicache``'s.

* the D2H stream is the transfer engine's ``device_to_host_stream`` (0.5.12: ``write_stream``);
* sglang fences both transfer streams on the forward stream (``write_fence_stream`` / ``load_fence_stream``, set by
  the scheduler): on a GPU the records' copies wait for the same fences (0.5.12 has none);
* the host pool is the ``HostPoolGroup``'s anchor entry's pool (0.5.12: ``mem_pool_host`` itself); a group with
  side pools (SWA, mamba, ...) or packed draft layers is refused;
* a load's consumer is named where sglang's forward enters the canary (``in_tree_slot.InTreeSlot``); the layer
  counter sits on the device pool as on 0.5.12 (``hicache.note_load_consumer``).

``HybridCacheController`` inherits ``HiCacheController.start_writing`` / ``start_loading`` (it overrides
``write``/``load`` only: they allocate and queue), so the hooks sit on the base class, as on 0.5.12.

The storage tier (``--hicache-storage-backend file``; the bodies: ``hicache_storage.page_set_body`` /
``page_get_body``):

* the pages' host pool is ``controller.storage_host_pool`` (the group's anchor pool; 0.5.12: ``mem_pool_host``);
* ``_generic_page_get`` returns the pages it read and checks ``operation.is_terminated()`` before each page
  (0.5.12: returns None and counts each page with ``operation.increment``);
* the hit query is the hybrid controller's own ``HybridCacheController._storage_hit_query`` (same contract as
  0.5.12's: the leading hits' keys and their tokens; it also notes the KV pool's hit pages on the operation):
  ``contain`` cuts it before a poisoned key (``after_storage_hit_query``), as on 0.5.12.
"""

from __future__ import annotations

from typing import Any

from .hicache import FLAG, _refuse, start_loading_body, start_writing_body
from .hicache_storage import after_storage_hit_query as _cut_hits
from .hicache_storage import page_get_body, page_set_body


def d2h_stream(controller) -> Any:
    return controller.l2_transfer_engine.device_to_host_stream


def write_fence(controller) -> Any:
    return getattr(controller, "write_fence_stream", None)


def load_fence(controller) -> Any:
    return getattr(controller, "load_fence_stream", None)


def host_pool(controller) -> Any:
    """The KV host pool: the anchor entry of ``controller.mem_pool_host`` (a ``HostPoolGroup``), when it is the
    group's only entry and holds no packed draft layers; None without a group."""
    group = getattr(controller, "mem_pool_host", None)
    anchor = getattr(group, "anchor_entry", None)
    if anchor is None:
        return None
    entries = list(getattr(group, "entries", None) or [anchor])
    if len(entries) != 1:
        names = ", ".join(str(getattr(getattr(e, "name", None), "value", getattr(e, "name", "?"))) for e in entries)
        _refuse(f"the host pools {names}", "host copies are verified for one MHA KV pool only", f"drop {FLAG}")
    host = anchor.host_pool
    if int(getattr(host, "layer_num", 0)) != int(getattr(host, "target_layer_num", getattr(host, "layer_num", 0))):
        _refuse("a draft model's layers packed in the host pool (speculative decoding)",
                "host copies are verified for the target model's layers only", f"drop {FLAG}")
    return host


def around_start_writing(original, controller, *args, **kwargs):
    """``HiCacheController.start_writing`` on 0.5.23 (``adapter/hicache.start_writing_body``)."""
    return start_writing_body(original, controller, args, kwargs, d2h_stream=d2h_stream, fence=write_fence)


def around_start_loading(original, controller, *args, **kwargs):
    """``HiCacheController.start_loading`` on 0.5.23 (``adapter/hicache.start_loading_body``)."""
    return start_loading_body(original, controller, args, kwargs, fence=load_fence)


def storage_host(controller) -> Any:
    """The host pool the storage tier reads and writes pages of (0.5.23: the anchor pool)."""
    return controller.storage_host_pool


def may_read(operation) -> bool:
    """0.5.23 reads no page after the controller terminated the prefetch."""
    return not operation.is_terminated()


def fetched(operation, tokens: int) -> bool:
    """0.5.23 counts the pages read by the return value: nothing to tell the operation."""
    del operation, tokens
    return True


def around_generic_page_set(original, controller, hash_values, host_indices, extra_info=None) -> bool:
    """``HiCacheController._generic_page_set`` on 0.5.23 (``hicache_storage.page_set_body``)."""
    return page_set_body(original, controller, hash_values, host_indices, extra_info, host=storage_host(controller))


def around_generic_page_get(original, controller, operation, hash_values, host_indices, extra_info=None) -> int:
    """``HiCacheController._generic_page_get`` on 0.5.23: the pages read (``hicache_storage.page_get_body``)."""
    return page_get_body(original, controller, operation, hash_values, host_indices, extra_info,
                         host=storage_host(controller), may_read=may_read, fetched=fetched)


def after_storage_hit_query(result, controller, *args, **kwargs):
    """``HybridCacheController._storage_hit_query`` -> (keys, tokens): cut before the first key ``contain`` poisoned
    (``hicache_storage.after_storage_hit_query``); the KV pool's hit pages noted on the operation follow the cut."""
    cut = _cut_hits(result, controller, *args, **kwargs)
    if cut is result:
        return result
    operation = args[0] if args else kwargs.get("operation")
    pages = len(cut[0])
    verdicts = getattr(operation, "query_pool_hit_pages", None)
    for name in list(verdicts or ()):
        verdicts[name] = min(int(verdicts[name]), pages)
    pooled = getattr(operation, "pool_storage_result", None)
    if pooled is not None and getattr(pooled, "kv_hit_pages", 0) > pages:
        pooled.kv_hit_pages = pages
    return cut
