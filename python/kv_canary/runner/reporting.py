"""Violation reporting: ring rows and health drift -> log lines, counts, ``--kv-canary contain`` orders, stats.

``Reporting`` is a mixin of ``CanaryManager`` (runner/manager.py): the manager's ``poll`` hands it each counter copy
that landed (``_check_health``, then ``_handle_counters``), it reads the new ring rows, logs each distinct violation
once (repeats are only counted), orders the aborts of ``contain`` and raises in ``raise`` mode. It reads the
manager's ``config``, ``groups``, ``counters``, ``ring``, ``perturb``, ``transfer`` and forward/sweep counts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict, deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .. import fingerprint as fp
from ..config import CanaryMode
from ..containment import SCRUB_RID, SWEEP_RID, UNKNOWN_RIDS, ContainmentTarget, build_order
from ..swa_divergence import SwaDivergenceLog
from ..violations import (
    ENGINE_ERROR_PREFIX, STATS_PREFIX, SUMMARY_PREFIX, CanaryViolationError, Violation, decode_rows, format_line,
    health_violation,
)
from .brackets import CanaryBracketError
from .ring_reader import RingReader

logger = logging.getLogger("kv_canary")

RID_HISTORY = 4096  # forwards whose request ids are remembered for reports
HEALTH_COUNTERS = ("forwards", "verify_launches", "write_launches", "slots_written")
SCRUB_BATCH_INDEX = -2  # ring rows of the scrub (the sweep's are -1)
REPORTED_MEMORY = 1 << 16  # distinct violations remembered so repeats are counted, not re-logged
MIN_RING_READ_BUDGET = 256  # ring rows the host reads per poll at most (at least 4 x max_logged_violations)


class Reporting:
    """Mixin of ``CanaryManager``: reads counter copies and ring rows, reports violations, keeps the counts."""

    def _init_reporting(self) -> None:
        """The ring reader, and counts that span the whole run (the reset at init finished keeps them)."""
        self._ring_reader = RingReader(self.ring, self.counters,
                                       budget=max(MIN_RING_READ_BUDGET, 4 * self.config.max_logged_violations))
        self._windowed = any(g.window > 0 for g in self.groups)  # a hybrid sliding-window pool (stats line)
        self._containment: Optional[ContainmentTarget] = None  # --kv-canary contain: the engine's side
        self.contained_requests = 0  # requests --kv-canary contain ordered aborted
        self._contained: "OrderedDict[str, None]" = OrderedDict()  # their rids (bounded)
        self.violations_by_kind: Dict[str, int] = {}  # every reported row (repeats included) by kind
        # what decoding a ring row needs of the groups (fixed at install): their names, each row's (layer, half)
        self._group_names = [g.name for g in self.groups]
        self._group_rows = [[(kv.layer, kv.half) for kv in g.rows] for g in self.groups]

    def _reset_reporting(self) -> None:
        """What restarts with the zeroed device counters when init finishes."""
        # forward index % RID_HISTORY -> (forward index, request ids in batch order, replayed from a CUDA graph);
        # written by the manager's outside post-ops
        self._forward_info: List[Optional[Tuple[int, Sequence[str], bool]]] = [None] * RID_HISTORY
        self._violations_seen = 0
        self.violations_reported = 0
        self.violations_lost = 0
        self.violations_repeated = 0
        self._reported: "OrderedDict[tuple, None]" = OrderedDict()
        self._distinct_reported = 0  # violations logged (or summarized) as new, lost rows included
        self._reason_names: Dict[int, Tuple[str, str]] = {}  # ring reason bits -> (kind, group)
        self.last_counters: Optional[List[int]] = None  # the newest counter copy the host has read
        self._last_stats_forward = 0
        self._last_swa_forward = 0
        # health check: the host's count of slots the TAIL launches should have written, and per counter copy
        # queued (forward, expected slots written, deferred write launches), in order
        self._expected_written = 0
        self._expected_written_at: Deque[Tuple[int, int, int]] = deque()
        self._health_drift: Tuple[int, ...] = (0,) * len(HEALTH_COUNTERS)
        self.health_violations = 0

    def attach_containment(self, target: ContainmentTarget) -> None:
        """The engine's abort/evict side for ``--kv-canary contain`` (it reports the holders of a bad slot found at
        rest that it aborted, when it can: ``on_holders_aborted``)."""
        self._containment = target
        listen = getattr(target, "on_holders_aborted", None)
        if listen is not None:
            listen(self.note_contained)

    def note_contained(self, rids) -> None:
        """Count requests contained, once each: the readers an order names, and the requests the engine aborted for
        holding a bad slot the scrub or the sweep found (no reader named them)."""
        for rid in rids:
            if rid not in self._contained:
                self._contained[rid] = None
                self.contained_requests += 1
        while len(self._contained) > REPORTED_MEMORY:
            self._contained.popitem(last=False)

    def _handle_counters(self, host_counters: List[int], catch_up: bool = False) -> None:
        """Read the ring rows not read yet (one budgeted read per poll; all of them when ``catch_up``)."""
        self.last_counters = host_counters
        total = int(host_counters[fp.C_VIOLATIONS])
        reported = self._distinct_reported
        while self._violations_seen < total:
            first, rows, lost = self._ring_reader.read(self._violations_seen, total)
            self._violations_seen = first + len(rows)
            self.violations_lost += lost
            self._report_rows(first, rows, lost)
            if not catch_up:
                break
        every = self.config.stats_print_every_n_steps
        forward = int(host_counters[fp.C_FORWARD_INDEX])
        swa_every = self.config.swa_divergence_stats_interval
        if swa_every and forward - self._last_swa_forward >= swa_every:
            self._last_swa_forward = forward
            logger.info(SwaDivergenceLog.from_counters(host_counters).format())
        if (every and forward - self._last_stats_forward >= every) or self._distinct_reported > reported:
            self._last_stats_forward = forward
            logger.info(self.stats_line(host_counters))

    def note_failed_step(self, fb: object) -> None:
        """An outer step raised inside its bracket (its post-ops never ran): remember its requests under the forward
        index its TAIL used, so that ``report_before_engine_error`` names them."""
        if self.init_finished:
            self._forward_info[self.forwards % RID_HISTORY] = (self.forwards, self._adapter.rids(fb) or (), None)

    def report_before_engine_error(self, error: BaseException) -> None:
        """The engine's step raised ``error`` (a forward, the sampler, a CUDA error surfacing at a sync): read what
        the device counted up to that point (the failed forward's TAIL included, which ran before its sampler) and
        report it now, before the error ends the process. ``raise``: the ``CanaryViolationError`` propagates,
        chained to ``error``. The failed step's host bookkeeping never ran, so no health check here. A device that
        can no longer be read (a CUDA context lost to a device-side assert) is said in one line with the newest
        counter copy that landed."""
        logger.error(format_line(ENGINE_ERROR_PREFIX, self.forwards, {
            "error": type(error).__name__, "action": "reading_the_canary_counters_before_it_propagates"}))
        try:
            self._d2h.snapshot(self.forwards, force=True)  # the counters as the failed step left them
            for _, host_counters in self._d2h.drain():
                self._handle_counters(host_counters, catch_up=True)
        except CanaryViolationError:
            raise
        except Exception as unread:  # noqa: BLE001 - the engine's error is the one that propagates
            c = self.last_counters
            try:  # copies that landed: on the kernel-write path (d2h.PublishGraphs) a read of host memory only
                landed = self._d2h.ready(1 << 62)
                c = landed[-1][1] if landed else c
            except Exception:  # noqa: BLE001
                pass
            logger.error(format_line(ENGINE_ERROR_PREFIX, self.forwards, {
                "unread": f"{type(unread).__name__}", "violations_counted": -1 if c is None else c[fp.C_VIOLATIONS],
                "violations_read": self._violations_seen}))

    def _report_rows(self, first: int, rows: List[List[int]], lost: int) -> None:
        """Ring rows (sequence numbers from ``first``): repeats of a reported violation are counted without being
        reported again. ``raise`` reports whatever it read, then stops. ``contain`` decodes a repeat to see whom it
        names: a request not contained yet (admitted after the first order, with a prefix hit on the bad slot) is
        reported and contained like a fresh row; ``_report`` still logs the violation once."""
        dedup = self.config.mode is not CanaryMode.RAISE
        contain = self.config.mode is CanaryMode.CONTAIN

        def decode(r: List[int], seq: int) -> Violation:
            return decode_rows(torch.tensor([r]), seq, self._group_names, self._describe_forward, self._group_rows)[0]

        violations: List[Violation] = []
        for k, r in enumerate(rows):
            key = self._row_key(r)
            if dedup and key in self._reported:
                v = decode(r, first + k) if contain else None
                if v is not None and v.rid not in UNKNOWN_RIDS and v.rid not in self._contained:
                    violations.append(v)  # a reader not contained yet
                    continue
                self._reported.move_to_end(key)
                self.violations_repeated += 1
                self.violations_reported += 1
                continue
            violations.append(decode(r, first + k))
        if violations or lost:
            self._report(violations, lost)

    def _row_key(self, r: List[int]) -> tuple:
        """The dedup key of a raw ring row: the same as ``_violation_key`` of its decoded ``Violation``."""
        reason = r[fp.V_REASON]
        names = self._reason_names.get(reason)
        if names is None:
            v = decode_rows(torch.tensor([r]), 0, self._group_names, lambda *_: ("?", None))[0]
            names = self._reason_names[reason] = (v.kind, v.group)
        return names + (r[fp.V_SLOT], r[fp.V_POSITION], r[fp.V_STORED], r[fp.V_EXPECTED])

    @staticmethod
    def _violation_key(v: Violation) -> tuple:
        return (v.kind, v.group, v.slot, v.position, v.stored, v.expected)

    def _describe_forward(self, forward: int, batch_index: int) -> Tuple[str, Optional[bool]]:
        """(request id, replayed from a CUDA graph) for a ring row; '?'/None once forgotten."""
        entry = self._forward_info[forward % RID_HISTORY] if forward >= 0 else None
        _, rids, replayed = entry if entry is not None and entry[0] == forward else (forward, (), None)
        if batch_index == SCRUB_BATCH_INDEX:
            return SCRUB_RID, None  # a scrub row: found by the round-robin whole-slot check
        if batch_index < 0:
            return SWEEP_RID, None  # a sweep row: the slot is held by the prefix cache
        rid = str(rids[batch_index]) if batch_index < len(rids) else "?"
        return rid, replayed

    def _check_health(self, step: int, c: List[int]) -> None:
        """The device must have run HEAD and TAIL for every forward the host counted up to ``step``.

        A canary that silently stopped running (a graph replayed without its
        kernels, an unwired forward path) shows here as a ``kind=health``
        violation, reported once per new discrepancy.
        """
        groups = len(self.groups)
        pending = self._expected_written_at
        while pending and pending[0][0] < step:
            pending.popleft()
        if pending and pending[0][0] == step:
            _, written, deferred = pending.popleft()
        else:
            written, deferred = c[fp.C_SLOTS_WRITTEN], c[fp.C_WRITE_LAUNCHES] - step * groups
        want = (step, step * groups, step * groups + deferred, written)
        got = (c[fp.C_FORWARD_INDEX], c[fp.C_VERIFY_LAUNCHES], c[fp.C_WRITE_LAUNCHES], c[fp.C_SLOTS_WRITTEN])
        drift = (got[0] - want[0], got[1] - want[1], got[2] - want[2], got[3] - want[3])
        if drift == self._health_drift:  # the common case: nothing changed
            return
        bad = [
            health_violation(name, g, w, step)
            for name, g, w, d, old in zip(HEALTH_COUNTERS, got, want, drift, self._health_drift)
            if d != old
        ]
        self._health_drift = drift
        self.health_violations += len(bad)
        self._report(bad, 0)

    def _report(self, violations: List[Violation], lost: int) -> None:
        """Log each new violation once; repeats (the same corrupt slot read again) are only counted."""
        if self.transfer is not None:  # PD: name the bootstrap room and the prefill slot it came from
            violations = [
                dataclasses.replace(v, identity=tuple(self.transfer.identity(v.rid, v.slot, v.position).items()))
                for v in violations
            ]
        if self.host_records is not None:  # HiCache: a loaded slot's line names its host slot
            violations = self.annotate_loads(violations)
        new = []
        for v in violations:
            key = self._violation_key(v)
            if key in self._reported:
                self._reported.move_to_end(key)
                self.violations_repeated += 1
                continue
            self._reported[key] = None
            new.append(v)
        while len(self._reported) > REPORTED_MEMORY:
            self._reported.popitem(last=False)
        self._distinct_reported += len(new) + lost
        limit = self.config.max_logged_violations
        for v in new[:limit]:
            logger.error(v.format())
        hidden = max(0, len(new) - limit) + lost
        if hidden:
            logger.error(format_line(SUMMARY_PREFIX, len(violations) + lost, {"not_itemized": hidden}))
        self.violations_reported += len(violations) + lost
        for v in violations:
            self.violations_by_kind[v.kind] = self.violations_by_kind.get(v.kind, 0) + 1
        if lost:
            self.violations_by_kind["unitemized"] = self.violations_by_kind.get("unitemized", 0) + lost
        if self.config.mode is CanaryMode.CONTAIN:
            self._contain(violations)
        if self.config.mode is CanaryMode.RAISE:
            raise CanaryViolationError(new[:limit] or violations[:limit], lost=hidden)

    def _contain(self, violations: List[Violation]) -> None:
        """Every row counts, repeats included: each names a request that read a bad slot."""
        order = build_order(violations, self.groups[0].num_slots, already_aborted=self._contained,
                            engine_group=self.groups[0].name)
        if not order:
            return
        if self._containment is None:
            raise CanaryBracketError("kv-canary: --kv-canary contain needs the engine's containment side attached")
        self.note_contained(order.aborts)  # (build_order left out the rids already contained)
        self._containment.submit(order)

    def metrics_snapshot(self) -> Dict[str, int]:
        """Cumulative counts for exporters (device counters as of the newest host read)."""
        c = self.last_counters or [0] * fp.NUM_COUNTERS
        return {
            "forwards": self.forwards,
            "slots_verified": int(c[fp.C_SLOTS_VERIFIED]),
            "slots_written": int(c[fp.C_SLOTS_WRITTEN]),
            "slots_swept": int(c[fp.C_SLOTS_SWEPT]),
            "slots_witnessed": int(c[fp.C_SLOTS_WITNESSED]),
            "slots_scrubbed": int(c[fp.C_SLOTS_SCRUBBED]),
            "sweeps": self.sweeps,
            "health_violations": self.health_violations,
            "perturbations": self.perturb.injection_count,
            "contained_requests": self.contained_requests,
        }

    def stats_line(self, host_counters: Optional[List[int]] = None) -> str:
        """The stats log line of ``host_counters`` (default: the newest counter copy read)."""
        c = self.last_counters if host_counters is None else host_counters
        values = [0] * fp.NUM_COUNTERS if c is None else list(c)
        return format_line(
            STATS_PREFIX,
            values[fp.C_FORWARD_INDEX],
            {
                "mode": self.config.mode.value,
                "outer_steps": self.outer_steps,
                # the canary's own host work per outer step (outside pre- and post-ops; a forward replayed from a
                # CUDA graph runs no HEAD or TAIL host code), mean µs since init
                "host_us_per_step": round(self.outside_host_ns / 1e3 / max(1, self.outer_steps), 1),
                "forwards_host": self.forwards,
                "graph_forwards": self.graph_forwards,
                "slots_written": values[fp.C_SLOTS_WRITTEN],
                "slots_verified": values[fp.C_SLOTS_VERIFIED],
                "verify_launches": values[fp.C_VERIFY_LAUNCHES],
                "write_launches": values[fp.C_WRITE_LAUNCHES],
                "sweeps": self.sweeps,
                "slots_swept": values[fp.C_SLOTS_SWEPT],
                "slots_scrubbed": values[fp.C_SLOTS_SCRUBBED],
                "slots_witnessed": values[fp.C_SLOTS_WITNESSED],
                **({"slots_first_read": values[fp.C_SLOTS_FIRST_READ]} if self.config.first_read else {}),
                **({"slots_verified_swa": values[fp.C_SWA_VERIFIED]} if self._windowed else {}),
                "violations": values[fp.C_VIOLATIONS],
                "violations_repeated": self.violations_repeated,
                "health_violations": self.health_violations,
                "perturbations": self.perturb.injection_count,
                "contained_requests": self.contained_requests,
                **({"tails_at_anchor": self.early_tail.early_tails} if self.early_tail is not None else {}),
                **(self.transfer.stats() if self.transfer is not None else {}),
                **(self.host_copies_stats() if self.host_records is not None else {}),
                **(getattr(getattr(self, "_prefix_cache", None), "walk_stats", dict)()),
            },
        )
