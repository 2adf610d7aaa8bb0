"""Bench-only ablation ``KVC_DIAG_CANARY_IDLE=1`` (the HiCache row's ``hc_ours_idle``): the canary installed, its
per-forward work skipped.

The canary server is built as usual (plugin, hooks on sglang's runner, graph runner and HiCache controller, the
manager and its device buffers), but ``CanaryManager``'s per-forward flow does nothing: the outside bracket's pre-
and post-ops, plan + HEAD, TAIL and ``record_sampled`` return at once, so no graph captures a canary kernel and no
eager forward launches one. HiCache's per-operation hooks (a backup's or a load's records) still run. Set beside
``hc_off`` and ``hc_ours`` in one row, it splits what the canary's presence costs sglang's own code (its installed
hooks, memory, imports) from what its work costs. It verifies nothing: a bench configuration, never a setting.

Applied when ``kv_canary.runner.manager`` is imported (an import hook installed by this directory's
``sitecustomize``), before any manager exists.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "kv_canary.runner.manager"
IDLE_METHODS = ("_pre_ops_outside_graph", "_post_ops_outside_graph", "pre_ops_maybe_inside_graph",
                "post_ops_maybe_inside_graph", "record_sampled")


def make_idle(manager_cls) -> None:
    """Every per-forward method of ``manager_cls`` returns None at once."""
    for name in IDLE_METHODS:
        if not callable(getattr(manager_cls, name, None)):
            raise AttributeError(f"KVC_DIAG_CANARY_IDLE: {manager_cls.__name__} has no method {name}")
        setattr(manager_cls, name, _idle)
    manager_cls.kvc_diag_idle = True
    print(f"kvc_diag_canary_idle=1 pid={os.getpid()} (bench ablation: the canary verifies nothing)", file=sys.stderr)


def _idle(*_args, **_kwargs):
    return None


class _IdleAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` with the other finders, then runs ``make_idle`` on its ``CanaryManager`` once executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_then_idle(module):
            run(module)
            make_idle(module.CanaryManager)

        spec.loader.exec_module = exec_then_idle
        return spec


def install() -> None:
    """The import hook (or the patch now, if the module is imported already)."""
    if TARGET in sys.modules:
        make_idle(sys.modules[TARGET].CanaryManager)
    elif not any(isinstance(f, _IdleAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _IdleAfterImport())
