"""The token oracle: what each request must be fed and must read, as the scheduler records it.

Never filled from ``input_ids`` (what a forward *feeds* the model is checked against it).
Its device state is O(request rows + tokens of one forward), at any context length:

* **fed tokens of an EXTEND forward** (TAIL checks them): before the forward, the host
  stages each request's own tokens for exactly the positions the forward feeds, from the
  scheduler's record (``origin_input_ids`` + ``output_ids``), into ``staged`` through a
  pinned buffer and one non-blocking copy. Request i's entries sit at
  ``staged[new_starts[i] + i + k]`` for k in [0, new_len]: k < new_len the token fed at
  ``prefix + k`` (-1 where the host's record does not have it yet: a decode request of a
  mixed batch under the overlap scheduler; TAIL then uses ``next_token[row]``), and one
  more entry, the record's token at ``seq_len`` (-1 if unknown): a known one means the
  chunk is unfinished, so the token sampled after it is thrown away and must not count.
* **fed tokens of a DECODE forward**: ``next_token[row]``, written on the device from the
  sampled ids. The ``ModelRunner.sample`` hook only copies them into ``sampled`` (one
  ``copy_``); the next forward's HEAD (captured with it) scatters ``sampled[i]`` to
  ``next_token[next_rows[i]]`` for the ``pending`` entries the previous TAIL announced
  (TAIL stores ``next_rows[i]`` = row, or -1 for a thrown-away sample / padding, and
  resets ``sampled[i]`` to -1 so a forward that sampled nothing scatters nothing).
* **tokens of the slots a forward reads** (HEAD): ``row_chain[row]`` is the CHAIN
  (``fingerprint``: an additive hash over the prefix) of the request's own tokens over the
  positions its row holds. The host sets it when a request is admitted (its cached prefix,
  ``fingerprint.prefix_chains_np``); each TAIL advances it over the tokens it wrote. HEAD
  compares the last read slot's recorded chain with it: with the local link checks, equal
  chains mean every read token is the request's own (a radix match to another prompt's
  slots fails here). A mismatch is reported once (``token`` at the last read position,
  stored/expected = the two chains); TAIL then continues from the recorded chain.

Admission (``stage``): a request is new in its row when the adapter's admission key
(rid, retraction count, Req identity) differs from the row's; a continuation chunk, or a
decode request inside a mixed batch, keeps the device-maintained chain.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Callable, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .fingerprint import CHAIN_ANCHOR, prefix_chains_np
from .staging import PinnedStaging
from .views import CanaryCapacityError

Record = Callable[[], Tuple[Sequence[int], Sequence[int]]]
FedRequest = Tuple[int, Hashable, int, int, Record]
"""(req_to_token row, admission key, prefix length, new tokens, () -> (prompt ids, output ids so far))."""

UNKNOWN = -1  # a staged token the host's record does not have (yet)
CHAIN_CACHE_TOKENS = 1 << 20  # tokens of recent admission prefixes whose chains are remembered (host memory)
CHAIN_CACHE_ENTRIES = 128  # and at most this many prefixes
# an admission feeding fewer tokens is not remembered after its extend: remembered, they would save the next turn's
# admission < ~1 us of hashing (~30 ns a token), less than the entry's bookkeeping
FED_REMEMBER_MIN_TOKENS = 32


class TokenOracle:
    def __init__(self, *, rows: int, max_batch_size: int, max_tokens_per_forward: int, device: torch.device,
                 verify_reads: bool = True, check_fed: bool = True):
        self.rows = rows
        self.max_batch_size = max_batch_size
        self.max_tokens_per_forward = max_tokens_per_forward
        self.verify_reads = verify_reads  # HEAD compares the read prefix's chain with row_chain
        self.check_fed = check_fed  # TAIL reports fed tokens that are not the request's own
        i64 = dict(dtype=torch.int64, device=device)
        self.row_chain = torch.zeros(rows, **i64)
        self.next_token = torch.zeros(rows + 1, **i64)  # + a dummy row for masked scatters
        # extend forwards: expected tokens (max tokens + one entry per request), then row initialisations
        # (rows, chains[, next tokens]) of admitted / arrived requests
        self._admit_at = max_tokens_per_forward + max_batch_size
        self.staged = torch.full((self._admit_at + 3 * max_batch_size,), UNKNOWN, **i64)
        self.next_rows = torch.full((max_batch_size,), -1, **i64)
        self.sampled = torch.full((max_batch_size,), -1, **i64)
        self.pending = torch.zeros(1, **i64)
        # host buffers of the fed tokens (a TAIL's: three, so one is never handed out while the device may still
        # be behind its copy) and of admissions / row initialisations
        self._fed_staging = PinnedStaging((self._admit_at,), torch.int64, device, count=3)
        self._admit_staging = PinnedStaging((3 * max_batch_size,), torch.int64, device)
        # ``stage_admissions``'s: (rows, each request's record and cached prefix length, remember each, the chains
        # list it fills); the prefixes are sliced there, off the extend's launch where the admissions are left
        self._admit_pending: Optional[Tuple[List[int], List[Tuple[Record, int]], List[bool], List[int]]] = None
        self._fed_requests: Optional[Tuple[Sequence[FedRequest], List[int], List[int]]] = None  # ``stage_fed``'s
        self._row_owner: Dict[int, Hashable] = {}
        self._row_inits: List[Tuple[int, int, int]] = []  # (row, chain, next token) to apply before the next forward
        self._sampled_views: Dict[int, torch.Tensor] = {}
        # recent admission prefixes by length, then by last token: len -> last token -> [(tokens, chain)] (a lookup
        # finds the candidates of one length in one step), and all of them oldest first
        self._chain_cache: Dict[int, Dict[int, List[Tuple[List[int], int]]]] = {}
        self._chain_order: "Deque[Tuple[List[int], int]]" = deque()
        self._cached_tokens = 0
        # extends whose fed tokens' chain ``remember_fed`` computes after the forward's launch: (row, admission key,
        # record, prefix, fed tokens int64[n] (a copy of the staged ones), the chain over positions [0, prefix))
        self._fed_pending: List[Tuple[int, Hashable, Record, int, np.ndarray, int]] = []
        # row -> (admission key, positions, chain over them) of its request's last remembered extend: the base of
        # its next chunk (a chunked prefill's prompt is remembered whole)
        self._row_fed: Dict[int, Tuple[Hashable, int, int]] = {}

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.row_chain, self.next_token, self.staged, self.next_rows, self.sampled, self.pending))

    def reset(self) -> None:
        """Forget every row (after warmup and graph capture)."""
        self.row_chain.zero_()
        self.next_token.zero_()
        self.staged.fill_(UNKNOWN)
        self.next_rows.fill_(-1)
        self.sampled.fill_(-1)
        self.pending.zero_()
        self._row_owner.clear()
        self._row_inits.clear()
        self._chain_cache.clear()
        self._chain_order.clear()
        self._cached_tokens = 0
        self._fed_pending.clear()
        self._fed_requests = None
        self._admit_pending = None
        self._row_fed.clear()

    # ------------------------------------------------------------------ host side, before a forward

    def stage(self, requests: Sequence[FedRequest], *, fed_later: bool = False, admit_later: bool = False) -> int:
        """Extend forward: admit the new requests (their cached prefixes' chains, which HEAD's verify reads) and
        stage the expected tokens of every request (batch order; TAIL's write reads them); returns how many were
        admitted. ``fed_later``: leave the fed tokens to ``stage_fed``, called by the forward's TAIL on the host
        (an eager forward's: its launch is then past the model's layers, and what the host does there overlaps
        them instead of delaying the forward's start; ~80-100 us of the row workload's extend on one H200 host,
        docs/history/hicache.md 7.19). ``admit_later`` (with ``fed_later``): the admitted prefixes' chains too
        (``stage_admissions``, which ``stage_fed`` runs first): for a forward whose verify runs with its TAIL (the
        model's last stage). Looking up and hashing 64 admitted 4k-token prefixes held an H200's extend launch ~5
        ms (docs/results/gpu-h200-2026-12-01b-idle-control).

        Also applies row initialisations queued by ``init_row`` (any forward: call with ``[]``).
        """
        if self._row_inits:
            self._apply_row_inits()
        self._fed_requests = None
        self.stage_admissions()  # a forward that left its admissions (never dropped: the rows' owners are set)
        if not requests:
            return 0
        total = sum(n + 1 for _, _, _, n, _ in requests)
        if total - len(requests) > self.max_tokens_per_forward or len(requests) > self.max_batch_size:
            raise CanaryCapacityError(
                f"kv-canary: an extend forward feeds {total - len(requests)} tokens to {len(requests)} requests; the "
                f"token oracle holds {self.max_tokens_per_forward} tokens / {self.max_batch_size} requests per forward "
                "(sized at startup from --max-prefill-tokens, the context length and --max-running-requests)"
            )
        if self._fed_pending:  # the last forward's post-ops did not run
            self.remember_fed()
        admit_rows: List[int] = []
        admit_prefixes: List[Tuple[Record, int]] = []
        admit_kept: List[bool] = []  # remember the admission's prefix (no longer fed prompt of it will be)
        admissions: List[int] = []  # per request: its admission's index, -1 (admitted uncached), -2 (continued)
        for row, key, prefix, n, record in requests:
            admitted = self._row_owner.get(row) != key
            if not admitted:
                admissions.append(-2)
                continue
            self._row_owner[row] = key  # a new request in this row: its cached prefix's chain
            if prefix <= 0:
                admissions.append(-1)
                continue
            prompt, outputs = record()
            # its fed prompt is remembered after the forward if every fed token is known (an admission's chain is)
            rememberable = len(prompt) + len(outputs) - prefix >= n >= FED_REMEMBER_MIN_TOKENS
            admissions.append(len(admit_rows))
            admit_rows.append(row)
            admit_prefixes.append((record, prefix))  # sliced by ``stage_admissions`` (a 4k-token prefix: ~10 us)
            admit_kept.append(not rememberable)
        chains: List[int] = []
        self._fed_requests = (requests, admissions, chains)  # ``chains`` is filled by ``stage_admissions``
        if admit_rows:
            self._admit_pending = (admit_rows, admit_prefixes, admit_kept, chains)
        if not (fed_later and admit_later):
            self.stage_admissions()
        if not fed_later:
            self.stage_fed()
        return len(admit_rows)

    def stage_admissions(self) -> None:
        """The chains over the admitted requests' cached prefixes that ``stage`` left (nothing if none): one
        non-blocking copy and one scatter into ``row_chain`` on the current stream, ahead of the verify that reads
        them."""
        pending, self._admit_pending = self._admit_pending, None
        if pending is None:
            return
        rows, records, kept, chains = pending
        a = len(rows)
        buf, arr = self._admit_staging.take()
        # the scheduler's records are as ``stage`` read them: the forward that admits them has not sampled yet
        chains.extend(self._prefix_chains([_slice(*record(), 0, prefix) for record, prefix in records], kept))
        arr[:a] = rows
        arr[a:2 * a] = chains
        dev = self.staged[self._admit_at:self._admit_at + 2 * a]
        dev.copy_(buf[:2 * a], non_blocking=self._admit_staging.is_cuda)
        self.row_chain.index_copy_(0, dev[:a], dev[a:])
        self._admit_staging.done()

    @property
    def fed_unstaged(self) -> bool:
        """``stage(fed_later=True)`` left fed tokens (and maybe admissions) that ``stage_fed`` has not staged yet."""
        return self._fed_requests is not None

    def forget_fed(self) -> None:
        """Drop the fed tokens ``stage`` left (their forward's TAIL did not run on the host); its admissions are
        staged, not dropped (their rows' new owners are recorded: a later forward verifies against their chains)."""
        self._fed_requests = None
        self.stage_admissions()

    def stage_fed(self) -> None:
        """The fed tokens ``stage`` left (nothing if none): one non-blocking copy on the current stream, which the
        TAIL's write then reads. A fed prompt whose chain before it is known (an admission's, or a remembered
        chunk's) is queued for ``remember_fed``."""
        if self._fed_requests is None:
            return
        self.stage_admissions()  # the chains the fed prompts extend
        pending, self._fed_requests = self._fed_requests, None
        requests, admissions, chains = pending
        buf, arr = self._fed_staging.take()
        at = 0
        fed: List[Tuple[int, Hashable, Record, int, np.ndarray, int]] = []
        for (row, key, prefix, n, record), admission in zip(requests, admissions):
            prompt, outputs = record()
            known = _fill(arr, at, prompt, outputs, prefix, n + 1)
            if known >= n >= FED_REMEMBER_MIN_TOKENS:
                if admission != -2:  # admitted: the anchor, or its admission's chain
                    fed.append((row, key, record, prefix, arr[at:at + n].copy(),
                                chains[admission] if admission >= 0 else CHAIN_ANCHOR))
                else:  # a continuation chunk after a remembered one
                    last = self._row_fed.get(row)
                    if last is not None and last[0] == key and last[1] == prefix:
                        fed.append((row, key, record, prefix, arr[at:at + n].copy(), last[2]))
            at += n + 1
        self.staged[:at].copy_(buf[:at], non_blocking=self._fed_staging.is_cuda)
        self._fed_staging.done()
        self._fed_pending.extend(fed)

    def remember_fed(self) -> None:
        """After an extend's launch (outside post-ops): remember the chain over each newly admitted request's cached
        prefix and fed tokens, [0, prefix + fed), computed from the staged tokens (no list conversion); a chunked
        prefill's next chunk extends it, so its whole prompt is remembered. A multi-turn
        request's next turn has this turn's prompt as its cached prefix: its admission then finds it remembered
        instead of converting and hashing it before that forward (``_prefix_chains``); here the host work runs
        while the device computes the forward that was just launched."""
        pending, self._fed_pending = self._fed_pending, []
        if not pending:
            return
        chains = prefix_chains_np([p[4] for p in pending], starts=[p[3] for p in pending],
                                  bases=[p[5] for p in pending])
        for (row, key, record, prefix, fed, _), chain in zip(pending, chains):
            self._row_fed[row] = (key, prefix + len(fed), chain)
            prompt, outputs = record()
            tokens = _slice(prompt, outputs, 0, prefix + len(fed))
            tokens = tokens if isinstance(tokens, list) else list(tokens)
            n = len(tokens)
            known = n in self._chain_cache and self._longest_remembered(tokens, (n,))[0] == n
            if not known:  # a batch may feed one prompt twice
                self._remember_chain(tokens, chain)

    def _prefix_chains(self, prefixes: Sequence[Sequence[int]], kept: Sequence[bool]) -> List[int]:
        """``prefix_chains_np``, extending remembered prefixes: a multi-turn request's cached prefix is the previous
        turn's admitted prefix plus that turn's tokens, and requests share a system prompt. The chain is additive, so
        the longest remembered prefix of each (exact: compared token by token, one C-level list comparison, ~3 ns a
        token) gives the chain over its positions and only the tokens after it are converted to numpy and hashed
        (~20 ns a token: the cost of a miss). Prefixes equal within the batch are hashed once. A prefix is remembered
        if ``kept`` (its request's fed prompt, which extends it, will not be: ``remember_fed``) or the batch admits
        it more than once (a shared system prompt); else its longer fed prompt serves its next turn."""
        chains: List[Optional[int]] = [None] * len(prefixes)
        todo: List[Tuple[List[int], int, int, List[int]]] = []  # (tokens, remembered length, its chain, indices)
        lengths = sorted(self._chain_cache, reverse=True)
        for i, p in enumerate(prefixes):
            tokens = p if isinstance(p, list) else list(p)
            n, base = self._longest_remembered(tokens, lengths)
            if n == len(tokens):
                chains[i] = base
                continue
            same = next((where for t, _, _, where in todo  # lists compare lengths first; prefixes of one length
                         if t[-1] == tokens[-1] and t == tokens), None)  # share a system prompt: the last token first
            if same is None:
                todo.append((tokens, n, base, [i]))
            else:
                same.append(i)
        if todo:
            rests = prefix_chains_np([t[n:] for t, n, _, _ in todo], starts=[n for _, n, _, _ in todo],
                                     bases=[b for _, _, b, _ in todo])
            for (tokens, _, _, where), chain in zip(todo, rests):
                for i in where:
                    chains[i] = chain
                if len(where) > 1 or kept[where[0]]:
                    self._remember_chain(tokens, chain)
        return chains

    def _longest_remembered(self, tokens: List[int], lengths: Sequence[int]) -> Tuple[int, int]:
        """(n, chain over tokens[:n]) of the longest remembered prefix of ``tokens`` ((0, CHAIN_ANCHOR): none).
        ``lengths``: the remembered lengths, longest first. The candidates of a length are those ending in the same
        token; the first and middle tokens skip most look-alikes before the exact comparison."""
        size = len(tokens)
        for n in lengths:
            if n > size:
                continue
            candidates = self._chain_cache[n].get(tokens[n - 1])
            if not candidates:
                continue
            first, mid = tokens[0], tokens[n // 2]
            for t, chain in candidates:
                if t[0] == first and t[n // 2] == mid and (t == tokens if n == size else t == tokens[:n]):
                    return n, chain
        return 0, CHAIN_ANCHOR

    def _remember_chain(self, tokens: List[int], chain: int) -> None:
        """Keep ``tokens``' chain (the oldest go past ``CHAIN_CACHE_TOKENS`` tokens or ``CHAIN_CACHE_ENTRIES``)."""
        entry = (tokens, chain)
        self._chain_cache.setdefault(len(tokens), {}).setdefault(tokens[-1], []).append(entry)
        self._chain_order.append(entry)
        self._cached_tokens += len(tokens)
        while len(self._chain_order) > 1 and (self._cached_tokens > CHAIN_CACHE_TOKENS
                                              or len(self._chain_order) > CHAIN_CACHE_ENTRIES):
            old, _ = self._chain_order.popleft()
            n = len(old)
            by_last = self._chain_cache[n]
            same = by_last[old[-1]]
            same.pop(0)  # remembered in order, forgotten in order: the oldest of its list
            if not same:
                del by_last[old[-1]]
                if not by_last:
                    del self._chain_cache[n]
            self._cached_tokens -= n

    def init_row(self, row: int, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        """A request whose KV no forward of this server wrote (PD decode side: arrived by transfer, or reloaded).

        Its row holds positions [0, len(prompt) + len(outputs) - 1); the next forward feeds the last output
        id. Applied on the device right before the next forward (on its stream, after the pending samples).
        """
        own = list(prompt) + list(outputs)
        held = max(0, len(own) - 1)
        chain = prefix_chains_np([own[:held]])[0]
        self._row_owner.pop(row, None)  # a later extend of this row is a new admission
        self._row_inits.append((row, chain, int(own[held]) if own else 0))

    def _apply_row_inits(self) -> None:
        inits = list({r: (r, c, t) for r, c, t in self._row_inits}.values())  # the latest per row: indices unique
        self._row_inits = []
        self.flush_pending()  # a pending sample of the row's previous owner must not land after this
        for k in range(0, len(inits), self.max_batch_size):
            part = inits[k:k + self.max_batch_size]
            a = len(part)
            buf, arr = self._admit_staging.take()
            arr[:a] = [r for r, _, _ in part]
            arr[a:2 * a] = [c for _, c, _ in part]
            arr[2 * a:3 * a] = [t for _, _, t in part]
            dev = self.staged[self._admit_at:self._admit_at + 3 * a]
            dev.copy_(buf[:3 * a], non_blocking=self._admit_staging.is_cuda)
            self.row_chain.index_copy_(0, dev[:a], dev[a:2 * a])
            self.next_token.index_copy_(0, dev[:a], dev[2 * a:])
            self._admit_staging.done()

    def flush_pending(self) -> None:
        """Scatter the pending sampled ids now (what the next HEAD would do); device ops, no host sync."""
        idx = torch.arange(self.max_batch_size, device=self.pending.device)
        ok = (idx < self.pending) & (self.next_rows >= 0) & (self.sampled >= 0)
        rows = torch.where(ok, self.next_rows, torch.full_like(self.next_rows, self.rows))  # dummy row
        self.next_token.index_copy_(0, rows, torch.where(ok, self.sampled, torch.zeros_like(self.sampled)))
        self.pending.zero_()

    # ------------------------------------------------------------------ after sampling

    def record_sampled(self, sampled: torch.Tensor) -> None:
        """sampled: int[n] device tensor of the tokens just sampled, batch order: one copy (the next HEAD scatters)."""
        n = int(sampled.shape[0])
        view = self._sampled_views.get(n)
        if view is None:
            if n > self.max_batch_size:
                raise CanaryCapacityError(
                    f"kv-canary: {n} sampled tokens, the token oracle holds {self.max_batch_size} per forward")
            view = self._sampled_views[n] = self.sampled[:n]
        view.copy_(sampled)


def _slice(prompt: Sequence[int], outputs: Sequence[int], a: int, b: int) -> Sequence[int]:
    """Tokens [a, b) of prompt + outputs (b <= len(prompt) + len(outputs))."""
    p = len(prompt)
    if b <= p:
        return prompt[a:b]
    if a >= p:
        return outputs[a - p:b - p]
    return list(prompt[a:]) + list(outputs[:b - p])


def _fill(arr: np.ndarray, at: int, prompt: Sequence[int], outputs: Sequence[int], start: int, count: int) -> int:
    """arr[at:at + count] (int64, C-contiguous) = tokens [start, start + count) of prompt + outputs, UNKNOWN past
    their end; returns how many are known. A list of Python ints (the scheduler's record) is packed straight into
    the buffer (``struct.pack_into``: ~4x faster than numpy's conversion of a list, ~13 us for 1,088 tokens; a fresh
    prompt's tokens are staged on the host before its prefill is launched)."""
    known = max(0, min(count, len(prompt) + len(outputs) - start))
    if known:
        tokens = _slice(prompt, outputs, start, start + known)
        if isinstance(tokens, (list, tuple)):
            struct.pack_into(f"{known}q", arr.data, at * 8, *tokens)
        else:
            arr[at:at + known] = np.asarray(tokens, dtype=np.int64)
    if known < count:
        arr[at + known:at + count] = UNKNOWN
    return known
