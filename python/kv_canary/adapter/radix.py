"""Read sglang's radix prefix cache: the slots it holds, in sequence order.

A node (``TreeNode``) holds ``value`` (int64 device tensor of token slots),
``key.token_ids`` (the tokens) and ``lock_ref`` (> 0 while a running request
uses it); a node's positions continue its parent's. Evicted nodes (``value is
None``) hold no device slots.
"""

from __future__ import annotations

import random
from typing import Iterator, List, Optional, Tuple

import torch

from ..views import SweepEntries


class RadixCacheView:
    def __init__(self, tree_cache):
        self._tree = tree_cache

    @staticmethod
    def supports(tree_cache) -> bool:
        return type(tree_cache).__name__ == "RadixCache" and hasattr(tree_cache, "root_node")

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

    def sweep_entries(self, device: torch.device) -> SweepEntries:
        """Every resident cached slot with its predecessor, position and token (bounded by the pool size)."""
        nodes = list(self._walk())
        if not nodes:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return SweepEntries(empty, empty, empty, empty)
        offsets, lengths, positions, tokens = {}, [], [], []
        offset = 0
        for node, start, _ in nodes:
            n = len(node.value)
            offsets[id(node)] = offset
            lengths.append(n)
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            tokens.append(torch.as_tensor(list(node.key.token_ids[:n]), dtype=torch.int64))
            offset += n
        slots = torch.cat([node.value.to(device=device, dtype=torch.int64) for node, _, _ in nodes])
        # predecessor: the previous flat entry, except at a node's first slot: its parent's last slot
        prev_index = torch.arange(-1, offset - 1, dtype=torch.int64)
        for (node, _, parent), n in zip(nodes, lengths):
            first = offsets[id(node)]
            prev_index[first] = offsets[id(parent)] + len(parent.value) - 1 if id(parent) in offsets else -1
        prev_index = prev_index.to(device)
        preds = torch.where(prev_index >= 0, slots[prev_index.clamp(min=0)], torch.zeros_like(slots))
        return SweepEntries(
            slots=slots,
            preds=preds,
            positions=torch.cat(positions).to(device),
            tokens=torch.cat(tokens).to(device),
        )

    def pick_unused_slot(self, rng: random.Random) -> Optional[Tuple[int, int]]:
        """(slot, position) of a random slot held only by the cache (no running request), or None."""
        unused: List[Tuple[object, int]] = [(n, s) for n, s, _ in self._walk() if n.lock_ref == 0]
        if not unused:
            return None
        node, start = rng.choice(unused)
        k = rng.randrange(len(node.value))
        return int(node.value[k].item()), start + k
