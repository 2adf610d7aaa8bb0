"""Flip one byte of a HiCache host copy (``SGLANG_KV_CANARY_PERTURB_HOST_COPY_PROB``, docs/history/hicache.md 3.8).

After a backup settled (its K/V copy is in host memory, no DMA races the flip), with the given probability one
byte of one of its host slots is XORed with ``HOST_FLIP_MASK``; the byte is placed as
``SGLANG_KV_CANARY_PERTURB_KV_BYTES`` says for the device rows (``real_kv._place``), mapped to the host copy's row
of the same layer and half. The canary must report it when the copy is loaded back (the first read's full-row
hash); a copy freed before that never reads wrong and is never reported.
"""

from __future__ import annotations

import random
from typing import Mapping, Tuple

import torch

from ..buffer_groups import CanaryBufferGroup
from .real_kv import ByteFlip, _place

HOST_FLIP_MASK = 0x3C  # != FLIP_MASK and TRANSFER_FLIP_MASK: a host flip and a device flip of one byte never cancel

HostRows = Mapping[Tuple[int, str], torch.Tensor]  # (layer, half) -> uint8[host_slots, row_bytes], the host copy


def flip_host_byte(group: CanaryBufferGroup, host_rows: HostRows, host_slot: int, rng: random.Random,
                   where: str = "anywhere") -> ByteFlip:
    row, byte = _place(group, where, rng)
    host_rows[(row.layer, row.half)][host_slot, byte] ^= HOST_FLIP_MASK
    hashed = any(s.layer == row.layer and s.half == row.half and byte < s.words * 4 for s in group.sources)
    return ByteFlip(half=row.half, layer=row.layer, byte=byte, hashed=hashed)
