"""HiCache's storage tier under the canary: records ride inside each page object (docs/history/hicache.md 3.5).
sglang 0.5.12's hooks here; 0.5.23's (``hicache_0_5_23``) run the same bodies (``page_set_body``, ``page_get_body``).

``HiCacheController._generic_page_set`` / ``_generic_page_get`` (the generic page path, what
``--hicache-storage-backend file`` uses; ``attach_storage_backend`` binds them as ``page_set_func`` /
``page_get_func``) are taken over, AROUND rather than REPLACE: with no canary on the controller sglang's own body
runs unchanged. With the canary, the bodies do what sglang's do, plus:

* set (backup thread): the records of the pages' host slots are settled and appended to each page's K/V bytes as
  a trailer (``storage_trailer``); a page whose key is already stored is not rewritten (sglang's ``set`` skips
  it), so it is left out of the write and counted (``hicache_storage_pages_existing``): its trailer is whatever
  is stored;
* get (prefetch I/O thread): each page is read into a page + trailer sized target, one key at a time (what
  ``HiCacheFile.batch_get`` does); the K/V bytes go to ``set_from_flat_data_page`` as sglang does, the trailer's
  records to the page's host slots, before the page counts as fetched (``operation.increment``). A page with
  no valid trailer (a short read: written without the canary; another magic; a mix that does not match) ends
  the prefetch there, as a missing page does in sglang: a miss, recomputed (``hicache_storage_pages_without_
  records``). sglang's own ``get`` raises on a short read; here it is caught and counted;
* hit query (``_storage_hit_query``, prefetch thread; AFTER): with ``--kv-canary contain``, the leading hits stop
  before the first key whose host copy contain evicted as bad (``poison_storage_keys``), so a bad page is never
  read back (the storage tier has no delete).
"""

from __future__ import annotations

import logging
import os

import torch

from ..storage_trailer import BadTrailer, trailer_nbytes

logger = logging.getLogger("kv_canary")


def _manager(controller):
    return getattr(controller, "kv_canary_manager", None)


def _geometry(host):
    from ..perturb.storage_page import PageGeometry

    row_bytes = int(host.head_num) * int(host.head_dim) * host.kv_buffer.element_size()
    return PageGeometry(num_layers=int(host.layer_num), page_size=int(host.page_size), row_bytes=row_bytes)


def _kv_page_nbytes(host) -> int:
    """Bytes of one page's K/V (``get_data_page``'s flat page: [2, layers, page_size, heads, head_dim])."""
    g = _geometry(host)
    return 2 * g.num_layers * g.page_size * g.row_bytes


def _file_xor(backend):
    """``xor_at(key, offset, mask)`` on ``HiCacheFile``'s stored object of ``key``."""
    def xor_at(key: str, offset: int, mask: int) -> None:
        path = os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin")
        with open(path, "r+b", buffering=0) as f:
            f.seek(offset)
            byte = f.read(1)
            if len(byte) != 1:
                raise ValueError(f"kv-canary: stored page {path} has no byte {offset}")
            f.seek(offset)
            f.write(bytes([byte[0] ^ mask]))
    return xor_at


def around_generic_page_set(original, controller, hash_values, host_indices, extra_info=None):
    """``HiCacheController._generic_page_set`` on 0.5.12 (``page_set_body``; the host pool: ``mem_pool_host``)."""
    return page_set_body(original, controller, hash_values, host_indices, extra_info, host=controller.mem_pool_host)


def page_set_body(original, controller, hash_values, host_indices, extra_info, *, host):
    """Each new page's K/V bytes from ``host``, then its records' trailer (the lines' shared body)."""
    manager = _manager(controller)
    if manager is None or manager.host_records is None:
        return original(controller, hash_values, host_indices, extra_info)
    backend, page = controller.storage_backend, controller.page_size
    fresh = [i for i, key in enumerate(hash_values) if not backend.exists(key)]
    kv_pages = [host.get_data_page(host_indices[i * page]) for i in fresh]
    pick = torch.cat([host_indices[i * page:(i + 1) * page] for i in fresh]) if fresh else host_indices[:0]
    values = manager.storage_page_objects(kv_pages, pick, page)
    keys = [hash_values[i] for i in fresh]
    ok = backend.batch_set(keys, values)
    if ok:
        manager.storage_pages_written(keys, len(hash_values) - len(fresh), _geometry(host), _file_xor(backend))
    return ok


def around_generic_page_get(original, controller, operation, hash_values, host_indices, extra_info=None):
    """``HiCacheController._generic_page_get`` on 0.5.12: each page counts as fetched through
    ``operation.increment`` (False: terminated by the controller); returns None, as sglang's."""
    page_get_body(original, controller, operation, hash_values, host_indices, extra_info, host=controller.mem_pool_host,
                  may_read=always_read, fetched=increment)
    return None


def always_read(operation) -> bool:
    """0.5.12 tells a termination only through ``increment``'s answer."""
    del operation
    return True


def increment(operation, tokens: int) -> bool:
    """0.5.12 counts each page on the operation; False: terminated by the controller."""
    return operation.increment(tokens)


def page_get_body(original, controller, operation, hash_values, host_indices, extra_info, *, host, may_read,
                  fetched):
    """K/V to the host pages as sglang does, records to their host slots (the lines' shared body); the pages read
    (sglang's own body's result when the controller has no canary).

    ``may_read(operation)``: False ends the read before the next page (0.5.23: terminated);
    ``fetched(operation, tokens)``: after a page landed, False ends the read (0.5.12: ``increment``)."""
    manager = _manager(controller)
    if manager is None or manager.host_records is None:
        return original(controller, operation, hash_values, host_indices, extra_info)
    backend, page = controller.storage_backend, controller.page_size
    kv_nbytes = _kv_page_nbytes(host)
    count = 0
    for i, key in enumerate(hash_values):
        if not may_read(operation):
            break
        target = torch.empty(kv_nbytes + trailer_nbytes(page), dtype=torch.uint8)
        try:
            got = backend.get(key, target)
        except OSError:  # HiCacheFile: a short read (a page stored without a trailer)
            manager.storage_page_without_records(key, "short")
            break
        if got is None:
            logger.warning(f"Prefetch operation {operation.request_id} failed to retrieve page {key}.")
            break
        try:
            kv, records = manager.storage_page_split(target, kv_nbytes, page)
        except BadTrailer as e:
            manager.storage_page_without_records(key, e.reason)
            break
        # the K/V before the page counts as fetched (sglang's order), and its records with it
        host.set_from_flat_data_page(host_indices[i * page], kv.view(host.kv_buffer.dtype))
        manager.storage_page_read(key, host_indices[i * page:(i + 1) * page], records)
        count += 1
        if not fetched(operation, page):
            break  # terminated by the controller
    return count


def after_storage_hit_query(result, controller, *args, **kwargs):
    """``HiCacheController._storage_hit_query`` -> (keys, tokens) of the leading hits: cut before a poisoned key."""
    manager = _manager(controller)
    if manager is None or manager.host_records is None or not result:
        return result
    keys, tokens = result
    hits = manager.storage_hits(keys)
    if hits == len(keys):
        return result
    return keys[:hits], hits * controller.page_size
