"""PD disaggregation: what travels with the KV, and the host's book of what arrived.

With ``--disaggregation-mode prefill/decode`` a decode server's KV slots are
filled by a transfer, not by a forward, so no TAIL write fingerprints them. The
canary therefore sends its own per-slot data along with the KV, through the
transfer engine's own buffer list (no second channel):

* ``records`` of the (single) buffer group: ``int64[num_slots, 4]``, one item
  per slot exactly like the KV rows, so the transfer engine copies record
  ``s`` of the prefill to record ``d`` of the decode whenever it copies KV row
  ``s`` to ``d``; the decode side's HEAD then verifies the transferred slots
  against the fingerprints the prefill computed, and its TAIL writes continue
  the same chain from them.
* ``origin``: ``int64[num_slots, ORIGIN_WIDTH]`` = (bootstrap room, prefill
  slot), written by the prefill's host for every slot it sends; on the decode
  side it names, for a violation on a transferred slot, the PD request (room)
  and the prefill slot it came from: the join key between the two logs.

Both tensors are spliced in as two extra buffers after the KV buffers (an even
count keeps the engine's K-half / V-half pairing of identical lists intact);
item lengths are per page, like the KV buffers'.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

ORIGIN_WIDTH = 2
O_ROOM, O_SLOT = 0, 1
BOOK_CAPACITY = 4096  # PD requests remembered for reports

BufInfos = Tuple[List[int], List[int], List[int]]  # (data ptrs, data byte lengths, item byte lengths)


def new_origin(num_slots: int, device: torch.device) -> torch.Tensor:
    """int64[num_slots, ORIGIN_WIDTH], zero = never received/sent."""
    return torch.zeros((num_slots, ORIGIN_WIDTH), dtype=torch.int64, device=device)


def extra_buf_infos(records: torch.Tensor, origin: torch.Tensor, page_size: int) -> BufInfos:
    """The canary's two transfer buffers, described like the KV pool's (items are pages)."""
    out: BufInfos = ([], [], [])
    for t in (records, origin):
        if not t.is_contiguous():
            raise ValueError("kv-canary: transfer buffers must be contiguous")
        out[0].append(t.data_ptr())
        out[1].append(t.numel() * t.element_size())
        out[2].append(t[0].numel() * t.element_size() * page_size)
    return out


def splice(kv: BufInfos, extra: BufInfos) -> BufInfos:
    """KV buffer infos with the canary's buffers appended (both sides splice identically)."""
    return tuple(list(a) + list(b) for a, b in zip(kv, extra))  # type: ignore[return-value]


def mark_sent(origin: torch.Tensor, page_indices: Sequence[int], page_size: int, room: int) -> None:
    """Prefill side: stamp (room, slot) on every slot of the pages about to be sent.

    Runs on the scheduler thread right before the transfer is queued; on a GPU
    the stream is synchronised so the transfer engine reads the stamped rows.
    """
    pages = torch.as_tensor(list(page_indices), dtype=torch.int64)
    if pages.numel() == 0:
        return
    slots = (pages[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)).reshape(-1)
    rows = torch.stack([torch.full_like(slots, int(room)), slots], dim=1)
    origin[slots.to(origin.device)] = rows.to(origin.device)
    if origin.device.type == "cuda":
        torch.cuda.current_stream(origin.device).synchronize()


@dataclass(frozen=True)
class Arrival:
    """One request whose KV arrived by transfer (decode side): positions [0, received) of ``row``."""

    rid: str
    room: int
    row: int
    received: int


class TransferBook:
    """Host-side memory of PD requests: rid -> bootstrap room, what arrived, what was verified.

    ``slots_verified`` counts received slots whose request ran its first forward
    after arrival: that forward's HEAD verifies every one of them (its prefix is
    exactly the received positions).
    """

    def __init__(self, mode: str, origin: torch.Tensor):
        self.mode = mode  # "prefill" | "decode"
        self.origin = origin
        self._rooms: "OrderedDict[str, int]" = OrderedDict()
        self._received: "OrderedDict[str, int]" = OrderedDict()
        self._unread: Dict[str, int] = {}  # rid -> received slots not read by a forward yet
        self.requests_received = 0
        self.slots_received = 0
        self.slots_verified = 0
        self.fake_requests = 0  # sglang's fake transfers (warmup, health checks): fingerprinted in place

    def reset(self) -> None:
        self.__init__(self.mode, self.origin)

    def note_room(self, rid: str, room: Optional[int]) -> None:
        if room is None:
            return
        self._rooms[rid] = int(room)
        self._rooms.move_to_end(rid)
        while len(self._rooms) > BOOK_CAPACITY:
            self._rooms.popitem(last=False)

    def note_arrival(self, arrival: Arrival) -> None:
        self.note_room(arrival.rid, arrival.room)
        self._received[arrival.rid] = arrival.received
        while len(self._received) > BOOK_CAPACITY:
            self._received.popitem(last=False)
        self._unread[arrival.rid] = arrival.received
        while len(self._unread) > BOOK_CAPACITY:
            self._unread.pop(next(iter(self._unread)))
        self.requests_received += 1
        self.slots_received += arrival.received

    def forward_ran(self, rids: Sequence[str]) -> None:
        """A forward over these requests ran its HEAD: their received slots are verified."""
        if not self._unread:
            return
        for rid in rids:
            n = self._unread.pop(rid, None)
            if n is not None:
                self.slots_verified += n

    def identity(self, rid: str, slot: int, position: int) -> Dict[str, object]:
        """Report fields joining a violation to the prefill side (reads ``origin`` on the host: reports only)."""
        out: Dict[str, object] = {}
        room = self._rooms.get(rid)
        if room is not None:
            out["bootstrap_room"] = room
        received = self._received.get(rid)
        if received is not None and 0 <= position < received and 0 < slot < self.origin.shape[0]:
            o_room, o_slot = (int(x) for x in self.origin[slot].tolist())
            if o_room == 0 and o_slot == 0:
                out["origin"] = "missing"  # the prefill sent no fingerprints (no --kv-canary there?)
            else:
                out["origin_room"] = o_room
                out["origin_slot"] = o_slot
        return out

    def stats(self) -> Dict[str, int]:
        if self.mode != "decode":
            return {}
        return {
            "pd_requests_received": self.requests_received,
            "pd_slots_received": self.slots_received,
            "pd_slots_verified": self.slots_verified,
            "pd_fake_requests": self.fake_requests,
        }
