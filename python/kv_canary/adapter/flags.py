"""The ``--kv-canary*`` flags on a release that does not declare them (0.5.12): CLI, ``ServerArgs(...)``, Engine.

Each path validates the settings with the ``SGLANG_KV_CANARY_*`` env vars and the server-args
allow-list before any process starts (``apply_canary_settings``).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("kv_canary")


# ---------------------------------------------------------------- server args


def after_add_cli_args(_result, parser) -> None:
    from ..config import CanaryMode, RealData

    group = parser.add_argument_group("kv-canary")
    group.add_argument(
        "--kv-canary",
        type=str,
        default=CanaryMode.NONE.value,
        choices=[m.value for m in CanaryMode],
        help="KV-cache integrity canary: 'log' logs each violation and keeps serving, 'raise' stops "
        "the server with a report, 'contain' aborts the requests that read a corrupt KV slot, evicts it from "
        "the radix cache and keeps serving, 'none' (default) costs nothing. Needs --disable-piecewise-cuda-graph "
        "on GPU. Tuned by SGLANG_KV_CANARY_* env vars (see the sglang-kv-canary README).",
    )
    group.add_argument(
        "--kv-canary-real-data",
        type=str,
        default=None,
        choices=[r.value for r in RealData],
        help="How much of each slot's real K/V bytes the canary hashes: 'none' (token, position and chain "
        "only), 'partial' (SGLANG_KV_CANARY_KV_HASH_BYTES of K and V in SGLANG_KV_CANARY_KV_HASH_LAYERS), "
        "'all' (the default: the partial window at every read, plus every byte of K and V of every layer at a "
        "slot's first read after its write and by a scrub within a bound logged at startup; docs/design.md). "
        "Unset, it is 'partial' where 'all' is not verified (HiCache, PD disaggregation, the window env vars), "
        "and the startup log says why.",
    )
    group.add_argument(
        "--kv-canary-sweep-interval",
        type=int,
        default=0,
        metavar="N",
        help="Every N forwards, also verify every slot held by the radix cache, including cached prefixes "
        "no running request uses (0 = off, the default). Needs --kv-canary log or raise.",
    )


def around_from_cli_args(original, cls, args):
    mode, sweep = getattr(args, "kv_canary", "none"), getattr(args, "kv_canary_sweep_interval", 0)
    real_data = getattr(args, "kv_canary_real_data", None)
    _refuse_unsupported(args, mode)  # the user's own flags, before sglang's __post_init__ reacts to them
    server_args = original(cls, args)
    apply_canary_settings(server_args, mode, sweep, real_data)
    return server_args


def around_server_args_init(original, server_args, *args, kv_canary=None, kv_canary_sweep_interval=None,
                             kv_canary_real_data=None, **kwargs):
    """``ServerArgs(..., kv_canary="raise")`` (the Engine API) works like the CLI flags.

    Without these keywords (``from_cli_args``, which applies the flags itself, or a plain
    ``ServerArgs(...)``) the canary settings are only defaulted here.
    """
    if kv_canary is None and kv_canary_sweep_interval is None and kv_canary_real_data is None:
        original(server_args, *args, **kwargs)
        server_args.kv_canary, server_args.kv_canary_sweep_interval = "none", 0
        server_args.kv_canary_real_data = default_real_data(server_args, os.environ)[0]
        return
    mode = "none" if kv_canary is None else kv_canary
    _refuse_unsupported(_GivenArgs(type(server_args), kwargs), mode)
    original(server_args, *args, **kwargs)
    apply_canary_settings(server_args, mode, kv_canary_sweep_interval or 0, kv_canary_real_data)


class _GivenArgs:
    """The keyword arguments given to ``ServerArgs(...)``, falling back to the class defaults."""

    def __init__(self, cls, kwargs):
        self._cls, self._kwargs = cls, kwargs

    def __getattr__(self, name):
        return self._kwargs[name] if name in self._kwargs else getattr(self._cls, name, None)


def _refuse_unsupported(given, mode) -> None:
    from .server_args import check_supported
    from ..config import CanaryMode

    try:
        parsed = CanaryMode(str(getattr(mode, "value", mode)).strip().lower())
    except ValueError:
        return  # CanaryConfig.build names the bad --kv-canary value
    if parsed.enabled:
        check_supported(given, parsed.value, given_only=True)


def default_real_data(server_args, environ) -> tuple:
    """``--kv-canary-real-data`` when the operator did not give it: (value, why). ``all`` (every byte), or
    ``partial`` where ``all`` is not verified: HiCache, PD disaggregation, or the partial window's env vars set."""
    from ..config import ENV_PREFIX, WINDOW_ENV_VARS
    from .disagg import disaggregation_mode

    if bool(getattr(server_args, "enable_hierarchical_cache", False)):
        return "partial", "HiCache (--enable-hierarchical-cache) is verified with partial only"
    if disaggregation_mode(server_args) in ("prefill", "decode"):
        return "partial", "PD disaggregation is verified with partial only (both sides must hash the same bytes)"
    window = sorted(ENV_PREFIX + n for n in WINDOW_ENV_VARS if ENV_PREFIX + n in environ)
    if window:
        return "partial", f"{', '.join(window)} tune{'s' if len(window) == 1 else ''} partial's window"
    return "all", "every byte of every slot (the default)"


def apply_canary_settings(server_args, mode, sweep_interval, real_data=None) -> None:
    """Attach the canary settings to ``server_args`` and refuse, before any process starts, what it cannot verify.
    ``real_data`` None: not given, ``default_real_data``'s (logged with its reason)."""
    server_args.kv_canary = getattr(mode, "value", mode)
    server_args.kv_canary_sweep_interval = sweep_interval
    default_why = None
    if real_data is None:
        real_data, default_why = default_real_data(server_args, os.environ)
    server_args.kv_canary_real_data = getattr(real_data, "value", real_data)
    from .server_args import check_supported
    from .install import config_from_server_args

    config = config_from_server_args(server_args)  # CanaryConfigError (a ValueError) at startup
    if config.enabled:
        check_supported(server_args, config.mode.value)  # again: __post_init__ may have changed settings
        _check_hooks_applied(server_args)
        logger.info("kv_canary: %s", config.describe())
        if default_why is not None:
            logger.info("kv_canary_real_data_default=%s (--kv-canary-real-data not given: %s)", config.real_data.value,
                        default_why)



def _check_hooks_applied(server_args) -> None:
    from ..sglang_plugin import check_hooks_applied

    check_hooks_applied(server_args)
