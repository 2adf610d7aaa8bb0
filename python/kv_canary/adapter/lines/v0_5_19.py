"""sglang 0.5.19: the 0.5.18 adapter (``v0_5_18``) where 0.5.19 differs from it; a small diff of that line.

Every hook target of the 0.5.18 line has 0.5.18's signature on 0.5.19 but one: ``RadixCache._record_store_event``
is gone (0.5.19 records a store through ``self.kv_events.record_store(new_node)``, a ``KVCacheEventRecorder`` that
does not know its tree). What differs:

* The sweep's index learns a new node from ``RadixCache._insert_helper`` (AFTER; ``(self, node, key, value,
  priority=, chunked=)`` on 0.5.18-0.5.20): it returns ``(total_prefix_length, node)``, and ``node`` is one it added
  exactly when that prefix is shorter than the key (``after_insert_helper``), the node 0.5.18 recorded a store for.
* ``KVCacheEventRecorder.record_store`` is in the hook table as a fence target only (``fence_only``, nothing done):
  0.5.18's ``_insert_helper`` has the same signature, and that target exists on 0.5.19, not on 0.5.18, so the
  fence keeps the two lines apart.
* ``Req.req_pool_idx`` moved to ``Req.kv`` (0.5.23's reader, ``v0_5_23.req_row``).
* Its own server-args policy (``adapter/policy_0_5_19``: 0.5.18's plus 16 fields, classified as 0.5.23's policy does).

Served as a tested release since its CPU smoke passed on its own pins (2026-11-29, ``KVC_SGLANG=0.5.19`` venv,
torch 2.13.0: 0 violations, the sweep over the index this hook builds, injections caught; docs/compatibility.md).
0.5.19 loses a disconnected stream's abort as 0.5.18 does: the e2e workloads abort through ``/abort_request``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..policy_0_5_19 import POLICY_0_5_19
from ..radix import on_node_stored
from . import v0_5_17, v0_5_18, v0_5_23

_STORE_EVENT = "sglang.srt.mem_cache.radix_cache.RadixCache._record_store_event"
HOOKS = {
    **{target: hook for target, hook in v0_5_18.LINE.hooks.items() if target != _STORE_EVENT},
    "sglang.srt.mem_cache.radix_cache.RadixCache._insert_helper": ("lines.v0_5_19.after_insert_helper", "after"),
    "sglang.srt.mem_cache.events.KVCacheEventRecorder.record_store": ("lines.v0_5_19.fence_only", "after"),
}


def after_insert_helper(result, tree, node, key, *args, **kwargs) -> None:
    """``RadixCache._insert_helper``: the node it added, if any (0.5.18's ``_record_store_event`` node)."""
    prefix_len, last = result
    if prefix_len < len(key):
        on_node_stored(tree, last)


def fence_only(_result, *args, **kwargs) -> None:
    """A target the fence checks (it tells 0.5.19 from 0.5.18); nothing to do."""


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    return v0_5_17.unported_on(server_args, LINE.name)


LINE = dataclasses.replace(v0_5_18.LINE, name="0.5.19", versions=("0.5.19",), untested_versions=(), hooks=HOOKS,
                           req_row=v0_5_23.req_row, unported=unported, policy=POLICY_0_5_19)
