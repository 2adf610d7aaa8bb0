"""sglang 0.5.15: the 0.5.17 adapter (``v0_5_17``) where 0.5.15 differs from it; a small diff of that line.

Also serves 0.5.14 and 0.5.15.post1: every hook target has 0.5.15's signature there (``fence``,
``release_targets.json``).

0.5.14 and 0.5.15 ship the same in-tree kv_canary call sites as 0.5.17 (``model_runner.py`` binds
``install_canary`` at import and calls it in ``alloc_memory_pool``, right after ``init_memory_pool``;
``ModelRunner.forward`` enters ``with_ops_outside_graph`` + ``with_active_single_forward_manager(0)``;
``DecodeCudaGraphRunner.capture_one_shape`` enters ``with_active_single_forward_manager(0)``; the end of
``ModelRunner.initialize`` calls ``mark_init_finished``; the scheduler calls ``attach_radix_cache``). So this line
reuses every 0.5.17 hook; what differs:

* The KV pool is sized from ``ModelRunnerKVCacheMixin._profile_available_bytes`` (0.5.12's; 0.5.16 moved it to
  ``KVCacheConfigurator``): the canary's bytes are held back there with 0.5.12's hook, on the ``ModelRunner``
  (``kv_canary_reserved_bytes``, which the install reads).
* ``ForwardBatch.init_new`` is ``(cls, batch, model_runner)`` (0.5.16 added keyword-only arguments): the same hook
  (it takes ``*args, **kwargs``), the fence expecting 0.5.15's signature.
* Its own server-args policies (``adapter/policy_0_5_15``: 0.5.17's, on 0.5.15's fields; 0.5.14 has fewer).
* No post-capture KV sizing in these releases (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING`` is not read there).

Not ported, refused at startup naming the flag (as on 0.5.17): ``contain``, speculative decoding, PD
disaggregation, tensor and data parallel, HiCache; verified pools: MHA and MLA. CUDA graphs: the decode capture is
0.5.17's hook on the same target, not run on a GPU for these releases yet.
"""

from __future__ import annotations

from typing import Any

from ..policy_0_5_15 import POLICY_0_5_14, POLICY_0_5_15
from . import v0_5_12, v0_5_17
from .base import HookTable, SglangLine

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes"

HOOKS: HookTable = {
    **{target: hook for target, hook in v0_5_17.HOOKS.items() if target != _CONFIGURATOR},  # 0.5.16 and later
    _MIXIN: v0_5_12.HOOKS[_MIXIN],
}


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    return v0_5_17.unported_on(server_args, LINE.name, post_capture_kv_sizing=False)


LINE = SglangLine(name="0.5.15", versions=("0.5.14", "0.5.15", "0.5.15.post1"), hooks=HOOKS, in_tree_canary=True,
                  flags_declared_by_sglang=True, policy=POLICY_0_5_15, release_policies={"0.5.14": POLICY_0_5_14},
                  unported=unported, prefix_cache_view=v0_5_17.prefix_cache_view,
                  verified_pools=v0_5_17.LINE.verified_pools, prefix_caches=v0_5_17.LINE.prefix_caches)
