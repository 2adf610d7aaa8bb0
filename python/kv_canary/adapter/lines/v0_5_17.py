"""sglang 0.5.17: the 0.5.23 adapter (``v0_5_23``), with CUDA graphs verified; a small diff of that line.

Also serves 0.5.16: every hook target has 0.5.17's signature there (``fence``, ``release_targets.json``).

0.5.17 is the newest release the GPU host can load (it pins torch 2.11.0, the host's). It ships
the same in-tree kv_canary call sites as 0.5.23 (``model_runner.py`` binds ``install_canary`` at
import and calls it in ``_init_post_memory_pool_components``; ``ModelRunner.forward`` enters
``with_ops_outside_graph`` + ``with_active_single_forward_manager(0)``; the decode graph runner's
``capture_one_shape`` and the flashinfer autotune enter ``with_active_single_forward_manager(0)``;
``capture_cuda_graphs`` calls ``mark_init_finished``; the scheduler calls ``attach_radix_cache``),
``KVCacheConfigurator._profile_available_bytes`` and ``Scheduler.init_model_worker``. So this
line reuses every 0.5.23 hook; what differs:

* ``ServerArgs`` is a dataclass resolved in ``__post_init__`` (0.5.23: a msgspec Struct resolved
  by ``resolve_once``): the launching-process check hooks ``__post_init__``.
* ``Req.req_pool_idx`` (0.5.23 moved it to ``Req.kv``): the base line's reader.
* The prefix cache of a full-attention model is 0.5.12's Python ``RadixCache`` (0.5.23: the
  ``UnifiedRadixCache``, here only with ``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1``): the sweep's index
  follows it change by change through 0.5.12's three tree hooks (``adapter/radix``); a
  ``UnifiedRadixCache`` is read through its walk as on 0.5.23.
* Its own server-args policy (``adapter/policy_0_5_17``: 0.5.23's, on 0.5.17's fields).
* CUDA graphs are verified (on an H100/H200, docs/results/): decode graphs (backend ``full``)
  with the canary's HEAD/TAIL captured into them. sglang's decode capture enters only
  ``with_active_single_forward_manager(0)``; the plugin's capture also needs
  ``manager.capturing()`` (nothing reported or counted during warmup/capture, the counters kept
  across a recapture after init), so ``DecodeCudaGraphRunner.capture_one_shape`` gets 0.5.12's
  ``hooks.around_capture_one_batch_size`` (0.5.23's hook table has it). Prefill CUDA graphs (breakable
  by default on CUDA; verified on 0.5.23) stay refused on 0.5.17 by its policy: ``--disable-prefill-cuda-graph``.
* Post-capture KV sizing (sglang re-backs and resizes the KV pool after graph capture, after the
  canary sized its records to it) runs only with ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` and
  prefill CUDA graphs on: refused at startup naming the env var (``unported``); the 0.5.23 check
  after ``Scheduler.init_model_worker`` (a rebuilt pool is refused) stays as the backstop.
  0.5.17 does not ask ``per_forward_workspace_bytes`` (0.5.23 does, from that sizing).

Not ported, refused at startup naming the flag (as on 0.5.23): ``contain``, speculative
decoding, PD disaggregation, tensor parallel; verified pools: MHA and MLA.
"""

from __future__ import annotations

import os
from typing import Any

from ..policy_0_5_17 import POLICY_0_5_17
from ..radix import RadixCacheView
from ..unified_radix import unified_view_for
from . import v0_5_12, v0_5_23
from .base import HookTable, SglangLine

HOOKS: HookTable = {
    **{target: hook for target, hook in v0_5_23.HOOKS.items()
       if target != "sglang.srt.server_args.ServerArgs.resolve_once"},  # 0.5.23 only
    # the CLI and sglang.Engine(...) both build (and resolve) their ServerArgs in the launching process
    "sglang.srt.server_args.ServerArgs.__post_init__": ("lines.v0_5_23.after_resolve_once", "after"),
    # the sweep's cached-slot index follows the Python RadixCache (0.5.12's hooks)
    **{target: hook for target, hook in v0_5_12.HOOKS.items() if target.startswith(
        "sglang.srt.mem_cache.radix_cache.RadixCache.")},
}

POST_CAPTURE_KV_SIZING_ENV = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    return unported_on(server_args, LINE.name)


def unported_on(server_args: Any, release: str, *, post_capture_kv_sizing: bool = True) -> str:
    """``unported`` naming ``release`` (a line that reuses this one: ``v0_5_15``, whose sglang has no post-capture
    KV sizing)."""
    sizing = os.environ.get(POST_CAPTURE_KV_SIZING_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if post_capture_kv_sizing and sizing:
        return (f"{POST_CAPTURE_KV_SIZING_ENV}=1 makes sglang re-back and resize the KV pool after CUDA-graph capture, "
                "after the canary sized its per-slot records to it; unset it")
    if str(getattr(server_args, "kv_canary", "none")) == "contain":
        return ("contain (aborts and radix-cache evictions at the scheduler's safe point) is not verified on sglang "
                f"{release} yet; use --kv-canary log or raise, or sglang 0.5.12")
    if getattr(server_args, "speculative_algorithm", None):
        return (f"speculative decoding on sglang {release} is not verified yet; drop --speculative-algorithm, or use "
                "sglang 0.5.12")
    if int(getattr(server_args, "tp_size", 1) or 1) > 1:
        return f"tensor parallel on sglang {release} is not verified yet; drop --tp-size, or use sglang 0.5.12"
    if int(getattr(server_args, "dp_size", 1) or 1) > 1:
        return f"data parallel on sglang {release} is not verified yet; drop --dp-size, or use sglang 0.5.23"
    if str(getattr(server_args, "disaggregation_mode", "null") or "null") != "null":
        return (f"PD disaggregation on sglang {release} is not verified yet; drop --disaggregation-mode, or use "
                "sglang 0.5.12")
    return ""


def prefix_cache_view(tree_cache, manager):
    """The sweep's reader: the Python ``RadixCache`` (followed by the tree hooks), else a full-attention
    ``UnifiedRadixCache`` (walked before each sweep), else None."""
    return RadixCacheView(tree_cache) if RadixCacheView.supports(tree_cache) else unified_view_for(tree_cache, manager)


LINE = SglangLine(name="0.5.17", versions=("0.5.16", "0.5.17"), hooks=HOOKS, in_tree_canary=True,
                  flags_declared_by_sglang=True, policy=POLICY_0_5_17, unported=unported,
                  prefix_cache_view=prefix_cache_view, verified_pools=("MHATokenToKVPool", "MLATokenToKVPool"),
                  prefix_caches="RadixCache and UnifiedRadixCache (full-attention tree)")
