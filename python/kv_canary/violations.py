"""Violation records: the device ring, host-side decoding, and the parseable log lines.

Device side: ``int64[capacity, RING_WIDTH]`` rows appended by the HEAD kernel at
``counters[C_VIOLATIONS] % capacity``. Host side: ``Violation`` (one decoded row
plus the request id the host remembered for that forward) and the
``kv_canary_violation=`` / ``kv_canary_stats=`` / ``kv_canary_perturb=`` lines,
each ``prefix=<value>`` followed by space-separated ``key=value`` fields.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from . import fingerprint as fp

VIOLATION_PREFIX = "kv_canary_violation"
SUMMARY_PREFIX = "kv_canary_violation_summary"
STATS_PREFIX = "kv_canary_stats"
PERTURB_PREFIX = "kv_canary_perturb"
INSTALLED_PREFIX = "kv_canary_installed"
READY_PREFIX = "kv_canary_ready"
OFF_PREFIX = "kv_canary_off"
ENGINE_ERROR_PREFIX = "kv_canary_engine_error"  # the engine's step raised: what the canary found up to it
CONTAIN_PREFIX = "kv_canary_contain"  # --kv-canary contain: kv_canary_contain=abort rid=... / =evict slot=...
GROUP_SHIFT = fp.GROUP_SHIFT


def reason_names(bits: int) -> str:
    names = [name for bit, name in sorted(fp.REASON_NAMES.items()) if bits & bit]
    return "+".join(names) if names else "none"


@dataclass(frozen=True)
class Violation:
    seq: int  # global violation number (counters[C_VIOLATIONS] order)
    kind: str  # '+'-joined reason names, e.g. "kv_hash" or "position+chain"
    group: str
    slot: int
    position: int
    rid: str
    row: int  # req_to_token row
    batch_index: int
    stored: int
    expected: int
    forward: int  # canary forward index (0 = first forward after init)
    cuda_graph: Optional[bool]  # that forward was replayed from a CUDA graph (None: unknown)
    # PD disaggregation: (key, value) pairs joining the line to the other side's log
    # (bootstrap_room, origin_room, origin_slot; see kv_canary.transfer); empty otherwise
    identity: Tuple[Tuple[str, object], ...] = ()
    # kind unwritten: (layer, half, rows_unwritten) of the first K/V row the forward left unwritten
    detail: Tuple[Tuple[str, object], ...] = ()

    def format(self) -> str:
        fields = asdict(self)
        fields.pop("identity")
        fields.pop("detail")
        fields.update(self.detail)
        fields.update(self.identity)
        return format_line(VIOLATION_PREFIX, self.seq, fields, skip=("seq",))


_PROCESS_TAGS: Dict[str, object] = {}  # appended to every line this process writes (e.g. tp_rank)


def set_process_tags(**tags: object) -> None:
    """Fields every later line of this process ends with (install sets ``tp_rank``: one log per TP rank)."""
    _PROCESS_TAGS.clear()
    _PROCESS_TAGS.update(tags)


def format_line(prefix: str, head: object, fields: Dict[str, object], skip: Iterable[str] = ()) -> str:
    """``prefix=head k=v k=v`` then the process tags; values must not contain spaces (they become '_')."""
    parts = [f"{prefix}={head}"]
    for key, value in (*fields.items(), *((k, v) for k, v in _PROCESS_TAGS.items() if k not in fields)):
        if key in skip:
            continue
        parts.append(f"{key}={str(value).replace(' ', '_')}")
    return " ".join(parts)


# A prefix may contain '_' (kv_canary_violation_summary); it ends at the first '=', so
# kv_canary_violation never matches a kv_canary_violation_summary line.
_LINE = re.compile(r"(kv_canary_[a-z_]+)=(\S+)((?: [A-Za-z_][A-Za-z0-9_]*=\S*)*)")


def parse_line(line: str, prefix: str) -> Optional[Dict[str, str]]:
    """Parse one ``prefix=head k=v ...`` occurrence in ``line`` (None if absent)."""
    for m in _LINE.finditer(line):
        if m.group(1) != prefix:
            continue
        out = {prefix: m.group(2)}
        for item in m.group(3).split():
            key, _, value = item.partition("=")
            out[key] = value
        return out
    return None


def parse_lines(text: str, prefix: str) -> List[Dict[str, str]]:
    found = []
    for line in text.splitlines():
        parsed = parse_line(line, prefix)
        if parsed is not None:
            found.append(parsed)
    return found


def decode_rows(rows, first_seq: int, group_names, describe_forward, group_rows=None) -> List[Violation]:
    """rows: int64 host tensor [n, RING_WIDTH] in sequence order starting at ``first_seq``.

    ``describe_forward(forward, batch_index) -> (rid, cuda_graph)`` supplies what the host remembers;
    ``group_rows[g][k]``: (layer, half) of group g's k-th K/V row (names an ``unwritten`` row's layer and half).
    """
    out = []
    for k, r in enumerate(rows.tolist()):
        reason = r[fp.V_REASON]
        group_index = reason >> GROUP_SHIFT
        forward = r[fp.V_FORWARD]
        rid, cuda_graph = describe_forward(forward, r[fp.V_BATCH_INDEX])
        out.append(
            Violation(
                seq=first_seq + k,
                kind=reason_names(reason & ((1 << GROUP_SHIFT) - 1)),
                group=group_names[group_index] if 0 <= group_index < len(group_names) else str(group_index),
                slot=r[fp.V_SLOT],
                position=r[fp.V_POSITION],
                rid=rid,
                row=r[fp.V_ROW],
                batch_index=r[fp.V_BATCH_INDEX],
                stored=r[fp.V_STORED],
                expected=r[fp.V_EXPECTED],
                forward=forward,
                cuda_graph=cuda_graph,
                detail=_unwritten_detail(reason, group_index, r, group_rows),
            )
        )
    return out


def _unwritten_detail(reason: int, group_index: int, r, group_rows) -> Tuple[Tuple[str, object], ...]:
    """An ``unwritten`` row's first unwritten (layer, half) and how many rows it left unwritten."""
    if not reason & fp.R_UNWRITTEN:
        return ()
    rows = group_rows[group_index] if group_rows is not None and 0 <= group_index < len(group_rows) else ()
    k = r[fp.V_STORED]
    layer, half = rows[k] if 0 <= k < len(rows) else (-1, "?")
    return (("layer", layer), ("half", half), ("rows_unwritten", r[fp.V_EXPECTED]))


def health_violation(what: str, device_value: int, host_value: int, forward: int) -> Violation:
    """The canary itself did not run as the host launched it (``kind=health``)."""
    return Violation(
        seq=-1, kind=f"health:{what}", group="*", slot=-1, position=-1, rid="?", row=-1, batch_index=-1,
        stored=device_value, expected=host_value, forward=forward, cuda_graph=None,
    )


class CanaryViolationError(RuntimeError):
    """Raised by ``--kv-canary raise`` when the KV cache failed verification."""

    def __init__(self, violations: List[Violation], lost: int = 0):
        self.violations = violations
        lines = "\n".join(v.format() for v in violations)
        extra = f"\n({lost} more violations were not itemized: the device ring overflowed)" if lost else ""
        super().__init__(
            f"kv-canary detected {len(violations) + lost} KV-cache violation(s); serving stopped "
            f"(--kv-canary raise):\n{lines}{extra}"
        )
