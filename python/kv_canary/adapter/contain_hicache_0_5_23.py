"""``--kv-canary contain`` with HiCache on sglang 0.5.23 (``UnifiedRadixCache`` with its host tier): evict the node
holding a bad slot, and its subtree, from the device *and* the host, so the bad bytes are never loaded back.

A bad slot is named either by its device slot (a violation at a read: after a load-back 0.5.23 keeps the host
copy, so the node holds both) or by its host slot (``identity host_slot``: the copy a bad loaded slot came from,
or one the host scrub found at rest). The node holding it is found by one walk of the tree's Python nodes
(``component_data[FULL].value`` / ``.host_value``), and the node and its whole subtree leave both tiers, children
first (each a leaf when it goes), through sglang's own per-node steps, each drained by
``UnifiedRadixCache._apply_eviction_result`` (the freed device slots to the allocator, the host slots to the host
pool, the cache actions applied):

* a device value with a host copy: ``tree_core.demote(node_id)`` (the device value freed; the node stays, host-only);
* a device value without one: ``tree_core.drop_subtree_no_host(node_id)`` (the node leaves the tree);
* a host-only leaf: the Python tree core's ``_evict_host_leaf`` -- the one-node step of its own host eviction
  (``FullComponent.drive_host_eviction`` calls it per LRU host leaf) -- wrapped in a ``DriveHostEvictionResult``.

The last step exists only in the Python tree core: sglang 0.5.23's Rust core (its default) exposes host eviction
only as ``drive_host_eviction(component, num_tokens)`` over its LRU, with no per-node host drop, and hands out no
node objects (``node_by_id`` raises). So ``contain`` with HiCache needs ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=
python`` (``adapter/hicache.check_hicache`` refuses it otherwise, and ``supports`` re-checks the core at install).

A node is busy -- retried at later safe points, like a locked node on 0.5.12 -- while a request holds it
(``lock_ref``), a load or prefetch holds its host copy (``host_lock_ref``), or its write-through or load-back is
in flight (``write_through_pending_id`` / ``load_back_pending_id``), or the tree is mid-insert.

With the ``file`` storage tier the bad pages may rest in storage too, which has no delete: the evicted nodes' page
keys (``tree_core.get_hash_values``, one per page, the keys sglang writes and queries pages by) are poisoned, and
``hicache_0_5_23.after_storage_hit_query`` stops every later storage lookup before them.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

from .contain_hicache import subtree_children_first

logger = logging.getLogger("kv_canary")

PYTHON_CORE = "UnifiedTreeCore"  # sglang.srt.mem_cache.unified_cache.unified_tree_core (the Python tree core)


def supports(tree) -> bool:
    """A ``UnifiedRadixCache`` with HiCache, the FULL component only, on the Python tree core."""
    core = getattr(tree, "tree_core", None)
    comps = getattr(tree, "components", None)
    return (type(tree).__name__ == "UnifiedRadixCache" and not getattr(tree, "disable", False)
            and getattr(core, "enable_hicache", False) and type(core).__name__ == PYTHON_CORE
            and comps is not None and [getattr(c, "name", str(c)) for c in comps] == ["FULL"]
            and hasattr(core, "_evict_host_leaf") and hasattr(core, "_is_host_leaf")
            and hasattr(tree, "_apply_eviction_result"))


def _full(node):
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return node.component_data[ComponentType.FULL]


def holders(tree, device_slots, host_slots) -> Tuple[Dict[int, object], Dict[int, object]]:
    """(device slot -> node whose FULL device value holds it, host slot -> node whose FULL host value holds it)."""
    dev: Dict[int, object] = {}
    host: Dict[int, object] = {}
    if not device_slots and not host_slots:
        return dev, host
    stack = list(tree.tree_core.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        cd = _full(node)
        if device_slots and cd.value is not None:
            for s in cd.value.tolist():
                if s in device_slots:
                    dev[s] = node
        if host_slots and cd.host_value is not None:
            for h in cd.host_value.tolist():
                if h in host_slots:
                    host[h] = node
    return dev, host


def subtree_busy(tree, node) -> bool:
    """Some node of ``node``'s subtree is held by a request, a load/prefetch, or an in-flight copy."""
    if tree.tree_core.has_ongoing_insert():
        return True
    return any(n.write_through_pending_id is not None or n.load_back_pending_id is not None
               or any(cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in n.component_data)
               for n in subtree_children_first(node))


def evict_subtree(tree, node, removed: set) -> Tuple[int, int, int, List[str]]:
    """Free ``node`` and every descendant from the device and the host, children first; their ids go into
    ``removed``. Returns (nodes removed, device tokens freed, host slots freed, the removed nodes' storage page
    keys). Stops (logged; the rest is retried at a later safe point) at a node sglang's steps would not take."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DriveHostEvictionResult

    core = tree.tree_core
    nodes = tokens = host_slots = 0
    keys: List[str] = []
    order: List[object] = subtree_children_first(node)
    for n in order:
        if n.children:
            logger.warning("kv_canary: contain: HiCache node %d still has children; left in the cache", n.id)
            break
        keys.extend(k for k in (core.get_hash_values(n.id) or ()) if isinstance(k, str))
        cd = _full(n)
        if cd.value is not None:
            tokens += len(cd.value)
            if cd.host_value is None:  # device only: sglang's unbacked-leaf drop takes it out of the tree
                result = core.drop_subtree_no_host(n.id)
                tree._apply_eviction_result(result)
                if not result.is_dropped:
                    logger.warning("kv_canary: contain: HiCache node %d declined the drop; left in the cache", n.id)
                    break
                removed.add(id(n))
                nodes += 1
                continue
            tree._apply_eviction_result(core.demote(n.id))  # device value freed; the node stays, host-only
        if _full(n).host_value is not None:
            if not core._is_host_leaf(n):
                logger.warning("kv_canary: contain: HiCache node %d is not a host leaf; its host copy is left", n.id)
                break
            host_slots += len(_full(n).host_value)
            result = DriveHostEvictionResult()
            core._evict_host_leaf(n, result.tracker, result.device_frees, result.host_frees,
                                  cache_actions=result.cache_actions)
            tree._apply_eviction_result(result)
        removed.add(id(n))
        nodes += 1
    return nodes, tokens, host_slots, keys
