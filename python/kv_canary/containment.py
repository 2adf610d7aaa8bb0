"""``--kv-canary contain``: what to do about a batch of violations, as a plain order for the engine.

The host learns of violations ``SGLANG_KV_CANARY_D2H_DELAY_STEPS`` forwards after
the forward that read the bad slots (+ ``SGLANG_KV_CANARY_D2H_INTERVAL - 1``; see ``d2h``). ``ContainOrder`` names the
requests to abort -- exactly those whose forward read a bad slot (the request id
the host remembered for that forward and batch index) -- with a message naming
the kind and the slot, and the bad slots to evict from the prefix cache. The sweep's rows
(``rid=cache``) and the scrub's (``rid=scrub``) were found at rest, with no reader to name: the engine
evicts them too and aborts every running request whose row holds the slot at its position (it would read
it at its next forward, where a flip outside the window HEAD hashes at every read goes unseen). A reader's
row goes to the holders too: HEAD checks a slot that several requests of a batch read at the same position
after the same predecessor once (``triton_kernels._verify_block``), so its row names the first of them only.
Health violations have neither a request nor a slot: they are only logged.

The engine side (``ContainmentTarget``) aborts the requests the way the engine
aborts and evicts the cache entries holding the slots, the node and everything
below it, so a retry of the same prompt is computed fresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Dict, Iterable, Protocol, Tuple

from .violations import Violation

HOST_SCRUB_RID = "host_scrub"  # a bad HiCache host copy the host scrub found at rest (runner/host_copies)
SCRUB_RID, SWEEP_RID = "scrub", "cache"  # rows of the device scrub and of the sweep: found at rest, no reader
UNKNOWN_RIDS = ("?", SWEEP_RID, "", HOST_SCRUB_RID, SCRUB_RID)  # rows no request read: nobody to abort by name


@dataclass(frozen=True)
class ContainOrder:
    aborts: Dict[str, str]  # rid -> abort message
    slots: Tuple[int, ...]  # bad slots (sorted, unique) to evict from the prefix cache
    # HiCache: the host slots the bad loaded slots came from (their host copies are bad too; sorted, unique)
    host_slots: Tuple[int, ...] = ()
    # (slot, position, abort message) of bad slots found at rest (scrub, sweep) in the engine's slot space: the
    # engine aborts every running request whose row holds that slot at that position (it reads it next forward)
    held_slots: Tuple[Tuple[int, int, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.aborts or self.slots or self.host_slots or self.held_slots)


class ContainmentTarget(Protocol):
    def submit(self, order: ContainOrder) -> None:
        """Queue the aborts and evictions; the engine applies them at its next safe point."""
        ...


def abort_message(v: Violation) -> str:
    return (f"kv-canary contain: aborted: the KV cache this request read failed verification "
            f"(kind={v.kind} group={v.group} slot={v.slot} position={v.position} forward={v.forward})")


def held_abort_message(v: Violation) -> str:
    found = {SCRUB_RID: "the scrub", SWEEP_RID: "the sweep"}.get(v.rid, f"a read by request {v.rid}")
    return (f"kv-canary contain: aborted: the KV cache this request holds failed verification, found by {found} "
            f"(kind={v.kind} group={v.group} slot={v.slot} position={v.position} forward={v.forward})")


def build_order(violations: Iterable[Violation], num_slots: int, already_aborted: Container[str] = (),
                engine_group: str = "") -> ContainOrder:
    """One abort per request id not ``already_aborted`` (its first violation names the message); every
    in-range bad slot; every host slot a bad loaded slot came from (identity ``host_slot``, HiCache); and, for
    rows found at rest (scrub, sweep) or read by a request, in ``engine_group`` (the group whose slots the engine's
    request rows hold), the slot and position whose holders the engine aborts."""
    aborts: Dict[str, str] = {}
    slots, host_slots = set(), set()
    held: Dict[Tuple[int, int], str] = {}
    for v in violations:
        if v.kind.startswith("health:"):
            continue
        if 0 < v.slot < num_slots:
            slots.add(v.slot)
            named = v.rid in (SCRUB_RID, SWEEP_RID) or v.rid not in UNKNOWN_RIDS  # found at rest, or read
            if named and v.group == engine_group and v.position >= 0:
                held.setdefault((v.slot, v.position), held_abort_message(v))
        host_slot = dict(v.identity).get("host_slot")
        if host_slot is not None:
            host_slots.add(int(host_slot))
        if v.rid not in UNKNOWN_RIDS and v.rid not in aborts and v.rid not in already_aborted:
            aborts[v.rid] = abort_message(v)
    return ContainOrder(aborts=aborts, slots=tuple(sorted(slots)), host_slots=tuple(sorted(host_slots)),
                        held_slots=tuple((s, p, m) for (s, p), m in sorted(held.items())))
