"""Speculative decoding (EAGLE, topk = 1) on the target model: what a verify forward means for the canary.

Plain tensors only; the adapter (``adapter/speculative``) finds them on sglang's objects.

A TARGET_VERIFY forward feeds each request ``n = num_draft_tokens`` tokens at
positions ``[c, c + n)``, ``c`` its committed length (sglang's ``seq_lens`` in that
batch): the token at ``c`` is the one sampled last round (the request's own, in
the token oracle), the ``n - 1`` after it are the draft model's guesses. Its
attention reads ``[0, c)`` from earlier forwards (HEAD verifies them) plus the
drafts it writes itself. After the forward sglang keeps ``a`` of them
(``accept_lens``, 1 <= a <= n): positions ``[c, c + a)`` become committed, the
scheduler appends ``a`` tokens, ``next_token_ids[i*n : i*n + a]``, at positions
``c + 1 .. c + a``; the rejected drafts' slots at ``[c + a, c + n)`` stay in the
row past the committed length (spec v2 over-allocates) and are rewritten by the
next verify, which starts at ``c + a``, before any forward reads them.

So the canary:

* TAIL fingerprints all ``n`` slots (sequence index ``c + k``, chained from ``c - 1``);
  the accepted ones are the committed prefix's slots, exactly as written;
* checks the fed token at ``c`` against the oracle, and not the drafts: before
  the TAIL, ``stage_draft_tokens`` puts each draft into the oracle at its
  position (a draft is not known to be right or wrong until verification);
* after verification, ``record_accepted`` writes the scheduler's accepted tokens
  at ``c + 1 .. c + a``: a committed position's oracle entry is always the token
  the scheduler appended there, never a draft's guess. (A draft left past the
  committed length is never compared: HEAD reads ``[0, c)`` only.)

Every op is a fixed-shape device op (no host sync, no allocation that depends on
data), so ``stage_draft_tokens`` is captured with the forward in a CUDA graph.
"""

from __future__ import annotations

import torch


def stage_draft_tokens(expected_tokens: torch.Tensor, known_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens_after: torch.Tensor, input_ids: torch.Tensor, batch_size: int, n: int) -> None:
    """Oracle entries at ``c + k`` (1 <= k < n) := the draft fed there; k = 0 stays the oracle's.

    ``c = seq_lens_after[i] - n`` (the view's ``seq_lens`` counts the drafts).
    expected_tokens: int32[rows, ctx]; known_lens: int32[rows] (positions filled from the
    scheduler's record at admission: never overwritten); req_pool_indices, seq_lens_after:
    int[>= batch_size]; input_ids: int[>= batch_size * n], request-major.
    """
    if batch_size == 0 or n <= 1:
        return
    _masked_write(expected_tokens, known_lens, req_pool_indices[:batch_size], seq_lens_after[:batch_size], -n,
                  input_ids[: batch_size * n].view(batch_size, n), first=1, count=None)


def record_accepted(expected_tokens: torch.Tensor, known_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                    committed: torch.Tensor, next_token_ids: torch.Tensor, accept_lens: torch.Tensor,
                    batch_size: int, n: int) -> None:
    """Oracle entries at ``committed[i] + 1 + j`` (j < accept_lens[i]) := ``next_token_ids[i*n + j]``.

    What sglang's scheduler appends to the request's output (``accept_lens`` counts the
    bonus token); ``committed`` is the verify batch's ``seq_lens`` (before acceptance).
    """
    if batch_size == 0:
        return
    _masked_write(expected_tokens, known_lens, req_pool_indices[:batch_size], committed[:batch_size], 1,
                  next_token_ids[: batch_size * n].view(batch_size, n), first=0, count=accept_lens[:batch_size])


def _masked_write(table, known_lens, rows, base, shift: int, values, *, first: int, count) -> None:
    """table[rows[i], base[i] + shift + j] = values[i, j] for first <= j (< count[i]), inside the row and
    at or past known_lens; other entries unchanged. Sync-free: a masked-out entry adds 0."""
    bs, n = values.shape
    rows = rows.to(torch.int64)
    j = torch.arange(n, device=values.device, dtype=torch.int64)
    pos = base.to(torch.int64)[:, None] + shift + j[None, :]
    ctx = table.shape[1]
    ok = (j[None, :] >= first) & (pos < ctx) & (pos >= known_lens[rows].to(torch.int64)[:, None])
    if count is not None:
        ok &= j[None, :] < count.to(torch.int64)[:, None]
    rr = rows[:, None].expand(bs, n)
    pc = pos.clamp(0, ctx - 1)
    old = table[rr, pc]
    delta = torch.where(ok, values.to(table.dtype) - old, torch.zeros_like(old))
    table.index_put_((rr, pc), delta, accumulate=True)
