"""The sglang plugin: entry point ``register()`` (group ``sglang.srt.plugins``) and its hooks.

sglang calls ``load_plugins()`` in ``sglang serve``, ``python -m
sglang.launch_server``, ``Engine`` and every scheduler process; ``register``
then registers hooks with sglang's ``HookRegistry``:

* ``ServerArgs.add_cli_args`` / ``from_cli_args`` / ``__init__``: the ``--kv-canary``
  flags (and ``ServerArgs(kv_canary=...)``, so ``sglang.Engine(kv_canary=...)`` works),
  validated with the ``SGLANG_KV_CANARY_*`` env vars and the server-args allow-list
  (``adapter/server_args``) before any process starts; every hook below must have been
  applied by sglang (``check_hooks_applied``), else startup is refused;
* ``ModelRunnerKVCacheMixin._profile_available_bytes``: hold the canary's bytes back before the KV
  pool is sized from free memory (no OOM after startup);
* ``ModelRunner.init_memory_pool``: ``install_canary`` right after the KV pool exists;
* ``ModelRunner.initialize``: ``mark_init_finished`` after warmup and graph capture;
* ``ModelRunner.forward``: the outside-graph bracket + active single-forward manager 0;
* ``ModelRunner.sample``: the sampled token ids join the token oracle (one device copy; the next HEAD scatters);
* ``ForwardBatch.init_new``: keep the batch's Req objects (cached-prefix tokens for the token check);
* ``CudaGraphRunner.capture_one_batch_size``: warmup runs and capture happen with
  manager 0 active, so the canary's kernels are recorded into the graph;
* ``Scheduler.__init__``: hand the radix cache to the canary (sweep, unused-cache perturbation);
* ``RadixCache._record_store_event`` / ``_delete_leaf`` / ``reset``: keep the sweep's device index
  of cached slots in step with the tree (``--kv-canary-sweep-interval`` only); for hybrid
  sliding-window models ``SWARadixCache._insert_helper`` / ``_delete_leaf`` / ``_delete_tombstone_leaf``
  / ``reset`` and ``SWATokenToKVPoolAllocator.free`` (``adapter/swa_radix``); for hybrid linear-attention
  models ``MambaRadixCache._record_store_event`` / ``_delete_leaf`` / ``_delete_tombstone_leaf`` / ``reset``
  (``adapter/mamba_radix``);
* ``Scheduler.on_idle``: drain the delayed counter copies, so violations of the
  last forwards before an idle period are reported without waiting for traffic;
* ``Scheduler.process_input_requests``: ``--kv-canary contain`` aborts and evicts
  there (``adapter/contain``), where sglang itself handles ``AbortReq``; with
  ``--enable-metrics`` the ``sglang:kv_canary_*`` counters are updated there and
  on idle (``adapter/metrics``);
* PD disaggregation (``adapter/disagg``): the records and an origin stamp are
  registered as extra transfer buffers when the KV manager is built, the prefill
  stamps what it sends, the decode side notes each arrival's tokens and identity,
  and decode-side retraction carries the records to the host and back.

Speculative decoding (``adapter/speculative``): ``EAGLEWorkerV2.verify`` moves the target's token
oracle to the accepted prefix; the EAGLE draft worker's own KV pool gets its own manager
(``adapter/draft``: ``EagleDraftWorker.draft_forward`` is one outer step of ``num_steps - 1`` forwards,
``EagleDraftWorker.__init__`` starts its reporting), eager or under CUDA graphs (``EAGLEDraftCudaGraphRunner`` /
``EAGLEDraftExtendCudaGraphRunner``: captured with HEAD/TAIL inside, each replay one outer step).
Which hooks, on which targets, is the release line's business (``adapter/lines``: one table per
supported sglang release, chosen from ``sglang.__version__``). On 0.5.23 sglang's own call
sites for its in-tree canary drive the plugin's manager instead (``lines/v0_5_23``). On any
other release the plugin installs nothing and refuses ``--kv-canary`` at startup, naming the
version and the supported ones. Before any hook is registered the fence (``adapter/lines/fence``) checks
that every hook target of the line exists on the running sglang with the signature the line expects; if
one differs, nothing of the line is registered and ``--kv-canary`` is refused, naming the target.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("kv_canary")

_registered = False
_HOOK_TYPES = ("before", "after", "around", "replace")


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .adapter.lines import current_choice

    choice = current_choice()
    if choice.line is None:
        logger.warning("kv_canary plugin inactive: %s", choice.reason)
        if choice.refuse:  # --kv-canary log|raise|contain must not quietly run unverified (or run sglang's own)
            for target, (hook, kind) in REFUSAL_HOOKS.items():
                HookRegistry.register(target, resolve_hook(hook), HookType(kind))
        _registered = True
        return
    if choice.untested:
        logger.warning("kv_canary: %s", choice.reason)
    for target, (hook, kind) in choice.line.all_hooks().items():
        HookRegistry.register(target, resolve_hook(hook), HookType(kind))
    _registered = True


def resolve_hook(name: str):
    """``module.function`` of the adapter layer (``hooks.after_sample``, ``lines.v0_5_23.install``)."""
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(f"{__package__}.adapter.{module}"), attr)


# on a release no line supports: present on every release since 0.5.12, whatever else moved
REFUSAL_HOOKS = {
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("refusal.around_from_cli_args", "around"),
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("refusal.before_scheduler_init", "before"),
}


def check_hooks_applied(server_args=None) -> None:
    """Refuse to run half-wired: sglang's HookRegistry only logs a hook it failed to apply."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from .adapter.disagg import disaggregation_mode
    from .adapter.lines import current_line
    from .config import FLAG_MODE, CanaryConfigError

    line = current_line()
    patched = getattr(HookRegistry, "_patched", None)
    required = line.required_hooks(pd=disaggregation_mode(server_args) in ("prefill", "decode"),
                                   spec=bool(getattr(server_args, "speculative_algorithm", None)),
                                   hicache=bool(getattr(server_args, "enable_hierarchical_cache", False)))
    missing = sorted(t for t in required if patched is None or t not in patched)
    if missing:
        raise CanaryConfigError(
            f"{FLAG_MODE}: sglang did not apply the canary's hook(s) on {', '.join(missing)} (see the "
            "'Failed to apply hooks' error above); the canary would run half-wired. Check that this is stock "
            f"sglang {line.name} and that SGLANG_PLUGINS allows kv_canary, or run with {FLAG_MODE} none."
        )
    unported = line.unported(server_args)
    if unported:
        raise CanaryConfigError(f"{FLAG_MODE} {getattr(server_args, 'kv_canary', '')}: {unported}")
