"""HiCache's refusal at startup, and sglang 0.5.12's host pool reader (``SglangLine.hicache_host_pool``'s default).

Shared by ``adapter/hicache`` (the gate and the hooks, which read the running line) and ``lines/base`` (the line
type), so neither imports the other.
"""

from __future__ import annotations

from typing import Any

from ..config import FLAG_MODE, CanaryConfigError

FLAG = "--enable-hierarchical-cache"


def _refuse(what: str, why: str, do: str) -> None:
    raise CanaryConfigError(f"{FLAG_MODE} cannot verify {FLAG} with {what}: {why}; {do}, or run this server "
                            f"with {FLAG_MODE} none")


def host_pool_0_5_12(controller) -> Any:
    """sglang 0.5.12's ``HiCacheController.mem_pool_host`` (``SglangLine.hicache_host_pool``'s default); a controller
    that also copies a draft model's pool is refused (its records are not kept)."""
    if getattr(controller, "has_draft", False):
        _refuse("a draft model's pool (speculative decoding)", "host copies are verified for MHATokenToKVPoolHost "
                "(no draft pool) only", f"drop {FLAG}")
    return getattr(controller, "mem_pool_host", None)
