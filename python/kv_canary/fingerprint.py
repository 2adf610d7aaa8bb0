"""The per-slot fingerprint: record layout, reason codes and the hash functions.

A record is ``int64[RECORD_WIDTH]`` per KV slot and buffer group:

    [TOKEN, POSITION, CHAIN, KV_HASH, FULL_HASH]

* ``CHAIN`` of position p is ``CHAIN(p-1) + g(token_p, p)`` (wrapping int64
  addition), anchored at ``CHAIN_ANCHOR`` before position 0. Two prefixes that
  differ anywhere before p therefore differ at p (unless a 2^-64 collision), a
  slot's link to its predecessor is checked locally (verify is parallel over
  slots), and writing a chunk is a prefix sum (parallel over tokens).
* ``KV_HASH`` mixes the K/V bytes ``--kv-canary-real-data`` selects (none or a
  window; ``all``: the window), read from the live pool; HEAD checks it on every read.
* ``FULL_HASH`` (the scrub, ``SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD``, and ``all``)
  covers every byte of every layer's K and V row; the scrub checks a bounded
  number of slots per forward against it. Its per-word term is a 32-bit mix
  (``full_hash_from_words``: a third of ``KV_HASH``'s int64 work per word, since
  it reads ~100x more words): a change of one word always changes it (the term
  is a bijection of the word and the sum of terms < 2^32 cannot wrap to the old
  value); a random change of several words escapes with probability ~2^-32.
* ``TOKEN`` / ``POSITION`` are the token and position the model was fed (TAIL
  checks both against the request's own before recording them).

All arithmetic is wrapping int64 with logical shifts expressed as arithmetic
shift + mask, so the torch reference and the Triton kernels agree bit for bit.
The functions here operate on torch tensors; the Triton kernels re-implement the
same formulas with the same constants.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

RECORD_WIDTH = 5
F_TOKEN, F_POSITION, F_CHAIN, F_KV_HASH, F_FULL_HASH = 0, 1, 2, 3, 4

# Violation reasons (bit flags; one ring row carries the OR of all that failed).
R_POSITION = 1  # record's position differs from the position the request reads it at
R_CHAIN = 2  # chain link to the predecessor slot broken (foreign or reordered prefix)
R_KV_HASH = 4  # live K/V bytes no longer hash to the recorded value
R_TOKEN = 8  # recorded token differs from the request's own token at that position
R_SLOT = 16  # req_to_token points at the padding slot or outside the pool
R_UNWRITTEN = 32  # the forward meant to fill the slot left a layer's K or V row unwritten (write witness)

REASON_NAMES = {
    R_POSITION: "position",
    R_CHAIN: "chain",
    R_KV_HASH: "kv_hash",
    R_TOKEN: "token",
    R_SLOT: "slot",
    R_UNWRITTEN: "unwritten",
}

CHAIN_ANCHOR = 0x1B873593CC9E2D51  # < 2**63: the same value as int64 everywhere
G_TOKEN_MUL = 0x1F8B3C5D7E9A0B2D
G_POS_MUL = 0x3C6EF372FE94F82B
G_ADD = 0x2545F4914F6CDD1D
MIX_M1 = 0x62A9D9ED799705F5
MIX_M2 = 0x4BE98134A5976FD3
WORD_MUL = 0x5851F42D4C957F2D
HASH_SEED = 0x14057B7EF767814F
FULL_WORD_KEY = 0x9E3779B1  # FULL_HASH: word w is keyed with ((w + 1) * FULL_WORD_KEY) mod 2^32
MIX32_M1 = 0x7FEB352D
MIX32_M2 = 0x846CA68B

MASK_31 = (1 << 31) - 1
MASK_32 = (1 << 32) - 1
MASK_35 = (1 << 35) - 1

# Device counters (int64[NUM_COUNTERS], one tensor per manager).
C_VIOLATIONS = 0  # violation rows ever appended to the ring
C_SLOTS_VERIFIED = 1
C_SLOTS_WRITTEN = 2
C_VERIFY_LAUNCHES = 3
C_WRITE_LAUNCHES = 4
C_FORWARD_INDEX = 5  # forwards completed (bumped by the last TAIL launch of a forward)
C_REPORT_ENABLED = 6  # 0 while capturing/warming up: violations are counted nowhere
C_SLOTS_SWEPT = 7  # cached slots checked by radix-cache sweeps
C_CURRENT_FORWARD = 8  # the running forward's index, stored by its HEAD for its TAIL's rows (TAIL bumps 5)
C_SLOTS_SCRUBBED = 9  # slots whose every K/V byte the scrub checked
# windowed (hybrid sliding-window) groups, the SWA divergence reporter's inputs:
C_SWA_VERIFIED = 10  # slots verified by windowed groups (the rest of C_SLOTS_VERIFIED: the full groups)
C_SWA_DIVERGENCE = 11  # of those, entries whose group slot differs from the engine (full) slot
C_SWA_OUT_OF_WINDOW = 12  # prefix positions a windowed group did not verify (outside its window)
C_SLOTS_WITNESSED = 13  # new slots whose every K/V row the write witness checked in TAIL
C_SLOTS_FIRST_READ = 14  # read slots whose every K/V byte a first read checked (all; HiCache: loaded slots)
NUM_COUNTERS = 15

# Violation ring rows (int64[capacity, RING_WIDTH]).
V_REASON, V_SLOT, V_POSITION, V_BATCH_INDEX, V_ROW, V_STORED, V_EXPECTED, V_FORWARD = range(8)
RING_WIDTH = 8
GROUP_SHIFT = 8  # V_REASON = reason bits | (buffer group index << GROUP_SHIFT)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """Bijective int64 -> int64 finaliser (xor-shift-multiply), wrapping."""
    x = x ^ ((x >> 29) & MASK_35)
    x = x * MIX_M1
    x = x ^ ((x >> 32) & MASK_32)
    x = x * MIX_M2
    x = x ^ ((x >> 33) & MASK_31)
    return x


def chain_term(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """g(token, position): int64 tensors of equal shape -> int64."""
    return mix64(token.to(torch.int64) * G_TOKEN_MUL + position.to(torch.int64) * G_POS_MUL + G_ADD)


def kv_hash_from_words(words: torch.Tensor) -> torch.Tensor:
    """words: int32[n, W] (all hashed words of n slots, in canonical order) -> int64[n]."""
    n, width = words.shape
    idx = torch.arange(width, device=words.device, dtype=torch.int64)
    terms = mix64((words.to(torch.int64) & MASK_32) + (idx + 1) * WORD_MUL)
    return mix64(terms.sum(dim=1) ^ HASH_SEED)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective uint32 -> uint32 finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * MIX32_M1) & MASK_32
    x = x ^ (x >> 15)
    x = (x * MIX32_M2) & MASK_32
    return x ^ (x >> 16)


def full_hash_from_words(words: torch.Tensor) -> torch.Tensor:
    """FULL_HASH. words: int32[n, W] (every word of n slots' rows, canonical order) -> int64[n].

    ``mix64(SUM_w mix32(word_w ^ key_w) ^ HASH_SEED)``, ``key_w = (w + 1) * FULL_WORD_KEY mod 2^32``; the
    sum is over terms in [0, 2^32) in int64 (additive: any split of the words gives the same sum)."""
    n, width = words.shape
    idx = torch.arange(width, device=words.device, dtype=torch.int64)
    key = ((idx + 1) * FULL_WORD_KEY) & MASK_32
    terms = mix32((words.to(torch.int64) & MASK_32) ^ key)
    return mix64(terms.sum(dim=1) ^ HASH_SEED)



# ---------------------------------------------------------------- numpy twin (host side of the token oracle)


# the numpy twin's constants as numpy scalars, made once (an array op with a Python int converts it each call)
_U64 = {name: np.uint64(value) for name, value in (
    ("t", G_TOKEN_MUL), ("p", G_POS_MUL), ("a", G_ADD), ("m1", MIX_M1), ("m2", MIX_M2), ("s29", 29), ("s32", 32),
    ("s33", 33))}


def _mix64_np_inplace(x: "np.ndarray") -> "np.ndarray":
    """``mix64`` over a uint64 array the caller owns, in place (wrapping; logical shifts are plain uint64 shifts; array
    ops wrap silently: no errstate needed); ~half the host time of an allocating form at the oracle's sizes (tens to
    thousands of tokens)."""
    c, y = _U64, np.empty_like(x)
    np.right_shift(x, c["s29"], out=y)
    x ^= y
    x *= c["m1"]
    np.right_shift(x, c["s32"], out=y)
    x ^= y
    x *= c["m2"]
    np.right_shift(x, c["s33"], out=y)
    x ^= y
    return x


def _chain_terms_np_inplace(tokens: "np.ndarray", positions: "np.ndarray") -> "np.ndarray":
    """``chain_terms_np`` over int64 arrays the caller owns: ``tokens`` becomes the uint64 terms (returned)."""
    c = _U64
    x = tokens.view(np.uint64)
    x *= c["t"]
    p = positions.view(np.uint64)
    p *= c["p"]
    x += p
    x += c["a"]
    return _mix64_np_inplace(x)


def chain_terms_np(tokens, positions) -> "np.ndarray":
    """g(token, position) for int sequences of equal length -> uint64 array (bit-equal to ``chain_term``)."""
    return _chain_terms_np_inplace(np.array(tokens, dtype=np.int64), np.array(positions, dtype=np.int64))


def prefix_chains_np(prefixes, starts=None, bases=None) -> "list[int]":
    """CHAIN(len(s) - 1) of each token sequence s (CHAIN_ANCHOR for an empty one), as Python ints in int64 range.

    ``starts`` / ``bases`` (optional, one per sequence): s holds the tokens at positions [start, start + len(s)) and
    ``base`` is the chain over positions [0, start) (the chain is additive: CHAIN_ANCHOR + the sum of every position's
    term), so a remembered prefix's chain is extended by the tokens after it only. One vectorized pass over all
    sequences (the host sets a newly admitted request's expected chain over its cached prefix with it), a fixed
    number of numpy calls whatever their count; bit-equal to the records TAIL writes for the same tokens.
    """
    lens = [len(s) for s in prefixes]
    out = [CHAIN_ANCHOR] * len(prefixes) if bases is None else [int(b) for b in bases]
    some = [i for i, n in enumerate(lens) if n]
    if not some:
        return out
    sizes = [lens[i] for i in some]
    offsets = list(itertools.accumulate(sizes, initial=0))
    total = offsets.pop()
    tokens = np.concatenate([np.asarray(prefixes[i], dtype=np.int64) for i in some])
    positions = np.arange(total, dtype=np.int64)  # position = start + (index - offset) within each sequence
    if starts is not None or len(some) > 1:
        first = [0] * len(some) if starts is None else [int(starts[i]) for i in some]
        positions += np.repeat(np.array([a - o for a, o in zip(first, offsets)], dtype=np.int64), sizes)
    terms = _chain_terms_np_inplace(tokens, positions)
    sums = np.add.reduceat(terms, offsets)
    sums += np.array([out[i] for i in some], dtype=np.int64).view(np.uint64)
    for i, chain in zip(some, sums.view(np.int64).tolist()):
        out[i] = chain
    return out


def full_hash_terms_np(words: "np.ndarray", first_word: int = 0) -> "np.ndarray":
    """FULL_HASH's sum over a run of words: uint32[n, w] whose first word is word ``first_word`` of the canonical
    order -> uint64[n] (additive: the sums of a slot's rows add up to ``full_hash_from_words``'s sum)."""
    w = words.shape[1]
    key = ((np.arange(first_word + 1, first_word + w + 1, dtype=np.uint64) * np.uint64(FULL_WORD_KEY))
           & np.uint64(MASK_32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = words ^ key
        x ^= x >> np.uint32(16)
        x *= np.uint32(MIX32_M1)
        x ^= x >> np.uint32(15)
        x *= np.uint32(MIX32_M2)
        x ^= x >> np.uint32(16)
    return x.sum(axis=1, dtype=np.uint64)


def full_hash_finalize_np(sums: "np.ndarray") -> "np.ndarray":
    """uint64[n] sums of ``full_hash_terms_np`` -> int64[n] FULL_HASH, bit-equal to ``full_hash_from_words``."""
    return _mix64_np_inplace(sums ^ np.uint64(HASH_SEED)).view(np.int64)  # a fresh array: mixed in place
