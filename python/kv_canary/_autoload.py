"""Imported at interpreter start by ``sglang_kv_canary.pth`` (must stay cheap: no torch, no sglang).

``sglang serve --help`` prints the server flags before sglang loads its plugins,
so ``--kv-canary`` would be missing from that help. This installs a meta-path
hook that, once ``sglang.cli.serve`` has been imported, runs sglang's own
``load_plugins()`` (idempotent, honours ``SGLANG_PLUGINS``); ``serve`` then finds
the plugins already loaded. No other import is affected.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.cli.serve"


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``target`` executes (the other finders find it); no other import
    is affected. Also used by the benches' ``benchmarks/stack_sampler/canary_idle.py``."""

    def __init__(self, target: str, callback):
        self.target, self.callback = target, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_callback(module):
            exec_module(module)
            self.callback(module)

        spec.loader.exec_module = exec_then_callback
        return spec


def install_after_import(target: str, callback) -> None:
    """``AfterImport(target, callback)`` first on ``sys.meta_path``, once per target."""
    if not any(isinstance(f, AfterImport) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(target, callback))


def _load_plugins(_serve_module) -> None:
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    except Exception as exc:  # never break sglang's CLI because of the canary
        print(f"kv_canary: could not pre-load sglang plugins for 'sglang serve': {exc}", file=sys.stderr)


def install() -> None:
    install_after_import(_TARGET, _load_plugins)


install()
