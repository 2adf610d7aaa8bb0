"""Read sglang's radix prefix cache: the slots it holds, in sequence order; keep the canary's index of them.

A node (``TreeNode``) holds ``value`` (int64 device tensor of token slots),
``key.token_ids`` (the tokens) and ``lock_ref`` (> 0 while a running request
uses it); a node's positions continue its parent's. Evicted nodes (``value is
None``) hold no device slots.
"""

from __future__ import annotations

import random
from typing import Iterator, List, Optional, Tuple

INDEX_ATTR = "kv_canary_index"  # the CachedSlotIndex a RadixCache reports its changes to


class RadixCacheView:
    LOCK_ATTR = "lock_ref"  # the node field that is > 0 while a running request holds the node

    def __init__(self, tree_cache):
        self._tree = tree_cache

    def attach_index(self, index) -> None:
        """Report every later change of the tree to ``index`` (a ``CachedSlotIndex``), starting from what it holds."""
        setattr(self._tree, INDEX_ATTR, index)
        index.clear()
        for node, start, parent in self._walk():
            on_node_stored(self._tree, node, start=start)

    @staticmethod
    def supports(tree_cache) -> bool:
        return type(tree_cache).__name__ == "RadixCache" and hasattr(tree_cache, "root_node")

    def before_sweep(self) -> None:
        """Nothing to do: the tree hooks keep the index in step with every change."""

    def _walk(self) -> Iterator[Tuple[object, int, object]]:
        """(node, first position, parent node) for every resident non-root node, parents first."""
        root = self._tree.root_node
        stack = [(child, 0, root) for child in root.children.values()]
        while stack:
            node, start, parent = stack.pop()
            if node.value is None or len(node.value) == 0:
                continue
            yield node, start, parent
            end = start + len(node.value)
            stack.extend((child, end, node) for child in node.children.values())

    def pick_unused_slot(self, rng: random.Random) -> Optional[Tuple[int, int]]:
        """(slot, position) of a random slot held only by the cache (no running request), or None."""
        unused: List[Tuple[object, int]] = [(n, s) for n, s, _ in self._walk() if getattr(n, self.LOCK_ATTR) == 0]
        if not unused:
            return None
        node, start = rng.choice(unused)
        k = rng.randrange(len(node.value))
        return int(node.value[k].item()), start + k


# ---------------------------------------------------------------- tree-change hooks (registered by the plugin)


def _node_start(node) -> int:
    """First position of ``node``: the key lengths of its ancestors (host walk up, O(depth))."""
    start, p = 0, node.parent
    while p is not None and p.parent is not None:  # the root holds no key
        start += len(p.key)
        p = p.parent
    return start


def on_node_stored(tree, node, start: Optional[int] = None) -> None:
    """A node with new slots entered the tree (``RadixCache._record_store_event``)."""
    index = getattr(tree, INDEX_ATTR, None)
    if index is None or node.value is None or len(node.value) == 0:
        return
    start = _node_start(node) if start is None else start
    parent = node.parent
    pred = parent.value[-1:] if start > 0 and parent is not None and len(parent.value) else None
    index.add(node.value, node.key.token_ids, start, pred)


def on_node_removed(tree, node) -> None:
    """A leaf left the tree and its slots were freed (``RadixCache._delete_leaf``)."""
    index = getattr(tree, INDEX_ATTR, None)
    if index is not None and node.value is not None:
        index.remove(node.value)


def on_reset(tree) -> None:
    """The tree was emptied (``RadixCache.reset``)."""
    index = getattr(tree, INDEX_ATTR, None)
    if index is not None:
        index.clear()


# AFTER hooks (plugin HOOKS), shared by RadixCache, SWARadixCache and MambaRadixCache: each is a no-op
# until the sweep attaches its index to the tree


def after_node_stored(_result, tree, node, *args, **kwargs) -> None:
    """``_record_store_event``: a new node with the inserting request's slots (host queue only)."""
    on_node_stored(tree, node)


def after_node_removed(_result, tree, node, *args, **kwargs) -> None:
    """``_delete_leaf`` / ``_delete_tombstone_leaf``: the node left the tree and its slots were freed."""
    on_node_removed(tree, node)


def after_tree_reset(_result, tree, *args, **kwargs) -> None:
    """``reset``: the tree was emptied."""
    on_reset(tree)

