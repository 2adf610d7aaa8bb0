"""Speculative verifies' bookkeeping: spec v1's deferred TAIL, and EAGLE spec v2's accepted drafts.

Speculative tree verifies (spec v1) defer their TAIL: the verify forward's TAIL writes nothing (tree nodes are no
sequence positions yet), and once the engine kept a path of drafts ``write_accepted_drafts`` runs that TAIL over the
kept slots (eager; counted by the health check as write launches and slots, not as a forward). ``record_accepted``
(spec v2) hands the accepted drafts to the token oracle after a verify's sampling.

``DeferredWrites`` is a mixin of ``CanaryManager`` (runner/manager.py); it uses the manager's ``kernels``,
``groups``, ``token_oracle``, ``single_forward_managers[0]`` and the health check's expected counts (reporting.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..speculative import AcceptedDraftBuffers
from .brackets import CanaryBracketError


class DeferredWrites:
    """Mixin of ``CanaryManager``: the deferred TAIL of spec v1's tree verifies, and spec v2's ``record_accepted``."""

    def _init_deferred_writes(self) -> None:
        """No buffers until ``enable_deferred_writes``."""
        self._accepted: Optional[AcceptedDraftBuffers] = None  # spec v1's deferred TAIL (enable_deferred_writes)
        # where its expected tokens are staged: int64[n], the token oracle's ``staged`` table if there is one,
        # else a scratch of max_batch_size * (max_kept_per_request + 1)
        self._accepted_staged: Optional[torch.Tensor] = None

    def _reset_deferred_writes(self) -> None:
        """What restarts with the zeroed device counters when init finishes."""
        self._deferred_write_launches = 0  # write launches of deferred TAILs (write_accepted_drafts)
        self._deferred_uncopied = False  # deferred TAILs ran since the last counter copy

    def enable_deferred_writes(self, max_kept_per_request: int) -> None:
        """Spec v1 (speculative tree verifies): preallocate the deferred TAIL's buffers, at install (before
        ``precompile``, which then also compiles its launches).

        max_kept_per_request: kept tree nodes a request can have per verify (--speculative-num-steps + 1).
        """
        bs, kept = self.capacities.max_batch_size, max(1, max_kept_per_request)
        self._accepted = AcceptedDraftBuffers.allocate(bs, kept, self.counters.device)
        # where the expected tokens go: the token oracle's staged table (read by the write), else a scratch table
        self._accepted_staged = (self.token_oracle.staged if self.token_oracle is not None
                                 else torch.zeros(bs * (kept + 1), dtype=torch.int64, device=self.counters.device))

    def write_accepted_drafts(self, *, rows: torch.Tensor, committed: torch.Tensor, accept_lens: Sequence[int],
                              kept_nodes: torch.Tensor, fed_tokens: torch.Tensor, fed_positions: torch.Tensor,
                              appended: torch.Tensor) -> None:
        """The deferred TAIL of a speculative tree verify (spec v1), once the engine kept its drafts.

        The verify forward's own TAIL wrote nothing (tree nodes are no sequence positions yet); this is its
        write: eager, outside any graph, on the forward's stream, after the engine moved the kept K/V into place.
        One launch lays out the kept slots and stages what each must hold in the token oracle
        (``speculative.build_accepted_drafts``) -> one write launch per group over them (position = depth
        checked, token checked, records chained) -> each request's bonus token pending. No host sync, no new
        forward: the health check expects these write launches and slots on top of the forwards'.

        rows, committed (the verify batch's seq_lens before it): int[bs]; accept_lens: host ints (kept nodes per
        request, root included); kept_nodes, fed_tokens, fed_positions, appended: see ``build_accepted_drafts``.
        """
        bs = len(accept_lens)
        if not self.init_finished or self._capturing or bs == 0:
            return
        out = self._accepted
        if out is None:
            raise CanaryBracketError("kv-canary: a speculative tree verify (spec v1) ran, but the canary was installed "
                                     "without its deferred TAIL (enable_deferred_writes): this path is not wired")
        kept = int(sum(accept_lens))
        out.check(batch_size=bs, kept=kept, staged=self._accepted_staged)
        n = int(fed_tokens.shape[0]) // bs
        self.kernels.accepted_drafts(
            out=out, staged=self._accepted_staged,
            req_to_token=self._req_to_token, rows=rows, committed=committed, kept_nodes=kept_nodes, kept=kept,
            batch_size=bs, n=n, fed_tokens=fed_tokens, fed_positions=fed_positions, appended=appended)
        view = out.view(rows=rows, batch_size=bs, kept=kept, max_new_len=max(accept_lens))
        self.single_forward_managers[0].deferred_post_ops(view)
        if self.token_oracle is not None:
            self.token_oracle.sampled[:bs].copy_(out.bonus[:bs])
        self._expected_written += kept * len(self.groups)
        self._deferred_write_launches += len(self.groups)
        self._deferred_uncopied = True  # the next forward's counter copy covers it (or the idle drain's)

    def record_accepted(self, *, req_pool_indices: torch.Tensor, committed: torch.Tensor,
                        next_token_ids: torch.Tensor, accept_lens: torch.Tensor, batch_size: int, n: int) -> None:
        """EAGLE (spec v2), after a verify's sampling: the accepted drafts join the token oracle
        (``speculative.record_accepted``; one launch on the Triton backend), outside any graph, no host sync."""
        o = self.token_oracle
        if o is not None:
            self.kernels.record_accepted(staged=o.staged, row_chain=o.row_chain, sampled=o.sampled,
                                         req_pool_indices=req_pool_indices, committed=committed,
                                         next_token_ids=next_token_ids, accept_lens=accept_lens,
                                         batch_size=batch_size, n=n)

    def _copy_deferred(self) -> None:
        """Idle drain after deferred TAILs (``write_accepted_drafts``) no forward's counter copy covers: one more
        copy at the same forward index. The copies in flight are read first, so none is dropped (each copy is
        matched to its expected-counts entry in order)."""
        for step, host_counters in self._d2h.drain():
            self._check_health(step, host_counters)
            self._handle_counters(host_counters, catch_up=True)
        self._expected_written_at.append((self.forwards, self._expected_written, self._deferred_write_launches))
        self._deferred_uncopied = False
        self._d2h.snapshot(self.forwards, force=True)
