"""Flip one K/V byte of a page the canary wrote to the storage tier (``SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB``,
docs/history/hicache.md 3.8).

After a page object (K/V bytes then the records trailer, ``storage_trailer``) was written, with the given
probability one byte of its K/V part is XORed with ``STORAGE_FLIP_MASK`` where it rests (the file backend: in the
page's file). The byte is one token's (``page_slot``) K or V row byte, placed as ``SGLANG_KV_CANARY_PERTURB_KV_BYTES``
says for the device rows (``real_kv._place``: anywhere in the row by default, mostly outside the hashed window);
the trailer is left alone. The canary must report it when the page is read back into host memory and loaded back
to the device (the first read's full-row hash); a page never read back is never reported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..buffer_groups import CanaryBufferGroup
from ..storage_trailer import page_byte_offset
from .real_kv import ByteFlip, _place

# != FLIP_MASK, TRANSFER_FLIP_MASK and HOST_FLIP_MASK: a storage flip never cancels a device, PD or host flip
STORAGE_FLIP_MASK = 0x66


@dataclass(frozen=True)
class PageGeometry:
    """A page object's K/V part, flattened as [2 (K, V), num_layers, page_size, row_bytes]."""

    num_layers: int
    page_size: int
    row_bytes: int


def flip_stored_byte(group: CanaryBufferGroup, geometry: PageGeometry, rng: random.Random, where: str,
                     xor_at: Callable[[int, int], None]) -> "tuple[int, ByteFlip]":
    """Pick a token of the page and a byte of its rows; ``xor_at(offset in the page object, mask)`` flips it where
    the page rests. (page slot, the flip)."""
    row, byte = _place(group, where, rng)
    page_slot = rng.randrange(geometry.page_size)
    offset = page_byte_offset(half=0 if row.half == "k" else 1, layer=row.layer, page_slot=page_slot, byte=byte,
                              num_layers=geometry.num_layers, page_size=geometry.page_size,
                              row_bytes=geometry.row_bytes)
    xor_at(offset, STORAGE_FLIP_MASK)
    hashed = any(s.layer == row.layer and s.half == row.half and byte < s.words * 4 for s in group.sources)
    return page_slot, ByteFlip(half=row.half, layer=row.layer, byte=byte, hashed=hashed)
