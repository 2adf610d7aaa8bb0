"""Flip one byte of a slot's real K or V row: anywhere in the slot, or where a spec says.

``SGLANG_KV_CANARY_PERTURB_KV_BYTES`` picks where:

* ``anywhere`` (default): uniform over every byte of every layer's K and V row of
  the slot -- how a real stray write lands; ``--kv-canary-real-data partial``
  hashes a small window and misses most of these, ``all`` catches every one;
* ``hashed``: uniform over the bytes the kv_hash covers (the window);
* ``LAYER:HALF:BYTE``: one place, e.g. ``-1:k:mid`` (the middle byte of the last
  layer's K row); a negative LAYER counts from the last.

The byte is XORed with a mask: ``FLIP_MASK`` (0xFF) for the modes that corrupt
a server's own pool, ``TRANSFER_FLIP_MASK`` for the PD ``transfer`` mode. Two
flips of one byte with the same mask cancel, and a real bug does not put a byte
back: within one server the perturbation keeps the XOR it has left at each place
(``standing``) and never applies a mask equal to it (a later flip of a byte an
earlier one left wrong, e.g. a ``real_kv_used`` flip of the byte a
``real_kv_post_forward`` flip changed, would restore it and look like a miss);
a PD pair runs a prefill-side flip and a decode-side flip over the same KV bytes
(a prefill slot is copied to a decode slot) in two processes, so the two masks
differ: injections on both sides of one slot always leave a changed byte behind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from ..buffer_groups import CanaryBufferGroup, KVRow
from ..config import CanaryConfigError

FLIP_MASK = 0xFF  # real_kv_* modes: a server corrupting its own pool
TRANSFER_FLIP_MASK = 0x5A  # PD transfer mode: != FLIP_MASK, so it never undoes a prefill-side flip of the byte


@dataclass(frozen=True)
class ByteFlip:
    half: str  # "k" or "v"
    layer: int  # pool layer id
    byte: int  # byte offset in the row
    hashed: bool  # inside the bytes the kv_hash covers


def _weighted_pick(rows: Sequence[KVRow], sizes: Sequence[int], rng: random.Random):
    k = rng.randrange(sum(sizes))
    for row, size in zip(rows, sizes):
        if k < size:
            return row, k
        k -= size
    raise RuntimeError("flip picker: index past the rows")  # unreachable: k < sum(sizes)


def _place(group: CanaryBufferGroup, where: str, rng: random.Random):
    """(row, byte) to flip for the spec ``where``."""
    if where == "anywhere":
        return _weighted_pick(group.rows, [r.row_words * 4 for r in group.rows], rng)
    if where == "hashed":
        if not group.sources:
            raise CanaryConfigError(
                "SGLANG_KV_CANARY_PERTURB_KV_BYTES=hashed, but --kv-canary-real-data none hashes no K/V bytes")
        return _weighted_pick(group.sources, [s.words * 4 for s in group.sources], rng)
    layer_s, half, byte_s = where.split(":")
    layers = sorted({r.layer for r in group.rows})
    layer = int(layer_s)
    layer = layers[layer] if -len(layers) <= layer < len(layers) else None
    match = [r for r in group.rows if r.layer == layer and r.half == half]
    if not match:
        raise CanaryConfigError(f"SGLANG_KV_CANARY_PERTURB_KV_BYTES={where!r}: group '{group.name}' has no such row "
                                f"(layers {layers[0]}..{layers[-1]}, halves {sorted({r.half for r in group.rows})})")
    row = match[0]
    byte = row.row_words * 2 if byte_s == "mid" else int(byte_s)
    if not 0 <= byte < row.row_words * 4:
        raise CanaryConfigError(f"SGLANG_KV_CANARY_PERTURB_KV_BYTES={where!r}: byte {byte} is outside the "
                                f"{row.row_words * 4}-byte row")
    return row, byte


def check_flip_spec(group: CanaryBufferGroup, where: str) -> None:
    """Raise ``CanaryConfigError`` at startup if ``where`` cannot be applied to ``group``."""
    _place(group, where, random.Random(0))


def flip_kv_byte(group: CanaryBufferGroup, slot: int, rng: random.Random, where: str = "anywhere",
                 mask: int = FLIP_MASK, standing: Optional[Dict[tuple, int]] = None) -> ByteFlip:
    """XOR ``mask`` (non-zero, < 256) into one byte of ``slot``'s K/V rows (device op, no sync).

    ``standing``: the XOR earlier flips left at each (group, layer, half, slot, byte), updated; a mask equal to
    it would undo them, so another non-zero mask is used (the byte stays changed whether or not the slot was
    rewritten in between)."""
    row, byte = _place(group, where, rng)
    if standing is not None:
        key = (group.name, row.layer, row.half, slot, byte)
        left = standing.get(key, 0)
        if mask == left:
            mask = 0x0F if left != 0x0F else 0xF0
        standing[key] = left ^ mask
    bytes_ = row.view[slot].view(torch.uint8)
    bytes_[byte] ^= mask
    hashed = any(s.layer == row.layer and s.half == row.half and byte < s.words * 4 for s in group.sources)
    return ByteFlip(half=row.half, layer=row.layer, byte=byte, hashed=hashed)
