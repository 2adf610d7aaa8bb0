"""On an sglang release no line supports: ``--kv-canary`` other than ``none`` is refused at startup.

The message names the running version, the supported ones and, where the release ships its
own kv_canary, the switch that selects it (``SGLANG_KV_CANARY_IMPL=in-tree``). Nothing else
of the canary is installed.
"""

from __future__ import annotations

from typing import Any


def _refuse(server_args: Any) -> None:
    mode = str(getattr(getattr(server_args, "kv_canary", "none"), "value", getattr(server_args, "kv_canary", "none")))
    if mode.strip().lower() in ("", "none"):
        return
    from ..config import CanaryConfigError
    from .lines import current_choice

    raise CanaryConfigError(f"--kv-canary {mode}: {current_choice().reason}")


def around_from_cli_args(original, cls, args):
    _refuse(args)
    return original(cls, args)


def before_scheduler_init(scheduler, *args, **kwargs):
    server_args = kwargs.get("server_args", args[0] if args else None)
    _refuse(server_args)
