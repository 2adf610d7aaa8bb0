"""KV pool -> canary buffer groups (records + hash views per slot index space).

A *buffer group* is one index space of KV slots that attention reads: its
fingerprint records plus zero-copy int32 views of the real K/V bytes to hash.
An MHA pool has one group (``full``); a hybrid sliding-window pool has two
(``full`` and ``swa``, the latter with a slot translation and a window); an MLA
pool has no V half. Pool classes are registered by the adapter layer with a
``PoolLayout`` extractor, so this module never names an engine class.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .config import CanaryConfig, CanaryConfigError, RealData
from .fingerprint import RECORD_WIDTH
from .witness_stamp import STAMP_WORDS, witness_stamp

@dataclass(frozen=True)
class PoolLayout:
    """What a pool exposes for one group: per-layer K (and V) buffers, ``[num_slots, ...]``."""

    name: str
    k_buffers: Sequence[torch.Tensor]
    v_buffers: Optional[Sequence[torch.Tensor]]  # None for MLA-style pools (no V half)
    # engine slot (req_to_token / out_cache_loc) -> this group's slot, a live int device tensor the
    # engine owns (hybrid SWA: full -> swa; 0 = no slot, e.g. released outside the window); None: same slots
    slot_translation: Optional[torch.Tensor] = None
    # > 0: attention reads only the last ``window`` positions before a forward's new tokens
    # (sliding-window layers); HEAD verifies only those. 0: the whole prefix.
    window: int = 0
    # the element type the K/V rows hold (an fp8 pool stores it as uint8); None: the buffers' own dtype
    kv_dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class KVRow:
    """The K or V row of one layer, as a live int32 view ``[num_slots, row_words]``.

    ``words`` is how many words from the start of each row the kv_hash covers
    (the whole row with ``--kv-canary-real-data all``).
    """

    layer: int
    half: str  # "k" or "v"
    view: torch.Tensor
    words: int

    @property
    def row_words(self) -> int:
        return int(self.view.shape[1])


@dataclass(frozen=True)
class CanaryBufferGroup:
    """Records and hash sources of one slot index space.

    records: int64[num_slots, RECORD_WIDTH] (zeros = never written)
    sources: the hashed rows, in the kv_hash's canonical order (per layer: K, then V)
    rows: every layer's K and V row, whole (what a K/V perturbation may hit)
    source_table: int64[len(sources), 4] on the device, one row per source:
        (int32 offset of the source's view from ``base``, row stride in words,
        words hashed, index of its first word in the canonical order)
    base: the int32 view with the lowest address (kernel pointer base; offsets >= 0)
    full_table / full_base: the same over ``rows`` (every byte: the scrub's FULL_HASH)
    slot_map: engine slot -> group slot (None: identity); the kernels apply it to req_to_token and
        out_cache_loc entries before touching records or K/V rows
    window: > 0: HEAD verifies only the last ``window`` positions of each prefix
    """

    name: str
    records: torch.Tensor
    sources: Tuple[KVRow, ...]
    rows: Tuple[KVRow, ...]
    source_table: torch.Tensor
    base: torch.Tensor
    full_table: torch.Tensor
    full_base: torch.Tensor
    slot_map: Optional[torch.Tensor] = None  # ``PoolLayout.slot_translation``
    window: int = 0  # ``PoolLayout.window``
    # the write witness's stamp for this group's element type (``witness_stamp``; 0 with the witness off)
    witness_stamp: int = 0
    # False: HEAD does not check chain links (the draft pool, ``draft_pool.DraftCanaryManager``: sglang splices
    # draft slots of different requests whose records differ; position, K/V hash and slot are still checked)
    check_chain: bool = True
    # FULL_HASH state (the scrub or ``--kv-canary-real-data all``; None: no whole-row hashing)
    full_row: Optional["FullRowState"] = None

    @property
    def num_slots(self) -> int:
        return int(self.records.shape[0])

    @functools.cached_property
    def longest_source_words(self) -> int:
        """Words of the longest hashed source (0: none); read on every launch's host path, computed once."""
        return max((s.words for s in self.sources), default=0)

    @functools.cached_property
    def longest_row_words(self) -> int:
        """Words of the longest whole row (0: none); read on every launch's host path, computed once."""
        return max((r.words for r in self.rows), default=0)

    @functools.cached_property
    def row_word_alignment(self) -> int:
        """4 when every whole row starts at a 16-byte boundary and its offset from ``full_base``, stride and length
        are multiples of 4 words (the whole-row hash then loads 16 bytes per access), else 1."""
        base = self.full_base.data_ptr()
        aligned = base % 16 == 0 and all(
            (r.view.data_ptr() - base) % 16 == 0 and r.view.stride(0) % 4 == 0 and r.words % 4 == 0 for r in self.rows)
        return 4 if aligned else 1

    @functools.cached_property
    def row_words_gcd(self) -> int:
        """The greatest common divisor of the whole rows' lengths in words (a word tile that divides it never runs
        past a row: the whole-row hash then skips its per-word masks); computed once."""
        return functools.reduce(math.gcd, (r.words for r in self.rows), 0)

    def forget(self, slots: torch.Tensor) -> None:
        """The records of engine slots ``slots`` (int64[n], on the records' device) are gone: zeroed as never written
        (chain 0: the scrub skips them; tag = FULL_HASH = 0: no first read lists them), for K/V stored there without
        a TAIL. Fixed-shape ``index_fill_`` launches, no host sync, no allocation: CUDA-graph capturable. Slot 0
        (sglang's padding slot, a padding lane's ``out_cache_loc``) is never recorded (every write masks it, the
        scrub starts at 1, a read of it is a ``slot`` violation), so zeroing it changes nothing."""
        if self.slot_map is not None:
            raise ValueError(f"kv-canary: group '{self.name}' translates its slots; forgetting slots is verified for "
                             "groups without a slot map only (the speculative pools, MHATokenToKVPool)")
        if slots.dtype != torch.int64:
            raise ValueError(f"kv-canary: slots to forget are {slots.dtype}; int64 expected (sglang's out_cache_loc)")
        self.records.index_fill_(0, slots, 0)
        if self.full_row is not None:
            self.full_row.tags.index_fill_(0, slots, 0)

    @property
    def hashed_word_count(self) -> int:
        return sum(s.words for s in self.sources)

    def all_words(self, slots: torch.Tensor) -> torch.Tensor:
        """int32[n, every word of every row] of the given slots, canonical order (the FULL_HASH's input)."""
        return torch.cat([r.view[slots] for r in self.rows], dim=1)

    def hashed_words(self, slots: torch.Tensor) -> torch.Tensor:
        """int32[n, hashed_word_count] of the given slots, canonical order (the sources' words, concatenated)."""
        if not self.sources:
            return torch.zeros((int(slots.shape[0]), 0), dtype=torch.int32, device=self.records.device)
        return torch.cat([s.view[slots, : s.words] for s in self.sources], dim=1)


FIRST_READ_CAPACITY = 4096  # most read slots per forward and group whose full row HEAD verifies (the rest wait)


def first_read_capacity(num_slots: int, hicache: bool) -> int:
    """Entries of a group's first-read work list: ``FIRST_READ_CAPACITY`` (``all``: a forward's first reads since
    their write; the rest wait for the next forward), or every slot of the pool with HiCache (a load-back brings
    any number of slots, all listed by the forward that consumes it and hashed beside it by layer, none left over
    for the forward stream of a later one; 24 B a slot)."""
    return num_slots if hicache else FIRST_READ_CAPACITY


@dataclass(frozen=True)
class FullRowState:
    """Device state of the split whole-row hash (``kernels.full_row``), per group.

    acc: int64[num_slots], partial FULL_HASH sums (zero between launches)
    tickets: int32[num_slots], row chunks of the running launch a slot's sums have (zero between launches): the
        program that adds the last chunk finalizes the slot (``kernels.full_row``)
    tags: int64[num_slots], the FULL_HASH a first read last verified (TAIL zeroes it; a record whose
        FULL_HASH differs from its tag is unverified)
    work: int64[capacity, 3], the first-read work list (slot, batch index, req_to_token row)
    work_state: int64[2], (entries listed this forward, listed lanes finished: the last one empties the list)
    first_read: HEAD lists unverified read slots (``--kv-canary-real-data all``, HiCache)
    clear_tags: TAIL zeroes a new slot's tag (``all``: listed at its first read); else TAIL sets it to the new
        FULL_HASH (HiCache outside ``all``: only slots a load-back filled, tag zeroed there, are listed)
    """

    acc: torch.Tensor
    tickets: torch.Tensor
    tags: torch.Tensor
    work: torch.Tensor
    work_state: torch.Tensor
    first_read: bool
    clear_tags: bool = True

    @staticmethod
    def build(num_slots: int, first_read: bool, device: torch.device, capacity: int,
              clear_tags: bool = True) -> "FullRowState":
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        return FullRowState(acc=zeros(num_slots), tickets=torch.zeros(num_slots, dtype=torch.int32, device=device),
                            tags=zeros(num_slots), work=zeros(capacity if first_read else 1, 3),
                            work_state=zeros(2), first_read=first_read, clear_tags=clear_tags)

    @staticmethod
    def bytes(num_slots: int, first_read: bool, capacity: int) -> int:
        return 8 * (2 * num_slots + 3 * (capacity if first_read else 1) + 2) + 4 * num_slots


@dataclass(frozen=True)
class PoolContext:
    """What an extractor may need beyond the pool object (read from the engine by the adapter)."""

    sliding_window: Optional[int] = None  # the engine's sliding-window size (hybrid SWA models), else None


LayoutExtractor = Callable[[object, PoolContext], List[PoolLayout]]
_REGISTRY: Dict[type, LayoutExtractor] = {}


def register_pool_class(pool_cls: type, extractor: LayoutExtractor) -> None:
    """Teach the buffer-group builder a pool class (exact class match; subclasses must register too)."""
    _REGISTRY[pool_cls] = extractor


def registered_pool_classes() -> List[str]:
    return sorted(c.__name__ for c in _REGISTRY)


def int32_row_view(buf: torch.Tensor) -> torch.Tensor:
    """``[num_slots, ...]`` buffer of any dtype -> int32[num_slots, row_bytes // 4] view (no copy)."""
    flat = buf.reshape(buf.shape[0], -1)
    if flat.data_ptr() != buf.data_ptr() or not flat.is_contiguous():
        raise CanaryConfigError("kv-canary: a KV buffer is not contiguous; cannot hash it in place")
    row_bytes = flat.shape[1] * flat.element_size()
    if row_bytes % 4:
        raise CanaryConfigError(f"kv-canary: KV row of {row_bytes} bytes is not a multiple of 4")
    return flat.view(torch.uint8).view(torch.int32)


def build_group(layout: PoolLayout, config: CanaryConfig, device: torch.device) -> CanaryBufferGroup:
    num_layers = len(layout.k_buffers)
    rows: List[KVRow] = []
    for layer in range(num_layers):
        halves = [("k", layout.k_buffers[layer])]
        if layout.v_buffers is not None:
            halves.append(("v", layout.v_buffers[layer]))
        for half, buf in halves:
            view = int32_row_view(buf)
            rows.append(KVRow(layer=layer, half=half, view=view, words=int(view.shape[1])))
    if config.real_data in (RealData.PARTIAL, RealData.ALL):  # all: the window at every read, FULL_HASH besides
        for layer in config.kv_hash_layers:
            if layer >= num_layers:
                raise CanaryConfigError(
                    f"SGLANG_KV_CANARY_KV_HASH_LAYERS names layer {layer}, but pool group "
                    f"'{layout.name}' has {num_layers} layers (0..{num_layers - 1})"
                )
        by_layer = {(r.layer, r.half): r for r in rows}
        sources = [
            KVRow(layer=r.layer, half=r.half, view=r.view, words=min(config.kv_hash_bytes // 4, r.row_words))
            for layer in config.kv_hash_layers
            for r in (by_layer[(layer, h)] for h in ("k", "v") if (layer, h) in by_layer)
        ]
    else:
        sources = []
    num_slots = int((sources or rows)[0].view.shape[0])
    records = torch.zeros((num_slots, RECORD_WIDTH), dtype=torch.int64, device=device)
    source_table, base = _source_table(sources, rows[0].view, device)
    full_table, full_base = _source_table(rows, rows[0].view, device)
    if layout.window < 0:
        raise CanaryConfigError(f"kv-canary: pool group '{layout.name}' has a negative window {layout.window}")
    slot_map = layout.slot_translation
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype not in (torch.int32, torch.int64)):
        raise CanaryConfigError(f"kv-canary: pool group '{layout.name}': the slot translation must be a 1-D "
                                f"int32/int64 tensor, not {tuple(slot_map.shape)} {slot_map.dtype}")
    full_row = None
    if config.full_row_hash:
        full_row = FullRowState.build(num_slots, config.first_read, device,
                                      first_read_capacity(num_slots, config.hicache), clear_tags=config.clear_tags)
    return CanaryBufferGroup(
        name=layout.name, records=records, sources=tuple(sources), rows=tuple(rows),
        source_table=source_table, base=base, full_table=full_table, full_base=full_base,
        slot_map=slot_map, window=int(layout.window), full_row=full_row,
        witness_stamp=witness_stamp(layout.name, _kv_dtype(layout), min((r.words for r in rows), default=STAMP_WORDS))
        if config.write_witness else 0,
    )


def _kv_dtype(layout: PoolLayout) -> Optional[torch.dtype]:
    """The element type the group's K/V rows hold."""
    return layout.kv_dtype or (layout.k_buffers[0].dtype if len(layout.k_buffers) else None)


def _source_table(sources: Sequence[KVRow], fallback: torch.Tensor, device: torch.device):
    """(int64[n, 4] device table, base view) for the kernels' ``_kv_hash`` (see ``CanaryBufferGroup``)."""
    base = min((s.view for s in sources), key=lambda v: v.data_ptr(), default=fallback)
    table, first = [], 0
    for s in sources:
        delta = s.view.data_ptr() - base.data_ptr()
        if delta % 4:
            raise CanaryConfigError("kv-canary: a KV buffer is not 4-byte aligned; cannot hash it in place")
        table.append([delta // 4, s.view.stride(0), s.words, first])
        first += s.words
    return torch.tensor(table or [[0, 0, 0, 0]], dtype=torch.int64, device=device), base


def attach_canary_buffers(pool: object, config: CanaryConfig, device: torch.device,
                          context: Optional[PoolContext] = None) -> List[CanaryBufferGroup]:
    """Build the groups for ``pool`` and keep them on it as ``pool.kv_canary_groups``.

    Raises ``CanaryConfigError`` naming the class when the pool kind is unsupported.
    """
    extractor = _REGISTRY.get(type(pool))
    if extractor is None:
        raise CanaryConfigError(
            f"--kv-canary does not support the KV pool class {type(pool).__name__}; "
            f"supported: {', '.join(registered_pool_classes()) or 'none registered'}. "
            "Run with --kv-canary none for this model/configuration."
        )
    groups = [build_group(layout, config, device) for layout in extractor(pool, context or PoolContext())]
    pool.kv_canary_groups = groups
    return groups


def groups_still_view(pool: object, groups: Sequence[CanaryBufferGroup], context: Optional[PoolContext] = None) -> bool:
    """Do ``groups`` still view the pool's live K/V buffers (same tensors, same slot count)?

    False when the engine rebuilt or resized the pool after the canary attached (the records and
    zero-copy views would no longer match it).
    """
    layouts = _REGISTRY[type(pool)](pool, context or PoolContext())
    for layout, group in zip(layouts, groups):
        live = [*layout.k_buffers, *(layout.v_buffers or [])]
        if {t.data_ptr() for t in live} != {row.view.data_ptr() for row in group.rows}:
            return False
        if int(live[0].shape[0]) != int(group.rows[0].view.shape[0]):
            return False
    return len(layouts) == len(groups)
