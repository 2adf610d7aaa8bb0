"""Host -> device staging without a host wait: a few host buffers (pinned on CUDA) used in turn.

A buffer is handed out again only once the copies issued from it have landed:
``take`` waits for the event ``done`` recorded after those copies, ``count`` uses ago
(normally long done). Used by the token oracle (each forward's tokens) and the
sweep's cached-slot index (queued radix adds).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch


class PinnedStaging:
    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, count: int = 2):
        if count < 2:
            raise ValueError(f"kv-canary: staging needs at least two host buffers, got {count}")
        self.is_cuda = device.type == "cuda"
        self._bufs = [torch.zeros(tuple(shape), dtype=dtype, pin_memory=self.is_cuda) for _ in range(count)]
        self._arrs = [b.numpy() for b in self._bufs]
        # one event per buffer, made once (a new event a use cost the oracle's staging ~10x its record)
        self._events: List[Optional[object]] = [torch.cuda.Event() if self.is_cuda else None for _ in range(count)]
        self._recorded = [False] * count  # copies were issued from the buffer since its last take
        self._cur = 0

    @property
    def capacity(self) -> int:
        """Elements along the last dimension."""
        return int(self._bufs[0].shape[-1])

    def take(self) -> Tuple[torch.Tensor, np.ndarray]:
        """The next buffer and its numpy view (waiting only for the copies issued from it ``count`` uses ago)."""
        self._cur = (self._cur + 1) % len(self._bufs)
        if self._recorded[self._cur]:
            self._events[self._cur].synchronize()
            self._recorded[self._cur] = False
        return self._bufs[self._cur], self._arrs[self._cur]

    def done(self) -> None:
        """Mark the copies issued from the current buffer (an event on the current stream)."""
        if self.is_cuda:
            self._events[self._cur].record()
            self._recorded[self._cur] = True
