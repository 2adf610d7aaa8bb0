"""Canary configuration: built once from server args + ``SGLANG_KV_CANARY_*`` env vars.

Nothing below this module reads the environment: ``CanaryConfig`` is frozen and
passed down. Every env var the canary knows is listed in ``ENV_VARS``; an unknown
``SGLANG_KV_CANARY_*`` name or a malformed value is a ``CanaryConfigError`` at
startup, so a typo never silently turns a feature off.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

ENV_PREFIX = "SGLANG_KV_CANARY_"
WINDOW_ENV_VARS = ("KV_HASH_BYTES", "KV_HASH_LAYERS")  # (after ENV_PREFIX) tune partial's hashed window
FLAG_MODE = "--kv-canary"
FLAG_SWEEP_INTERVAL = "--kv-canary-sweep-interval"
FLAG_REAL_DATA = "--kv-canary-real-data"


class CanaryConfigError(ValueError):
    """A flag or env var of the canary has a value it cannot run with."""


class CanaryMode(str, enum.Enum):
    NONE = "none"
    LOG = "log"
    RAISE = "raise"
    CONTAIN = "contain"  # abort the requests that read a bad slot, evict it from the prefix cache, keep serving

    @property
    def enabled(self) -> bool:
        return self is not CanaryMode.NONE


class RealData(str, enum.Enum):
    """How much of each slot's real K/V bytes the kv_hash covers (upstream's flag and meaning)."""

    NONE = "none"  # no K/V bytes: the fingerprint is token, position, chain
    PARTIAL = "partial"  # SGLANG_KV_CANARY_KV_HASH_BYTES of K and V in SGLANG_KV_CANARY_KV_HASH_LAYERS
    ALL = "all"  # every byte of K and V of every layer: at a slot's first read, then by the scrub (design.md)


ALL_SCRUB_SLOTS_PER_FORWARD = 256  # the scrub's default with --kv-canary-real-data all


class KernelBackend(str, enum.Enum):
    AUTO = "auto"  # triton on CUDA; on CPU triton if TRITON_INTERPRET=1, else torch
    TRITON = "triton"
    TORCH = "torch"


def _parse_int(lo: int, hi: Optional[int] = None) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise CanaryConfigError(f"{name}={raw!r}: expected an integer") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise CanaryConfigError(f"{name}={raw!r}: expected an integer {bound}")
        return value

    return parse


def _parse_prob(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise CanaryConfigError(f"{name}={raw!r}: expected a probability in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise CanaryConfigError(f"{name}={raw!r}: expected a probability in [0, 1]")
    return value


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise CanaryConfigError(f"{name}={raw!r}: expected 1/0 (true/false)")


def _parse_kv_bytes(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value in ("anywhere", "hashed"):
        return value
    parts = value.split(":")
    if len(parts) == 3 and parts[1] in ("k", "v"):
        try:
            int(parts[0])
            if parts[2] != "mid":
                int(parts[2])
            return value
        except ValueError:
            pass
    raise CanaryConfigError(
        f"{name}={raw!r}: expected 'anywhere', 'hashed' or LAYER:HALF:BYTE "
        "(e.g. '-1:k:mid': the middle byte of the last layer's K row)"
    )


def _parse_layers(name: str, raw: str) -> Tuple[int, ...]:
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not parts:
        raise CanaryConfigError(f"{name}={raw!r}: expected layer ids like '0' or '0,15,31'")
    layers = tuple(_parse_int(0)(name, p) for p in parts)
    if len(set(layers)) != len(layers):
        raise CanaryConfigError(f"{name}={raw!r}: layer ids repeat")
    return layers


def _parse_hash_bytes(name: str, raw: str) -> int:
    value = _parse_int(4, 4096)(name, raw)
    if value % 4:
        raise CanaryConfigError(f"{name}={raw!r}: expected a multiple of 4 bytes")
    return value


def _parse_backend(name: str, raw: str) -> KernelBackend:
    try:
        return KernelBackend(raw.strip().lower())
    except ValueError:
        choices = ", ".join(b.value for b in KernelBackend)
        raise CanaryConfigError(f"{name}={raw!r}: expected one of {choices}") from None


# env var suffix -> (config field, parser, help)
ENV_VARS: Dict[str, Tuple[str, Callable[[str, str], Any], str]] = {
    "KV_HASH_BYTES": ("kv_hash_bytes", _parse_hash_bytes,
                      "bytes of K and of V hashed per slot and layer (multiple of 4, default 16)"),
    "KV_HASH_LAYERS": ("kv_hash_layers", _parse_layers,
                       "comma-separated layer ids whose K/V bytes are hashed (default 0)"),
    "ENABLE_TOKEN_ORACLE": ("token_oracle", _parse_bool,
                            "keep each request's own tokens from the scheduler's record on the device; the token "
                            "checks need it (default 1)"),
    "ENABLE_VERIFY_TOKEN_ASSERT": ("verify_tokens", _parse_bool,
                                   "HEAD: check each verified slot's token against the request's own token "
                                   "(default 1; needs the token oracle)"),
    "ENABLE_WRITE_INPUT_ASSERT": ("write_input_assert", _parse_bool,
                                  "TAIL: check the positions and (with the token oracle) tokens each forward is fed "
                                  "(default 1)"),
    "WRITE_WITNESS": ("write_witness", _parse_bool,
                      "stamp every K/V row of each slot a forward is meant to fill before it runs and report "
                      "a row the forward left unwritten (kind unwritten) in its TAIL (default 1)"),
    "RING_CAPACITY": ("ring_capacity", _parse_int(16, 1 << 20),
                      "violation records kept on the device between host reads (default 4096)"),
    "D2H_DELAY_STEPS": ("d2h_delay_steps", _parse_int(0, 64),
                        "forwards between a device counter copy and its host read (default 2)"),
    "D2H_INTERVAL": ("d2h_interval", _parse_int(1, 64),
                     "forwards between device counter copies (and before every idle drain): the host learns of a "
                     "violation up to D2H_DELAY_STEPS + D2H_INTERVAL - 1 forwards later, for 1/N of the copies' "
                     "host time (default 1)"),
    "KERNEL_BACKEND": ("kernel_backend", _parse_backend, "auto | triton | torch (default auto)"),
    "STATS_PRINT_EVERY_N_STEPS": ("stats_print_every_n_steps", _parse_int(0),
                                  "forwards between kv_canary_stats= lines; 0 = off (default 100)"),
    "MAX_LOGGED_VIOLATIONS": ("max_logged_violations", _parse_int(1),
                              "violation lines logged per host read; the rest are counted (default 64)"),
    "SCRUB_SLOTS_PER_FORWARD": ("scrub_slots_per_forward", _parse_int(0, 1 << 24),
                                "slots per forward whose every K/V byte the scrub checks, cycling through the "
                                "pool (0 = off, the default; with --kv-canary-real-data all the default is 256)"),
    "HOST_SCRUB_SLOTS_PER_SECOND": ("host_scrub_slots_per_second", _parse_int(0, 1 << 24),
                                    "HiCache: host copies per second whose every K/V byte a scheduler-process thread "
                                    "checks against their records, cycling through the host pool (0 = off, the "
                                    "default; needs --enable-hierarchical-cache)"),
    "SWA_DIVERGENCE_STATS_INTERVAL": ("swa_divergence_stats_interval", _parse_int(0),
                                      "hybrid sliding-window pools: forwards between kv_canary_swa_divergence= "
                                      "lines (verify entries of the full and swa groups, swa/full slot "
                                      "divergence, out-of-window tokens); 0 = off (default)"),
    "PERTURB_REAL_KV_USED_PROB": ("perturb_real_kv_used_prob", _parse_prob,
                                  "per-forward probability of flipping a K/V byte of a slot the forward reads"),
    "PERTURB_REQ_TO_TOKEN_PROB": ("perturb_req_to_token_prob", _parse_prob,
                                  "per-forward probability of pointing one read req_to_token entry at another "
                                  "slot of the same request for that forward"),
    "PERTURB_REAL_KV_UNUSED_CACHE_PROB": ("perturb_real_kv_unused_cache_prob", _parse_prob,
                                          "per-forward probability of flipping a K/V byte of a slot only the radix "
                                          "cache holds (needs --kv-canary-sweep-interval > 0)"),
    "PERTURB_REAL_KV_POST_FORWARD_PROB": ("perturb_real_kv_post_forward_prob", _parse_prob,
                                          "per-forward probability of flipping a K/V byte of a slot the forward "
                                          "just wrote, after its TAIL write"),
    "PERTURB_TRANSFER_PROB": ("perturb_transfer_prob", _parse_prob,
                              "PD decode side: per-request probability of flipping a K/V byte of a slot received "
                              "by transfer, after arrival and before its first read"),
    "PERTURB_HOST_COPY_PROB": ("perturb_host_copy_prob", _parse_prob,
                               "HiCache: per settled backup, probability of flipping a K/V byte of one of its host "
                               "copies (caught when it is loaded back; needs --enable-hierarchical-cache)"),
    "PERTURB_STORAGE_PAGE_PROB": ("perturb_storage_page_prob", _parse_prob,
                                  "HiCache storage: per page the canary wrote to the storage tier, probability of "
                                  "flipping one K/V byte of it where it rests (caught when loaded back; needs "
                                  "--hicache-storage-backend file)"),
    "PERTURB_POSITION_SHIFT_PROB": ("perturb_position_shift_prob", _parse_prob,
                                    "per-forward probability of running one decode forward at positions + 1 "
                                    "(a position bookkeeping bug: K is rotated for the wrong position)"),
    "PERTURB_NEXT_TOKEN_SWAP_PROB": ("perturb_next_token_swap_prob", _parse_prob,
                                     "per-forward probability of feeding two requests of a decode forward each "
                                     "other's token (a future-token resolution bug)"),
    "PERTURB_WRITE_DROPPED_PROB": ("perturb_write_dropped_prob", _parse_prob,
                                   "per-forward probability of dropping one token's K/V store in every layer (it "
                                   "goes to the padding slot; the token's slot keeps its old bytes)"),
    "PERTURB_WRITE_DROPPED_LAYER_PROB": ("perturb_write_dropped_layer_prob", _parse_prob,
                                         "per-forward probability of dropping one token's K/V store in one layer"),
    "PERTURB_WRITE_MISDIRECTED_PROB": ("perturb_write_misdirected_prob", _parse_prob,
                                       "per-forward probability of one token's K/V store landing in the "
                                       "neighbouring slot, in every layer"),
    "PERTURB_KV_BYTES": ("perturb_kv_bytes", _parse_kv_bytes,
                         "where K/V flips land: anywhere (default: uniform over every byte of every layer's K "
                         "and V row), hashed (inside the hashed window only), or LAYER:HALF:BYTE, e.g. -1:k:mid"),
    "PERTURB_TARGET_GROUP": ("perturb_target_group", lambda name, raw: raw.strip(),
                             "buffer group the K/V perturbations hit (default: the first, 'full'; hybrid SWA: 'swa'; '*': a "
                             "random group per injection)"),
    "PERTURB_WARMUP_STEPS": ("perturb_warmup_steps", _parse_int(0),
                             "forwards before any perturbation (default 50)"),
    "PERTURB_SEED": ("perturb_seed", _parse_int(0), "seed of the perturbation RNG (default 0)"),
    "PERTURB_MAX_INJECTIONS": ("perturb_max_injections", _parse_int(0),
                               "stop perturbing after this many injections; 0 = no limit (default 0)"),
    "PERTURB_TP_RANK": ("perturb_tp_rank", _parse_int(-1),
                        "tensor parallel: only this rank perturbs its KV shard; -1 = every rank (default -1)"),
    "PERTURB_DP_RANK": ("perturb_dp_rank", _parse_int(-1),
                        "data parallel: only this DP rank perturbs its KV pool; -1 = every rank (default -1)"),
}


# read by adapter/lines when it picks the release line, not by the canary's config
LINE_ENV_VARS: Dict[str, str] = {
    "IMPL": "plugin (default) or in-tree: on a release with sglang's own kv_canary, which one serves --kv-canary",
    "ALLOW_UNTESTED_RELEASE": "1: run an sglang release newer than the newest tested one when every hook target "
                              "of the newest line has the signature it expects there (default 0: refused)",
}


@dataclass(frozen=True)
class CanaryConfig:
    """Everything the canary needs to know, fixed at startup."""

    mode: CanaryMode = CanaryMode.NONE
    sweep_interval: int = 0
    real_data: RealData = RealData.PARTIAL
    scrub_slots_per_forward: int = 0
    host_scrub_slots_per_second: int = 0
    kv_hash_bytes: int = 16
    kv_hash_layers: Tuple[int, ...] = (0,)
    token_oracle: bool = True
    verify_tokens: bool = True
    write_input_assert: bool = True
    write_witness: bool = True
    ring_capacity: int = 4096
    d2h_delay_steps: int = 2
    d2h_interval: int = 1
    kernel_backend: KernelBackend = KernelBackend.AUTO
    stats_print_every_n_steps: int = 100
    max_logged_violations: int = 64
    swa_divergence_stats_interval: int = 0
    perturb_real_kv_used_prob: float = 0.0
    perturb_req_to_token_prob: float = 0.0
    perturb_real_kv_unused_cache_prob: float = 0.0
    perturb_real_kv_post_forward_prob: float = 0.0
    perturb_transfer_prob: float = 0.0
    perturb_host_copy_prob: float = 0.0
    perturb_storage_page_prob: float = 0.0
    perturb_position_shift_prob: float = 0.0
    perturb_next_token_swap_prob: float = 0.0
    perturb_write_dropped_prob: float = 0.0
    perturb_write_dropped_layer_prob: float = 0.0
    perturb_write_misdirected_prob: float = 0.0
    perturb_kv_bytes: str = "anywhere"
    perturb_target_group: str = ""
    perturb_warmup_steps: int = 50
    perturb_seed: int = 0
    perturb_max_injections: int = 0
    perturb_tp_rank: int = -1
    perturb_dp_rank: int = -1
    # --enable-hierarchical-cache: slots come back from host copies (docs/hicache.md); their every byte is
    # checked at the first read after the load-back against the FULL_HASH TAIL stored when they were written
    hicache: bool = False
    env_overrides: Tuple[Tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def enabled(self) -> bool:
        return self.mode.enabled

    @property
    def full_row_hash(self) -> bool:
        """TAIL stores every new slot's FULL_HASH (the scrub, or ``all``'s first-read verification)."""
        return self.scrub_slots_per_forward > 0 or self.real_data is RealData.ALL or self.hicache

    @property
    def first_read(self) -> bool:
        """HEAD lists read slots whose full row is unverified (``all``: every slot once after its write;
        HiCache: the slots a load-back filled)."""
        return self.real_data is RealData.ALL or self.hicache

    @property
    def clear_tags(self) -> bool:
        """TAIL marks each new slot's full row unverified (``all``); else verified (HiCache outside ``all``:
        only loaded slots, whose tag the load-back zeroes, are listed)."""
        return self.real_data is RealData.ALL

    @property
    def uses_token_oracle(self) -> bool:
        """The oracle is kept when on and some check reads it."""
        return self.token_oracle and (self.verify_tokens or self.write_input_assert)

    @property
    def any_perturbation(self) -> bool:
        return any(p > 0.0 for p in (self.perturb_real_kv_used_prob, self.perturb_req_to_token_prob,
                                     self.perturb_real_kv_unused_cache_prob, self.perturb_real_kv_post_forward_prob,
                                     self.perturb_position_shift_prob, self.perturb_next_token_swap_prob,
                                     self.perturb_transfer_prob, self.perturb_write_dropped_prob,
                                     self.perturb_host_copy_prob, self.perturb_storage_page_prob,
                                     self.perturb_write_dropped_layer_prob, self.perturb_write_misdirected_prob))

    @classmethod
    def build(
        cls,
        *,
        mode: Any,
        sweep_interval: Any = 0,
        real_data: Any = RealData.PARTIAL.value,
        environ: Mapping[str, str],
        disable_piecewise_cuda_graph: bool = True,
        hicache: bool = False,
    ) -> "CanaryConfig":
        """Validate the flags and env vars; raise ``CanaryConfigError`` naming the bad one."""
        try:
            parsed_mode = CanaryMode(str(mode).strip().lower())
        except ValueError:
            choices = ", ".join(m.value for m in CanaryMode)
            raise CanaryConfigError(f"{FLAG_MODE} {mode!r}: expected one of {choices}") from None
        sweep = _parse_int(0)(FLAG_SWEEP_INTERVAL, str(sweep_interval))
        if sweep > 0 and not parsed_mode.enabled:
            raise CanaryConfigError(
                f"{FLAG_SWEEP_INTERVAL} {sweep} needs the canary on: add {FLAG_MODE} log or "
                f"{FLAG_MODE} raise, or drop {FLAG_SWEEP_INTERVAL}"
            )
        try:
            parsed_real_data = RealData(str(real_data).strip().lower())
        except ValueError:
            choices = ", ".join(r.value for r in RealData)
            raise CanaryConfigError(f"{FLAG_REAL_DATA} {real_data!r}: expected one of {choices}") from None
        values: Dict[str, Any] = {}
        seen = []
        for name in sorted(environ):
            if not name.startswith(ENV_PREFIX):
                continue
            suffix = name[len(ENV_PREFIX):]
            if suffix in LINE_ENV_VARS:
                continue
            if suffix not in ENV_VARS:
                known = ", ".join(ENV_PREFIX + s for s in sorted({**ENV_VARS, **LINE_ENV_VARS}))
                raise CanaryConfigError(f"unknown env var {name}; the canary knows: {known}")
            field_name, parse, _ = ENV_VARS[suffix]
            values[field_name] = parse(name, environ[name])
            seen.append((name, environ[name]))
        config = cls(mode=parsed_mode, sweep_interval=sweep, real_data=parsed_real_data, env_overrides=tuple(seen),
                     hicache=bool(hicache) and parsed_mode.enabled, **values)
        if parsed_real_data is RealData.ALL and "scrub_slots_per_forward" not in values:
            # all = the window at every read + every byte at a slot's first read + the scrub (design.md)
            config = replace(config, scrub_slots_per_forward=ALL_SCRUB_SLOTS_PER_FORWARD)
        window_vars = [n for n, _ in seen if n[len(ENV_PREFIX):] in WINDOW_ENV_VARS]
        if window_vars and parsed_real_data is not RealData.PARTIAL:
            raise CanaryConfigError(
                f"{', '.join(window_vars)} tune{'s' if len(window_vars) == 1 else ''} the hashed window of "
                f"{FLAG_REAL_DATA} partial, but it is {parsed_real_data.value}: unset "
                f"{'it' if len(window_vars) == 1 else 'them'} or pass {FLAG_REAL_DATA} partial"
            )
        if config.enabled and not disable_piecewise_cuda_graph:
            raise CanaryConfigError(
                f"{FLAG_MODE} {parsed_mode.value} cannot run inside piecewise CUDA graphs: "
                "pass --disable-piecewise-cuda-graph"
            )
        if config.any_perturbation and not config.enabled:
            raise CanaryConfigError(
                "SGLANG_KV_CANARY_PERTURB_* is set but the canary is off: "
                f"add {FLAG_MODE} log or {FLAG_MODE} raise"
            )
        if config.perturb_host_copy_prob > 0 and not config.hicache:
            raise CanaryConfigError("SGLANG_KV_CANARY_PERTURB_HOST_COPY_PROB corrupts HiCache's host copies: add "
                                    "--enable-hierarchical-cache or unset it")
        if config.host_scrub_slots_per_second > 0 and not config.hicache:
            raise CanaryConfigError("SGLANG_KV_CANARY_HOST_SCRUB_SLOTS_PER_SECOND checks HiCache's host copies: add "
                                    "--enable-hierarchical-cache or unset it")
        if config.perturb_storage_page_prob > 0 and not config.hicache:
            raise CanaryConfigError("SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB corrupts pages of HiCache's storage "
                                    "tier: add --enable-hierarchical-cache --hicache-storage-backend file or unset it")
        if config.perturb_real_kv_unused_cache_prob > 0 and config.sweep_interval == 0:
            raise CanaryConfigError(
                "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB corrupts slots only the radix cache holds, "
                f"which only the sweep can check: add {FLAG_SWEEP_INTERVAL} N (N > 0)"
            )
        return config

    def scrub_bound_forwards(self, span: int) -> int:
        """Forwards within which the scrub has checked every slot of a ``span``-slot pool once (0: off)."""
        if not self.scrub_slots_per_forward:
            return 0
        return -(-span // min(self.scrub_slots_per_forward, span))

    def describe(self) -> str:
        """One line for the startup log."""
        return (
            f"mode={self.mode.value} sweep_interval={self.sweep_interval} real_data={self.real_data.value} "
            f"scrub_slots_per_forward={self.scrub_slots_per_forward} "
            f"kv_hash_bytes={self.kv_hash_bytes} kv_hash_layers={','.join(map(str, self.kv_hash_layers))} "
            f"ring_capacity={self.ring_capacity} d2h_delay_steps={self.d2h_delay_steps} "
            f"d2h_interval={self.d2h_interval} "
            f"kernel_backend={self.kernel_backend.value} token_oracle={int(self.uses_token_oracle)} "
            f"verify_tokens={int(self.verify_tokens and self.uses_token_oracle)} "
            f"write_input_assert={int(self.write_input_assert)} write_witness={int(self.write_witness)} "
            f"perturb_real_kv_used_prob={self.perturb_real_kv_used_prob} "
            f"perturb_req_to_token_prob={self.perturb_req_to_token_prob} "
            f"perturb_real_kv_unused_cache_prob={self.perturb_real_kv_unused_cache_prob} "
            f"perturb_real_kv_post_forward_prob={self.perturb_real_kv_post_forward_prob} "
            f"perturb_position_shift_prob={self.perturb_position_shift_prob} "
            f"perturb_next_token_swap_prob={self.perturb_next_token_swap_prob} perturb_kv_bytes={self.perturb_kv_bytes}"
            + (" hicache=1" if self.hicache else "")
            + (f" host_scrub_slots_per_second={self.host_scrub_slots_per_second}"
               if self.host_scrub_slots_per_second else "")
            + (f" perturb_host_copy_prob={self.perturb_host_copy_prob}" if self.perturb_host_copy_prob else "")
            + (f" perturb_storage_page_prob={self.perturb_storage_page_prob}" if self.perturb_storage_page_prob
               else "")
            + (f" perturb_transfer_prob={self.perturb_transfer_prob}" if self.perturb_transfer_prob else "")
            + (f" perturb_tp_rank={self.perturb_tp_rank}" if self.perturb_tp_rank >= 0 else "")
            + (f" perturb_dp_rank={self.perturb_dp_rank}" if self.perturb_dp_rank >= 0 else "")
            + "".join(f" perturb_{m}_prob={p}" for m, p in (
                ("write_dropped", self.perturb_write_dropped_prob),
                ("write_dropped_layer", self.perturb_write_dropped_layer_prob),
                ("write_misdirected", self.perturb_write_misdirected_prob)) if p)
        )

    def for_tp_rank(self, tp_rank: int, dp_rank: Optional[int] = None) -> "CanaryConfig":
        """This rank's config: without the perturbations when ``perturb_tp_rank`` (``perturb_dp_rank``) names
        another TP (DP) rank."""
        tp_ok = self.perturb_tp_rank < 0 or self.perturb_tp_rank == tp_rank
        dp_ok = self.perturb_dp_rank < 0 or self.perturb_dp_rank == (dp_rank or 0)
        if tp_ok and dp_ok:
            return self
        return replace(self, **{f.name: 0.0 for f in fields(self) if f.name.startswith("perturb_")
                                and f.name.endswith("_prob")})
