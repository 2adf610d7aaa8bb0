"""KV pool -> canary buffer groups (records + hash views per slot index space).

A *buffer group* is one index space of KV slots that attention reads: its
fingerprint records plus zero-copy int32 views of the real K/V bytes to hash.
An MHA pool has one group (``full``); a hybrid sliding-window pool will have two
(``full`` and ``swa``, the latter with a slot translation); an MLA pool has no
V half. Pool classes are registered by the adapter layer with a
``PoolLayout`` extractor, so this module never names an engine class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .config import CanaryConfig, CanaryConfigError
from .fingerprint import RECORD_WIDTH

MAX_HASHED_LAYERS = 4


@dataclass(frozen=True)
class PoolLayout:
    """What a pool exposes for one group: per-layer K (and V) buffers, ``[num_slots, ...]``."""

    name: str
    k_buffers: Sequence[torch.Tensor]
    v_buffers: Optional[Sequence[torch.Tensor]]  # None for MLA-style pools (no V half)
    slot_translation: Optional[torch.Tensor] = None  # full slot -> this group's slot (SWA)


@dataclass(frozen=True)
class CanaryBufferGroup:
    """Records and hash views of one slot index space.

    records: int64[num_slots, RECORD_WIDTH] (zeros = never written)
    k_views / v_views: int32[num_slots, row_words], live views of hashed layers
    hash_words: 32-bit words hashed from the start of each K (and V) row
    """

    name: str
    records: torch.Tensor
    k_views: Tuple[torch.Tensor, ...]
    v_views: Tuple[torch.Tensor, ...]
    hash_words: int
    hashed_layers: Tuple[int, ...]
    slot_translation: Optional[torch.Tensor] = None

    @property
    def num_slots(self) -> int:
        return int(self.records.shape[0])

    @property
    def has_v(self) -> bool:
        return len(self.v_views) > 0

    def hashed_words(self, slots: torch.Tensor) -> torch.Tensor:
        """int32[n, words] of the given slots, canonical order (per layer: K words, then V words)."""
        parts = []
        for i in range(len(self.k_views)):
            parts.append(self.k_views[i][slots, : self.hash_words])
            if self.has_v:
                parts.append(self.v_views[i][slots, : self.hash_words])
        return torch.cat(parts, dim=1)


LayoutExtractor = Callable[[object], List[PoolLayout]]
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
    for layer in config.kv_hash_layers:
        if layer >= num_layers:
            raise CanaryConfigError(
                f"SGLANG_KV_CANARY_KV_HASH_LAYERS names layer {layer}, but pool group "
                f"'{layout.name}' has {num_layers} layers (0..{num_layers - 1})"
            )
    if len(config.kv_hash_layers) > MAX_HASHED_LAYERS:
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_KV_HASH_LAYERS names {len(config.kv_hash_layers)} layers; "
            f"at most {MAX_HASHED_LAYERS} are supported"
        )
    k_views = tuple(int32_row_view(layout.k_buffers[i]) for i in config.kv_hash_layers)
    v_views = (
        tuple(int32_row_view(layout.v_buffers[i]) for i in config.kv_hash_layers)
        if layout.v_buffers is not None
        else ()
    )
    row_words = min(v.shape[1] for v in k_views + v_views)
    hash_words = min(config.kv_hash_bytes // 4, row_words)
    num_slots = int(k_views[0].shape[0])
    records = torch.zeros((num_slots, RECORD_WIDTH), dtype=torch.int64, device=device)
    return CanaryBufferGroup(
        name=layout.name,
        records=records,
        k_views=k_views,
        v_views=v_views,
        hash_words=hash_words,
        hashed_layers=tuple(config.kv_hash_layers),
        slot_translation=layout.slot_translation,
    )


def attach_canary_buffers(pool: object, config: CanaryConfig, device: torch.device) -> List[CanaryBufferGroup]:
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
    groups = [build_group(layout, config, device) for layout in extractor(pool)]
    pool.kv_canary_groups = groups
    return groups
