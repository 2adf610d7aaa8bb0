"""Pick the adapter for the running sglang release, once, from ``sglang.__version__``.

| sglang | adapter | in-tree kv_canary |
| --- | --- | --- |
| 0.5.12 | ``v0_5_12`` | none |
| 0.5.17 | ``v0_5_17`` | yes: as 0.5.23 (``v0_5_17`` is a diff of ``v0_5_23``; CUDA graphs verified on the GPU host) |
| 0.5.23 | ``v0_5_23`` | yes: the plugin takes its place (``SGLANG_KV_CANARY_IMPL=in-tree`` keeps sglang's own) |

Any other release: the plugin installs nothing and a ``--kv-canary`` other than ``none`` is
refused at startup, naming the version and the supported ones (``refusal``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .base import SglangLine

# release -> adapter module of this package
LINE_MODULES = {"0.5.12": "v0_5_12", "0.5.17": "v0_5_17", "0.5.23": "v0_5_23"}
SUPPORTED_VERSIONS = tuple(LINE_MODULES)
IMPL_ENV = "SGLANG_KV_CANARY_IMPL"
IMPL_PLUGIN, IMPL_IN_TREE = "plugin", "in-tree"


class UnsupportedSglang(RuntimeError):
    """This sglang release (or the chosen implementation) has no adapter here."""


@dataclass(frozen=True)
class LineChoice:
    """``line`` to register, or None with ``reason`` (then ``refuse`` says whether --kv-canary must be refused)."""

    version: str
    line: Optional[SglangLine]
    reason: str = ""
    refuse: bool = False


def choose_line(version: str, *, has_in_tree_canary: bool, environ: Optional[Mapping[str, str]] = None) -> LineChoice:
    """The adapter for sglang ``version``; pure (unit-tested without sglang)."""
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
    module = LINE_MODULES.get(version)
    if module is None:
        return LineChoice(version, None, unsupported_message(version, has_in_tree_canary), refuse=True)
    return LineChoice(version, load_line(module))


def unsupported_message(version: str, has_in_tree_canary: bool) -> str:
    msg = (f"sglang {version} is not supported by sglang-kv-canary (supported: {', '.join(SUPPORTED_VERSIONS)}); "
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

        _current = choose_line(version, has_in_tree_canary=importlib.util.find_spec("sglang.srt.kv_canary") is not None)
    return _current


def current_line() -> SglangLine:
    choice = current_choice()
    if choice.line is None:
        raise UnsupportedSglang(choice.reason)
    return choice.line
