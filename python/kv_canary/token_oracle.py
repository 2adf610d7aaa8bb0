"""The token oracle: each request's own tokens, as the scheduler records them, on the device.

What a forward *feeds* the model (``input_ids``) is checked against this, so the
oracle is never filled from ``input_ids``:

* at admission (the first extend forward of a request in a req_to_token row),
  the host copies the scheduler's record of the request -- prompt ids, then the
  output ids it already has (a retracted request) -- into the row, through a
  pinned staging buffer with a non-blocking copy (no host wait);
* after each sampling step, ``record_sampled`` scatters the sampled token ids
  (a device tensor) to the position they will be fed at, on the device.

Tensors (all on the canary's device):

* ``expected_tokens``: int32[rows, ctx] -- row r's own token at each position;
* ``known_lens``: int32[rows] -- positions of the row filled at admission; a
  sampled token lands only at or past it (an unfinished chunked prefill samples
  a token that is thrown away, and the prompt goes on);
* ``next_rows`` / ``next_positions``: int64[max_batch_size] -- written by the
  TAIL of the forward just run: request i's row and the position its sampled
  token will take (-1: none).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch

AdmittedRequest = Tuple[int, str, Callable[[], Tuple[Sequence[int], Sequence[int]]]]
"""(req_to_token row, request id, () -> (prompt ids, output ids so far))."""

STAGING_MIN_TOKENS = 1 << 20  # ints per pinned staging buffer (two of them); at least one full row


class TokenOracle:
    def __init__(self, *, rows: int, ctx: int, max_batch_size: int, device: torch.device, record_sampled_kernel):
        self.expected_tokens = torch.zeros((rows, ctx), dtype=torch.int32, device=device)
        self.known_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.next_rows = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.next_positions = torch.full((max_batch_size,), -1, dtype=torch.int64, device=device)
        self._record_sampled_kernel = record_sampled_kernel
        self._staging = _Staging(max(STAGING_MIN_TOKENS, ctx + 1), device)
        self._row_owner: Dict[int, str] = {}  # row -> rid whose tokens the row holds
        # Compile the sampling scatter now (no JIT after startup): nothing is written, next_positions are -1.
        self.record_sampled(torch.zeros(1, dtype=torch.int64, device=device), 1)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.expected_tokens, self.known_lens, self.next_rows, self.next_positions))

    def reset(self) -> None:
        """Forget every row (after warmup and graph capture)."""
        self.expected_tokens.zero_()
        self.known_lens.zero_()
        self.next_positions.fill_(-1)
        self._row_owner.clear()

    def admit(self, requests: Iterable[AdmittedRequest]) -> int:
        """Copy the scheduler's record of each newly admitted request into its row; returns how many."""
        admitted = 0
        for row, rid, record in requests:
            if self._row_owner.get(row) == rid:
                continue  # a continuation chunk (or a re-admission into the same row): the row holds it
            self._row_owner[row] = rid
            prompt, outputs = record()
            self._staging.copy_row(self.expected_tokens, self.known_lens, row, prompt, outputs)
            admitted += 1
        self._staging.flush()
        return admitted

    def record_sampled(self, sampled: torch.Tensor, batch_size: int) -> None:
        """sampled: int[>= batch_size] device tensor of the tokens just sampled, batch order."""
        self._record_sampled_kernel(self, sampled, batch_size)


class _Staging:
    """Two host staging buffers (pinned on CUDA) used in turn; a buffer is reused once its copies landed."""

    def __init__(self, capacity: int, device: torch.device):
        pin = device.type == "cuda"
        self._bufs = [torch.zeros(capacity + 1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._events: List = [None, None]
        self._is_cuda = pin
        self._cur = 0
        self._used = 0

    def copy_row(self, tokens: torch.Tensor, known_lens: torch.Tensor, row: int,
                 prompt: Sequence[int], outputs: Sequence[int]) -> None:
        n = min(len(prompt) + len(outputs), tokens.shape[1])
        if self._used + n + 1 > self._bufs[self._cur].shape[0]:
            self.flush()
            self._switch()
        buf = self._bufs[self._cur]
        a = self._used
        arr = buf.numpy()
        k = min(len(prompt), n)
        arr[a:a + k] = np.asarray(prompt[:k], dtype=np.int32)
        if n > k:
            arr[a + k:a + n] = np.asarray(outputs[: n - k], dtype=np.int32)
        arr[a + n] = n
        tokens[row, :n].copy_(buf[a:a + n], non_blocking=self._is_cuda)
        known_lens[row:row + 1].copy_(buf[a + n:a + n + 1], non_blocking=self._is_cuda)
        self._used = a + n + 1

    def flush(self) -> None:
        """Mark the copies issued from the current buffer (an event on the current stream)."""
        if self._is_cuda and self._used:
            event = torch.cuda.Event()
            event.record()
            self._events[self._cur] = event

    def _switch(self) -> None:
        self._cur ^= 1
        self._used = 0
        event = self._events[self._cur]
        if event is not None:
            event.synchronize()  # its copies were issued one buffer ago: normally long done
            self._events[self._cur] = None
