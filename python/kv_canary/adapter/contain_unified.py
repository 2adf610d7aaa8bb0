"""``--kv-canary contain`` on sglang 0.5.23: the same orders as 0.5.12 (``contain.SchedulerContainment``),
applied to 0.5.23's scheduler and its ``UnifiedRadixCache``. Diff it against ``contain.py``:

* **Abort** (``_inflight_reqs``, ``_answer_queued``): as on 0.5.12 -- a running request gets ``to_finish =
  FINISH_ABORT(message)``, every aborted one ``skip_radix_cache_insert`` -- but the in-flight requests are
  sglang's own ``Scheduler.collect_inflight_reqs()`` (running batch, last batch, queued results) plus the
  chunked one, and a queued request is released and answered the way 0.5.23's ``Scheduler.abort_request``
  does it: ``_release_aborted_request`` (the tree's per-request state: ``tree_cache.finish(handle, ABORT)``),
  the beam group retired, then ``send_abort_output(AbortReq)`` (0.5.23 has no ``send_to_tokenizer``).
* **Evict** (``_evict``): 0.5.23's tree nodes live in a tree core (Rust by default) that hands out no node
  objects, only node ids behind ``UnifiedTreeCoreInterface``. The node holding a bad slot and its subtree
  are found and removed through that interface only:

  1. ``walk_for_kv_canary(False, False)``: every device slot as (slot, position, prev slot); the second walk
     with ``unlocked_only`` tells which slots no running request holds (a lock covers the node's whole root
     path, so an unlocked node has no locked descendant).
  2. Each leaf slot below the bad slot gives one root-to-leaf chain of slots; its key is the tokens the
     canary recorded for those slots (``F_TOKEN``, the token the model was fed at that position, which is
     the tree's key). ``match_full_device_prefix(key)`` (read-only: no split, no LRU touch) returns the leaf
     node id, accepted only if ``collect_full_device_indices(leaf, root)`` is exactly that chain of slots
     (so a namespace with the same tokens -- LoRA ``extra_key``, ``cache_salt`` -- is never taken for
     another: the default namespace is tried first, then those of the requests seen here).
  3. ``collect_path_info([leaf])`` names every node on the path with its span: the bad slot's node is the
     one whose span holds the slot's position, the nodes after it are its descendants.
  4. Children first, each node is dropped with ``drop_subtree_no_host(node)`` -- sglang's own removal of an
     unbacked device leaf (the write-back fallback of ``UnifiedRadixCache._evict_components``) -- after
     re-checking through ``collect_path_info`` that it is a leaf now (the Rust core panics, and then refuses
     all further use, on a node that is not an unlocked device leaf), and the step's result is drained by
     ``UnifiedRadixCache._apply_eviction_result`` exactly as sglang's ``_drop_subtree_no_host`` does: the
     freed slots go once to the allocator (``FreeComponentDeviceSlot``), the cache actions are applied.

  A bad slot not cached (yet), or whose node a running request holds, is retried at later safe points, as
  on 0.5.12 (``PENDING_TTL``); so is one whose subtree is not fully resolved (nothing is dropped then).

Supported tree: ``UnifiedRadixCache`` with the FULL component only, page size 1 or 16, no EAGLE bigram keys
(speculative decoding is refused on 0.5.23). With HiCache (the Python tree core only) the evictions are
``contain_hicache_0_5_23``'s: the node leaves the device and the host (``_evict_hicache``).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..fingerprint import F_TOKEN
from ..violations import CONTAIN_PREFIX, format_line
from . import contain_hicache_0_5_23 as hicache_0_5_23
from .contain import SchedulerContainment, poison_storage_keys

logger = logging.getLogger("kv_canary")

MAX_NAMESPACES = 64  # (extra_key, cache_salt) pairs of recent requests tried after the default namespace
Namespace = Tuple[Optional[str], Optional[str]]


class UnifiedSchedulerContainment(SchedulerContainment):
    def __init__(self, scheduler, manager):
        super().__init__(scheduler)
        self._records = manager.groups[0].records
        self._namespaces: "OrderedDict[Namespace, None]" = OrderedDict()
        tree = getattr(scheduler, "tree_cache", None)
        self._evictor = UnifiedTreeEvictor(tree, self._records) if UnifiedTreeEvictor.supports(tree) else None
        self._hicache_tree = tree if hicache_0_5_23.supports(tree) else None  # HiCache: device and host copies go
        if self._hicache_tree is None and getattr(getattr(tree, "tree_core", None), "enable_hicache", False):
            from ..config import CanaryConfigError  # check_hicache refuses it at startup; this is the backstop

            raise CanaryConfigError(
                f"--kv-canary contain cannot evict host copies from this HiCache tree ({type(tree).__name__}, tree "
                f"core {type(tree.tree_core).__name__}): set SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python or use "
                "--kv-canary log or raise")

    # ------------------------------------------------------------------ abort (0.5.23's scheduler)

    def _note_namespace(self, req) -> None:
        ns = (getattr(req, "extra_key", None), getattr(req, "cache_salt", None) or None)
        if ns != (None, None):
            self._namespaces[ns] = None
            self._namespaces.move_to_end(ns)
            while len(self._namespaces) > MAX_NAMESPACES:
                self._namespaces.popitem(last=False)

    def _inflight_reqs(self) -> List[object]:
        s = self._scheduler
        running = list(s.collect_inflight_reqs())
        if getattr(s, "chunked_req", None) is not None:
            running.append(s.chunked_req)
        for req in running:
            self._note_namespace(req)
        return running

    def _kv_row(self, req):
        kv = getattr(req, "kv", None)  # 0.5.23 keeps a request's KV bookkeeping in ``Req.kv``
        return (None, 0) if kv is None else (getattr(kv, "req_pool_idx", None), int(kv.kv_allocated_len or 0))

    def _answer_queued(self, req, message: str) -> None:
        from sglang.srt.managers.io_struct import AbortReq
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        s = self._scheduler
        self._note_namespace(req)
        s._release_aborted_request(req)  # as Scheduler.abort_request does for a queued request
        coordinator = getattr(s, "beam_coordinator", None)
        if coordinator is not None:
            coordinator.retire_group(req)
        s.send_abort_output(
            AbortReq(rid=req.rid, finished_reason=FINISH_ABORT(message=message).to_json(), abort_message=message),
            req,
        )

    # ------------------------------------------------------------------ evict (UnifiedRadixCache)

    def _evict(self) -> None:
        if self._hicache_tree is not None:
            return self._evict_hicache(self._hicache_tree)
        evictor = self._evictor
        snap = evictor.snapshot() if evictor is not None else None
        freed = set()  # slots freed in this pass (a slot may sit below an earlier slot's node)
        for key in list(self._slots):  # ("slot", device slot): no HiCache host copies on this line
            slot = key[1]
            if slot in freed:
                del self._slots[key]  # already evicted with an ancestor's subtree: free nothing twice
                continue
            nodes = snap.subtree_nodes(slot, self._namespace_order()) if snap is not None else None
            if nodes is None:  # not cached (yet), a running request still holds it, or not resolved
                self._retry_later(key)
                continue
            dropped, tokens, slots = evictor.drop(nodes)
            freed |= slots
            self.evicted_nodes += dropped
            self.evicted_tokens += tokens
            logger.error(format_line(CONTAIN_PREFIX, "evict", {"slot": slot, "nodes": dropped, "tokens": tokens}))
            if dropped == len(nodes):
                del self._slots[key]
            else:  # stopped below the bad slot's node (see drop): the rest is retried
                self._retry_later(key)
            snap = evictor.snapshot()  # the tree changed

    def _evict_hicache(self, tree) -> None:
        """HiCache (``contain_hicache_0_5_23``): a bad device or host slot's node and subtree leave both tiers."""
        device = {slot for tier, slot in self._slots if tier == "slot"}
        host = {slot for tier, slot in self._slots if tier == "host_slot"}
        dev_nodes, host_nodes = hicache_0_5_23.holders(tree, device, host)
        removed = set()  # ids of nodes evicted in this pass (a slot may sit below an earlier slot's node)
        for key in list(self._slots):
            node = (dev_nodes if key[0] == "slot" else host_nodes).get(key[1])
            if node is not None and id(node) in removed:
                del self._slots[key]  # already evicted with an ancestor's subtree: free nothing twice
                continue
            if node is None or hicache_0_5_23.subtree_busy(tree, node):  # not cached (yet), or held: retried
                self._retry_later(key)
                continue
            nodes, tokens, host_slots, keys = hicache_0_5_23.evict_subtree(tree, node, removed)
            self.evicted_nodes += nodes
            self.evicted_tokens += tokens
            fields = {key[0]: key[1], "nodes": nodes, "tokens": tokens, "host_slots": host_slots}
            fields.update(poison_storage_keys(tree, keys))  # storage has no delete
            logger.error(format_line(CONTAIN_PREFIX, "evict", fields))
            if id(node) in removed:
                del self._slots[key]
            else:  # stopped below the bad slot's node: the rest is retried
                self._retry_later(key)

    def _namespace_order(self) -> List[Namespace]:
        return [(None, None), *reversed(self._namespaces)]


def contain_evictor_gap() -> str:
    """What the running sglang lacks of the interface the evictor below uses ('' if nothing): checked at startup, so
    a release mapped to this line that lacks it refuses ``--kv-canary contain`` instead of crashing the scheduler at
    its first eviction. Found on sglang 0.5.22 by the release matrix's contain smoke (2026-11-29): no
    ``UnifiedRadixCache._apply_eviction_result`` (so contain evicted nothing) and no ``TreePathNodeInfo.num_children``
    (the evictor's leaf check raised in the scheduler once the first was bridged)."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import TreePathNodeInfo
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    missing = [name for name, ok in (
        ("UnifiedRadixCache._apply_eviction_result", hasattr(UnifiedRadixCache, "_apply_eviction_result")),
        ("TreePathNodeInfo.num_children", "num_children" in getattr(TreePathNodeInfo, "__struct_fields__", ())),
    ) if not ok]
    return ", ".join(missing)


class UnifiedTreeEvictor:
    """Find and drop, through ``UnifiedTreeCoreInterface``, the nodes of a ``UnifiedRadixCache`` holding a slot."""

    def __init__(self, tree_cache, records):
        self._tree = tree_cache
        self._core = tree_cache.tree_core
        self._records = records
        self.warned = set()  # slots whose unresolved subtree was logged (once each)

    @staticmethod
    def supports(tree_cache) -> bool:
        core = getattr(tree_cache, "tree_core", None)
        comps = getattr(tree_cache, "components", None)
        return (type(tree_cache).__name__ == "UnifiedRadixCache" and not getattr(tree_cache, "disable", False)
                and comps is not None and [getattr(c, "name", str(c)) for c in comps] == ["FULL"]
                and not getattr(core, "is_eagle", False) and not getattr(core, "enable_hicache", False)
                and hasattr(tree_cache, "_apply_eviction_result")
                and all(hasattr(core, m) for m in ("walk_for_kv_canary", "match_full_device_prefix",
                                                    "collect_full_device_indices", "collect_path_info",
                                                    "drop_subtree_no_host", "root_node_handle")))

    def snapshot(self) -> Optional["TreeSnapshot"]:
        if self._core.has_ongoing_insert():  # never mid-insert (a safe point is not inside one)
            return None
        return TreeSnapshot(self)

    def resolve_leaf(self, chain: Sequence[int], namespaces: Sequence[Namespace]) -> Optional[int]:
        """The node id whose root path holds exactly ``chain`` (slots, root first), or None."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tokens = self._records[np.asarray(chain, dtype=np.int64), F_TOKEN].tolist()
        root = self._core.root_node_handle()
        for extra_key, cache_salt in namespaces:
            key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
            matched, node_id, _ = self._core.match_full_device_prefix(key)
            if matched != len(chain) or self._core.is_root(node_id):
                continue
            if self._core.collect_full_device_indices(node_id, root).tolist() == list(chain):
                return node_id
        return None

    def drop(self, nodes: Sequence[int]) -> Tuple[int, int, set]:
        """Drop ``nodes`` (deepest first, each a device leaf once those before it are gone): (nodes, tokens,
        freed slots). Stops at a node that is not an unlocked device leaf without a host copy."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        dropped, tokens, freed = 0, 0, set()
        for node_id in nodes:
            info = self._core.collect_path_info([node_id])[0][-1]
            if info.num_children or self._core.is_backuped(node_id):
                logger.warning("kv_canary: contain: node %d is not a device leaf any more; left in the cache",
                               node_id)
                break
            result = self._core.drop_subtree_no_host(node_id)
            for values in result.device_frees.get(ComponentType.FULL, ()):
                freed.update(values.tolist())
            is_dropped = result.is_dropped
            tokens += int(result.tracker.get(ComponentType.FULL, 0))
            self._tree._apply_eviction_result(result)  # frees once through the allocator, applies the actions
            if not is_dropped:  # declined (locked): nothing freed
                break
            dropped += 1
        return dropped, tokens, freed


class TreeSnapshot:
    """One walk of the tree: slot -> row, the rows below each row, and the slots no running request holds
    (numpy over the walk's host rows; no per-slot Python work unless a pending slot is cached and unlocked)."""

    def __init__(self, evictor: UnifiedTreeEvictor):
        core = evictor._core
        self._evictor = evictor
        walk = core.walk_for_kv_canary(False, False)
        self.slots = walk.slot_indices.numpy()
        self.positions = walk.positions.numpy()
        n = len(self.slots)
        lut = np.full(int(self.slots.max()) + 2 if n else 1, -1, dtype=np.int64)  # slot -> row; lut[-1] = -1
        lut[self.slots] = np.arange(n, dtype=np.int64)
        self._lut = lut
        self.parent = lut[walk.prev_slot_indices.numpy()]  # prev slot -1 (position 0) -> lut[-1] = -1
        order = np.argsort(self.parent, kind="stable")  # rows grouped by parent row: children of r = a run
        self._by_parent = order
        self._first = np.searchsorted(self.parent[order], np.arange(n), side="left")
        self._last = np.searchsorted(self.parent[order], np.arange(n), side="right")
        self._unlocked = np.zeros(len(lut), dtype=bool)
        free = core.walk_for_kv_canary(True, False).slot_indices.numpy()
        self._unlocked[free[free < len(lut) - 1]] = True

    def _row(self, slot: int) -> Optional[int]:
        if not 0 <= slot < len(self._lut) - 1:
            return None
        r = int(self._lut[slot])
        return r if r >= 0 else None

    def _children(self, r: int):
        return self._by_parent[self._first[r]:self._last[r]]

    def _chain(self, r: int) -> List[int]:
        out = []
        while r >= 0:
            out.append(int(self.slots[r]))
            r = int(self.parent[r])
        return out[::-1]

    def subtree_nodes(self, slot: int, namespaces: Sequence[Namespace]) -> Optional[List[int]]:
        """Node ids of the node holding ``slot`` and of its whole subtree, deepest first; None if the slot is
        not cached, a running request holds it, or a leaf below it cannot be resolved to a node."""
        r = self._row(int(slot))
        if r is None or not self._unlocked[int(slot)]:
            return None
        position = int(self.positions[r])
        starts: Dict[int, int] = {}  # node id -> first position
        stack = [r]
        while stack:
            cur = stack.pop()
            kids = self._children(cur)
            if len(kids):
                stack.extend(int(k) for k in kids)
                continue
            leaf = self._evictor.resolve_leaf(self._chain(cur), namespaces)
            if leaf is None:
                if slot not in self._evictor.warned and len(self._evictor.warned) < 4096:
                    self._evictor.warned.add(slot)
                    logger.warning("kv_canary: contain: the cache node below slot %d (leaf slot %d) was not found "
                                   "by its key (another namespace?); retried later", slot, int(self.slots[cur]))
                return None
            for info in self._evictor._core.collect_path_info([leaf])[0]:
                if info.path_end > position:
                    starts[info.node_id] = info.path_start
        return sorted(starts, key=lambda n: -starts[n])
