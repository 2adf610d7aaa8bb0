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


class _LoadPluginsAfterServe(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_load_plugins(module):
            exec_module(module)
            try:
                from sglang.srt.plugins import load_plugins

                load_plugins()
            except Exception as exc:  # never break sglang's CLI because of the canary
                print(f"kv_canary: could not pre-load sglang plugins for 'sglang serve': {exc}", file=sys.stderr)

        spec.loader.exec_module = exec_then_load_plugins
        return spec


def install() -> None:
    if not any(isinstance(f, _LoadPluginsAfterServe) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoadPluginsAfterServe())


install()
