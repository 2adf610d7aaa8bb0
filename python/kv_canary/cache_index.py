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
replays the queue in order on the current stream right before a sweep. A run of
consecutive ``add``s is applied as one batch: the tokens and positions of all its
nodes go through one preallocated pinned staging buffer in one non-blocking
host->device copy, and one scatter per index tensor writes them (a constant
number of launches per batch, not per node; no host allocation of pinned memory,
which can synchronise the device). A ``remove`` is one scatter. Never a host
sync, except waiting for a staging buffer's copy issued two batches earlier
(long done). The sweep then checks every held slot with one launch over
``num_slots`` lanes (device work O(num_slots)).

Ordering: a slot evicted, reallocated and cached again between two sweeps is
removed then re-added in queue order, so the sweep never checks a slot against a
claim the cache no longer makes. The tree's tensors were made on the scheduler's
stream; sglang orders its forward stream after it before each forward, and the
replay marks each tensor it reads as used on the forward stream
(``record_stream``) so the allocator does not reuse it early.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .staging import PinnedStaging

# device bytes per slot: held (int8) + position, pred, token (int32), plus the scratch of one run of adds
# (its staged int32 tokens, positions and node offsets, int64 slots, int32 predecessors); plus 2 x 12 bytes
# of pinned host staging
BYTES_PER_SLOT = 1 + 3 * 4 + (3 * 4 + 8 + 4)


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
        # int32[3 * num_slots]: a run of adds holds each pool slot at most once; flat, so that each run's
        # [tokens | positions | node offsets] is one contiguous slice (a non-contiguous pinned source would
        # be copied through pageable memory: a copy that waits for the device)
        self._staging = PinnedStaging((3 * num_slots,), torch.int32, device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)  # pred_of_first of a node at position 0
        # device scratch of one run of adds, preallocated: applying a run allocates nothing (a caching-allocator
        # miss mid-serving would call cudaMalloc, which can stall the host on the device)
        self._dev_staged = torch.zeros(3 * num_slots, dtype=torch.int32, device=device)
        self._dev_slots = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self._dev_pred = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
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

    def remove_all(self, slots: Sequence[torch.Tensor]) -> None:
        """The cache no longer holds any of ``slots`` (int[n] tensors the engine made, possibly on its own stream):
        concatenated on the current stream, each first kept from reuse until this stream has read it (without
        that, a tensor the engine dropped returns to its stream's pool while the concatenation is still queued
        here, and the index reads another tensor's values: a device-side index assert, H200, issue 57)."""
        parts = [self._on_this_stream(t) for t in slots if t.numel()]
        if parts:
            self.remove(torch.cat(parts).to(device=self.device, dtype=torch.int64))

    def clear(self) -> None:
        """The cache dropped everything."""
        self._pending = [("clear",)]

    def replace_rows(self, slots: torch.Tensor, positions: torch.Tensor, preds: torch.Tensor,
                     records: torch.Tensor) -> None:
        """The cache holds exactly these rows now (host int64[n] each; ``preds`` 0 at position 0).

        For a tree that does not report its changes one by one but can be walked (sglang 0.5.23's
        ``UnifiedRadixCache``: ``walk_for_kv_canary``). The walk has no keys, so each held slot's
        token is its own record's (``records``: the group's int64[num_slots, RECORD_WIDTH]): the
        sweep then checks position, chain link and K/V bytes, not the cache's token claim (HEAD's
        token check covers that at the first read).
        """
        self._pending = [("rows", slots, positions, preds, records)]

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ before a sweep (current stream, no sync)

    def apply_pending(self) -> None:
        """Replay the queued changes, in order, as device writes on the current stream."""
        ops, self._pending = self._pending, []
        run: List[Tuple] = []  # consecutive adds, applied together
        for op in ops:
            if op[0] == "add":
                run.append(op)
                continue
            self._apply_adds(run)
            run = []
            if op[0] == "clear":
                self.held.zero_()
            elif op[0] == "rows":
                self._apply_rows(*op[1:])
            else:
                self.held.index_fill_(0, self._on_this_stream(op[1]).to(torch.int64), 0)
                self.nodes_removed += 1
        self._apply_adds(run)

    def _apply_rows(self, slots: torch.Tensor, positions: torch.Tensor, preds: torch.Tensor,
                    records: torch.Tensor) -> None:
        """Everything held is replaced: one pinned staging copy (no host sync), then four scatters."""
        self.held.zero_()
        n = int(slots.numel())
        if n == 0:
            return
        host, arr = self._staging.take()  # [0, n): slots; [n, 2n): positions; [2n, 3n): predecessors
        arr[:n], arr[n:2 * n], arr[2 * n:3 * n] = slots.numpy(), positions.numpy(), preds.numpy()
        dev = self._dev_staged[:3 * n]
        dev.copy_(host[:3 * n], non_blocking=self._staging.is_cuda)
        self._staging.done()
        index = self._dev_slots[:n]
        index.copy_(dev[:n])
        self.position.index_copy_(0, index, dev[n:2 * n])
        self.pred.index_copy_(0, index, dev[2 * n:])
        self.token.index_copy_(0, index, records[index, 0].to(torch.int32))
        self.held.index_fill_(0, index, 1)
        self.nodes_added += 1

    def _on_this_stream(self, t: torch.Tensor) -> torch.Tensor:
        """The engine made ``t`` on its own stream: keep its memory from reuse until this stream has read it."""
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    def _apply_adds(self, run: List[Tuple]) -> None:
        """Nodes ("add", slots, tokens, start, pred_of_first) with no remove between them (no slot twice).

        Host work: one C-level list -> int32 conversion per node (its key's tokens, straight into the
        pinned staging buffer) plus a few numpy ops for the whole run; device work: one copy, two
        concatenations and four scatters for the whole run, whatever its number of nodes.
        """
        if not run:
            return
        sizes = np.fromiter((len(op[1]) for op in run), dtype=np.int64, count=len(run))
        total = int(sizes.sum())
        if total > self.num_slots:  # more than the pool's slots at once: cannot happen; split anyway
            half = len(run) // 2 or 1
            self._apply_adds(run[:half])
            self._apply_adds(run[half:])
            return
        host, arr = self._staging.take()  # [0, total): tokens; [total, 2 total): positions; then node offsets
        offsets = np.zeros(len(run), dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        starts = np.fromiter((op[3] for op in run), dtype=np.int64, count=len(run))
        for (_, _slots, tokens, _start, _pred), a, n in zip(run, offsets.tolist(), sizes.tolist()):
            arr[a:a + n] = tokens[:n]
        arr[total:2 * total] = np.arange(total) + np.repeat(starts - offsets, sizes)
        arr[2 * total:2 * total + len(run)] = offsets
        used = 2 * total + len(run)
        dev = self._dev_staged[:used]
        dev.copy_(host[:used], non_blocking=self._staging.is_cuda)
        self._staging.done()
        index = self._dev_slots[:total]
        torch.cat([self._on_this_stream(op[1]) for op in run], out=index)
        pred = self._dev_pred[:total + 1]  # pred[i + 1] = index[i]; pred[:total] is each slot's predecessor
        pred[1:].copy_(index)
        pred[:1].zero_()
        # a node's first slot: its parent's last slot (or 0)
        firsts = [self._on_this_stream(op[4]).reshape(1) if op[4] is not None else self._zero for op in run]
        pred.index_copy_(0, dev[2 * total:].to(torch.int64), torch.cat(firsts).to(torch.int32))
        pred = pred[:total]
        self.token.index_copy_(0, index, dev[:total])
        self.position.index_copy_(0, index, dev[total:2 * total])
        self.pred.index_copy_(0, index, pred)
        self.held.index_fill_(0, index, 1)  # not ``held[index] = 1``: a Python scalar there is copied to the device synchronously
        self.nodes_added += len(run)
