"""The ``model.forward`` patch: every forward of the model bracketed by the manager's HEAD and TAIL.

``_patch_model_forward(model, manager, tail_anchor)`` at install (``install.install_canary``); the ForwardBatch is found
among the forward's arguments (sglang passes it third).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

from ..runner import CanaryManager
from ..runner.early_tail import EarlyTail

logger = logging.getLogger("kv_canary")


def _extract_forward_batch(args: tuple, kwargs: dict) -> Any:
    """Find the ForwardBatch among ``model.forward``'s arguments (sglang passes it third)."""
    fb = kwargs.get("forward_batch")
    if fb is not None:
        return fb
    for arg in args:
        if hasattr(arg, "forward_mode") and hasattr(arg, "out_cache_loc"):
            return arg
    raise TypeError("kv-canary: model.forward was called without a ForwardBatch argument")


def _with_canary_bracketing(forward: Callable, manager: CanaryManager, early: Optional[EarlyTail] = None) -> Callable:
    """Wrap ``forward``: plan + HEAD before, TAIL after (or, with ``early``, at the start of the model's last stage,
    beside it: ``runner/early_tail.py``); nested calls share the outer bracket."""
    depth = [0]

    @functools.wraps(forward)
    def bracketed(*args, **kwargs):
        if depth[0]:
            return forward(*args, **kwargs)
        depth[0] += 1
        try:
            view = manager.pre_ops_maybe_inside_graph(_extract_forward_batch(args, kwargs),
                                                      verify_later=early is not None)
            armed = early is not None and view is not None
            if armed:
                early.arm(view)
            try:
                out = forward(*args, **kwargs)
            except BaseException:
                if armed and not early.finish():  # it raised before the anchor, where its verify waited
                    try:
                        manager.verify_deferred_on_error(view)
                    except Exception:  # noqa: BLE001 - the forward's error is the one that propagates
                        logger.exception("kv-canary: the deferred verify of a forward that raised failed too")
                raise
            ran = early.finish() if armed else False
            if not ran:  # no anchor, or the forward never reached it
                manager.post_ops_maybe_inside_graph(view)
            return out
        finally:
            depth[0] -= 1

    bracketed.__kv_canary_original__ = forward
    return bracketed


def _patch_model_forward(model: torch.nn.Module, manager: CanaryManager,
                         tail_anchor: Optional[torch.nn.Module] = None) -> None:
    """``tail_anchor``: the module whose start follows every K/V store of a forward (the adapter's
    ``SglangFacts.tail_anchor``); the TAIL then runs there, beside the model's last stage (``manager.early_tail``)."""
    if getattr(model.forward, "__kv_canary_original__", None) is not None:
        raise RuntimeError("kv-canary: model.forward is already patched (install_canary ran twice)")
    early = None
    if tail_anchor is not None:
        early = EarlyTail(tail_anchor, manager.post_ops_maybe_inside_graph, manager.counters.device)
    manager.early_tail = early
    model.forward = _with_canary_bracketing(model.forward, manager, early)
