"""Read sglang's ``SWARadixCache`` (hybrid sliding-window models); keep the sweep's cached-slot index of it.

A node holds ``value`` (int64 device tensor of engine = full slots), ``key`` and
``swa_tombstone``: True once sglang released the node's swa KV (``free_swa``, which
also zeroes the slots' full -> swa mapping); the full KV of a tombstoned node stays
cached. The index (``kv_canary.cache_index``) holds the engine slots of every node;
the ``full`` group is swept there, the ``swa`` group through the live mapping only
(``kernels/index_sweep``), so a tombstoned node's slots are never verified in it.

What changes the slots the tree holds, and the hook that reports it (plugin HOOKS):

* ``_insert_helper`` (around): new nodes (``_add_new_node``) and tombstoned nodes
  *revived* with the inserting request's slots (their old full slots are freed and
  ``value`` replaced; sglang records no store event). Every allocator ``free``
  during the insert drops those slots from the index (the revived nodes' old slots;
  the request's duplicate slots, which the index never held, harmlessly); then the
  inserted key's path is walked and every node whose ``value`` is not the tensor the
  index was given is (re)added, with its children (their first slot's predecessor
  is that node's last slot). O(path length) host work per insert, no device op.
* ``_delete_leaf`` / ``_delete_tombstone_leaf`` (after): an evicted node's slots dropped.
* ``reset`` (after): cleared.
  (Those two are ``adapter/radix``'s hooks, shared with ``RadixCache``.)

Splits (``_split_node``) and compaction move slots between nodes without changing
any slot's position, token or predecessor, so they need no report. (A split clones
the values, so a later insert through the node re-adds its slots: the same claims
again. A claim that does change -- a revived parent's new last slot as its children's
predecessor -- always follows that insert's free of the old slots, so the index
replays the two in order.)
"""

from __future__ import annotations

from .radix import INDEX_ATTR, RadixCacheView, on_node_removed, on_node_stored

VALUE_ATTR = "kv_canary_value"  # on a node: the value tensor the index was last given for it
FREED_ATTR = "kv_canary_freed_into"  # on the allocator, during an insert: the index its frees are reported to


class SWARadixCacheView(RadixCacheView):
    # an unused-cache pick includes tombstoned nodes (their full KV is cached); the perturbation skips them for
    # the swa group (mapping 0)
    LOCK_ATTR = "full_lock_ref"

    @staticmethod
    def supports(tree_cache) -> bool:
        return type(tree_cache).__name__ == "SWARadixCache" and hasattr(tree_cache, "root_node")

    def attach_index(self, index) -> None:
        """Report every later change of the tree to ``index``, starting from what it holds."""
        setattr(self._tree, INDEX_ATTR, index)
        index.clear()
        for node, start, _parent in self._walk():
            _add(self._tree, node, start)


def _add(tree, node, start: int) -> None:
    on_node_stored(tree, node, start=start)
    setattr(node, VALUE_ATTR, node.value)


def _walk_inserted(tree, key) -> None:
    """(Re)add every node on ``key``'s path whose value changed since the index last saw it, and its children."""
    node, start, page = tree.root_node, 0, tree.page_size
    while len(key) > 0:
        child = node.children.get(key.child_key(page))  # .get: the children dict is a defaultdict
        if child is None or child.value is None:
            return
        matched = child.key.match(key, page_size=page)
        if matched == 0:
            return
        if getattr(child, VALUE_ATTR, None) is not child.value:
            _add(tree, child, start)
            end = start + len(child.value)
            for grandchild in list(child.children.values()):
                _add(tree, grandchild, end)
        if matched < len(child.key):
            return
        start += len(child.key)
        key = key[matched:]
        node = child


# ---------------------------------------------------------------- hooks (registered by the plugin)


def around_insert_helper(original, tree, node, key, *args, **kwargs):
    """``SWARadixCache._insert_helper``: report the frees it makes and the nodes it adds or revives."""
    index = getattr(tree, INDEX_ATTR, None)
    if index is None:
        return original(tree, node, key, *args, **kwargs)
    allocator = tree.token_to_kv_pool_allocator
    setattr(allocator, FREED_ATTR, index)
    try:
        result = original(tree, node, key, *args, **kwargs)
    finally:
        setattr(allocator, FREED_ATTR, None)
    if node is tree.root_node:
        _walk_inserted(tree, key)
    return result


def after_allocator_free(_result, allocator, free_index, *args, **kwargs) -> None:
    """``SWATokenToKVPoolAllocator.free`` inside an insert: those full slots are no longer the tree's."""
    index = getattr(allocator, FREED_ATTR, None)
    if index is not None and free_index is not None:
        index.remove(free_index)
