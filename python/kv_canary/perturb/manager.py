"""``PerturbManager``: deliberate KV corruption that proves the canary detects each class.

Modes (env-var probabilities per forward, after a warmup gate):

* ``req_to_token`` (pre-forward): one read entry of a running request points at
  another slot of the same request for the duration of this forward, then is
  restored (a transient mapping bug; restoring keeps sglang's allocator sound).
* ``real_kv_used`` (pre-forward): flip a K/V byte of a slot this forward reads.
* ``real_kv_unused_cache`` (pre-forward): flip a K/V byte of a slot only the
  radix cache holds; only the sweep (or a later prefix hit) reads it.
* ``real_kv_post_forward`` (post-forward): flip a K/V byte of a slot this
  forward just wrote, stream-ordered after its TAIL write; the next read catches it.
* ``transfer`` (PD decode side, pre-forward): flip a K/V byte of a slot a
  request received by transfer, after arrival and before its first read (with
  its own XOR mask: it never cancels a prefill-side flip of the same byte).
* ``position_shift`` (pre-forward, decode forwards): the whole forward runs at
  positions + 1 (a position bookkeeping bug: RoPE rotates K for the wrong
  position); TAIL catches it in that forward.
* ``next_token_swap`` (pre-forward, decode forwards): two requests are fed each
  other's next token (a future-token resolution bug; upstream swaps them at the
  sampler exit); TAIL catches both in that forward.
* ``host_copy`` / ``storage_page`` (HiCache): a byte of a settled host copy / of a page the canary wrote to the
  storage tier (``host_copy``, ``storage_page``); caught when loaded back.
* ``write_dropped`` / ``write_dropped_layer`` / ``write_misdirected`` (pre-forward, armed for one forward):
  one token's K/V store dropped in every layer / in one layer, or landing in the neighbouring slot
  (``write_paths``); the write witness catches each in that forward's TAIL.

K/V flips land anywhere in the slot by default (``SGLANG_KV_CANARY_PERTURB_KV_BYTES``).

Every injection is one parseable ``kv_canary_perturb=<mode>`` line with the
group, slot, request, position and forward index.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable, List, Optional, Sequence

import torch

from ..config import CanaryConfig, CanaryConfigError
from ..views import ForwardView, HostBatch
from ..buffer_groups import CanaryBufferGroup
from ..violations import PERTURB_PREFIX, format_line
from .real_kv import TRANSFER_FLIP_MASK, check_flip_spec, flip_kv_byte
from .slot_picker import pick_read_slot
from .write_paths import WriteRedirect, pick_write_lane

logger = logging.getLogger("kv_canary")
ANY_GROUP = "*"  # SGLANG_KV_CANARY_PERTURB_TARGET_GROUP: a random group per injection


class WarmupGate:
    """Open once ``warmup_steps`` forwards have run since init finished."""

    def __init__(self, warmup_steps: int):
        self._warmup_steps = warmup_steps

    def is_open(self, forward_index: int) -> bool:
        return forward_index >= self._warmup_steps


class PerturbManager:
    def __init__(self, *, config: CanaryConfig, groups: Sequence[CanaryBufferGroup], req_to_token: torch.Tensor):
        self._config = config
        self._req_to_token = req_to_token
        self._rng = random.Random(config.perturb_seed)
        self._gate = WarmupGate(config.perturb_warmup_steps)
        # "*": each K/V injection hits a group drawn at random (one server exercises every group)
        self._groups = list(groups) if config.perturb_target_group == ANY_GROUP else []
        self._group = self._target_group(groups, config.perturb_target_group)
        if config.any_perturbation:
            for group in self._groups or [self._group]:
                check_flip_spec(group, config.perturb_kv_bytes)
        self._prefix_cache = None  # RadixCacheView, attached by the adapter
        self._restore: List[Callable[[], None]] = []
        self._standing: dict = {}  # the XOR left at each flipped K/V byte (real_kv.flip_kv_byte: no flip undoes one)
        self.injections: List[str] = []  # formatted lines, newest last (bounded)
        self.injection_count = 0  # injections so far (SGLANG_KV_CANARY_PERTURB_MAX_INJECTIONS caps it)
        self.active = config.any_perturbation  # read on every forward's host path: computed once
        # the write-path modes' device state; the adapter wraps the engine's KV store methods with it
        self.write_redirect = (WriteRedirect(groups[0].num_slots, groups[0].records.device)
                               if any(p > 0 for p in self._write_probs()) else None)
        self._armed = False
        self._lock = threading.Lock()  # the storage mode draws on the engine's storage thread
        self._count_lock = threading.Lock()

    def _write_probs(self):
        c = self._config
        return (c.perturb_write_dropped_prob, c.perturb_write_dropped_layer_prob, c.perturb_write_misdirected_prob)

    @staticmethod
    def _target_group(groups: Sequence[CanaryBufferGroup], name: str) -> CanaryBufferGroup:
        if not name or name == ANY_GROUP:
            return groups[0]
        for g in groups:
            if g.name == name:
                return g
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_PERTURB_TARGET_GROUP={name!r}: this pool has groups "
            f"{', '.join(g.name for g in groups)} (or '{ANY_GROUP}': a random group per injection)"
        )

    def _exhausted(self) -> bool:
        cap = self._config.perturb_max_injections
        return cap > 0 and self.injection_count >= cap

    def attach_prefix_cache(self, prefix_cache) -> None:
        self._prefix_cache = prefix_cache

    def _draw(self, prob: float) -> bool:
        return prob > 0 and not self._exhausted() and self._rng.random() < prob

    # ------------------------------------------------------------------ pre-forward

    def perturb_pre_forward(self, *, forward_index: int, host_batch: Callable[[], Optional[HostBatch]],
                            view: Callable[[], ForwardView]) -> None:
        """The pre-forward modes, for the forward about to run as ``forward_index``."""
        if not self._gate.is_open(forward_index) or self._exhausted():
            return
        c = self._config
        batch: Optional[HostBatch] = None
        if self._draw(c.perturb_position_shift_prob):
            batch = batch or host_batch()
            if batch is not None and set(batch.new_lens) == {1}:
                self._position_shift(batch, view(), forward_index)
        if self._draw(c.perturb_next_token_swap_prob):
            batch = batch or host_batch()
            if batch is not None and set(batch.new_lens) == {1}:
                self._next_token_swap(batch, view(), forward_index)
        if self._draw(c.perturb_req_to_token_prob):
            batch = batch or host_batch()
            if batch is not None:
                self._req_to_token_mode(batch, forward_index)
        if self._draw(c.perturb_real_kv_used_prob):
            batch = batch or host_batch()
            if batch is not None:
                self._real_kv_used(batch, forward_index)
        if self._draw(c.perturb_real_kv_unused_cache_prob) and self._prefix_cache is not None:
            self._real_kv_unused_cache(forward_index)
        if self.write_redirect is not None and self.write_redirect.installed:
            for mode, prob in zip(("write_dropped", "write_dropped_layer", "write_misdirected"), self._write_probs()):
                if not self._armed and self._draw(prob):
                    batch = batch or host_batch()
                    if batch is not None:
                        self._write_path(mode, batch, view(), forward_index)

    def _write_path(self, mode: str, batch: HostBatch, view: ForwardView, forward_index: int) -> None:
        """Arm one write-path perturbation for this forward (``write_paths``)."""
        picked = pick_write_lane(batch, self._rng)
        redirect = self.write_redirect
        if picked is None or picked.lane >= int(view.out_cache_loc.shape[0]):
            return
        slot = int(view.out_cache_loc[picked.lane].item())
        layers = sorted(redirect.layers_seen)
        if slot <= 0 or (mode == "write_dropped_layer" and not layers):
            return
        layer = self._rng.choice(layers) if mode == "write_dropped_layer" else -1
        target = -1 if mode == "write_misdirected" else 0
        redirect.arm(picked.lane, layer, target)
        self._armed = True
        landed = (slot + 1 if slot + 1 < redirect.num_slots else slot - 1) if target < 0 else 0
        self._log(mode, slot=slot, rid=picked.rid, position=picked.position, forward=forward_index,
                  layer_id=layer, landed_in=landed)

    def _req_to_token_mode(self, batch: HostBatch, forward_index: int) -> None:
        entry = pick_read_slot(batch, self._req_to_token, self._rng)
        if entry is None:
            return
        read = batch.read_positions(entry.batch_index)
        if entry.position == len(read) - 1:
            # The last read slot is also the predecessor this forward's TAIL links new tokens to;
            # corrupting it would leave a wrong chain behind after the restore. Skip this draw.
            return
        others = [q for q in read if q != entry.position]
        q = self._rng.choice(others)
        row, pos = entry.row, entry.position
        new_slot = int(self._req_to_token[row, q].item())
        self._req_to_token[row, pos] = new_slot
        original = entry.slot
        self._restore.append(lambda: self._req_to_token.__setitem__((row, pos), original))
        self._log("req_to_token", slot=new_slot, rid=entry.rid, position=pos, forward=forward_index,
                  row=row, original_slot=original, from_position=q)

    def _position_shift(self, batch: HostBatch, view: ForwardView, forward_index: int) -> None:
        n = len(batch.rows)
        view.positions[:n].add_(1)  # the batch's own positions tensor: the forward runs with it
        self._log("position_shift", slot=-1, rid=batch.rids[0], position=batch.seq_lens[0] - 1,
                  forward=forward_index, requests=n, shift=1)

    def _next_token_swap(self, batch: HostBatch, view: ForwardView, forward_index: int) -> None:
        """Two requests of the decode batch are fed each other's token (one neighbouring id when they agree)."""
        n = len(batch.rows)
        own = [int(t) for t in view.input_ids[:n].tolist()]
        pair = self._rng.sample(range(n), 2) if n > 1 else [0]
        if len(pair) == 2 and own[pair[0]] != own[pair[1]]:
            fed = {pair[0]: own[pair[1]], pair[1]: own[pair[0]]}
        else:
            i = pair[0]
            fed = {i: own[i] - 1 if own[i] > 0 else own[i] + 1}  # a neighbouring id: inside the vocabulary
        for i, token in fed.items():
            view.input_ids[i] = token  # the batch's own input_ids: the forward is fed it
            self._log("next_token_swap", slot=-1, rid=batch.rids[i], position=batch.seq_lens[i] - 1,
                      forward=forward_index, fed=token, own=own[i])

    def _pick_group(self) -> None:
        """With target group '*', draw the group the next K/V injection hits."""
        if self._groups:
            self._group = self._rng.choice(self._groups)

    def _group_slot(self, engine_slot: int) -> int:
        """The target group's slot for an engine slot (a translated group: its map; <= 0: none)."""
        slot_map = self._group.slot_map
        if slot_map is None:
            return engine_slot
        if not 0 <= engine_slot < int(slot_map.shape[0]):
            return -1
        return int(slot_map[engine_slot].item())

    def _translated_fields(self, engine_slot: int) -> dict:
        return {} if self._group.slot_map is None else {"engine_slot": engine_slot}

    def _real_kv_used(self, batch: HostBatch, forward_index: int) -> None:
        self._pick_group()
        # a windowed group: only what its attention reads (the last ``window`` positions) is a read slot
        entry = pick_read_slot(batch, self._req_to_token, self._rng, window=self._group.window)
        if entry is None:
            return
        slot = self._group_slot(entry.slot)
        if slot <= 0:
            return
        flip = flip_kv_byte(self._group, slot, self._rng, self._config.perturb_kv_bytes,
                            standing=self._standing)
        self._log("real_kv_used", slot=slot, rid=entry.rid, position=entry.position, forward=forward_index,
                  half=flip.half, layer=flip.layer, byte=flip.byte, hashed=int(flip.hashed),
                  **self._translated_fields(entry.slot))

    def _real_kv_unused_cache(self, forward_index: int) -> None:
        picked = self._prefix_cache.pick_unused_slot(self._rng)
        if picked is None:
            return
        engine_slot, position = picked
        self._pick_group()
        slot = self._group_slot(engine_slot)  # a translated group: 0 where its KV was released (SWA tombstone)
        if slot <= 0:
            return
        flip = flip_kv_byte(self._group, slot, self._rng, self._config.perturb_kv_bytes,
                            standing=self._standing)
        self._log("real_kv_unused_cache", slot=slot, rid="cache", position=position, forward=forward_index,
                  half=flip.half, layer=flip.layer, byte=flip.byte, hashed=int(flip.hashed),
                  **self._translated_fields(engine_slot))

    def perturb_transferred(self, *, forward_index: int, arrivals) -> None:
        """PD decode side: per arrived request (``transfer.Arrival``), maybe flip a byte of one received slot."""
        if not self._gate.is_open(forward_index):
            return
        for a in arrivals:
            if a.received <= 0 or not self._draw(self._config.perturb_transfer_prob):
                continue
            position = self._rng.randrange(a.received)
            slot = int(self._req_to_token[a.row, position].item())
            # Its own mask: a PD pair with one SGLANG_KV_CANARY_PERTURB_SEED draws mirrored streams, and a
            # prefill-side real_kv_post_forward flip (0xFF) of this very byte would otherwise be undone.
            flip = flip_kv_byte(self._group, slot, self._rng, self._config.perturb_kv_bytes,
                                mask=TRANSFER_FLIP_MASK, standing=self._standing)
            self._log("transfer", slot=slot, rid=a.rid, position=position, forward=forward_index,
                      bootstrap_room=a.room, half=flip.half, layer=flip.layer, byte=flip.byte,
                      hashed=int(flip.hashed))

    # ------------------------------------------------------------------ post-forward

    def perturb_post_forward(self, *, forward_index: int, written: Callable[[], Sequence[int]]) -> None:
        """Undo transient pre-forward corruption; run the post-forward mode for forward ``forward_index``."""
        while self._restore:
            self._restore.pop()()
        if self._armed:  # a write-path perturbation lasts one forward
            self.write_redirect.disarm()
            self._armed = False
        if (not self._gate.is_open(forward_index) or self._exhausted()
                or not self._draw(self._config.perturb_real_kv_post_forward_prob)):
            return
        slots = [s for s in written() if s > 0]
        if not slots:
            return
        engine_slot = self._rng.choice(slots)
        self._pick_group()
        slot = self._group_slot(engine_slot)
        if slot <= 0:
            return
        flip = flip_kv_byte(self._group, slot, self._rng, self._config.perturb_kv_bytes,
                            standing=self._standing)
        self._log("real_kv_post_forward", slot=slot, rid="?", position=-1, forward=forward_index,
                  half=flip.half, layer=flip.layer, byte=flip.byte, hashed=int(flip.hashed),
                  **self._translated_fields(engine_slot))

    def perturb_host_copies(self, *, forward_index: int, backups, host_rows) -> list:
        """HiCache: per settled backup (``backups``: int host-slot tensors), maybe flip a byte of one of its host
        copies (``host_copy.flip_host_byte``); the host slots flipped."""
        from .host_copy import flip_host_byte

        flipped = []
        if not self._gate.is_open(forward_index):
            return flipped
        for host_idx in backups:
            if host_idx.numel() == 0 or not self._draw(self._config.perturb_host_copy_prob):
                continue
            host_slot = int(host_idx[self._rng.randrange(host_idx.numel())])
            flip = flip_host_byte(self._group, host_rows, host_slot, self._rng, self._config.perturb_kv_bytes)
            self._log("host_copy", host_slot=host_slot, slot=-1, forward=forward_index, half=flip.half,
                      layer=flip.layer, byte=flip.byte, hashed=int(flip.hashed))
            flipped.append(host_slot)
        return flipped

    def perturb_storage_page(self, *, forward_index: int, key: str, geometry, xor_at) -> int:
        """HiCache storage: per page the canary wrote (``key``), maybe flip one K/V byte of it where it rests
        (``storage_page.flip_stored_byte``; ``xor_at(offset, mask)``); the flipped page slot, or -1. Runs on the
        engine's storage thread."""
        from .storage_page import flip_stored_byte

        with self._lock:
            if not self._gate.is_open(forward_index) or not self._draw(self._config.perturb_storage_page_prob):
                return -1
            page_slot, flip = flip_stored_byte(self._group, geometry, self._rng, self._config.perturb_kv_bytes, xor_at)
            self._log("storage_page", key=key, page_slot=page_slot, slot=-1, forward=forward_index, half=flip.half,
                      layer=flip.layer, byte=flip.byte, hashed=int(flip.hashed))
        return page_slot

    def _log(self, mode: str, **fields) -> None:
        line = format_line(PERTURB_PREFIX, mode, {"group": self._group.name, **fields})
        logger.warning(line)
        with self._count_lock:  # the storage mode logs from the engine's storage thread
            self.injection_count += 1
            self.injections.append(line)
            del self.injections[:-1000]
