"""HiCache: the records of slots a hierarchical cache copies to host memory and loads back (docs/history/hicache.md 3.2-3.3).

The engine wiring tells the manager three things, with plain tensors:

* ``backup_records(device_idx, host_idx)``: the engine is about to copy these device slots' K/V to those host
  slots; their records go to the host slots' rows on the current stream (``HostRecordStore.backup``: a table on
  the device, indexed by host slot), ahead of the K/V copy when a storage tier, the host-copy perturbation or the
  host scrub reads them after the engine's write ack; otherwise batched with the host frees until the engine
  acks a backup or loads (``flush_host_records``: a few device ops for all of them, off the path from a finished
  request to its response and from a prefill to its next decode step);
* ``stage_load(host_idx)`` before the engine queues a load, then ``load_records(host_idx, device_idx, host_dev=)``:
  the engine loads those host copies into *new* device slots; their host records are written at the new indices
  and their first-read tag is zeroed, so the next read lists them and hashes every byte once
  (``kernels.first_read``), against the FULL_HASH TAIL stored when they were written; device ops only (the
  scheduler thread never waits for the device here);
* ``load_in_flight(wait_until_layer, load_id)``: the next forward consumes load ``load_id``; its HEAD first waits
  for the records and for the hashed layers' K/V (``wait_until_layer(layer)`` makes the current stream wait for one
  layer), and its first-read hashing runs layer by layer as the layers land, beside the forward
  (``load_hashing``). Only the first
  forward that names a pending load consumes it: an engine may keep naming the load on later forwards of the
  same batch (sglang's decode batches carry their prefill's consumer index), which read nothing new from it.

One buffer group (the gate refuses more). Loads arrive with extend batches only, which run eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from ..containment import HOST_SCRUB_RID
from ..host_records import HostRecordStore
from ..host_scrub import HostMismatch, HostScrub
from ..storage_trailer import records_tag
from ..violations import Violation
from .brackets import CanaryBracketError
from .load_hashing import LoadWaits
from .storage_pages import StoragePages

# batched backups and host frees past which a forward's outside pre-ops flush them (``bound_host_batch``): a bound
# on the batch's size, not a point the records need (an ack of a backup, or a load, flushes them)
MAX_BATCHED_HOST_OPS = 512


class HostCopies(StoragePages):
    """``CanaryManager`` mixin: the host record store and the load-back hand-over to the next forward (with
    ``StoragePages``: host copies that came from the storage tier)."""

    def _init_host_copies(self) -> None:
        self.host_records: Optional[HostRecordStore] = None
        self._load_stream = None  # CUDA: the side stream the records of a load are copied on
        self._load_event = None  # CUDA: marks the records of the load no forward consumed yet landed
        self._last_load_event = None  # CUDA: the last load's (a host eviction's zeroing waits for its reads)
        self._pending_load_id: Optional[int] = None  # the engine's name of the load no forward consumed yet
        self._loads_consumed = 0  # loads handed over to their consuming forward (load_in_flight)
        # the load book, for violation lines: int64[device slots, 2] on the pool's device, device slot -> (host slot
        # it was loaded from, the consuming forward); written on the load's stream, read only to report a violation
        self._loaded_from: Optional[torch.Tensor] = None
        self._load_moves: Optional[Callable[..., None]] = None  # kernels.record_moves.load_records, at attach
        # SGLANG_KV_CANARY_PERTURB_HOST_COPY_PROB: the host copies' rows, and the flipped host slots (-> loaded yet)
        self._host_rows: Mapping[Tuple[int, str], torch.Tensor] = {}
        self._flipped: Dict[int, bool] = {}
        self._flipped_loaded = 0  # flipped host copies loaded back, ever (a later free of the copy does not undo it)
        # backups whose K/V copy is queued, for the host-copy perturbation and the host scrub (both act on landed
        # copies only): (host slots int64[n] CPU, the copy's event or None)
        self._copies_in_flight: List[Tuple[torch.Tensor, Optional[torch.cuda.Event]]] = []
        self.host_scrub: Optional[HostScrub] = None  # SGLANG_KV_CANARY_HOST_SCRUB_SLOTS_PER_SECOND > 0
        # batched bookkeeping (``defer_host_ops``): backups (device slots, host slots CPU) and frees (host slots CPU)
        # since the last ``flush_host_records``, and the last stream a backup's gather must wait for
        self.defer_host_ops = False
        self._pending_backups: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_frees: List[torch.Tensor] = []
        self._pending_fence = None
        self._init_storage_pages()

    def attach_host_records(self, store: HostRecordStore,
                            host_rows: Optional[Mapping[Tuple[int, str], torch.Tensor]] = None, *,
                            storage: bool = False) -> None:
        """``host_rows``: (layer, half) -> uint8[host_slots, row_bytes] views of the host copies (what the host-copy
        perturbation flips and the host scrub hashes; needed only with them). ``storage``: host copies also go to and
        come from a storage tier (``StoragePages``)."""
        if len(self.groups) != 1:
            raise ValueError("kv-canary: host copies of more than one buffer group are not verified")
        if (self.config.perturb_host_copy_prob > 0 or self.config.host_scrub_slots_per_second > 0) and not host_rows:
            raise ValueError("kv-canary: the host-copy perturbation and the host scrub need the host copies' rows")
        self.host_records = store
        self.storage_on = bool(storage)
        # without a storage tier, the host-copy perturbation and the host scrub, nothing reads a host record before
        # the engine's next load (``flush_host_records``): backups and frees are batched until an ack or a load
        self.defer_host_ops = not storage and self.config.perturb_host_copy_prob <= 0 and (
            self.config.host_scrub_slots_per_second <= 0)
        if storage:  # what the records' hashes cover: a page written by a server hashing otherwise has none for us
            g = self.groups[0]
            self.storage_tag = records_tag([x for r in g.sources for x in (r.layer, r.half == "v", r.words)] + [-1]
                                           + [x for r in g.rows for x in (r.layer, r.half == "v", r.row_words)])
        self._host_rows = host_rows or {}
        self._loaded_from = torch.full((self.groups[0].num_slots, 2), -1, dtype=torch.int64,
                                       device=self.groups[0].records.device)
        if self.counters.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=self.counters.device)
        from ..kernels.record_moves import load_records  # Triton: imported with HiCache only

        g = self.groups[0]
        triton_ok = g.records.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        self._load_moves = functools.partial(load_records, triton_ok=triton_ok)
        if triton_ok and g.full_row is not None:  # compiled now (an empty load), never while serving
            none = torch.zeros(0, dtype=torch.int64, device=g.records.device)
            self._load_moves(store.records, none, g.records, none, g.full_row.tags, self._loaded_from, 0)
        for sfm in self.single_forward_managers:
            sfm.attach_load_hashing()
        if self.config.host_scrub_slots_per_second > 0:
            self.host_scrub = self._build_host_scrub()
            self.host_scrub.start()

    def _build_host_scrub(self) -> HostScrub:
        """The scrub reads the host copies' rows in the device's canonical order, and their records from the device
        on a stream of its own (its thread waits for that copy alone)."""
        group, store = self.groups[0], self.host_records
        rows = []
        for r in group.rows:
            host = self._host_rows.get((r.layer, r.half))
            if host is None or host.shape[1] != 4 * r.row_words:
                raise ValueError(f"kv-canary: the host scrub needs the host copies' {r.half} rows of layer {r.layer} "
                                 f"({4 * r.row_words} bytes a slot)")
            rows.append(host.numpy().view(np.uint32))
        stream = torch.cuda.Stream(device=store.records.device) if store.records.is_cuda else None

        def read_records(idx: np.ndarray) -> np.ndarray:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return store.rows(torch.from_numpy(idx)).numpy()

        return HostScrub(rows, read_records, self.config.host_scrub_slots_per_second)

    def backup_records(self, device_idx: torch.Tensor, host_idx: torch.Tensor, wait_for=None) -> None:
        """The engine is about to copy device slots ``device_idx`` (int[n], device) to host slots ``host_idx`` (int[n],
        CPU): their records go to the host slots' rows on the current stream (first waiting for ``wait_for``, a CUDA
        stream a forward may still write the records on, or None).

        Immediate (a storage tier, the host-copy perturbation or the host scrub reads host records after the
        engine's write ack): queued before the engine's K/V copy, whose start waits for this stream, so its ack
        covers them. Batched (``defer_host_ops``): kept until ``flush_host_records``, which the engine wiring calls
        right after an ack check that acked a backup (before the scheduler can free the acked device slots) and
        before every load; the device slots stay the engine's until their ack (a write-through lock, or
        write-back's blocking check), so their records are unchanged until then, and every later load is queued
        behind the flush (no forward reads a host record)."""
        if self.host_records is None or device_idx.numel() == 0:
            return
        if self.host_scrub is not None:  # before the records and the K/V change: the scrub discards what it hashes
            self.host_scrub.backup_started(host_idx.to("cpu", torch.int64).numpy())
        self._pending_backups.append((device_idx, host_idx))
        if wait_for is not None:
            self._pending_fence = wait_for
        if not self.defer_host_ops:
            self.flush_host_records()

    def flush_host_records(self) -> None:
        """Backups and frees since the last flush (batched, or the one just made when immediate), in a few device ops
        on the current stream: the freed host slots' records zeroed (after the last load's read of them), then every
        backup's records written (a slot freed and backed up again since the last flush ends with its new record; a
        slot backed up and then freed within one interval cannot happen: its node is locked until its ack, which
        flushes before the scheduler goes on)."""
        backups, frees = self._pending_backups, self._pending_frees
        if not backups and not frees:
            return
        self._pending_backups, self._pending_frees = [], []
        fence, self._pending_fence = self._pending_fence, None
        stream = torch.cuda.current_stream(self.counters.device) if self.counters.device.type == "cuda" else None
        if frees and stream is not None and self._last_load_event is not None:
            stream.wait_event(self._last_load_event)
        freed = (frees[0] if len(frees) == 1 else torch.cat(frees)) if frees else None
        if not backups:
            self.host_records.free(freed)
            return
        if fence is not None and stream is not None:
            stream.wait_stream(fence)
        records = self.groups[0].records
        dev = backups[0][0] if len(backups) == 1 else torch.cat([d.reshape(-1) for d, _ in backups])
        host = backups[0][1] if len(backups) == 1 else torch.cat([h.reshape(-1) for _, h in backups])
        self.host_records.backup(host, records.index_select(0, dev.reshape(-1).to(records.device, torch.int64)),
                                 freed=freed, backups=len(backups))

    def bound_host_batch(self) -> None:
        """Before a forward (outside a graph): flush when more than ``MAX_BATCHED_HOST_OPS`` are batched."""
        if len(self._pending_backups) + len(self._pending_frees) > MAX_BATCHED_HOST_OPS:
            self.flush_host_records()

    def backup_queued(self, host_idx: torch.Tensor, stream=None) -> None:
        """The engine queued its K/V copy to ``host_idx`` on ``stream`` (None: done already). The host-copy
        perturbation (a byte flipped before would be overwritten by the copy) and the host scrub (a copy hashed
        before would read half-written bytes) need to know when it lands."""
        if self.host_records is None or host_idx.numel() == 0 or (
                self.config.perturb_host_copy_prob <= 0 and self.host_scrub is None):
            return
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        self._copies_in_flight.append((host_idx.to("cpu", torch.int64), event))

    def host_backups_acked(self) -> None:
        """After the engine's write acks: copies that landed may be scrubbed, and the host-copy perturbation may flip
        a byte of one."""
        if not self._copies_in_flight:
            return
        landed, waiting = [], []
        for h, e in self._copies_in_flight:  # one query per copy: a copy landing between two would be lost
            (landed if e is None or e.query() else waiting).append((h, e))
        self._copies_in_flight = waiting
        landed = [h for h, _ in landed]
        if self.host_scrub is not None:
            for h in landed:
                self.host_scrub.backup_landed(h.numpy())  # (``backup_queued`` keeps them as CPU int64)
        if self.config.perturb_host_copy_prob <= 0:
            return
        for host_slot in self.perturb.perturb_host_copies(forward_index=self.forwards, backups=landed,
                                                          host_rows=self._host_rows):
            self._flipped[host_slot] = False

    def free_host_slots(self, host_idx: torch.Tensor) -> None:
        """The engine freed host copies: their records go (after the last load's read of them), and so does a flip of
        one (never loaded: never read)."""
        if self.host_scrub is not None:
            self.host_scrub.freed(host_idx.to("cpu", torch.int64).numpy())
        self._pending_frees.append(host_idx.reshape(-1).to("cpu", torch.int64))
        if not self.defer_host_ops:  # batched: zeroed with the next flush
            self.flush_host_records()
        if self._flipped or self._storage_from or self._copies_in_flight:
            slots = host_idx.tolist()
            for h in slots:
                self._flipped.pop(h, None)
            self._storage_slots_freed(slots)
            if self._copies_in_flight:  # a copy freed before it landed is not the perturbation's to flip
                freed = set(slots)
                self._copies_in_flight = [(h, e) for h, e in self._copies_in_flight if not freed & set(h.tolist())]

    def clear_host_records(self) -> None:
        """The engine dropped every host copy (a cache reset, idle): their records, flips and load book go; a load
        named but never consumed is forgotten (the engine restarts its load names)."""
        if self.host_records is None:
            return
        if self.host_scrub is not None:
            self.host_scrub.cleared()
        self.host_records.clear()
        self._pending_backups, self._pending_frees, self._pending_fence = [], [], None
        self._flipped.clear()
        self._copies_in_flight.clear()
        self._storage_clear()
        self._pending_load_id = None
        self._loaded_from.fill_(-1)

    def stage_load(self, host_idx: torch.Tensor) -> Optional[torch.Tensor]:
        """Before the engine queues a load's K/V copy (its start of the load): what is batched flushed and the host
        slot ids ``host_idx`` (int[n], CPU) copied to the device now, on the current stream; int64[n] on the device
        for ``load_records(host_dev=...)``, or None (no host records, nothing loaded).

        Queued after the engine's load, a host-to-device copy of more than a few KiB waits on the copy engine for
        the whole load, and the forward queued behind it on the same stream with it: that forward loses the
        engine's layer-by-layer overlap with its load (a 1 GiB load of 32 layers on an H100: the first layer's
        compute done at 19.8 ms instead of 1.0 ms behind a 72 KiB copy; an 8 KiB one is not held,
        ``scripts/bench_copy_order.py (at 686ff20, benchmarks/README.md)``)."""
        if self.host_records is None or host_idx.numel() == 0:
            return None
        self.flush_host_records()
        return self.host_records.index(host_idx)

    def load_records(self, host_idx: torch.Tensor, device_idx: torch.Tensor, *, host_dev: Optional[torch.Tensor],
                     load_id: int = 0) -> None:
        """The engine loads host copies ``host_idx`` (int[n], CPU) into new device slots ``device_idx`` (int[n],
        device); ``host_dev``: ``stage_load(host_idx)``'s result, made before the engine queued the load (int64[n],
        device; None only when there is nothing to load); ``load_id``: the engine's name of this load, which the
        consuming forward names (``load_in_flight``). No wait on the host: a few device ops on the canary's load
        stream, behind the current one."""
        store = self.host_records
        if store is None or device_idx.numel() == 0:
            return
        if host_dev is None:
            raise ValueError("kv-canary: load_records needs stage_load(host_idx)'s ids, staged before the engine "
                             "queued its load (a copy after it waits for the whole load)")
        self.flush_host_records()
        self._pending_load_id = int(load_id)
        group = self.groups[0]
        dev = device_idx.to(group.records.device, torch.int64)
        host = host_dev  # staged on the current stream before the engine's load
        if self._flipped or self._storage_flipped_slots:
            slots = host_idx.tolist()
            for h in slots:
                if self._flipped.get(h) is False:
                    self._flipped[h] = True
                    self._flipped_loaded += 1
            self._storage_slots_loaded(slots)
        stream = self._load_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(group.records.device))
        store.count_load(host.numel())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # one launch on a GPU (the six torch ops of the reference were host time on the boundary's critical
            # path); no Python scalar goes to the device (``tags[dev] = 0`` would copy it synchronously)
            self._load_moves(store.records, host, group.records, dev, group.full_row.tags, self._loaded_from,
                             self.forwards)
        if stream is not None:
            dev.record_stream(stream)
            host.record_stream(stream)
            self._load_event = self._last_load_event = torch.cuda.Event()
            self._load_event.record(stream)

    def load_in_flight(self, wait_until_layer: Callable[[int], None], load_id: int = 0) -> bool:
        """The next forward names load ``load_id``: if that load is pending, this forward consumes it (its HEAD waits
        for it, its full-row hashing runs after it) and True; a load already consumed (or never issued) is not
        handed over again (False)."""
        if self._pending_load_id is None or int(load_id) != self._pending_load_id:
            return False
        self._pending_load_id = None
        self._loads_consumed += 1
        layer = max(self.config.kv_hash_layers)
        event, self._load_event = self._load_event, None

        def head() -> None:
            if event is not None:
                torch.cuda.current_stream(self.counters.device).wait_event(event)
            wait_until_layer(layer)

        self.single_forward_managers[0].expect_load(LoadWaits(head=head, layer=wait_until_layer))
        return True

    def _check_load_consumed(self) -> None:
        """After a forward: a load handed over but not consumed ran in a replayed graph (never expected)."""
        for sfm in self.single_forward_managers:
            if sfm.load_pending:
                sfm.expect_load(None)
                raise CanaryBracketError("kv-canary: a HiCache load-back was consumed by a forward that did not "
                                         "run the canary's HEAD (a CUDA-graph replay?): its slots went unverified")

    def annotate_loads(self, violations: List) -> List:
        """Violations on a slot loaded back for the forward that reports them name the host slot it came from."""
        if not violations:
            return violations
        # one gather and one copy to the host for the batch (slot 0, the pool's padding slot, is never loaded into)
        slots = [v.slot if 0 < v.slot < self._loaded_from.shape[0] else 0 for v in violations]
        book = self._loaded_from[torch.tensor(slots, device=self._loaded_from.device)].tolist()
        out = []
        for v, (host_slot, forward) in zip(violations, book):
            if host_slot >= 0 and forward == v.forward:
                v = dataclasses.replace(v, identity=v.identity + (("hicache", "load"), ("host_slot", host_slot))
                                        + self.storage_identity(host_slot))
            out.append(v)
        return out

    def host_scrub_violations(self) -> List:
        """Host copies the scrub found bad since the last call, as violations naming their host slot (``slot`` -1:
        no device slot holds them; ``rid`` host_scrub)."""
        found: List[HostMismatch] = self.host_scrub.drain() if self.host_scrub is not None else []
        return [Violation(seq=-1, kind="kv_hash", group=self.groups[0].name, slot=-1, position=m.position,
                          rid=HOST_SCRUB_RID, row=-1, batch_index=-1, stored=m.stored, expected=m.live,
                          forward=self.forwards, cuda_graph=None,
                          identity=(("hicache", "host_scrub"), ("host_slot", m.host_slot))
                          + self.storage_identity(m.host_slot))
                for m in found]

    def host_copies_stats(self) -> Dict[str, int]:
        s = self.host_records.stats
        out = {"hicache_backups": s.backups, "hicache_slots_backed_up": s.slots_backed_up,
               "hicache_loads": s.loads, "hicache_slots_loaded": s.slots_loaded,
               "hicache_loads_consumed": self._loads_consumed}
        if self.host_scrub is not None:
            out["hicache_host_scrubbed"] = self.host_scrub.slots_scrubbed
            out["hicache_host_scrub_passes"] = self.host_scrub.passes
            out["hicache_host_scrub_stopped"] = int(bool(self.host_scrub.error))
        if self.config.perturb_host_copy_prob > 0:  # flipped host copies loaded back: each must be reported
            out["hicache_flipped_copies_loaded"] = self._flipped_loaded
        return {**out, **self.storage_pages_stats()}
