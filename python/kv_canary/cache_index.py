"""Device-resident index of the slots the prefix cache holds: what the sweep verifies, in one launch.

Per KV slot (``num_slots`` of the pool), on the device:

    held: int8      1 while the prefix cache holds the slot
    position: int32 the position the cache holds it at
    pred: int32     the slot of the previous position in the same cached sequence (0 at position 0)
    token: int32    the cache key's token at that position

The engine adapter reports tree changes as they happen (``add`` when a node with
new slots is stored, ``remove`` when a node is evicted, ``clear`` on a reset).
Those calls only queue the change on the host (O(1) work, no device op), so the
scheduler's tree operations never launch or wait for anything. ``apply_pending``
replays the queue in order on the current stream right before a sweep: per
queued node a few small device writes plus one pinned, non-blocking host->device
copy of its tokens and positions; never a host sync. The sweep then checks every
held slot with one launch over ``num_slots`` lanes (device work O(num_slots)).

Ordering: a slot evicted, reallocated and cached again between two sweeps is
removed then re-added in queue order, so the sweep never checks a slot against a
claim the cache no longer makes. The tree's tensors were made on the scheduler's
stream; sglang orders its forward stream after it before each forward, and the
replay marks each tensor it reads as used on the forward stream
(``record_stream``) so the allocator does not reuse it early.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

# bytes per slot: held (int8) + position, pred, token (int32)
BYTES_PER_SLOT = 1 + 3 * 4


class CachedSlotIndex:
    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.held = torch.zeros(num_slots, dtype=torch.int8, device=device)
        self.position = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.pred = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.token = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # queued changes, oldest first: ("add", slots, tokens, start, pred_of_first) | ("remove", slots) | ("clear",)
        self._pending: List[Tuple] = []
        self.nodes_added = 0
        self.nodes_removed = 0

    # ------------------------------------------------------------------ called from the engine's tree ops (host only)

    def add(self, slots: torch.Tensor, tokens: Sequence[int], start: int,
            pred_of_first: Optional[torch.Tensor]) -> None:
        """The cache now holds ``slots`` (device int[n]) for tokens ``tokens[:n]`` at positions ``start..start+n-1``.

        ``pred_of_first``: device int[1], the slot of position ``start - 1`` (None when start == 0).
        ``tokens`` is read only when the queue is applied (pass the cache's own key list, not a copy).
        """
        if len(slots):
            self._pending.append(("add", slots, tokens, start, pred_of_first))

    def remove(self, slots: torch.Tensor) -> None:
        """The cache no longer holds ``slots`` (device int[n])."""
        if len(slots):
            self._pending.append(("remove", slots))

    def clear(self) -> None:
        """The cache dropped everything."""
        self._pending = [("clear",)]

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ before a sweep (current stream, no sync)

    def apply_pending(self) -> None:
        """Replay the queued changes, in order, as device writes on the current stream."""
        ops, self._pending = self._pending, []
        for op in ops:
            if op[0] == "clear":
                self.held.zero_()
            elif op[0] == "remove":
                self.held[self._on_this_stream(op[1]).to(torch.int64)] = 0
                self.nodes_removed += 1
            else:
                self._apply_add(*op[1:])
                self.nodes_added += 1

    def _on_this_stream(self, t: torch.Tensor) -> torch.Tensor:
        """The engine made ``t`` on its own stream: keep its memory from reuse until this stream has read it."""
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    def _apply_add(self, slots: torch.Tensor, tokens: Sequence[int], start: int,
                   pred_of_first: Optional[torch.Tensor]) -> None:
        n = len(slots)
        host = torch.empty((2, n), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host[0] = torch.as_tensor(list(tokens[:n]), dtype=torch.int32)
        torch.arange(start, start + n, dtype=torch.int32, out=host[1])
        dev = host.to(self.device, non_blocking=True)
        index = self._on_this_stream(slots).to(device=self.device, dtype=torch.int64)
        first = (self._on_this_stream(pred_of_first).to(device=self.device, dtype=torch.int32).reshape(1)
                 if pred_of_first is not None else torch.zeros(1, dtype=torch.int32, device=self.device))
        self.token[index] = dev[0]
        self.position[index] = dev[1]
        self.pred[index] = torch.cat([first, index[:-1].to(torch.int32)])
        self.held[index] = 1
