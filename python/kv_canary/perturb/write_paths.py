"""Write-path perturbations: a forward's K/V store for one token that never lands where it should.

The bug class the write witness exists for (``kernels/witness.py``): an attention backend lane that skips
its store, a store aimed at the padding slot or at the neighbouring slot, a layer's store that goes
missing. The slot then keeps the bytes it held before and TAIL alone would fingerprint them as the truth.
These modes break the store itself, the way such bugs do, through the engine's own KV write call (the
adapter wraps the pool's store methods with ``WriteRedirect.apply``):

* ``write_dropped``: one token's store, in every layer, goes to the padding slot 0 (its own slot keeps
  the bytes it held before);
* ``write_dropped_layer``: the same in one layer only (K and V);
* ``write_misdirected``: one token's store, in every layer, lands in the neighbouring slot (slot + 1, or
  slot - 1 at the pool's end) instead of its own.

Each is armed for exactly one forward (outside any graph: one small device copy) and disarmed after it.
The redirect is plain tensor work on the store's own index tensor, so it is captured into CUDA graphs
with the store and replays with whatever the host armed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Set

import torch

from ..views import HostBatch

MODES = ("write_dropped", "write_dropped_layer", "write_misdirected")


class WriteRedirect:
    """Device state of one armed write perturbation: ``state`` = int64[3] (lane, layer, target).

    lane: the index into the store's ``loc`` to redirect (-1: disarmed); layer: the layer id whose store is
    redirected (-1: every layer); target: the slot it goes to instead (-1: the neighbouring slot).
    """

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.state = torch.full((3,), -1, dtype=torch.int64, device=device)
        self.layers_seen: Set[int] = set()  # layer ids whose stores went through ``apply`` (capture or eager)
        self.installed = False  # the adapter wrapped the engine's store methods

    def apply(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """The store's ``loc`` (int[n] engine slots) with the armed lane redirected; graph-safe."""
        self.layers_seen.add(int(layer_id))
        lanes = torch.arange(loc.shape[0], device=loc.device)
        lane, layer, target = self.state[0], self.state[1], self.state[2]
        hit = (lanes == lane) & ((layer < 0) | (layer == layer_id))
        neighbour = torch.where(loc + 1 < self.num_slots, loc + 1, loc - 1)
        return torch.where(hit, torch.where(target >= 0, target, neighbour).to(loc.dtype), loc)

    def arm(self, lane: int, layer: int, target: int) -> None:
        self.state.copy_(torch.tensor([lane, layer, target], dtype=torch.int64))

    def disarm(self) -> None:
        self.state.fill_(-1)


@dataclass(frozen=True)
class WriteLane:
    """One new token of a forward: its lane in ``out_cache_loc`` and whose token it is."""

    lane: int
    batch_index: int
    rid: str
    position: int


def pick_write_lane(batch: HostBatch, rng: random.Random) -> Optional[WriteLane]:
    """A random new token of the forward (lanes in batch order: request i's run after requests < i)."""
    owners = [i for i, n in enumerate(batch.new_lens) if n > 0]
    if not owners:
        return None
    i = rng.choice(owners)
    k = rng.randrange(batch.new_lens[i])
    return WriteLane(lane=sum(batch.new_lens[:i]) + k, batch_index=i, rid=batch.rids[i],
                     position=batch.seq_lens[i] - batch.new_lens[i] + k)
