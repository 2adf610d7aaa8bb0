"""Pick (request, position, slot) entries of a batch for perturbation.

Only slots the forward *reads* from earlier forwards are candidates: positions
``[0, seq_len - new_len)`` of each request. Slots this forward writes
(out_cache_loc) are never picked: their bytes are about to be overwritten, so a
flip there would prove nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from ..views import HostBatch


@dataclass(frozen=True)
class SlotEntry:
    batch_index: int
    rid: str
    row: int
    position: int
    slot: int


def pick_read_slot(batch: HostBatch, req_to_token: torch.Tensor, rng: random.Random,
                   window: int = 0) -> Optional[SlotEntry]:
    """A uniformly random read entry of the batch (None when the batch reads nothing).

    ``window`` > 0: only the last ``window`` read positions of each request (a sliding-window group).
    The slot is the engine's (req_to_token); a translated group maps it itself.
    """
    reads = [batch.read_positions(i) for i in range(len(batch.rows))]
    if window > 0:
        reads = [r[max(0, len(r) - window):] for r in reads]
    sizes = [len(r) for r in reads]
    total = sum(sizes)
    if total == 0:
        return None
    k = rng.randrange(total)
    for i, n in enumerate(sizes):
        if k < n:
            row = batch.rows[i]
            position = reads[i][k]
            slot = int(req_to_token[row, position].item())
            return SlotEntry(batch_index=i, rid=batch.rids[i], row=row, position=position, slot=slot)
        k -= n
    raise RuntimeError("slot picker: index past the batch")  # unreachable: k < total
