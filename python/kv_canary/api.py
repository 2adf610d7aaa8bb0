"""Public entry: ``install_canary`` and the ``model.forward`` patch.

``install_canary(server_args=..., model_runner=...)`` is called by the plugin
right after sglang's ``ModelRunner.init_memory_pool``. It returns None for
``--kv-canary none`` (and then nothing of the canary ever runs), otherwise it
attaches canary buffers to the KV pool, builds the ``CanaryManager`` and patches
``model.forward`` so every forward is bracketed by HEAD verify and TAIL write.

The bodies live in the adapter layer (``adapter/install``, ``adapter/forward_patch``), which the hooks call; this
module names them for callers outside the plugin and imports nothing the adapter imports back.
"""

from __future__ import annotations

from .adapter.forward_patch import _patch_model_forward, _with_canary_bracketing
from .adapter.install import (
    EXTRA_CONTEXT_BOUND, MIN_KV_BYTES_PER_SLOT, REQ_ROWS_BOUND, canary_reserved_bytes, check_groups_supported,
    compute_capacities, config_from_server_args, install_canary, install_draft_canary, installed_line,
)

__all__ = [
    "EXTRA_CONTEXT_BOUND", "MIN_KV_BYTES_PER_SLOT", "REQ_ROWS_BOUND", "canary_reserved_bytes", "check_groups_supported",
    "compute_capacities", "config_from_server_args", "install_canary", "install_draft_canary", "installed_line",
    "_patch_model_forward", "_with_canary_bracketing",
]
