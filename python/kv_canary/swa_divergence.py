"""The SWA divergence reporter (``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``; seed 002, upstream #26820).

For a hybrid sliding-window pool the HEAD kernels accumulate on the device, per
forward and without any host sync: the verify entries of the full groups and of
the windowed (``swa``) groups, how many of the latter sat at a group slot
different from the engine's (full) slot -- the full -> swa translation really
mattered -- and how many prefix positions were outside the window (not
verified, as attention does not read them). The counts travel with the
ordinary delayed device -> host counter copy; every ``interval`` forwards the
host logs one parseable line::

    kv_canary_swa_divergence=<forward> verify_full=.. verify_swa=.. swa_full_idx_divergence=.. swa_out_of_window_tokens=..

The values are cumulative since init. The three signals the SWA e2e test
asserts (out-of-window tokens >= 1, divergence >= 1, verify_swa < verify_full)
prove the windowed, translated path really ran.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from . import fingerprint as fp

PREFIX = "kv_canary_swa_divergence"
_FIELDS = ("verify_full", "verify_swa", "swa_full_idx_divergence", "swa_out_of_window_tokens")
_LINE = re.compile(PREFIX + r"=(-?\d+)((?: \w+=-?\d+)+)")


@dataclass(frozen=True)
class SwaDivergenceLog:
    forward: int
    verify_full: int
    verify_swa: int
    swa_full_idx_divergence: int
    swa_out_of_window_tokens: int

    @classmethod
    def from_counters(cls, counters: Sequence[int]) -> "SwaDivergenceLog":
        swa = int(counters[fp.C_SWA_VERIFIED])
        return cls(forward=int(counters[fp.C_FORWARD_INDEX]), verify_full=int(counters[fp.C_SLOTS_VERIFIED]) - swa,
                   verify_swa=swa, swa_full_idx_divergence=int(counters[fp.C_SWA_DIVERGENCE]),
                   swa_out_of_window_tokens=int(counters[fp.C_SWA_OUT_OF_WINDOW]))

    def format(self) -> str:
        return f"{PREFIX}={self.forward} " + " ".join(f"{k}={getattr(self, k)}" for k in _FIELDS)

    @classmethod
    def parse(cls, line: str) -> Optional["SwaDivergenceLog"]:
        """The record in ``line`` (anywhere in it), or None."""
        m = _LINE.search(line)
        if m is None:
            return None
        fields = dict(kv.split("=") for kv in m.group(2).split())
        if any(k not in fields for k in _FIELDS):
            return None
        return cls(int(m.group(1)), *(int(fields[k]) for k in _FIELDS))

    @classmethod
    def find_last(cls, text: str) -> Optional["SwaDivergenceLog"]:
        """The last record in a log text, or None."""
        last = None
        for line in text.splitlines():
            if PREFIX in line:
                last = cls.parse(line) or last
        return last
