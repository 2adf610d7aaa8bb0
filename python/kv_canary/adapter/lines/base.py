"""What one sglang release line gives the canary: its hook table and the settings it does not verify yet.

A line is one adapter file (``v0_5_12.py``, ``v0_5_23.py``, ...) holding one ``SglangLine``.
Hook names are ``module.function`` under ``kv_canary.adapter`` (``hooks.after_sample``,
``lines.v0_5_23.replace_install_canary``); the bodies shared by several lines live in
``adapter/hooks.py``. A new release is a new file: copy the newest, diff it against sglang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple

HookTable = Mapping[str, Tuple[str, str]]  # dotted sglang target -> (hook name, "before"|"after"|"around"|"replace")


def _nothing_unported(_server_args: Any) -> str:
    return ""


def _no_spec_v1(_server_args: Any) -> bool:
    return False


def _req_pool_idx(req: Any) -> int:
    return req.req_pool_idx


def _runner_tp_rank(model_runner: Any) -> int:
    return int(getattr(model_runner, "tp_rank", 0) or 0)


def _runner_dp_rank(model_runner: Any) -> Optional[int]:
    """The data-parallel rank sglang gave this ModelRunner (None without ``--dp-size``)."""
    rank = getattr(model_runner, "dp_rank", None)
    return None if rank is None else int(rank)


def _controller_host_pool(controller: Any) -> Any:
    from ..hicache_pool import host_pool_0_5_12

    return host_pool_0_5_12(controller)


def _radix_containment(scheduler: Any, manager: Any) -> Any:
    from ..contain import SchedulerContainment

    del manager
    return SchedulerContainment(scheduler)


@dataclass(frozen=True)
class SglangLine:
    """One sglang release line.

    ``hooks`` are required whenever the canary is on; ``pd_hooks`` with
    ``--disaggregation-mode prefill|decode``; ``spec_hooks`` with ``--speculative-algorithm``; ``hicache_hooks``
    with ``--enable-hierarchical-cache`` (adapter/hicache).
    ``unported(server_args)`` names the first setting this line's adapter does not verify yet
    ('' if none): refused at startup, naming the flag. ``in_tree_canary``: the release ships
    sglang's own kv_canary (the plugin takes its place, ``SGLANG_KV_CANARY_IMPL`` chooses).
    ``flags_declared_by_sglang``: ``--kv-canary*`` are sglang's own fields (else the plugin adds them).
    """

    name: str
    versions: Tuple[str, ...]
    hooks: HookTable
    pd_hooks: HookTable = field(default_factory=dict)
    spec_hooks: HookTable = field(default_factory=dict)
    hicache_hooks: HookTable = field(default_factory=dict)
    in_tree_canary: bool = False
    flags_declared_by_sglang: bool = False
    policy: Any = None  # adapter.server_args.ServerArgsPolicy: every ServerArgs field of this line classified
    # releases whose hook targets all match the line (the fence, from their wheels) but that no smoke ran on here:
    # served only with SGLANG_KV_CANARY_ALLOW_UNTESTED_RELEASE=1 (adapter/lines.choose_line)
    untested_versions: Tuple[str, ...] = ()
    # a release of the line whose ServerArgs fields differ from the line's own release -> its policy (policy_for)
    release_policies: Mapping[str, Any] = field(default_factory=dict)
    unported: Callable[[Any], str] = _nothing_unported
    req_row: Callable[[Any], int] = _req_pool_idx  # a scheduler Req's req_to_token row
    tp_rank: Callable[[Any], int] = _runner_tp_rank  # a ModelRunner's tensor-parallel rank
    dp_rank: Callable[[Any], Optional[int]] = _runner_dp_rank  # its data-parallel rank (None without --dp-size)
    # KV pool classes this line's adapter verifies (None: every class adapter/pools registers); others refused
    verified_pools: Optional[Tuple[str, ...]] = None
    # (tree cache, manager) -> the reader the sweep and the unused-cache perturbation use, or None; and its trees
    prefix_cache_view: Callable[[Any, Any], Any] = lambda tree, manager: None
    prefix_caches: str = "no prefix cache"
    # (scheduler, manager) -> --kv-canary contain's scheduler side: aborts, and eviction from this line's radix
    # cache (0.5.12: contain.SchedulerContainment, RadixCache nodes; 0.5.23: contain_unified, UnifiedRadixCache)
    containment: Callable[[Any, Any], Any] = _radix_containment
    # server args -> whether speculative decoding runs through spec v1 (tree verifies whose TAIL is deferred to the
    # kept drafts: 0.5.12's EAGLEWorker); False where the line has no spec v1 (0.5.23: EAGLEWorkerV2 only)
    spec_v1: Callable[[Any], bool] = _no_spec_v1
    # HiCache's cache controller -> the host pool whose copies the canary keeps records for (0.5.12: its
    # ``mem_pool_host``; 0.5.23: the host pool group's anchor entry); refuses a pool it does not verify
    hicache_host_pool: Callable[[Any], Any] = _controller_host_pool
    # --page-size values PD disaggregation is verified with on this line (adapter/disagg); others refused
    pd_page_sizes: Tuple[int, ...] = (1,)
    # PD disaggregation verified with --tp-size > 1 (the same on both sides) on this line
    pd_tensor_parallel: bool = False
    # PD disaggregation ran on this line's releases (its pd_hooks verified there); else --disaggregation-mode is
    # refused at startup (adapter/disagg): 0.5.21 and 0.5.22 carry 0.5.23's PD hooks, which never ran on them
    pd_verified: bool = False
    # target KV pool classes speculative decoding is verified over on this line (adapter/speculative.spec_pool_refusal)
    spec_target_pools: Tuple[str, ...] = ("MHATokenToKVPool",)

    def required_hooks(self, *, pd: bool, spec: bool, hicache: bool = False) -> HookTable:
        return {**self.hooks, **(self.pd_hooks if pd else {}), **(self.spec_hooks if spec else {}),
                **(self.hicache_hooks if hicache else {})}

    def policy_for(self, version: str) -> Any:
        """The server-args policy of release ``version`` of this line."""
        return self.release_policies.get(version, self.policy)

    def all_hooks(self) -> HookTable:
        return {**self.hooks, **self.pd_hooks, **self.spec_hooks, **self.hicache_hooks}
