"""HiCache's storage tier: the records of host copies written to storage pages and read back (docs/history/hicache.md 3.5).

The engine wiring tells the manager, with plain tensors and strings, on the engine's storage threads:

* ``storage_page_objects(kv_pages, host_idx, page_size)``: the page objects to store for those pages: each page's
  K/V bytes then a trailer with the records of its host slots (``storage_trailer``), settled first;
* ``storage_pages_written(keys, existing, geometry, xor_at)``: pages the canary wrote (counted; the
  ``storage_page`` perturbation may flip a byte of each, ``xor_at(key, offset, mask)``); ``existing``: pages the
  engine did not rewrite because their key was already stored (their trailer is whatever is stored);
* ``storage_page_read(key, host_idx, records)``: a page read back into host slots ``host_idx`` (int[page_size])
  with its trailer's ``records``: they become those host slots' records, settled, before the engine counts the
  page as fetched; a later load-back carries them to the device like any host copy's;
* ``storage_page_without_records(key, reason)``: a page with no valid trailer (written without the canary, torn,
  or its trailer corrupt): the wiring ends the read there, a miss the engine recomputes;
* ``poison_storage_keys(keys)`` / ``storage_hits(keys)``: ``--kv-canary contain`` evicted the host copies of these
  pages; the storage tier has no delete, so from then on a storage lookup stops before the first poisoned key
  (a miss, recomputed) instead of reading the bad page back (in this process: a restart forgets them, and a bad
  page read back is then reported and contained again).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Dict, List, Sequence, Set, Tuple

import torch

from ..storage_trailer import append_trailer, split_page
from ..violations import format_line

logger = logging.getLogger("kv_canary")
LOGGED_PAGES_WITHOUT_RECORDS = 8  # then only counted


@dataclasses.dataclass
class StorageStats:
    pages_set: int = 0
    pages_existing: int = 0
    pages_got: int = 0
    pages_without_records: int = 0
    keys_poisoned: int = 0  # contain: storage keys of evicted bad host copies
    hits_poisoned: int = 0  # storage lookups cut short at a poisoned key


class StoragePages:
    """``CanaryManager`` mixin (with ``HostCopies``): records in and out of the storage tier's page objects."""

    host_scrub = None  # HostCopies' host scrub (host_scrub.HostScrub) when on: a page read back has landed

    def _init_storage_pages(self) -> None:
        self.storage_on = False  # the engine has a storage tier (``attach_host_records(storage=True)``)
        self.storage_tag = 0  # storage_trailer.records_tag of what this server's record hashes cover
        self.storage_stats = StorageStats()
        self._storage_lock = threading.Lock()
        self._storage_from: Dict[int, Tuple[str, int]] = {}  # host slot -> (key, page slot) it was read from
        self._storage_flipped_keys: Dict[str, int] = {}  # key -> the page slot a storage_page flip hit
        self._storage_flipped_slots: Dict[int, str] = {}  # host slot holding a flipped stored byte -> its page key
        self._storage_flipped_loaded: Set[str] = set()  # keys of flipped pages loaded back to the device (ever)
        self._poisoned: Set[str] = set()  # contain: keys of pages whose host copies were evicted as bad

    def storage_page_objects(self, kv_pages: Sequence[torch.Tensor], host_idx: torch.Tensor,
                             page_size: int) -> List[torch.Tensor]:
        """uint8 page objects (K/V bytes then the trailer) for ``kv_pages`` (one CPU tensor per page, the host
        copies of ``host_idx[i * page_size:(i + 1) * page_size]``, int[len(kv_pages) * page_size])."""
        records = self.host_records.rows(host_idx[: len(kv_pages) * page_size])
        return [append_trailer(page, records[i * page_size:(i + 1) * page_size], self.storage_tag)
                for i, page in enumerate(kv_pages)]

    def storage_page_split(self, value: torch.Tensor, kv_nbytes: int, page_size: int):
        """A page object read back -> (its K/V bytes, its records); ``BadTrailer`` when it carries none of ours."""
        return split_page(value, kv_nbytes, page_size, self.storage_tag)

    def storage_pages_written(self, keys: Sequence[str], existing: int, geometry,
                              xor_at: Callable[[str, int, int], None]) -> None:
        with self._storage_lock:
            self.storage_stats.pages_set += len(keys)
            self.storage_stats.pages_existing += int(existing)
        if self.config.perturb_storage_page_prob <= 0:
            return
        for key in keys:
            page_slot = self.perturb.perturb_storage_page(
                forward_index=self.forwards, key=key, geometry=geometry,
                xor_at=lambda offset, mask, key=key: xor_at(key, offset, mask))
            if page_slot >= 0:
                with self._storage_lock:
                    self._storage_flipped_keys[key] = page_slot

    def storage_page_read(self, key: str, host_idx: torch.Tensor, records: torch.Tensor) -> None:
        """A page read back into ``host_idx`` (int[page_size]) with its trailer's ``records``
        (int64[page_size, RECORD_WIDTH])."""
        self.host_records.put(host_idx, records)
        if self.host_scrub is not None:  # the page's K/V bytes were written before its records: both landed
            self.host_scrub.backup_landed(host_idx.to("cpu", torch.int64).numpy())
        slots = host_idx.tolist()
        with self._storage_lock:
            self.storage_stats.pages_got += 1
            for page_slot, host_slot in enumerate(slots):
                self._storage_from[host_slot] = (key, page_slot)
            flipped = self._storage_flipped_keys.get(key)
            if flipped is not None:
                self._storage_flipped_slots[slots[flipped]] = key

    def storage_page_without_records(self, key: str, reason: str) -> None:
        with self._storage_lock:
            self.storage_stats.pages_without_records += 1
            n = self.storage_stats.pages_without_records
        if n <= LOGGED_PAGES_WITHOUT_RECORDS:
            logger.warning(format_line("kv_canary_hicache_storage", "page_without_records",
                                       {"key": key, "reason": reason, "count": n}))

    def poison_storage_keys(self, keys: Sequence[str]) -> int:
        """Pages ``keys`` must never be read back from storage (contain evicted their host copies); how many new."""
        with self._storage_lock:
            new = [k for k in keys if k not in self._poisoned]
            self._poisoned.update(new)
            self.storage_stats.keys_poisoned += len(new)
        return len(new)

    def storage_hits(self, keys: Sequence[str]) -> int:
        """Of the leading storage hits ``keys``, how many precede the first poisoned key (all when none is)."""
        if not self._poisoned:
            return len(keys)
        with self._storage_lock:
            for i, key in enumerate(keys):
                if key in self._poisoned:
                    self.storage_stats.hits_poisoned += 1
                    return i
        return len(keys)

    # ------------------------------------------------------------ HostCopies calls these

    def _storage_slots_loaded(self, host_slots: Sequence[int]) -> None:
        if self._storage_flipped_slots:
            with self._storage_lock:
                for h in host_slots:
                    if h in self._storage_flipped_slots:
                        self._storage_flipped_loaded.add(self._storage_flipped_slots[h])

    def _storage_slots_freed(self, host_slots: Sequence[int]) -> None:
        if self._storage_from:
            with self._storage_lock:
                for h in host_slots:
                    self._storage_from.pop(h, None)
                    self._storage_flipped_slots.pop(h, None)

    def _storage_clear(self) -> None:
        with self._storage_lock:
            self._storage_from.clear()
            self._storage_flipped_slots.clear()

    def storage_identity(self, host_slot: int) -> Tuple[Tuple[str, object], ...]:
        """A violation on a slot loaded from ``host_slot``: the storage page it was read from, if any."""
        got = self._storage_from.get(host_slot)
        return () if got is None else (("storage_key", got[0]), ("storage_page_slot", got[1]))

    def storage_pages_stats(self) -> Dict[str, int]:
        if not self.storage_on:
            return {}
        s = self.storage_stats
        out = {"hicache_storage_pages_set": s.pages_set, "hicache_storage_pages_existing": s.pages_existing,
               "hicache_storage_pages_got": s.pages_got,
               "hicache_storage_pages_without_records": s.pages_without_records,
               "hicache_storage_keys_poisoned": s.keys_poisoned, "hicache_storage_hits_poisoned": s.hits_poisoned}
        if self.config.perturb_storage_page_prob > 0:  # flipped pages read back and loaded to the device (ever)
            out["hicache_flipped_storage_pages_loaded"] = len(self._storage_flipped_loaded)
        return out
