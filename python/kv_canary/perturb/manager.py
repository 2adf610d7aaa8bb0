"""``PerturbManager``: runs the enabled perturbation modes in the outside-graph pre-ops.

Each injection is logged as one parseable ``kv_canary_perturb=`` line carrying
the mode, group, slot, request, position and forward index, so tests can match
it to the violation the canary must report.
"""

from __future__ import annotations

import logging
import random
from typing import Callable, List, Optional, Sequence

import torch

from ..config import CanaryConfig
from ..plan import HostBatch
from ..pool_patcher import CanaryBufferGroup
from ..violations import PERTURB_PREFIX, format_line
from .real_kv import flip_hashed_byte
from .slot_picker import pick_read_slot

logger = logging.getLogger("kv_canary")


class WarmupGate:
    """Open once ``warmup_steps`` forwards have run since init finished."""

    def __init__(self, warmup_steps: int):
        self._warmup_steps = warmup_steps

    def is_open(self, forward_index: int) -> bool:
        return forward_index >= self._warmup_steps


class PerturbManager:
    def __init__(self, *, config: CanaryConfig, groups: Sequence[CanaryBufferGroup], req_to_token: torch.Tensor):
        self._config = config
        self._groups = list(groups)
        self._req_to_token = req_to_token
        self._rng = random.Random(config.perturb_seed)
        self._gate = WarmupGate(config.perturb_warmup_steps)
        self.injections: List[str] = []  # formatted lines, newest last (bounded)

    @property
    def active(self) -> bool:
        return self._config.any_perturbation

    def perturb_pre_forward(self, *, forward_index: int, host_batch: Callable[[], Optional[HostBatch]]) -> None:
        """Run the pre-forward modes for the forward about to run as ``forward_index``."""
        if not self._gate.is_open(forward_index):
            return
        if self._config.perturb_real_kv_used_prob > 0 and self._rng.random() < self._config.perturb_real_kv_used_prob:
            batch = host_batch()
            if batch is not None:
                self._real_kv_used(batch, forward_index)

    def _real_kv_used(self, batch: HostBatch, forward_index: int) -> None:
        entry = pick_read_slot(batch, self._req_to_token, self._rng)
        if entry is None:
            return
        group = self._groups[0]
        flip = flip_hashed_byte(group, entry.slot, self._rng)
        line = format_line(
            PERTURB_PREFIX,
            "real_kv_used",
            {
                "group": group.name,
                "slot": entry.slot,
                "rid": entry.rid,
                "position": entry.position,
                "forward": forward_index,
                "half": flip.half,
                "layer": flip.layer,
                "byte": flip.byte,
            },
        )
        logger.warning(line)
        self.injections.append(line)
        del self.injections[:-1000]
