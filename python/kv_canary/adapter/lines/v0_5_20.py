"""sglang 0.5.20: the 0.5.19 adapter (``v0_5_19``) where 0.5.20 differs from it; a small diff of that line.

Every hook target of the 0.5.19 line is on 0.5.20, with 0.5.19's signature but two (the same hooks; the fence
expects 0.5.20's signatures): ``KVCacheEventRecorder.record_store`` (the fence-only target) gained ``session_id=``,
and ``DecodeCudaGraphRunner.capture_one_shape`` takes ``attention_variant=`` in place of ``dsa_variant=`` (its
hook passes every argument on). What differs:

* ``ServerArgs`` is a msgspec Struct (0.5.19: a dataclass). msgspec binds ``__post_init__`` when it builds the
  class, so a hook set on ``ServerArgs.__post_init__`` afterwards never runs: the launching-process check hooks
  ``ServerArgs.resolve_once`` (0.5.23's hook), which 0.5.20's CLI and ``sglang.Engine`` call before any scheduler
  starts.
* Its own server-args policy (``adapter/policy_0_5_20``: 0.5.19's on 0.5.20's fields).

Served as a tested release since its CPU smoke passed on its own pins (2026-11-30: ``KVC_SGLANG=0.5.20`` venv, torch
2.13.0; ``scripts/release_matrix.py``, docs/compatibility.md). Not ported, refused at startup naming the flag, as on
0.5.19: ``contain`` (0.5.20's ``UnifiedRadixCache`` lacks what ``adapter/contain_unified`` evicts through:
``_apply_eviction_result``, ``TreePathNodeInfo``), speculative decoding, tensor and data parallel, PD. 0.5.20 does
not lose a disconnected stream's abort (0.5.18 and 0.5.19 do): the e2e workloads disconnect there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..policy_0_5_20 import POLICY_0_5_20
from . import v0_5_17, v0_5_19, v0_5_23

_POST_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"
_RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"
HOOKS = {
    **{target: hook for target, hook in v0_5_19.HOOKS.items() if target != _POST_INIT},
    _RESOLVE_ONCE: v0_5_23.HOOKS[_RESOLVE_ONCE],
}


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    return v0_5_17.unported_on(server_args, LINE.name)


LINE = dataclasses.replace(v0_5_19.LINE, name="0.5.20", versions=("0.5.20",), hooks=HOOKS, unported=unported,
                           policy=POLICY_0_5_20)
