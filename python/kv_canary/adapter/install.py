"""The canary's install: ``install_canary`` and what it checks, sizes and builds (``kv_canary.api`` names it).

``install_canary(server_args=..., model_runner=...)`` is called by the plugin
right after sglang's ``ModelRunner.init_memory_pool`` (``hooks.after_init_memory_pool``; 0.5.23: the line's
``install``). It returns None for ``--kv-canary none`` (and then nothing of the canary ever runs), otherwise it
attaches canary buffers to the KV pool, builds the ``CanaryManager`` and patches
``model.forward`` so every forward is bracketed by HEAD verify and TAIL write (``forward_patch``).
``canary_reserved_bytes``: the bytes held back before the pool is sized. Here, in the adapter, so the hooks call
it without importing the entry points.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import torch

from .batch_adapter import SglangBatchAdapter
from .disagg import check_disaggregation
from .hicache import check_hicache
from .lines import current_choice, current_line
from .facts import SglangFacts, SpecFacts, max_prefill_tokens, read_facts
from .forward_patch import _patch_model_forward
from .pools import register_sglang_pools
from ..config import CanaryConfig, CanaryConfigError
from ..kernels import select_kernels
from ..memory import canary_memory_bytes, kv_pool_bytes, tokens_per_forward_bound
from ..views import LaunchCapacities
from ..buffer_groups import attach_canary_buffers
from ..runner import CanaryManager
from ..transfer import TransferBook, new_origin
from ..violations import INSTALLED_PREFIX, OFF_PREFIX, format_line, set_process_tags

logger = logging.getLogger("kv_canary")


def config_from_server_args(server_args: Any, environ=None) -> CanaryConfig:
    """The one place flags and env vars become a ``CanaryConfig``."""
    environ = os.environ if environ is None else environ
    config = CanaryConfig.build(
        mode=getattr(server_args, "kv_canary", "none"),
        sweep_interval=getattr(server_args, "kv_canary_sweep_interval", 0),
        real_data=getattr(server_args, "kv_canary_real_data", "partial"),
        environ=environ,
        disable_piecewise_cuda_graph=bool(getattr(server_args, "disable_piecewise_cuda_graph", True))
        or str(getattr(server_args, "device", "cuda")) == "cpu",
        hicache=bool(getattr(server_args, "enable_hierarchical_cache", False)),
    )
    check_disaggregation(server_args, config, environ)  # PD: what the canary verifies, the rest refused
    check_hicache(server_args, config)  # HiCache: likewise
    return config


def install_canary(*, server_args: Any, model_runner: Any) -> Optional[CanaryManager]:
    """The canary for one model runner (target or EAGLE draft), or None with ``--kv-canary none``."""
    tp_rank = current_line().tp_rank(model_runner)
    dp_rank = current_line().dp_rank(model_runner) if int(getattr(server_args, "dp_size", 1) or 1) > 1 else None
    # every canary line names its TP rank (each rank verifies its own shard) and, with --dp-size, its DP rank (each
    # DP rank is its own scheduler process with its own pool)
    set_process_tags(tp_rank=tp_rank, **({} if dp_rank is None else {"dp_rank": dp_rank}))
    config = config_from_server_args(server_args).for_tp_rank(tp_rank, dp_rank)
    if not config.enabled:
        logger.info(format_line(OFF_PREFIX, 1, {"mode": config.mode.value}) + " (no canary buffers, no device work)")
        return None
    facts = read_facts(server_args, model_runner, config.mode.value)  # sglang is read here, once
    if facts.is_draft_worker:
        return install_draft_canary(facts, config)
    from ..draft_pool import target_config

    config = target_config(config, facts.spec.draft_skip if facts.spec else "")  # PERTURB_TARGET_GROUP=draft
    if facts.mrope:
        raise CanaryConfigError(
            f"--kv-canary {config.mode.value}: this model uses M-RoPE (multimodal rotary positions, "
            "forward_batch.mrope_positions), whose positions are not the sequence index the canary checks; "
            "run it with --kv-canary none"
        )
    from .speculative import spec_pool_refusal

    spec_refusal = spec_pool_refusal(facts.spec and facts.spec.algorithm, facts.pool, draft=False,
                                     target_pools=current_line().spec_target_pools,
                                     draft_from_target=bool(facts.spec and facts.spec.draft_from_target),
                                     draft_skip=facts.spec.draft_skip if facts.spec else "")
    if spec_refusal:
        raise CanaryConfigError(f"--kv-canary {config.mode.value} cannot verify {spec_refusal}; drop "
                                "--speculative-algorithm or run with --kv-canary none")
    register_sglang_pools()
    groups = attach_canary_buffers(facts.pool, config, facts.device, facts.pool_context)
    check_groups_supported(config, groups, facts.pool_name, facts.pd_mode)
    if config.hicache:
        from .hicache import check_hicache_pool

        check_hicache_pool(facts.pool_name, [g.name for g in groups])
    capacities = compute_capacities(facts)
    kernels = select_kernels(config.kernel_backend, facts.device)
    if facts.device.type == "cuda" and not kernels.graph_safe and facts.cuda_graphs:
        raise CanaryConfigError(
            "SGLANG_KV_CANARY_KERNEL_BACKEND=torch cannot run inside CUDA graphs: "
            "use the triton backend or pass --disable-cuda-graph"
        )
    kernels, tracker = _track_variants(kernels, config)
    manager = CanaryManager(
        config=config,
        groups=groups,
        kernels=kernels,
        req_to_token=facts.req_to_token,
        capacities=capacities,
        batch_adapter=SglangBatchAdapter(max_batch_size=capacities.max_batch_size, device=facts.device,
                                         req_row=current_line().req_row, tree_verify=facts.tree_verify),
        device=facts.device,
        variant_tracker=tracker,
    )
    if manager.perturb.write_redirect is not None:  # the write-path perturbations break the engine's own stores
        from .kv_stores import wrap_kv_stores

        wrap_kv_stores(facts.pool, manager.perturb.write_redirect)
    if facts.pd_mode in ("prefill", "decode"):  # records travel with the KV (adapter/disagg)
        manager.attach_transfer(TransferBook(facts.pd_mode, new_origin(groups[0].num_slots, facts.device)))
    if facts.tree_verify:  # the tree verifies' deferred TAIL: at most num_steps + 1 kept nodes a request
        manager.enable_deferred_writes(facts.spec.num_steps + 1)
    if tracker is not None:
        _precompile(manager, capacities, facts)
        logger.info("kv_canary_precompiled=1 %s", tracker.describe())
    _patch_model_forward(facts.model, manager, facts.tail_anchor)
    req_rows, context_len = (int(n) for n in facts.req_to_token.shape)
    memory = canary_memory_bytes(
        num_slots=groups[0].num_slots, num_groups=len(groups), req_rows=req_rows, context_len=context_len,
        ring_capacity=config.ring_capacity, token_oracle=config.uses_token_oracle,
        max_batch_size=capacities.max_batch_size, sweep=config.sweep_interval > 0,
        full_row=config.full_row_hash, first_read=config.first_read, hicache=config.hicache,
        max_tokens_per_forward=capacities.tokens_per_forward,
    )
    kv_bytes = kv_pool_bytes(facts.pool)
    reserved = facts.reserved_bytes
    if reserved is not None and memory.total > reserved:
        logger.warning("kv_canary: allocated %d bytes, more than the %d held back from the KV pool's budget",
                       memory.total, reserved)
    if config.scrub_slots_per_forward:
        span = groups[0].num_slots - 1
        logger.info(format_line("kv_canary_scrub", config.scrub_slots_per_forward, {
            "pool_slots": span, "every_slot_within_forwards": config.scrub_bound_forwards(span)}))
    log_coverage(config, groups[0])
    logger.info(installed_line(config, facts.pool_name, groups, kernels.name, capacities, facts.pd_mode, memory={
        "req_rows": req_rows, "canary_bytes": memory.total, "kv_pool_bytes": kv_bytes,
        "canary_pct_of_kv_pool": f"{memory.pct_of(kv_bytes):.3f}",
        "reserved_before_kv_pool": "none" if reserved is None else reserved}))
    return manager


def _tail_variant(config: CanaryConfig):
    """What a TAIL's compiled variants depend on in its longest new run: the write kernel's block and, when
    the groups keep FULL_HASH (the scrub, ``all``), the whole-row hash's slot tile (more precompile launches:
    only when they can be needed)."""
    from ..kernels import triton_kernels as tk

    return tk.tail_variant if config.full_row_hash else tk.write_block


def _track_variants(kernels, config: CanaryConfig):
    """(kernels, tracker): the Triton kernels note every variant they launch (precompile, then no JIT)."""
    if kernels.name != "triton":
        return kernels, None
    from ..kernels.variants import VariantTracker, track

    tracker = VariantTracker()
    return track(kernels, tracker, _tail_variant(config)), tracker


def install_draft_canary(facts: SglangFacts, config: CanaryConfig) -> Optional[CanaryManager]:
    """The EAGLE draft runner's own pool (``kv_canary.draft_pool``): its own groups and ``DraftCanaryManager``."""
    from .draft import DraftBatchAdapter
    from .speculative import SPEC_POOL_CLASSES, spec_pool_refusal
    from ..draft_pool import (DRAFT_GROUP, DRAFT_INSTALLED_PREFIX, DRAFT_NOT_VERIFIED, KV_TOKEN_ID_VS_POSITION_OFFSET,
                             DraftCanaryManager, draft_config)

    spec = facts.spec
    if spec.draft_skip:
        logger.warning("kv_canary: --speculative-algorithm %s: %s (%s; docs/speculative.md); verifying the target "
                       "model's KV only", spec.algorithm, DRAFT_NOT_VERIFIED, spec.draft_skip)
        return None
    config = draft_config(config)
    register_sglang_pools()
    pool = facts.pool
    try:
        refusal = spec_pool_refusal(spec.algorithm, pool, draft=True)
        if refusal:
            raise CanaryConfigError(refusal)
        groups = attach_canary_buffers(pool, config, facts.device, facts.pool_context)
        if len(groups) != 1:
            pool.kv_canary_groups = None
            raise CanaryConfigError(f"the draft model's KV pool {facts.pool_name} has groups "
                                    f"{','.join(g.name for g in groups)}; only a single-group draft pool is verified")
    except CanaryConfigError as e:  # the target's KV stays verified, as before the draft pool was
        # PERTURB_TARGET_GROUP=draft would inject nowhere; a target pool beyond MHA (0.5.23's SWAKVPool) is verified
        # with its draft pool verified only
        if config.any_perturbation or spec.target_pool_name not in ("", *SPEC_POOL_CLASSES):
            raise
        logger.warning("kv_canary: --speculative-algorithm %s: %s (%s); verifying the target model's KV only",
                       spec.algorithm, DRAFT_NOT_VERIFIED, e)
        return None
    groups = [dataclasses.replace(groups[0], name=DRAFT_GROUP)]
    pool.kv_canary_groups = groups
    capacities = compute_capacities(facts)
    kernels, tracker = _track_variants(select_kernels(config.kernel_backend, facts.device), config)
    steps = spec.num_steps
    manager = DraftCanaryManager(
        config=config, groups=groups, kernels=kernels, req_to_token=facts.req_to_token, capacities=capacities,
        batch_adapter=DraftBatchAdapter(
            max_batch_size=capacities.max_batch_size, device=facts.device,
            draft_tokens_per_request=spec.draft_tokens_per_request,
            decode_steps=max(1, steps - 1), spec_v1=spec.tree_verify, num_steps=steps),
        device=facts.device, num_single_forward_managers=max(1, steps - 1), variant_tracker=tracker,
    )
    if spec.tree_verify:  # spec v1, page size > 1 with topk > 1: branch copies of a partial page, no TAIL
        from .kv_stores import forget_kv_moves

        forget_kv_moves(pool, manager.groups)
    if tracker is not None:
        _precompile(manager, capacities, facts)
        logger.info("kv_canary_precompiled=1 pool=draft %s", tracker.describe())
    _patch_model_forward(facts.model, manager)
    memory = canary_memory_bytes(
        num_slots=groups[0].num_slots, num_groups=1, req_rows=0, context_len=0,
        ring_capacity=config.ring_capacity, token_oracle=False, max_batch_size=capacities.max_batch_size,
        sweep=False, max_tokens_per_forward=capacities.tokens_per_forward,
        full_row=config.full_row_hash, first_read=config.first_read,
    )
    logger.info(format_line(DRAFT_INSTALLED_PREFIX, 1, {
        "algorithm": spec.algorithm, "draft_model": type(facts.model).__name__,
        "pool": facts.pool_name, "target_pool": spec.target_pool_name or "-", "groups": DRAFT_GROUP,
        "slots": groups[0].num_slots,
        "kernels": kernels.name, "single_forward_managers": max(1, steps - 1),
        "kv_token_id_vs_position_offset": KV_TOKEN_ID_VS_POSITION_OFFSET, "token_checks": 0,
        "canary_bytes": memory.total}))
    return manager


def check_groups_supported(config: CanaryConfig, groups, pool_name: str, pd_mode: Optional[str]) -> None:
    """Features not verified with several buffer groups (hybrid SWA) are refused, naming the flag."""
    if config.swa_divergence_stats_interval and not any(g.window > 0 for g in groups):
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL={config.swa_divergence_stats_interval}: the KV pool "
            f"{pool_name} has no sliding-window group (groups {','.join(g.name for g in groups)}); unset it"
        )
    if len(groups) <= 1:
        return
    names = ",".join(g.name for g in groups)
    if config.mode.value == "contain":
        raise CanaryConfigError(
            f"--kv-canary contain is not supported with the KV pool {pool_name} (groups {names}): its eviction "
            "of corrupt radix-cache nodes is only verified on single-group pools; use --kv-canary log or raise"
        )
    if pd_mode in ("prefill", "decode"):
        raise CanaryConfigError(
            f"--kv-canary {config.mode.value} with --disaggregation-mode {pd_mode} is not supported with the KV "
            f"pool {pool_name} (groups {names}): only the first group's records travel; use --kv-canary none"
        )


def log_coverage(config: CanaryConfig, group) -> None:
    """``kv_canary_coverage=<real data> window_bytes_per_read=... slot_bytes=... every_byte=0|1``: how many bytes of
    a slot each read hashes and whether every byte is hashed (``all``: at its first read and by the scrub); when not
    every byte, a warning names the flag that gets it (issue 60: on 0.5.23 sglang's default is ``none``)."""
    window = 4 * group.hashed_word_count
    slot = 4 * sum(row.words for row in group.rows)
    every = int(config.real_data.value == "all")
    logger.info(format_line("kv_canary_coverage", config.real_data.value, {
        "group": group.name, "window_bytes_per_read": window, "slot_bytes": slot, "every_byte": every}))
    if not every:
        seen = ("is seen only by the scrub, at rest" if config.scrub_slots_per_forward else "is not seen")
        logger.warning("kv_canary: --kv-canary-real-data %s hashes %d of the %d bytes of each %s slot at a read; a "
                       "byte flipped outside them %s. --kv-canary-real-data all hashes every byte at a slot's first "
                       "read and by the scrub (docs/detection.md)", config.real_data.value, window, slot, group.name,
                       seen)


def installed_line(config: CanaryConfig, pool_name: str, groups, kernels_name: str,
                   capacities: LaunchCapacities, disaggregation: Optional[str] = None,
                   memory: Optional[dict] = None) -> str:
    """``kv_canary_installed=1 mode=... pool=... groups=... slots=... kernels=... canary_bytes=...`` (parseable);
    ``release=`` the running sglang; ``untested_release=1`` when ``SGLANG_KV_CANARY_ALLOW_UNTESTED_RELEASE``
    let it in."""
    choice = current_choice()
    return " ".join([
        format_line(INSTALLED_PREFIX, 1, {"impl": "sglang-kv-canary", "sglang": current_line().name,
                                          "release": choice.version, **({"untested_release": 1}
                                                                         if choice.untested else {})}),
        config.describe(),
        format_line("pool", pool_name, {"groups": ",".join(g.name for g in groups), "slots": groups[0].num_slots,
                                        "kernels": kernels_name, "max_batch_size": capacities.max_batch_size,
                                        "max_context_len": capacities.max_context_len,
                                        "max_tokens_per_forward": capacities.tokens_per_forward,
                                        "disaggregation": disaggregation, **(memory or {})}),
    ])


REQ_ROWS_BOUND = 4096 + 1  # sglang 0.5.12 caps its request pool at 4096 rows (+1 padding row)
EXTRA_CONTEXT_BOUND = 64  # req_to_token width = context_len + a few (speculative decoding adds draft tokens)
MIN_KV_BYTES_PER_SLOT = 1024  # used only when the pool configurator does not expose its per-token size


def canary_reserved_bytes(model_runner: Any, available_bytes: int) -> int:  # or 0.5.23's KVCacheConfigurator
    """Device bytes to hold back from the KV pool's budget for the canary (0 when the canary is off).

    Called from sglang's memory profiling, before the pool is sized: the request pool's
    rows are not known yet, so the token table is bounded by sglang's own cap (or
    --max-running-requests + 1); the per-slot buffers scale with the slots the remaining
    bytes buy at the pool's per-token size. An upper bound of what ``install_canary``
    allocates (``canary_memory_bytes``), which it checks.
    """
    server_args = model_runner.server_args
    config = config_from_server_args(server_args)
    if not config.enabled or getattr(model_runner, "is_draft_worker", False):
        return 0
    mrr = getattr(server_args, "max_running_requests", None)
    rows = min(REQ_ROWS_BOUND, int(mrr) + 1) if mrr else REQ_ROWS_BOUND
    ctx = int(model_runner.model_config.context_len) + EXTRA_CONTEXT_BOUND
    groups = 2 if getattr(model_runner.model_config, "is_hybrid_swa", False) else 1  # SWAKVPool: full + swa
    max_bs = max(rows, int(getattr(server_args, "cuda_graph_max_bs", 0) or 0)) + 1  # >= compute_capacities'
    tokens = tokens_per_forward_bound(context_len=ctx, max_batch_size=max_bs,
                                      max_prefill_tokens=max_prefill_tokens(server_args))
    common = dict(num_groups=groups, req_rows=rows, context_len=ctx, ring_capacity=config.ring_capacity,
                  token_oracle=config.uses_token_oracle, max_batch_size=max_bs, sweep=config.sweep_interval > 0,
                  max_tokens_per_forward=tokens, full_row=config.full_row_hash,
                  first_read=config.first_read, hicache=config.hicache)
    fixed = canary_memory_bytes(num_slots=0, **common).total
    per_slot = canary_memory_bytes(num_slots=1, **common).total - fixed
    spec = SpecFacts.read(server_args, config.mode.value)
    if spec is not None and not spec.draft_skip:
        # the EAGLE draft pool's own manager (draft_pool): one group of records over the same slots, its ring
        draft = dict(common, num_groups=1, req_rows=0, token_oracle=False, sweep=False)
        draft_fixed = canary_memory_bytes(num_slots=0, **draft).total
        fixed += draft_fixed
        per_slot += canary_memory_bytes(num_slots=1, **draft).total - draft_fixed
    try:
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        cell = int(getattr(create_memory_pool_configurator(model_runner), "_cell_size", 0) or 0)
    except Exception:  # noqa: BLE001 - a configurator we cannot build: fall back to the bound below
        cell = 0
    cell = cell if cell > 0 else MIN_KV_BYTES_PER_SLOT
    slots = max(0, available_bytes - fixed) // (cell + per_slot) + 1
    return fixed + slots * per_slot


def _precompile(manager: CanaryManager, capacities: LaunchCapacities, facts: SglangFacts) -> None:
    """Every TAIL block size a forward can pick and every verify-grid specialization a batch size gives."""
    from ..kernels import VERIFY_BLOCK
    from ..kernels.variants import programs_classes, write_block_lengths

    # the longest new run is bounded by the context length (chunking only makes it shorter); speculative
    # decoding adds the verify forwards' variant (int64 lengths, staged drafts)
    lengths = sorted(write_block_lengths(_tail_variant(manager.config), capacities.max_context_len).values())
    sizes = sorted(programs_classes(
        lambda bs: capacities.verify_programs_per_request(bs, VERIFY_BLOCK), capacities.max_batch_size).values())
    manager.precompile(lengths, sizes, verify_staged=facts.spec is not None)


def compute_capacities(facts: SglangFacts) -> LaunchCapacities:
    max_bs = max(facts.req_pool_size, facts.cuda_graph_max_bs) + 1
    if facts.device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(facts.device).multi_processor_count
    else:
        target = 1  # CPU/interpreter: one program per request
    ctx = int(facts.req_to_token.shape[1])
    return LaunchCapacities(
        max_batch_size=max_bs,
        max_context_len=ctx,
        verify_programs_target=target,
        max_tokens_per_forward=tokens_per_forward_bound(
            context_len=ctx, max_batch_size=max_bs, max_prefill_tokens=facts.max_prefill_tokens),
    )
