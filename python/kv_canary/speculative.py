"""Speculative decoding (EAGLE) on the target model: what a verify forward means for the token oracle.

Plain tensors only; the adapter (``adapter/speculative``) finds them on sglang's objects.

Spec v2 (sglang's EAGLEWorkerV2, topk 1; spec v1 trees: the second half of this module).
A TARGET_VERIFY forward feeds each request ``n = num_draft_tokens`` tokens at
positions ``[c, c + n)``, ``c`` its committed length (sglang's ``seq_lens`` in that
batch): the token at ``c`` is the one sampled last round (the request's own:
``next_token[row]`` in the token oracle), the ``n - 1`` after it are the draft
model's guesses. Its attention reads ``[0, c)`` from earlier forwards (HEAD
verifies them: their chain must equal ``row_chain[row]``) plus the drafts it writes
itself. After the forward sglang keeps ``a`` of them (``accept_lens``, 1 <= a <= n):
positions ``[c, c + a)`` become committed and the scheduler appends ``a`` tokens,
``next_token_ids[i*n : i*n + a]``, at positions ``c + 1 .. c + a`` (the last one, the
*bonus* token, is fed at ``c + a`` by the next verify). The rejected drafts' slots at
``[c + a, c + n)`` stay in the row past the committed length (spec v2 over-allocates)
and are rewritten by the next verify, which starts at ``c + a``, before any forward
reads them.

So the canary:

* TAIL fingerprints all ``n`` slots (sequence index ``c + k``, chained from ``c - 1``);
  the accepted ones are the committed prefix's slots, exactly as written;
* checks the fed token at ``c`` against ``next_token[row]`` and not the drafts (a draft
  is not right or wrong until verification): ``stage_verify_tokens`` stages each draft
  as its own expected token in the oracle's ``staged`` table before the TAIL (the view
  is ``staged``, like an extend forward's), -1 at ``k = 0`` (then ``next_token[row]``)
  and at ``k = n`` (the row's next token is announced as pending, like a decode's);
* TAIL advances ``row_chain[row]`` over all ``n`` fed tokens; after verification
  ``record_accepted`` takes the rejected drafts' terms back out and replaces the
  accepted drafts' terms by those of the tokens the scheduler appended (so an accepted
  slot whose fed token is not the appended one fails the next HEAD), and puts each
  request's bonus token in ``sampled`` (the next HEAD scatters it to ``next_token``).
  A rejected draft leaves nothing behind: ``row_chain`` ends at ``c + a - 1``, HEAD
  reads ``[0, c + a)`` only, and the next TAIL rewrites the slots past it.

Every op is a fixed-shape device op on preallocated buffers (no host sync),
so ``stage_verify_tokens`` is captured with the forward in a CUDA graph;
``record_accepted`` runs eagerly after the verify's sampling, outside any graph: this torch
version is the reference (and the torch kernel backend's); the Triton backend runs the same
bits as one launch (``kernels/accept.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .fingerprint import chain_term
from .token_oracle import UNKNOWN  # no staged token (TAIL uses next_token[row])
from .views import CanaryCapacityError, ForwardView


def verify_table_entries(staged: torch.Tensor, batch_size: int, n: int) -> int:
    """Entries of ``staged`` a verify of ``batch_size`` x ``n`` uses; ``CanaryCapacityError`` beyond the table."""
    if batch_size * (n + 1) > staged.numel():
        raise CanaryCapacityError(
            f"kv-canary: a verify forward of {batch_size} requests x {n} draft tokens needs "
            f"{batch_size * (n + 1)} staged entries; the token oracle holds {staged.numel()}")
    return batch_size * (n + 1)


def _verify_table(staged: torch.Tensor, batch_size: int, n: int) -> torch.Tensor:
    """``staged`` as int64[bs, n + 1]: request i's entries at ``i * (n + 1) + k`` (the write kernel's
    ``new_starts[i] + i + k`` with ``new_starts[i] = i * n``)."""
    return staged[: verify_table_entries(staged, batch_size, n)].view(batch_size, n + 1)


def stage_verify_tokens(staged: torch.Tensor, input_ids: torch.Tensor, batch_size: int, n: int) -> None:
    """Before a TARGET_VERIFY TAIL: each draft is its own expected token; k = 0 and k = n are UNKNOWN.

    staged: the token oracle's int64 table; input_ids: int[>= batch_size * n], request-major
    (the fed token at ``c``, then the ``n - 1`` drafts).
    """
    if batch_size == 0:
        return
    table = _verify_table(staged, batch_size, n)
    table[:, 0].fill_(UNKNOWN)
    table[:, n].fill_(UNKNOWN)
    if n > 1:
        table[:, 1:n].copy_(input_ids[: batch_size * n].view(batch_size, n)[:, 1:])


def record_accepted(*, staged: torch.Tensor, row_chain: torch.Tensor, sampled: torch.Tensor,
                    req_pool_indices: torch.Tensor, committed: torch.Tensor, next_token_ids: torch.Tensor,
                    accept_lens: torch.Tensor, batch_size: int, n: int) -> None:
    """After the verify's sampling: ``row_chain`` ends at ``c + a - 1``, ``sampled`` holds the bonus tokens.

    row_chain: int64[rows], advanced by the TAIL over all n fed tokens (its drafts still in
    ``staged``, ``stage_verify_tokens``); sampled: int64[>= batch_size] (the next HEAD scatters
    it to ``next_token`` for the rows the TAIL announced); req_pool_indices, committed
    (``c``, the verify batch's ``seq_lens``), accept_lens: int[>= batch_size];
    next_token_ids: int[>= batch_size * n], request-major (sglang's ``predict``: entry j is the
    token at ``c + 1 + j``; the scheduler appends the first ``accept_lens[i]``).
    """
    if batch_size == 0:
        return
    bs = batch_size
    if n > 1:
        j = torch.arange(1, n, device=row_chain.device, dtype=torch.int64)[None, :]
        pos = committed[:bs].to(torch.int64)[:, None] + j
        drafts = _verify_table(staged, bs, n)[:, 1:n]
        appended = next_token_ids[: bs * n].view(bs, n)[:, : n - 1].to(torch.int64)
        accepted = j < accept_lens[:bs].to(torch.int64)[:, None]
        delta = torch.where(accepted, chain_term(appended, pos), 0) - chain_term(drafts, pos)
        row_chain.index_add_(0, req_pool_indices[:bs].to(torch.int64), delta.sum(dim=1))
    last = (accept_lens[:bs].to(torch.int64) - 1).clamp(min=0)[:, None]
    sampled[:bs].copy_(next_token_ids[: bs * n].view(bs, n).gather(1, last)[:, 0])


# ---------------------------------------------------------------------------------------------------------------
# Spec v1 (sglang's EAGLEWorker: --speculative-eagle-topk > 1 or --disable-overlap-schedule): a tree of drafts.
#
# The verify forward feeds each request n = num_draft_tokens tree nodes (node 0: the token sampled last round, the
# root; nodes 1..n-1: drafts) at positions c + depth -- several nodes share a depth -- into n fresh slots placed at
# req_to_token[row, c : c + n] (tree order, not sequence order), with a tree mask over [0, c) and each node's
# ancestors. sglang then keeps a path of a nodes (accept_index, root first), frees the other slots and re-lays
# req_to_token[row, c : c + a] to the kept nodes' slots (page size 1 or topk 1), or moves their K/V into the first a
# slots of the row's verify slots (page size > 1 with topk > 1, move_kv_cache), which already sit there.
#
# So the verify forward's own TAIL writes nothing (a tree node is no sequence position until it is kept: the
# adapter's view has new_lens 0, HEAD verifies [0, c)), and the TAIL is deferred to acceptance: one write over
# req_to_token[row, c + k], k < a, with the kept nodes' fed tokens and fed positions (so the position check is
# depth == sequence index), the K/V hashed from the bytes as they are after any move. Its expected tokens: k = 0 the
# request's own next token (next_token[row], UNKNOWN staged), k >= 1 the token the scheduler appended at c + k
# (sglang's accept_tokens: predict at the previous kept node), k = a UNKNOWN (the row's next token is announced
# pending); the bonus (the last appended token, fed at c + a next round) goes to ``sampled``.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptedDrafts:
    """The deferred TAIL of one spec v1 tree verify (``accepted_drafts``); the manager's ``write_accepted_drafts``.

    view: extend-like and ``staged``: request i's a_i kept nodes at ``new_starts[i]`` (int32), ``seq_lens`` c + a
    (int64), ``out_cache_loc`` = req_to_token[row, c + k] (int64). expected: int64[sum(a) + bs], the oracle's staged
    entries (request i's at ``new_starts[i] + i + k``, k in [0, a_i]). bonus: int64[bs]. slots: sum(a) (host).
    """

    view: ForwardView
    expected: torch.Tensor
    bonus: torch.Tensor
    slots: int


def accepted_drafts(*, req_to_token: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor,
                    accept_lens: Sequence[int], kept_nodes: torch.Tensor, fed_tokens: torch.Tensor,
                    fed_positions: torch.Tensor, appended: torch.Tensor) -> AcceptedDrafts:
    """Build the deferred TAIL of a tree verify (eager, after sglang's verify: it allocates; no host sync).

    rows, committed (c, the verify batch's seq_lens before it): int[bs]; accept_lens: host ints a_i >= 1 (kept
    nodes per request, root included, cut after a finishing token); kept_nodes: int[sum(a)] flat node indices into
    the verify's fed tokens (request-major, root first); fed_tokens, fed_positions: int[bs * n] (what the verify
    fed, tree order); appended: int[sum(a)] the tokens the scheduler appended (entry j of request i at c + 1 + j).
    """
    dev = rows.device
    bs = len(accept_lens)
    total = int(sum(accept_lens))
    lens = torch.tensor(list(accept_lens), dtype=torch.int64, device=dev)
    starts = torch.cumsum(lens, 0) - lens
    lane = torch.arange(total, device=dev)
    req_of = torch.repeat_interleave(torch.arange(bs, device=dev), lens, output_size=total)  # no host sync
    k = lane - starts[req_of]
    rows64, c = rows[:bs].to(torch.int64), committed[:bs].to(torch.int64)
    nodes = kept_nodes[:total].to(torch.int64)
    slots = req_to_token[rows64[req_of], c[req_of] + k].to(torch.int64)
    # staged entries: request i at starts[i] + i + k; k = 0 and k = a_i UNKNOWN, k in [1, a_i) the appended token
    # at c + k (lane - 1: entry k - 1 of the request's appended tokens)
    expected = torch.full((total + bs,), UNKNOWN, dtype=torch.int64, device=dev)
    prev = appended[:total].to(torch.int64)[(lane - 1).clamp(min=0)]
    expected.scatter_(0, starts[req_of] + req_of + k, torch.where(k > 0, prev, UNKNOWN))
    view = ForwardView(
        input_ids=fed_tokens.to(torch.int64)[nodes], positions=fed_positions.to(torch.int64)[nodes],
        out_cache_loc=slots, req_pool_indices=rows64, seq_lens=c + lens,
        new_starts=starts.to(torch.int32), new_lens=lens.to(torch.int32), batch_size=bs,
        max_new_len=max(accept_lens) if bs else 0, staged=True,
    )
    bonus = appended[:total].to(torch.int64)[starts + lens - 1] if bs else lens
    return AcceptedDrafts(view=view, expected=expected, bonus=bonus, slots=total)


def stage_accepted_tokens(staged: torch.Tensor, accepted: AcceptedDrafts) -> None:
    """Before the deferred TAIL: its expected tokens into the token oracle's ``staged`` table (one device copy)."""
    n = accepted.expected.numel()
    if n > staged.numel():
        raise CanaryCapacityError(
            f"kv-canary: a tree verify kept {accepted.slots} drafts of {accepted.view.batch_size} requests; the token "
            f"oracle holds {staged.numel()} staged entries")
    staged[:n].copy_(accepted.expected)
