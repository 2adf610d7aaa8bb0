"""``--kv-canary contain`` with HiCache (sglang 0.5.12's ``HiRadixCache``): evict a bad node from device *and* host.

A violation at a loaded slot's first read names a device slot whose bytes came back from a host copy; the
bad bytes live in that host copy too, so evicting the device node alone would let the next hit load the
same bad copy again. Here the node and its whole subtree, children first, leave both tiers with sglang's own
calls (``HiRadixCache._evict_backuped`` / ``_evict_regular`` for the device value, the body of
``HiRadixCache.evict_host`` for the host value), so a retry misses and is recomputed. With a storage tier the
pages may rest in storage too, which has no delete: their keys (``node.hash_value``, one per page) are poisoned
(``hicache_storage.after_storage_hit_query`` stops a lookup before them).

A node is busy (retried at later safe points, like a locked node) while a request holds it (``lock_ref``),
a load or prefetch holds its host copy (``host_ref_counter``), or its write-through or load-back is in flight.
"""

from __future__ import annotations

from typing import Dict, List, Tuple


def subtree_children_first(node) -> List[object]:
    """``node`` and every descendant, each after all of its descendants (so each is a leaf when removed)."""
    order: List[object] = []
    stack = [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    return order[::-1]


def is_hicache_tree(tree) -> bool:
    """A ``HiRadixCache`` (host tier beside the device tree): read by attribute, no sglang import."""
    return hasattr(tree, "evictable_host_leaves") and hasattr(tree, "cache_controller")


def host_slot_holders(tree, host_slots) -> Dict[int, object]:
    """host slot -> the node whose ``host_value`` holds it (one walk of the tree)."""
    out: Dict[int, object] = {}
    if not host_slots:
        return out
    stack = list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if getattr(node, "host_value", None) is None:
            continue
        for h in node.host_value.tolist():
            if h in host_slots:
                out[h] = node
    return out


def subtree_busy(tree, node) -> bool:
    """Some node of ``node``'s subtree is held by a request, a load/prefetch or an in-flight copy."""
    writing = getattr(tree, "ongoing_write_through", {})
    loading = getattr(tree, "ongoing_load_back", {})
    return any(n.lock_ref > 0 or getattr(n, "host_ref_counter", 0) > 0 or n.id in writing or n.id in loading
               for n in subtree_children_first(node))


def evict_hicache_subtree(tree, node, removed: set) -> Tuple[int, int, int, List[str]]:
    """Free ``node`` and every descendant from the device and the host, children first; their ids go into
    ``removed``. Returns (nodes, device tokens freed, host slots freed, the nodes' storage keys: one per page,
    with a storage tier)."""
    order = subtree_children_first(node)
    tokens = host_slots = 0
    keys: List[str] = []
    for n in order:
        keys.extend(k for k in (getattr(n, "hash_value", None) or ()) if isinstance(k, str))
        if n.value is not None:
            tokens += len(n.value)
            if n.host_value is None:  # device only: the tree's own regular eviction frees it and unlinks it
                tree._evict_regular(n)
                removed.add(id(n))
                continue
            tree._evict_backuped(n)  # device copy freed; the node stays, evicted, with its host copy
        if n.host_value is not None:
            host_slots += len(n.host_value)
            _drop_host(tree, n)
        removed.add(id(n))
    return len(order), tokens, host_slots, keys


def _drop_host(tree, node) -> None:
    """``HiRadixCache.evict_host``'s body for one evicted leaf: free its host copy and unlink it."""
    from sglang.srt.disaggregation.kv_events import StorageMedium  # as HiRadixCache.evict_host records it

    tree._record_remove_event(node, medium=StorageMedium.CPU)
    tree.cache_controller.evict_host(node.host_value)
    key = node.key.child_key(tree.page_size)
    if node.parent.children.get(key) is node:
        node.parent.children.pop(key)
    tree.evictable_host_leaves.discard(node)
    tree._update_host_leaf_status(node.parent)
    tree._update_leaf_status(node.parent)
