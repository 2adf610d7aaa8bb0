"""The write witness's stamp: what HEAD writes into a slot's K/V rows before the forward that fills it.

The stamp covers ``STAMP_WORDS`` int32 words at each end of every K/V row (words ``[0, 2)`` and ``[n - 2, n)`` of an
``n``-word row; 8 bytes a end). TAIL reports a row ``unwritten`` when either end still holds the whole stamp
(``kernels/witness.py``). The same word is written to both words of an end, one word per element type.

**Harmless to the computation.** When a store is dropped, the forward's own attention reads the stamped row (the
witness reports it in that forward's TAIL, but the read has happened). Every stamp element is therefore a finite
*subnormal* of its type, of alternating sign: |x| <= 0.0117 (fp8 e4m3fn), 4.6e-5 (e5m2), 3.0e-7 (fp16), 4.6e-40
(bf16), 7.1e-40 (fp32). A stamped row is the row the slot held before (the previous owner's finite bytes: exactly
what the same dropped store leaves without the canary) with 8 bytes at each end near zero: attention's result stays
finite and no worse than without the canary. (The first stamp was a signaling-NaN pattern: a dropped store then
turned the forward's logits into NaN, and sglang 0.5.12's sampler crashed the server at temperature > 0.)

**Distinct from any correct write.** A false ``unwritten`` needs a correct store to leave all of one end equal to
the stamp: two words, i.e. 4 (bf16, fp16), 8 (fp8) or 2 (fp32) specific elements, each a specific subnormal code:

* bf16, fp32: K/V are rounded from fp32 accumulations of O(1e-3 .. 1e2) values; a result below 1.2e-38 in magnitude
  that is not exactly 0 needs cancellation to ~35 orders of magnitude. No code of the stamp occurs in practice.
* fp16: a code's bin is 6e-8 wide; with K/V elements of density p(0) <= ~1 per unit near 0 (measured on the tiny
  model's real K/V: ``test_witness_stamp_odds``), an element hits one code with p <= ~6e-8, an end (4 codes) with
  <= ~1e-29.
* fp8 e4m3fn (sglang stores x / k_scale): a subnormal code's bin is 2^-9 wide, p <= ~2e-3 an element even where
  K/V crowd 0 (density ~1): an end (8 specific codes) <= ~3e-22; e5m2's bins are 1.5e-5 wide.
* Structure: an end's elements are distinct codes of alternating sign, so a constant row (zeros, a fill value,
  padding), a repeated element or a row of one sign never matches; a computed NaN/inf is not subnormal.

Per slot the check looks at 2 ends of 2 x layers rows (e.g. 128 ends for 32 layers): fp8's worst case is ~4e-20 a
slot, never seen over any realistic serving lifetime (1e12 slot writes: 4e-8 expected false alarms). The price: a
row whose store wrote only its middle, leaving both ends stamped, is caught; a store that wrote one end and not
the other is caught through the other end; a store that wrote both ends but not all of the middle is not seen by
the witness (the real-data hash sees it on the next read of a hashed row).
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import CanaryConfigError

STAMP_WORDS = 2  # int32 words stamped (and checked) at each end of a row

# One int32 word per element type (little-endian: the first element is the lowest bits); every element a
# subnormal, signs alternating, no two elements of a word equal. The word's top bit is clear (a positive int32).
_SUBNORMAL_PAIR = 0x0005_8003  # 16-bit types: elements 0x8003 (-), 0x0005 (+); fp32: one positive subnormal
WITNESS_STAMPS = {
    torch.bfloat16: _SUBNORMAL_PAIR,
    torch.float16: _SUBNORMAL_PAIR,
    torch.float32: _SUBNORMAL_PAIR,
    # bytes 0x83 (-3), 0x05 (+5), 0x86 (-6), 0x03 (+3) x 2^-9
    **({torch.float8_e4m3fn: 0x0386_0583} if hasattr(torch, "float8_e4m3fn") else {}),
    # bytes 0x83 (-3), 0x01 (+1), 0x82 (-2), 0x03 (+3) x 2^-16
    **({torch.float8_e5m2: 0x0382_0183} if hasattr(torch, "float8_e5m2") else {}),
}


def witness_stamp(name: str, dtype: Optional[torch.dtype], row_words: int) -> int:
    """The stamp word for a group's K/V element type; ``CanaryConfigError`` for a type without one, or for rows too
    short to hold a stamp at each end (``row_words``: the shortest K/V row of the group, in int32 words)."""
    stamp = WITNESS_STAMPS.get(dtype)
    if stamp is None:
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_WRITE_WITNESS: no write-witness stamp for pool group '{name}' of KV dtype "
            f"{dtype} (known: {', '.join(str(d).replace('torch.', '') for d in WITNESS_STAMPS)}); "
            "set SGLANG_KV_CANARY_WRITE_WITNESS=0 to run without it")
    if row_words < STAMP_WORDS:
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_WRITE_WITNESS: pool group '{name}' has K/V rows of {row_words * 4} bytes, fewer than "
            f"the stamp's {STAMP_WORDS * 4}; set SGLANG_KV_CANARY_WRITE_WITNESS=0 to run without the witness")
    return stamp
