"""Read sglang's ``MambaRadixCache`` (hybrid linear-attention models); keep the sweep's cached-slot index of it.

A node holds ``value`` (int64 device tensor of engine slots: the full-attention
layers' KV, the canary's ``full`` group), ``key`` and ``mamba_value`` (the index of
one linear-attention state in the ``MambaPool``, or None). ``full_lock_ref`` > 0
while a running request uses the node (it locks the whole path to the root).

What the tree really holds, in sglang 0.5.12 (``mem_cache/mamba_radix_cache.py``):

* **Mamba eviction tombstones, it keeps the KV.** ``evict_mamba`` on an internal
  node frees only its mamba state (``_tombstone_internal_node``: ``mamba_value =
  None``); its ``value`` stays, the slots stay allocated and a later match still
  reads them (a match ends at the last node with a mamba state, so a tombstoned
  node's KV is read whenever a descendant has one). So the index keeps a
  tombstoned node's slots and the sweep verifies them. On a leaf, ``evict_mamba``
  evicts the whole node (``_evict_leaf_node``: KV and mamba state freed).
* **Inserts never replace a node's KV.** ``_insert_helper`` frees the *inserted*
  value's duplicates of slots the tree already holds (a request that recomputed a
  tombstoned prefix: its KV is the same tokens at the same positions, so its
  chain equals the tree's) and keeps the node's slots; a tombstoned node gets a
  mamba state back without a KV change. Only a new leaf brings new slots, and
  sglang records a store event for it (``_record_store_event``).
* **Leaves leave** through ``_delete_leaf`` (full or mamba eviction) and
  ``_delete_tombstone_leaf`` (tombstones left childless by an eviction are
  deleted with it, ``_iteratively_delete_tombstone_leaf``); their slots are freed.
* **Splits** (``_split_node``, in match and insert) clone the values: no slot's
  position, token or predecessor changes, so they need no report (as in ``RadixCache``).
* ``reset`` empties the tree.

The hooks (plugin HOOKS: ``adapter/radix``'s, as for ``RadixCache``) report those to the
index: after ``_record_store_event`` (the new node's slots), after ``_delete_leaf`` /
``_delete_tombstone_leaf`` (its slots dropped), after ``reset`` (cleared). ``HiMambaRadixCache`` (hierarchical
cache) moves KV to and from the host and is not followed (refused by the plugin).
"""

from __future__ import annotations

from .radix import RadixCacheView


class MambaRadixCacheView(RadixCacheView):
    # an unused-cache pick includes tombstoned nodes: their KV is cached (and read again through a descendant's match)
    LOCK_ATTR = "full_lock_ref"

    @staticmethod
    def supports(tree_cache) -> bool:
        return type(tree_cache).__name__ == "MambaRadixCache" and hasattr(tree_cache, "root_node")
