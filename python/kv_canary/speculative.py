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
# adapter's view has new_lens 0, HEAD verifies [0, c) and forgets the n fresh slots' earlier records, since the forward
# stores into all of them: ForwardView.unrecorded_stores), and the TAIL is deferred to acceptance: one write over
# req_to_token[row, c + k], k < a, with the kept nodes' fed tokens and fed positions (so the position check is
# depth == sequence index), the K/V hashed from the bytes as they are after any move. Its expected tokens: k = 0 the
# request's own next token (next_token[row], UNKNOWN staged), k >= 1 the token the scheduler appended at c + k
# (sglang's accept_tokens: predict at the previous kept node), k = a UNKNOWN (the row's next token is announced
# pending); the bonus (the last appended token, fed at c + a next round) goes to ``sampled``.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptedDraftBuffers:
    """Preallocated outputs of ``build_accepted_drafts`` (the deferred TAIL's view), sized at install.

    ids, positions, out_cache_loc: int64[max_batch_size * max_kept] (the kept nodes, request-major); seq_lens:
    int64[max_batch_size] (c + a); new_starts, new_lens: int32[max_batch_size]; bonus: int64[max_batch_size]
    (each request's last appended token).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    new_starts: torch.Tensor
    new_lens: torch.Tensor
    bonus: torch.Tensor

    @classmethod
    def allocate(cls, max_batch_size: int, max_kept: int, device: torch.device) -> "AcceptedDraftBuffers":
        tokens, bs = max_batch_size * max_kept, max_batch_size

        def z(n, dt):
            return torch.zeros(n, dtype=dt, device=device)

        return cls(ids=z(tokens, torch.int64), positions=z(tokens, torch.int64), out_cache_loc=z(tokens, torch.int64),
                   seq_lens=z(bs, torch.int64), new_starts=z(bs, torch.int32), new_lens=z(bs, torch.int32),
                   bonus=z(bs, torch.int64))

    @property
    def max_batch_size(self) -> int:
        return int(self.seq_lens.numel())

    def check(self, *, batch_size: int, kept: int, staged: torch.Tensor) -> None:
        """``CanaryCapacityError`` when a verify kept more than the buffers (or the oracle's staged table) hold."""
        if batch_size > self.max_batch_size or kept > self.ids.numel() or kept + batch_size > staged.numel():
            raise CanaryCapacityError(
                f"kv-canary: a tree verify kept {kept} drafts of {batch_size} requests; the deferred TAIL holds "
                f"{self.ids.numel()} drafts of {self.max_batch_size} requests and the token oracle "
                f"{staged.numel()} staged entries (sized at install from --max-running-requests and "
                "--speculative-num-steps)")

    def view(self, *, rows: torch.Tensor, batch_size: int, kept: int, max_new_len: int) -> ForwardView:
        """The deferred TAIL's view over what ``build_accepted_drafts`` wrote (extend-like, ``staged``)."""
        bs = batch_size
        return ForwardView(
            input_ids=self.ids[:kept], positions=self.positions[:kept], out_cache_loc=self.out_cache_loc[:kept],
            req_pool_indices=rows[:bs].to(torch.int64), seq_lens=self.seq_lens[:bs], new_starts=self.new_starts[:bs],
            new_lens=self.new_lens[:bs], batch_size=bs, max_new_len=max_new_len, staged=True)


def build_accepted_drafts(*, out: AcceptedDraftBuffers, staged: torch.Tensor, req_to_token: torch.Tensor,
                          rows: torch.Tensor, committed: torch.Tensor, kept_nodes: torch.Tensor, kept: int,
                          batch_size: int, n: int, fed_tokens: torch.Tensor, fed_positions: torch.Tensor,
                          appended: torch.Tensor) -> None:
    """The deferred TAIL's inputs of a tree verify, into ``out`` and the token oracle's ``staged`` table.

    Torch reference (and the torch backend's); the Triton backend runs the same bits as one launch
    (``kernels/accept.py``). No host sync, no allocation that depends on data.

    rows, committed (c, the verify batch's seq_lens before it): int[bs]; kept_nodes: int[>= kept], the kept tree
    nodes as flat indices into the verify's ``bs * n`` fed tokens (request-major, root first; request i's in
    ``[i * n, (i + 1) * n)``, so a_i = how many fall there and the request's kept nodes start at the count below
    ``i * n``); fed_tokens, fed_positions: int[bs * n]; appended: int[>= kept] the tokens the scheduler appended
    (entry j of request i at c + 1 + j). Writes, for lane ``l = start_i + k`` (k < a_i): ids/positions = the kept
    node's fed token/position, out_cache_loc = ``req_to_token[row_i, c_i + k]``; seq_lens c + a, new_starts,
    new_lens a, bonus = the request's last appended token (-1 when it kept nothing); staged entry
    ``start_i + i + k`` (k <= a_i) = the appended token at c + k for 1 <= k < a_i, else UNKNOWN.
    """
    bs = batch_size
    if bs == 0:
        return
    dev = rows.device
    nodes = kept_nodes[:kept].to(torch.int64)
    lo = torch.arange(bs, device=dev, dtype=torch.int64) * n
    lens = ((nodes[None, :] >= lo[:, None]) & (nodes[None, :] < lo[:, None] + n)).sum(dim=1)
    starts = (nodes[None, :] < lo[:, None]).sum(dim=1)
    lane = torch.arange(kept, device=dev, dtype=torch.int64)
    req_of = (lane[None, :] >= starts[:, None]).sum(dim=0) - 1 if kept else lane  # the request owning each lane
    k = lane - starts[req_of]
    rows64, c = rows[:bs].to(torch.int64), committed[:bs].to(torch.int64)
    app = appended[:kept].to(torch.int64)
    out.ids[:kept] = fed_tokens.to(torch.int64)[nodes]
    out.positions[:kept] = fed_positions.to(torch.int64)[nodes]
    out.out_cache_loc[:kept] = req_to_token[rows64[req_of], c[req_of] + k].to(torch.int64)
    out.seq_lens[:bs] = c + lens
    out.new_starts[:bs] = starts.to(torch.int32)
    out.new_lens[:bs] = lens.to(torch.int32)
    last = (starts + lens - 1).clamp(min=0)
    out.bonus[:bs] = torch.where(lens > 0, app[last] if kept else lens, UNKNOWN)
    # staged: request i's entries at start_i + i + k; k in [1, a_i) the appended token at c + k, else UNKNOWN
    staged[: kept + bs].fill_(UNKNOWN)
    prev = app[(lane - 1).clamp(min=0)]
    staged.scatter_(0, starts[req_of] + req_of + k, torch.where(k > 0, prev, UNKNOWN))
