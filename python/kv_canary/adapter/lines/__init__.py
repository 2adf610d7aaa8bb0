"""Pick the adapter for the running sglang release, once, from ``sglang.__version__``.

| sglang | adapter | in-tree kv_canary |
| --- | --- | --- |
| 0.5.12, 0.5.12.post1 | ``v0_5_12`` | none |
| 0.5.13, 0.5.13.post1 | ``v0_5_13`` | yes: as 0.5.15 (a diff of ``v0_5_15``: the decode capture hook, the policy) |
| 0.5.14, 0.5.15, 0.5.15.post1 | ``v0_5_15`` | yes: as 0.5.17 (a diff of ``v0_5_17``: the KV sizing hook, the policy) |
| 0.5.16, 0.5.17 | ``v0_5_17`` | yes: as 0.5.23 (a diff of ``v0_5_23``; CUDA graphs verified on the GPU host) |
| 0.5.18 | ``v0_5_18`` | yes: as 0.5.17 (``capture_one_shape`` gained ``dsa_variant=``; its policy) |
| 0.5.19 | ``v0_5_19`` | yes: as 0.5.18 (the store hook on ``_insert_helper``, ``Req.kv``) |
| 0.5.20 | ``v0_5_20`` | yes: as 0.5.19 (a msgspec ``ServerArgs``: checked after ``resolve_once``; its policy) |
| 0.5.21 | ``v0_5_21`` | yes: as 0.5.23 (``ForwardBatch.init_new`` lacks 4 keywords; its policy) |
| 0.5.22 | ``v0_5_22`` | yes: as 0.5.23 (a diff of ``v0_5_23``: its PD sender differs; PD refused, never run) |
| 0.5.23 | ``v0_5_23`` | yes: the plugin takes its place (``SGLANG_KV_CANARY_IMPL=in-tree`` keeps sglang's own) |

A line covers the releases (``SglangLine.versions``) on which every hook target it relies on has the signature
it expects (``fence``; ``release_targets.json``, read from each release's wheel by ``scripts/release_targets.py``).
At startup the fence checks the running sglang the same way: a target that is missing or differs refuses
``--kv-canary`` (other than ``none``), naming the release, the target and what differs; nothing of the line is
installed. A release a line maps by the fence alone, with no smoke run on it (``SglangLine.untested_versions``),
runs only with ``ALLOW_UNTESTED_ENV`` (below), else it is refused naming that env var. A release newer than the
newest line is refused too, listing what differs, unless its targets all match the newest line and
``SGLANG_KV_CANARY_ALLOW_UNTESTED_RELEASE=1`` (``ALLOW_UNTESTED_ENV``) lets it run untested (the startup lines say
so). Any other release: the plugin installs nothing and a ``--kv-canary`` other
than ``none`` is refused at startup, naming the version and the supported ones (``refusal``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from .base import SglangLine

# line (the release it was built on) -> adapter module of this package; each line lists the releases it covers
LINE_MODULES = {"0.5.12": "v0_5_12", "0.5.13": "v0_5_13", "0.5.15": "v0_5_15", "0.5.17": "v0_5_17", "0.5.18": "v0_5_18",
                "0.5.19": "v0_5_19", "0.5.20": "v0_5_20", "0.5.21": "v0_5_21", "0.5.22": "v0_5_22", "0.5.23": "v0_5_23"}
IMPL_ENV = "SGLANG_KV_CANARY_IMPL"
IMPL_PLUGIN, IMPL_IN_TREE = "plugin", "in-tree"
ALLOW_UNTESTED_ENV = "SGLANG_KV_CANARY_ALLOW_UNTESTED_RELEASE"
# hook targets -> their signatures on the running sglang (fence.observed_targets; a stored release's in tests)
Observe = Callable[[Iterable[str]], Mapping[str, Optional[str]]]


def release_modules() -> Dict[str, str]:
    """release -> adapter module, from each line's ``versions`` and ``untested_versions``."""
    return {version: module for module in LINE_MODULES.values()
            for version in load_line(module).versions + load_line(module).untested_versions}


def supported_versions() -> Tuple[str, ...]:
    """The releases served without the opt-in (a smoke ran on them)."""
    return tuple(version for module in LINE_MODULES.values() for version in load_line(module).versions)


def release_key(version: str) -> Tuple[int, ...]:
    """``0.5.12.post1`` -> (0, 5, 12, 1); a pre/dev/local suffix counts as the release itself."""
    parts: List[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece.startswith("post") else piece
        if not digits.isdigit():
            break
        parts.append(int(digits))
    return tuple(parts + [0] * max(0, 4 - len(parts)))


class UnsupportedSglang(RuntimeError):
    """This sglang release (or the chosen implementation) has no adapter here."""


@dataclass(frozen=True)
class LineChoice:
    """``line`` to register, or None with ``reason`` (then ``refuse`` says whether --kv-canary must be refused)."""

    version: str
    line: Optional[SglangLine]
    reason: str = ""
    refuse: bool = False
    untested: bool = False  # a release newer than the line's, let in by ALLOW_UNTESTED_ENV (its targets all match)


def _flag(environ: Mapping[str, str], name: str) -> bool:
    """A 1/0 env var (unset: 0), read with the canary config's own parser; a bad value refuses the release."""
    from ...config import CanaryConfigError, _parse_bool

    raw = str(environ.get(name, "") or "")
    try:
        return bool(raw.strip()) and _parse_bool(name, raw)
    except CanaryConfigError as exc:
        raise UnsupportedSglang(str(exc)) from None


def choose_line(version: str, *, has_in_tree_canary: bool, environ: Optional[Mapping[str, str]] = None,
                observe: Optional[Observe] = None) -> LineChoice:
    """The adapter for sglang ``version``; pure (unit-tested without sglang). ``observe``: the fence (None: no
    signature check, the release table alone decides)."""
    environ = os.environ if environ is None else environ
    impl = str(environ.get(IMPL_ENV, IMPL_PLUGIN) or IMPL_PLUGIN).strip().lower()
    if impl not in (IMPL_PLUGIN, IMPL_IN_TREE):
        raise UnsupportedSglang(f"{IMPL_ENV}={impl!r}: expected {IMPL_PLUGIN} (default) or {IMPL_IN_TREE}")
    if impl == IMPL_IN_TREE:
        if not has_in_tree_canary:
            raise UnsupportedSglang(f"{IMPL_ENV}={IMPL_IN_TREE}: sglang {version} ships no in-tree kv_canary; "
                                    f"unset {IMPL_ENV} to use the plugin")
        return LineChoice(version, None, f"{IMPL_ENV}={IMPL_IN_TREE}: sglang {version}'s own kv_canary serves "
                                         "--kv-canary; the plugin stays out")
    allow_untested = _flag(environ, ALLOW_UNTESTED_ENV)
    module = release_modules().get(version)
    if module is not None:
        line = load_line(module)
        diffs = _fence(line, observe, has_in_tree_canary)
        if diffs:
            return LineChoice(version, None, fence_message(version, line, diffs, untested=False), refuse=True)
        if version in line.untested_versions:
            if not allow_untested:
                return LineChoice(version, None, untested_message(version, line), refuse=True)
            return LineChoice(version, line, f"sglang {version}: its hook targets all match the {line.name} line, but "
                                             f"no smoke has run on it; run untested ({ALLOW_UNTESTED_ENV}=1)",
                              untested=True)
        return LineChoice(version, line)
    newest = load_line(LINE_MODULES[max(LINE_MODULES, key=release_key)])
    if release_key(version) > release_key(newest.name) and observe is not None:
        diffs = _fence(newest, observe, has_in_tree_canary)
        if diffs or not allow_untested:
            return LineChoice(version, None, fence_message(version, newest, diffs, untested=True), refuse=True)
        return LineChoice(version, newest, f"sglang {version} is newer than the newest tested release "
                                           f"({newest.name}); its hook targets all match the {newest.name} line, "
                                           f"run untested ({ALLOW_UNTESTED_ENV}=1)", untested=True)
    reason = unsupported_message(version, has_in_tree_canary)
    if observe is not None:  # what keeps the closest line (fewest differences) out, named
        near = min(((_fence(load_line(m), observe, has_in_tree_canary), name) for name, m in LINE_MODULES.items()),
                   key=lambda d: (len(d[0]), [-k for k in release_key(d[1])]))
        reason += f" (the {near[1]} line's hook targets differ here: {'; '.join(near[0])})"
    return LineChoice(version, None, reason, refuse=True)


def _fence(line: SglangLine, observe: Optional[Observe], has_in_tree_canary: bool) -> List[str]:
    if observe is None:
        return []
    from .fence import differences

    diffs = differences(line, observe(line.all_hooks()))
    if line.in_tree_canary != has_in_tree_canary:
        diffs.insert(0, f"sglang.srt.kv_canary {'is missing' if line.in_tree_canary else 'exists'} "
                        f"(sglang {line.name}: {'ships' if line.in_tree_canary else 'has no'} an in-tree kv_canary)")
    return diffs


def fence_message(version: str, line: SglangLine, diffs: List[str], *, untested: bool) -> str:
    """The fence's refusal: the release, the line, each target that differs, and what to do."""
    if untested and not diffs:
        return (f"sglang {version} is newer than the newest release sglang-kv-canary was tested on ({line.name}); "
                f"its hook targets all match the {line.name} line: set {ALLOW_UNTESTED_ENV}=1 to run it untested, "
                f"install one of {', '.join(supported_versions())}, or run with --kv-canary none")
    head = (f"sglang {version} is newer than the newest release sglang-kv-canary was tested on ({line.name}) and"
            if untested else f"sglang {version}: the sglang-kv-canary {line.name} line's hook targets differ on this "
                             "install (not stock sglang?), so nothing of it is installed;")
    return (f"{head} {len(diffs)} hook target(s) differ from the {line.name} line: {'; '.join(diffs)}. Install "
            f"stock sglang {' or '.join(supported_versions())}, or run with --kv-canary none")


def untested_message(version: str, line: SglangLine) -> str:
    return (f"sglang {version} has not been run with sglang-kv-canary: its hook targets all match the {line.name} line "
            f"(read from its wheel), but no smoke ran on it; set {ALLOW_UNTESTED_ENV}=1 to run it untested, install "
            f"one of {', '.join(supported_versions())}, or run with --kv-canary none")


def unsupported_message(version: str, has_in_tree_canary: bool) -> str:
    msg = (f"sglang {version} is not supported by sglang-kv-canary (supported: {', '.join(supported_versions())}); "
           "install one of those, or run with --kv-canary none")
    if has_in_tree_canary:
        msg += f", or set {IMPL_ENV}={IMPL_IN_TREE} to use sglang's own in-tree kv_canary"
    return msg


def load_line(module: str) -> SglangLine:
    return importlib.import_module(f"{__name__}.{module}").LINE


_current: Optional[LineChoice] = None


def current_choice() -> LineChoice:
    """The choice for the installed sglang (computed once per process)."""
    global _current
    if _current is None:
        import importlib.util

        from sglang.version import __version__ as version

        from .fence import observed_targets

        _current = choose_line(version, has_in_tree_canary=importlib.util.find_spec("sglang.srt.kv_canary") is not None,
                               observe=observed_targets)
    return _current


def current_line() -> SglangLine:
    choice = current_choice()
    if choice.line is None:
        raise UnsupportedSglang(choice.reason)
    return choice.line
