"""Read sglang 0.5.23's ``UnifiedRadixCache`` for the sweep and the unused-cache perturbation.

0.5.23's radix cache keeps its nodes in a tree core (Rust by default) that reports no
per-node changes the plugin could follow, but it gives a walk made for exactly this:
``tree_core.walk_for_kv_canary(unlocked_only, swa_resident_only)`` -> flat host int64 rows
``(slot, position, prev slot)`` of every device-resident slot (prev -1 at position 0).
So the index is rebuilt from a walk right before each sweep (``before_sweep``): host work
O(cached slots) every ``--kv-canary-sweep-interval`` forwards, one pinned staging copy and a
few scatters on the device (``CachedSlotIndex.replace_rows``). The walk carries no keys, so
the sweep checks each cached slot's position, chain link and K/V bytes, not the cache's
token claim (HEAD checks that at the first read of the slot).

The trees it reads: ``FULL`` (full-attention models), ``FULL`` + ``SWA`` (hybrid sliding-window
models, ``SWAKVPool``) and ``FULL`` + ``MAMBA`` (below). The walk's slots are the engine's (full) slots, so both of the pool's groups
are swept from one index: ``full`` at those slots, ``swa`` through the live ``full_to_swa_index_mapping``
only where it is > 0 (``kernels/index_sweep``). sglang clears a full slot's mapping when it releases
its SWA KV (``SWATokenToKVPoolAllocator.free_swa`` / ``_free_swa_pages``: a node whose SWA value was
evicted, a request's slots outside its window), so the swa group is never swept at a released slot,
and a predecessor whose SWA KV was released leaves that chain link unchecked (as in HEAD). The
unused-cache pick takes nodes no request holds at all (the ``FULL`` lock, which every request takes
on its whole path: ``walk_for_kv_canary(True, False)``); the swa perturbation skips slots with no
mapping.

``FULL`` + ``MAMBA`` (hybrid linear-attention models, ``HybridLinearKVPool``: the one group ``full`` is
the full-attention layers' inner pool, engine slots): the walk emits every node whose FULL value is
on the device, mamba-tombstoned nodes included -- sglang's mamba eviction of an internal node frees
only its state and keeps its KV allocated and cached (a later match reads it through a descendant's
state), so the sweep verifies those slots, as 0.5.12's ``MambaRadixCache`` index did. The unused-cache
pick takes nodes with no FULL lock (tombstones included). The mamba state itself is not covered.
Any other tree (unified memory, ...) is not read: the sweep is refused naming its flag.

Walking only when the tree changed (``TreeChanges``): the walk is host work O(cached slots) (Rust core, 2-core
CPU: ~2-4 ms for 82k cached slots, plus ~2 ms to stage the rows), and a decode-heavy server's tree holds hundreds
of thousands of slots while it changes only at admissions and finishes. With sglang's default Rust core
(``RustUnifiedTreeCore``), every change of the tree passes through the core object's public methods (the Rust
binding is private to it), so the view wraps them on that one instance: a call to any method not known to leave
the walk's rows as they are marks the tree changed, before it runs, and the next sweep walks again; otherwise the
index of the last walk is still exact and the sweep reuses it. The Python core's components reach into its nodes
directly, so with that core the tree is walked before every sweep.

Evictions do not walk (``TreeChanges.EVICTING``): a server whose pool is full evicts a cached leaf every few decode
steps (issue 57: every sweep walked). An eviction step only takes device values away, and every FULL slot it takes
is in its result's ``device_frees`` (sglang frees exactly those), from leaves only (a device-resident node's
ancestors stay resident), so the other rows (positions, chain links) stay as they were: the sweep drops the freed
slots from the last walk's index (``CachedSlotIndex.remove``) instead of walking. Write-back eviction (``demote``,
``drop_subtree_no_host``) and the mamba/SWA state steps still mark the tree changed.

On a CUDA device the freed slots' tensors are read on the canary's stream at the next sweep, after sglang has
dropped them: ``CachedSlotIndex.remove_all`` records that stream on each first (as ``add`` always has), so their memory
is not reused before the read (the first GPU run without it, H200 2026-11-30, died on a device-side index assert;
with it, 2026-11-30c: 66 sweeps at decode bs64, 0 violations, +1.07% against a walk every sweep's +3.58%).
"""

from __future__ import annotations

import random
from typing import List, Optional, Tuple

import torch


class TreeChanges:
    """Whether a ``RustUnifiedTreeCore`` may have changed the walk's rows since the last ``take()`` (module doc).

    Wraps the core instance's public methods, except ``UNCHANGING`` (reads, lock and pin counts: the walk emits
    every device-resident slot, locked or not), so that a call marks the tree changed before it runs. A method
    sglang adds later is wrapped too (it counts as a change until it is listed here). ``EVICTING`` methods do not
    mark it: the FULL slots their results free are kept for the sweep to drop from the index.
    """

    CORES = ("RustUnifiedTreeCore",)
    UNCHANGING = frozenset((
        "walk_for_kv_canary", "evictable_size", "protected_size", "full_evictable_size", "full_protected_size",
        "component_evictable_size", "component_protected_size", "swa_evictable_size", "swa_protected_size",
        "mamba_evictable_size", "mamba_protected_size", "total_size", "get_component_device_value",
        "get_hash_values", "get_last_hash_value", "get_prefix_hash_values", "collect_full_device_indices",
        "collect_path_info", "root_node_handle", "node_by_id", "is_root", "is_backuped", "is_full_device_evicted",
        "is_write_back", "is_write_through_compatible", "is_host_memory_buffer_only", "has_ongoing_insert",
        "has_swa_host_pool", "component_has_host_value_only", "pretty_print", "sanity_check", "rotation_base_of",
        "rotation_phase_of", "supports_fast_match_prefix", "supports_rotation_base", "dfs_weight_order",
        "inc_lock_ref", "dec_lock_ref", "inc_full_pin", "dec_full_pin", "dec_swa_lock_only", "dec_window_lock_only",
        "inc_host_lock_ref", "dec_host_lock_ref",
    ))
    # sglang's device eviction walk (UnifiedRadixCache._evict_components): the start/end brackets return nothing
    # and free nothing; a step's result lists what it freed (``device_frees``, per component)
    EVICTING = frozenset(("evict_device_start", "evict_device_next_node", "evict_device_leaf", "evict_device_end"))

    def __init__(self, core):
        self.changed = True
        self.evicted: List[torch.Tensor] = []
        for name in dir(type(core)):
            # a property object is not callable: attributes and properties are left as they are
            if not name.startswith("_") and name not in self.UNCHANGING and callable(getattr(type(core), name)):
                wrap = self._evicting if name in self.EVICTING else self._marking
                setattr(core, name, wrap(getattr(core, name)))

    def _marking(self, method):
        def marked(*args, **kwargs):
            self.changed = True
            return method(*args, **kwargs)
        return marked

    def _evicting(self, method):
        def evicted(*args, **kwargs):
            try:
                result = method(*args, **kwargs)
            except BaseException:  # what a failed step left is unknown: walk again
                self.changed = True
                raise
            self.note_eviction(result)
            return result
        return evicted

    def note_eviction(self, result) -> None:
        """Keep the FULL slots an eviction step freed (read before sglang drains ``device_frees``)."""
        if result is None:  # the walk's start / end
            return
        frees = getattr(result, "device_frees", None)
        if frees is None:  # not the step result this was written for: walk again
            self.changed = True
            return
        for component, tensors in frees.items():
            if getattr(component, "name", None) == "FULL":
                self.evicted.extend(t for t in tensors if t.numel())

    @classmethod
    def follow(cls, core) -> "Optional[TreeChanges]":
        """Changes of ``core`` followed, or None where they cannot be (another core: walk every sweep)."""
        return cls(core) if type(core).__name__ in cls.CORES else None

    def take(self) -> Tuple[bool, List[torch.Tensor]]:
        """(walk, evicted) since the last call: whether the tree may have changed other than by evictions (or this
        is the first call), and the FULL slots evicted (to drop from the last walk's index when not walking)."""
        changed, evicted = self.changed, self.evicted
        self.changed, self.evicted = False, []
        return changed, evicted


class UnifiedRadixCacheView:
    def __init__(self, tree_cache, records):
        """``records``: the swept group's int64[num_slots, RECORD_WIDTH] (the held slots' tokens, see above)."""
        self._tree = tree_cache
        self._records = records
        self._index = None
        self.changes = TreeChanges.follow(tree_cache.tree_core)
        self.walks = 0
        self.walks_skipped = 0
        self.slots_evicted = 0  # slots dropped from the index without a walk (evictions between two sweeps)

    COMPONENTS = (("FULL",), ("FULL", "SWA"), ("FULL", "MAMBA"))  # the trees whose slots this view reads (module doc)

    @classmethod
    def supports(cls, tree_cache) -> bool:
        comps = getattr(tree_cache, "components", None)
        return (type(tree_cache).__name__ == "UnifiedRadixCache" and hasattr(getattr(tree_cache, "tree_core", None),
                                                                               "walk_for_kv_canary")
                and comps is not None and tuple(getattr(c, "name", str(c)) for c in comps) in cls.COMPONENTS)

    def attach_index(self, index) -> None:
        self._index = index
        self.before_sweep()

    def before_sweep(self) -> None:
        must_walk, evicted = self.changes.take() if self.changes is not None else (True, [])
        if not must_walk:
            if evicted:  # the last walk's rows less the evicted slots are the tree's (module doc)
                self.slots_evicted += sum(t.numel() for t in evicted)
                self._index.remove_all(evicted)
            self.walks_skipped += 1  # the index is exact
            return
        self.walks += 1
        walk = self._tree.tree_core.walk_for_kv_canary(False, False)
        preds = walk.prev_slot_indices.clamp(min=0)
        self._index.replace_rows(walk.slot_indices, walk.positions, preds, self._records)

    def walk_stats(self) -> dict:
        """For the stats line: sweeps that walked the tree, sweeps that reused the last walk's index, and the
        evicted slots those dropped from it."""
        return {"index_walks": self.walks, "index_walks_skipped": self.walks_skipped,
                "index_slots_evicted": self.slots_evicted}

    def pick_unused_slot(self, rng: random.Random) -> Optional[Tuple[int, int]]:
        """(slot, position) of a random slot held only by the cache (no running request), or None."""
        walk = self._tree.tree_core.walk_for_kv_canary(True, False)
        n = int(walk.slot_indices.numel())
        if n == 0:
            return None
        k = rng.randrange(n)
        return int(walk.slot_indices[k]), int(walk.positions[k])


def unified_view_for(tree_cache, manager):
    """The 0.5.23 line's prefix-cache reader (``SglangLine.prefix_cache_view``), or None for another tree."""
    return UnifiedRadixCacheView(tree_cache, manager.groups[0].records) if UnifiedRadixCacheView.supports(
        tree_cache) else None
