"""The engine wiring's two context managers, and the error raised when it uses them out of order.

``OutsideBracket`` (``CanaryManager.with_ops_outside_graph``) runs the outside pre-ops on entry and the outside
post-ops on a clean exit; ``ActiveBracket`` (``with_active_single_forward_manager``) routes the patched
``model.forward`` calls inside it to one single-forward manager. Both are classes, not generators: they run on
every forward's host path. They take the manager as the ``Bracketed`` it is (manager.py imports this module, not
the reverse).
"""

from __future__ import annotations

import time
from typing import List, Protocol, Sequence


class Bracketed(Protocol):
    """What ``OutsideBracket`` uses of ``CanaryManager``."""

    _in_outside_bracket: bool
    _eager_tails: int
    outside_host_ns: int  # host time in the outside pre- and post-ops since init (stats: host_us_per_step)

    def _check_index(self, index: int) -> None: ...

    def _pre_ops_outside_graph(self, fb: object) -> None: ...

    def _post_ops_outside_graph(self, fb: object, expected_forwards: int) -> None: ...

    def note_failed_step(self, fb: object) -> None: ...


class CanaryBracketError(RuntimeError):
    """The engine wiring used the canary's context managers out of order."""


class OutsideBracket:
    """``with_ops_outside_graph``'s context manager: outside pre-ops on entry, outside post-ops on a clean exit."""

    __slots__ = ("_m", "_indices", "_fb")

    def __init__(self, manager: Bracketed, indices: Sequence[int], fb: object):
        self._m, self._indices, self._fb = manager, indices, fb

    def __enter__(self) -> None:
        m = self._m
        if m._in_outside_bracket:
            raise CanaryBracketError("kv-canary: with_ops_outside_graph entered twice (nested outer steps)")
        for i in self._indices:
            m._check_index(i)
        m._in_outside_bracket = True
        m._eager_tails = 0
        t0 = time.perf_counter_ns()
        try:
            m._pre_ops_outside_graph(self._fb)
        except BaseException:
            m._in_outside_bracket = False
            raise
        m.outside_host_ns += time.perf_counter_ns() - t0

    def __exit__(self, exc_type, exc, tb) -> None:
        m = self._m
        t0 = time.perf_counter_ns()
        try:
            if exc_type is None:
                m._post_ops_outside_graph(self._fb, len(self._indices))
            else:  # the step raised: a report of its forward still names its requests
                m.note_failed_step(self._fb)
        finally:
            m._in_outside_bracket = False
            m.outside_host_ns += time.perf_counter_ns() - t0


class ActiveBracket:
    """``with_active_single_forward_manager``'s context manager: pushes the manager index, pops it on exit."""

    __slots__ = ("_stack", "_index")

    def __init__(self, stack: List[int], index: int):
        self._stack, self._index = stack, index

    def __enter__(self) -> None:
        self._stack.append(self._index)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stack.pop()
