"""Flip one byte inside the hashed region of a slot's real K or V row."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..buffer_groups import CanaryBufferGroup


@dataclass(frozen=True)
class ByteFlip:
    half: str  # "k" or "v"
    layer: int  # pool layer id
    byte: int  # byte offset in the row (within the hashed bytes)


def flip_hashed_byte(group: CanaryBufferGroup, slot: int, rng: random.Random) -> ByteFlip:
    """XOR 0xFF into a random byte that the canary hashes (device op, no sync)."""
    layer_i = rng.randrange(len(group.k_views))
    half = "v" if group.has_v and rng.random() < 0.5 else "k"
    view = (group.v_views if half == "v" else group.k_views)[layer_i]
    byte = rng.randrange(group.hash_words * 4)
    row = view[slot].view(torch.uint8)
    row[byte] ^= 0xFF
    return ByteFlip(half=half, layer=group.hashed_layers[layer_i], byte=byte)
