"""Plain-tensor descriptions of one forward and of the fixed launch capacities.

Nothing here names sglang: ``ForwardView`` is what the adapter layer extracts
from sglang's ``ForwardBatch``; ``LaunchCapacities`` is fixed at install so every
grid the canary launches is known before CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ForwardView:
    """What one model forward reads and writes, as device tensors.

    Request ``i`` (of ``batch_size``) owns row ``req_pool_indices[i]`` of
    req_to_token, has ``seq_lens[i]`` tokens after this forward, of which the
    last ``new_lens[i]`` are computed now: their ids/slots are
    ``input_ids/out_cache_loc[new_starts[i] : new_starts[i] + new_lens[i]]``,
    run at ``positions[...]`` (the positions the model's RoPE used).
    Attention reads positions ``[0, seq_lens[i])``; the first
    ``seq_lens[i] - new_lens[i]`` were written by earlier forwards and are the
    slots HEAD verifies.

    input_ids, positions, out_cache_loc: int32/int64[num_tokens]
    req_pool_indices, seq_lens, new_starts, new_lens: int32/int64[batch_size]

    ``staged``: an extend forward whose expected fed tokens the host staged in the token
    oracle (``TokenOracle.stage``), or a speculative verify whose TAIL stages its drafts
    (``speculative.stage_verify_tokens``); otherwise (decode) they are the oracle's ``next_token``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    new_starts: torch.Tensor
    new_lens: torch.Tensor
    batch_size: int
    max_new_len: int  # host-side bound on new_lens (sizes the TAIL grid)
    # A speculative TARGET_VERIFY forward: every request's new tokens are the last sampled token
    # then draft_tokens_per_request - 1 drafts (``kv_canary.speculative``); 0 otherwise.
    draft_tokens_per_request: int = 0
    staged: bool = False
    # The forward's K/V stores (``out_cache_loc[:store_lanes]``) are not its TAIL's to record: spec v1's draft decode
    # steps' scratch slots (given back after the phase), a tree verify's nodes (the kept ones recorded by the deferred
    # TAIL). HEAD forgets their records (``CanaryBufferGroup.forget``), whose bytes the forward changes.
    unrecorded_stores: bool = False

    @property
    def store_lanes(self) -> int:
        """The K/V stores the forward makes: one per token it runs (``positions``), at ``out_cache_loc``."""
        return min(int(self.out_cache_loc.shape[0]), int(self.positions.shape[0]))


@dataclass(frozen=True)
class LaunchCapacities:
    """Upper bounds fixed at install; a forward beyond them is an error, never a skip."""

    max_batch_size: int  # requests per forward (sizes the uniform index buffers)
    max_context_len: int  # positions per request (req_to_token width)
    verify_programs_target: int  # total verify programs to aim for per launch
    max_tokens_per_forward: int = 0  # new tokens of one forward (0: max_context_len + max_batch_size)

    @property
    def tokens_per_forward(self) -> int:
        return self.max_tokens_per_forward or self.max_context_len + self.max_batch_size

    def verify_programs_per_request(self, batch_size: int, block: int) -> int:
        """Programs per request for a HEAD launch; depends only on batch size (graph-safe)."""
        by_target = max(1, self.verify_programs_target // max(1, batch_size))
        by_context = max(1, -(-self.max_context_len // block))
        return min(by_target, by_context)

    def check(self, view: ForwardView) -> None:
        """Raise ``CanaryCapacityError`` when ``view`` exceeds a capacity."""
        if view.batch_size > self.max_batch_size:
            raise CanaryCapacityError(
                f"kv-canary: forward has {view.batch_size} requests, capacity max_batch_size="
                f"{self.max_batch_size}; raise --max-running-requests (or --cuda-graph-max-bs) "
                "at startup so the canary sizes its buffers for it"
            )


class CanaryCapacityError(RuntimeError):
    """A forward exceeded a launch capacity fixed at install."""


@dataclass(frozen=True)
class HostBatch:
    """Host copy of a batch's layout (built only when needed: perturbation, reports).

    rows/seq_lens/new_lens: one int per request, batch order; rids likewise.
    """

    rows: Sequence[int]
    seq_lens: Sequence[int]
    new_lens: Sequence[int]
    rids: Sequence[str]

    def read_positions(self, i: int) -> range:
        """Positions request ``i`` reads that earlier forwards wrote (what HEAD verifies)."""
        return range(0, max(0, self.seq_lens[i] - self.new_lens[i]))


@dataclass(frozen=True)
class SweepEntries:
    """Slots held by the prefix cache, flattened: int64 device tensors of equal length.

    preds[k] is the slot of position positions[k] - 1 in the same cached sequence
    (0 at position 0); tokens[k] is the cache key's token at that position.
    """

    slots: torch.Tensor
    preds: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.slots.shape[0])
