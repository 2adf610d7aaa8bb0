"""The records of a storage page travel inside the page object, as a trailer after its K/V bytes (docs/history/hicache.md 3.5).

A page object is ``kv bytes || trailer``; the trailer (``trailer_nbytes(page_size)`` bytes, little-endian) is

* ``TRAILER_MAGIC`` (4 bytes), the record width (int32), the page size (int64) and the records' tag (uint64:
  ``records_tag`` of what the hashes in them cover; a reader whose hashes cover other bytes, e.g. another
  ``SGLANG_KV_CANARY_KV_HASH_BYTES``, reads the page as having no records, never as corrupt): 24 bytes;
* the page's records, int64[page_size, RECORD_WIDTH] (one row per token of the page, ``fingerprint`` layout);
* a 64-bit mix of the header and record words (``_mix``): a flipped trailer byte reads as a page without records
  (a miss), never as corrupt K/V.

A reader that knows nothing of the trailer reads the K/V bytes and stops (a fixed-size target); a page written
without a trailer reads short here (``BadTrailer``). Plain tensors and bytes only: no engine class is named here.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from .fingerprint import RECORD_WIDTH

TRAILER_MAGIC = b"KVC1"
_HEADER = np.dtype([("magic", "S4"), ("width", "<i4"), ("page_size", "<i8"), ("tag", "<u8")])  # 24 bytes
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class BadTrailer(ValueError):
    """A page object with no (valid) canary trailer; ``reason``: short, magic, shape, tag or mix."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"kv-canary storage trailer: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


def trailer_nbytes(page_size: int) -> int:
    """Bytes of a page's trailer: header 24 + page_size x RECORD_WIDTH x 8 + mix 8."""
    return _HEADER.itemsize + int(page_size) * RECORD_WIDTH * 8 + 8


def _mix(words: np.ndarray) -> np.uint64:
    """64-bit mix of uint64 ``words``: splitmix64 of each word salted by its position, XOR-folded."""
    with np.errstate(over="ignore"):
        z = words.astype(np.uint64) + (np.arange(1, words.size + 1, dtype=np.uint64) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.bitwise_xor.reduce(z) if z.size else np.uint64(0)


def records_tag(parts: Sequence[int]) -> int:
    """A 64-bit tag of the ints that fix what a record's hashes cover (the writer's and reader's must match)."""
    return int(_mix(np.array([RECORD_WIDTH, *parts], dtype=np.int64).view(np.uint64)))


def encode_trailer(records: torch.Tensor, tag: int = 0) -> torch.Tensor:
    """uint8[trailer_nbytes(page_size)] for one page's ``records`` (int64[page_size, RECORD_WIDTH], CPU)."""
    if records.dim() != 2 or records.shape[1] != RECORD_WIDTH or records.dtype != torch.int64:
        raise ValueError(f"kv-canary storage trailer: records of shape {tuple(records.shape)} {records.dtype}, "
                         f"expected int64[page_size, {RECORD_WIDTH}]")
    header = np.zeros(1, dtype=_HEADER)
    header["magic"], header["width"], header["page_size"] = TRAILER_MAGIC, RECORD_WIDTH, records.shape[0]
    header["tag"] = np.uint64(tag & 0xFFFFFFFFFFFFFFFF)
    body = records.detach().cpu().contiguous().numpy().astype("<i8", copy=False)
    head_words = np.frombuffer(header.tobytes(), dtype="<u8")
    mix = _mix(np.concatenate([head_words, body.reshape(-1).view("<u8")]))
    blob = header.tobytes() + body.tobytes() + np.array([mix], dtype="<u8").tobytes()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def append_trailer(kv_page: torch.Tensor, records: torch.Tensor, tag: int = 0) -> torch.Tensor:
    """The page object: ``kv_page``'s bytes (any dtype, CPU) then the trailer of ``records``; uint8[kv + trailer]."""
    kv = kv_page.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([kv, encode_trailer(records, tag)])


def decode_trailer(trailer: torch.Tensor, page_size: int, tag: int = 0) -> torch.Tensor:
    """int64[page_size, RECORD_WIDTH] from a page's trailer bytes (uint8, CPU); ``BadTrailer`` when there is none
    (fewer bytes, another magic, another width or page size, another tag, or a mix that does not match)."""
    want = trailer_nbytes(page_size)
    raw = trailer.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if len(raw) < want:
        raise BadTrailer("short", f"{len(raw)} of {want} bytes")
    raw = raw[:want]
    header = np.frombuffer(raw[:_HEADER.itemsize], dtype=_HEADER)[0]
    if bytes(header["magic"]) != TRAILER_MAGIC:
        raise BadTrailer("magic", repr(bytes(header["magic"])))
    if int(header["width"]) != RECORD_WIDTH or int(header["page_size"]) != int(page_size):
        raise BadTrailer("shape", f"width {int(header['width'])} page size {int(header['page_size'])}, expected "
                                  f"{RECORD_WIDTH} and {page_size}")
    words = np.frombuffer(raw[:-8], dtype="<u8")
    if _mix(words) != np.frombuffer(raw[-8:], dtype="<u8")[0]:
        raise BadTrailer("mix")
    if int(header["tag"]) != (tag & 0xFFFFFFFFFFFFFFFF):  # a valid trailer of records hashed another way
        raise BadTrailer("tag", f"{int(header['tag']):#x}, expected {tag & 0xFFFFFFFFFFFFFFFF:#x}")
    body = np.frombuffer(raw[_HEADER.itemsize:-8], dtype="<i8").reshape(int(page_size), RECORD_WIDTH)
    return torch.from_numpy(body.copy())


def split_page(value: torch.Tensor, kv_nbytes: int, page_size: int,
               tag: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """A page object (uint8, CPU) -> (its K/V bytes: a uint8[kv_nbytes] view, its records int64[page_size,
    RECORD_WIDTH]); ``BadTrailer`` when it carries none."""
    flat = value.reshape(-1).view(torch.uint8)
    if flat.numel() < kv_nbytes + trailer_nbytes(page_size):
        raise BadTrailer("short", f"{flat.numel()} of {kv_nbytes + trailer_nbytes(page_size)} bytes")
    return flat[:kv_nbytes], decode_trailer(flat[kv_nbytes:], page_size, tag)


def page_byte_offset(*, half: int, layer: int, page_slot: int, byte: int, num_layers: int, page_size: int,
                     row_bytes: int) -> int:
    """Offset in a page object's K/V bytes of ``byte`` of one token's K (half 0) or V (half 1) row of ``layer``,
    for pages flattened as [2, layers, page_size, row_bytes] (the engine's layer-first host layout)."""
    if not (0 <= half < 2 and 0 <= layer < num_layers and 0 <= page_slot < page_size and 0 <= byte < row_bytes):
        raise ValueError(f"kv-canary: no byte {byte} of half {half} layer {layer} page slot {page_slot} in a page of "
                         f"{num_layers} layers x {page_size} slots x {row_bytes} row bytes")
    return ((half * num_layers + layer) * page_size + page_slot) * row_bytes + byte
