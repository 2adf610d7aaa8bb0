"""PD disaggregation, decode side: requests whose KV arrived by transfer (or by sglang's fake transfer).

The canary records travel with the KV; ``TransferBook`` (kv_canary.transfer) remembers what arrived so reports name
the bootstrap room and prefill slot. ``Arrivals`` is a mixin of ``CanaryManager`` (runner/manager.py); it uses the
manager's ``note_request_tokens`` (token oracle admission), ``kernels``, ``groups``, ``ring`` and ``perturb``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..transfer import Arrival, TransferBook
from ..views import ForwardView


class Arrivals:
    """Mixin of ``CanaryManager``: the transfer book, and the arrivals the transfer perturbation still draws for."""

    def _init_arrivals(self) -> None:
        """No book until ``attach_transfer`` (PD only)."""
        self.transfer: Optional[TransferBook] = None  # PD disaggregation (attach_transfer)

    def _reset_arrivals(self) -> None:
        """What restarts when init finishes."""
        self._arrivals: List[Arrival] = []  # PD arrivals the transfer perturbation has not drawn for yet
        if self.transfer is not None:
            self.transfer.reset()

    def attach_transfer(self, book: TransferBook) -> None:
        """PD disaggregation: the records travel with the KV; ``book`` remembers what arrived."""
        self.transfer = book

    def note_transfer_arrival(self, arrival: Arrival, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """PD decode side: ``arrival.received`` positions of a request arrived by transfer, before its first read."""
        self.note_request_tokens(arrival.row, arrival.rid, prompt_ids, output_ids)
        if self.transfer is not None:
            self.transfer.note_arrival(arrival)
        if self.config.perturb_transfer_prob > 0:
            self._arrivals.append(arrival)

    def note_fake_arrival(self, row: int, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """PD decode side: a *fake* transfer (sglang's warmup / health check) filled the KV positions with nothing.

        There is nothing to verify there; the TAIL kernel fingerprints the slots as
        they are (eager, outside any graph, counting into a scratch tensor so the
        health check is untouched), so later reads do not false-alarm and the decode
        TAIL chains onto them.
        """
        self.note_request_tokens(row, rid, prompt_ids, output_ids)
        tokens = (list(prompt_ids) + list(output_ids))[: len(prompt_ids) + max(0, len(output_ids) - 1)]
        if tokens:
            dev = self.counters.device
            self._write_fake_arrival(torch.tensor(tokens, dtype=torch.int64, device=dev), row,
                                     self._req_to_token[row, : len(tokens)].to(torch.int64))
        if self.transfer is not None:
            self.transfer.fake_requests += 1

    def _write_fake_arrival(self, tokens: torch.Tensor, row: int, slots: torch.Tensor) -> None:
        """TAIL's write of a fake arrival: tokens [n] int64 at positions 0..n-1 in ``slots`` [n] int64 of request
        row ``row``, counted into a scratch tensor (nothing reaches the counters or the ring's report)."""
        n, dev = int(tokens.numel()), self.counters.device
        one = torch.ones(1, dtype=torch.int64, device=dev)
        view = ForwardView(input_ids=tokens, positions=torch.arange(n, dtype=torch.int64, device=dev),
                           out_cache_loc=slots, req_pool_indices=one * row, seq_lens=one * n, new_starts=one * 0,
                           new_lens=one * n, batch_size=1, max_new_len=n)
        scratch = torch.zeros_like(self.counters)
        for group_index, group in enumerate(self.groups):
            self.kernels.write(group, view, self._req_to_token, scratch, self.ring, False,
                               group_index=group_index, check_fed=False, token_oracle=None)

    def _precompile_fake_arrivals(self, block_lengths: Sequence[int]) -> None:
        """PD decode side: one inert fake-arrival write per TAIL block (request row 0, the padding slot 0), so a
        warm-up or health-check fake transfer compiles nothing while serving."""
        if self.transfer is None or self.transfer.mode != "decode":
            return
        dev = self.counters.device
        for n in block_lengths:
            self._write_fake_arrival(torch.zeros(n, dtype=torch.int64, device=dev), 0,
                                     torch.zeros(n, dtype=torch.int64, device=dev))

    def _perturb_arrivals(self) -> None:
        """The transfer perturbation draws for the arrivals since the last forward, before the first that reads them."""
        self.perturb.perturb_transferred(forward_index=self.forwards, arrivals=self._arrivals)
        self._arrivals = []
