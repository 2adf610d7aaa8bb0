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
"""

from __future__ import annotations

import random
from typing import Optional, Tuple


class UnifiedRadixCacheView:
    def __init__(self, tree_cache, records):
        """``records``: the swept group's int64[num_slots, RECORD_WIDTH] (the held slots' tokens, see above)."""
        self._tree = tree_cache
        self._records = records
        self._index = None

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
        walk = self._tree.tree_core.walk_for_kv_canary(False, False)
        preds = walk.prev_slot_indices.clamp(min=0)
        self._index.replace_rows(walk.slot_indices, walk.positions, preds, self._records)

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
