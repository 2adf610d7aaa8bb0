"""sglang's HiCache (``--enable-hierarchical-cache``) under the canary: the startup gate (docs/hicache.md 3.13).

What is verified (the CPU e2e ``test_e2e_hicache.py``, sglang 0.5.12 through the test shim): an MHA pool (one
buffer group), ``--page-size`` 1 or 16, the write policies in ``VERIFIED_WRITE_POLICIES``, the ``layer_first``
host layout, no storage backend, one TP rank, ``--kv-canary log|raise`` with ``--kv-canary-real-data partial``.
Everything else is refused at startup naming the flag and its value.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..config import FLAG_MODE, FLAG_REAL_DATA, FLAG_SWEEP_INTERVAL, CanaryConfig, CanaryConfigError

FLAG = "--enable-hierarchical-cache"
VERIFIED_LINES = ("0.5.12",)
VERIFIED_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
VERIFIED_LAYOUTS = ("layer_first",)
VERIFIED_PAGE_SIZES = (1, 16)
VERIFIED_DEVICES = ("cpu",)
VERIFIED_POOLS = ("MHATokenToKVPool",)


def _refuse(what: str, why: str, do: str) -> None:
    raise CanaryConfigError(f"{FLAG_MODE} cannot verify {FLAG} with {what}: {why}; {do}, or run this server "
                            f"with {FLAG_MODE} none")


def check_hicache(server_args: Any, config: CanaryConfig, line: Optional[str] = None) -> None:
    """Refuse (``CanaryConfigError``) a HiCache configuration the canary does not verify; no-op without HiCache.

    ``line``: the running sglang line's name (default: ``adapter.lines.current_line()``)."""
    storage = getattr(server_args, "hicache_storage_backend", None)
    if not config.enabled:
        return
    if not getattr(server_args, "enable_hierarchical_cache", False):
        if storage:
            raise CanaryConfigError(f"{FLAG_MODE} {config.mode.value} cannot verify --hicache-storage-backend "
                                    f"{storage}: the canary keeps no records for storage pages yet; drop it or run "
                                    f"with {FLAG_MODE} none")
        return
    if line is None:
        from .lines import current_line

        line = current_line().name
    if line not in VERIFIED_LINES:
        _refuse(f"sglang {line}", f"HiCache is verified on sglang {', '.join(VERIFIED_LINES)} only",
                f"drop {FLAG}")
    if storage:
        _refuse(f"--hicache-storage-backend {storage}", "the canary keeps no records for storage pages yet",
                "drop --hicache-storage-backend")
    device = str(getattr(server_args, "device", None) or "cuda")
    if device not in VERIFIED_DEVICES:
        _refuse(f"--device {device}", "HiCache with the canary is verified on CPU (test shim) only; the GPU "
                "transfers are not verified yet (docs/hicache.md step 12)", f"drop {FLAG}")
    checks = (
        ("--kv-canary", config.mode.value, ("log", "raise"),
         "contain does not evict host copies yet"),
        (FLAG_REAL_DATA, config.real_data.value, ("partial",), "only partial was run with HiCache"),
        ("--page-size", getattr(server_args, "page_size", None) or 1, VERIFIED_PAGE_SIZES,
         "only these page sizes were run"),
        ("--hicache-write-policy", getattr(server_args, "hicache_write_policy", "write_through"),
         VERIFIED_WRITE_POLICIES, "only these write policies were run"),
        ("--hicache-mem-layout", getattr(server_args, "hicache_mem_layout", "layer_first"), VERIFIED_LAYOUTS,
         "only the layer_first host layout was run"),
        ("--tp-size", getattr(server_args, "tp_size", None) or 1, (1,), "host copies per TP rank are not verified"),
    )
    for flag, value, allowed, why in checks:
        if value not in allowed:
            _refuse(f"{flag} {value}", f"{why} (verified: {', '.join(map(str, allowed))})",
                    f"use {flag} {allowed[0]}")
    for flag, field, off in (("--speculative-algorithm", "speculative_algorithm", (None,)),
                             ("--disaggregation-mode", "disaggregation_mode", (None, "null")),
                             (FLAG_SWEEP_INTERVAL, "kv_canary_sweep_interval", (None, 0))):
        value = getattr(server_args, field, None)
        if value not in off:
            _refuse(f"{flag} {value}", "HiRadixCache's host tier is not verified with it", f"drop {flag}")


def check_hicache_pool(pool_name: str, group_names: Sequence[str]) -> None:
    """At install: HiCache is verified on a one-group MHA pool only."""
    if pool_name not in VERIFIED_POOLS or len(group_names) != 1:
        _refuse(f"the KV pool {pool_name} (groups: {', '.join(group_names)})",
                f"host copies are verified for {', '.join(VERIFIED_POOLS)} (one buffer group) only",
                f"drop {FLAG}")
