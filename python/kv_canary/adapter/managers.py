"""Where the canary's manager sits on sglang's ``ModelRunner``: ``canary_of``, ``manager_of``.

Read by the hook bodies (``hooks``, which names them too), ``speculative`` and the 0.5.23 line's modules. Here, not in
``hooks``: ``hooks`` reaches ``speculative`` (through the install), so ``speculative`` cannot import ``hooks``.
"""

from __future__ import annotations


def canary_of(model_runner):
    """The runner's manager, or None (canary off, draft worker, or not installed)."""
    if getattr(model_runner, "is_draft_worker", False):
        return None
    return manager_of(model_runner)


def manager_of(model_runner):
    """``model_runner.canary_manager``: the plugin's ``CanaryManager``, or on a line whose own call sites drive it
    (0.5.23) the slot object those call sites use, which holds it as ``kv_canary_manager``."""
    slot = getattr(model_runner, "canary_manager", None)
    return getattr(slot, "kv_canary_manager", slot)
