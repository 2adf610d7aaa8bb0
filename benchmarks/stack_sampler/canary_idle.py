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


def install() -> None:
    """Patch ``CanaryManager`` once its module is imported (now, if it is already)."""
    if TARGET in sys.modules:
        make_idle(sys.modules[TARGET].CanaryManager)
    else:
        from kv_canary._autoload import install_after_import

        install_after_import(TARGET, lambda module: make_idle(module.CanaryManager))
