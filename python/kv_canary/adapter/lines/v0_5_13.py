"""sglang 0.5.13: the 0.5.15 adapter (``v0_5_15``) where 0.5.13 differs from it; a small diff of that line.

Also serves 0.5.13.post1: every hook target has 0.5.13's signature there (``fence``, ``release_targets.json``).

0.5.13 ships the same in-tree kv_canary call sites as 0.5.15 (``install_canary`` bound at import and called right
after ``init_memory_pool``, the ``ModelRunner.forward`` bracket, ``mark_init_finished`` at the end of
``ModelRunner.initialize``, ``attach_radix_cache``), and the same KV sizing (``ModelRunnerKVCacheMixin``). What
differs:

* Decode CUDA graphs are captured by 0.5.12's ``CudaGraphRunner.capture_one_batch_size`` (0.5.14 moved it to
  ``DecodeCudaGraphRunner.capture_one_shape``), which enters ``with_active_single_forward_manager(0)`` itself: it
  gets the same hook (``hooks.around_capture_one_batch_size``: the manager capturing during warmup and capture).
* Its own server-args policy (``adapter/policy_0_5_15.POLICY_0_5_13``): no per-phase CUDA graph config yet; the
  piecewise CUDA graph flags are 0.5.12's, classified as 0.5.12 classifies them (piecewise graphs refused on a GPU:
  ``--disable-piecewise-cuda-graph``).

Not ported, refused at startup naming the flag (as on 0.5.15): ``contain``, speculative decoding, PD
disaggregation, tensor and data parallel, HiCache; verified pools: MHA and MLA. CUDA graphs not run on a GPU for
this release yet.
"""

from __future__ import annotations

from typing import Any

from ..policy_0_5_15 import POLICY_0_5_13
from . import v0_5_12, v0_5_15, v0_5_17
from .base import HookTable, SglangLine

_SHAPE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape"
_BATCH_SIZE = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size"

HOOKS: HookTable = {
    **{target: hook for target, hook in v0_5_15.HOOKS.items() if target != _SHAPE},  # 0.5.14 and later
    _BATCH_SIZE: v0_5_12.HOOKS[_BATCH_SIZE],
}


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    return v0_5_17.unported_on(server_args, LINE.name, post_capture_kv_sizing=False)


LINE = SglangLine(name="0.5.13", versions=("0.5.13", "0.5.13.post1"), hooks=HOOKS, in_tree_canary=True,
                  flags_declared_by_sglang=True, policy=POLICY_0_5_13, unported=unported,
                  prefix_cache_view=v0_5_15.LINE.prefix_cache_view, verified_pools=v0_5_15.LINE.verified_pools,
                  prefix_caches=v0_5_15.LINE.prefix_caches)
