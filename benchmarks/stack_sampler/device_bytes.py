"""Bench-only ablation ``KVC_DIAG_DEVICE_BYTES=N``: the layout probe, for a server without the canary.

Right after sglang's ``ModelRunner`` has built its KV pool (``init_memory_pool``; ``alloc_memory_pool`` from 0.5.15
on), where the canary's install allocates its device buffers, allocate ``N`` bytes on the runner's device and hold
them for the process's life; nothing else changes.
Beside ``off`` and ``ours_idle`` in one profile run (``profile_decode.py --configs
"off,alloc:off;KVC_DIAG_DEVICE_BYTES=<the install line's canary_bytes>,ours_idle"``) it tells whether the canary's
allocations alone move a GEMM's speed (docs/history/performance.md, decode bs1, 2026-12-01). It verifies nothing:
a bench configuration, never a setting.

Applied when sglang's model runner module is imported (an import hook installed by this directory's
``sitecustomize``).
"""

import functools
import os
import sys

TARGET = "sglang.srt.model_executor.model_runner"
ENV = "KVC_DIAG_DEVICE_BYTES"


POOL_METHODS = ("alloc_memory_pool", "init_memory_pool")  # the KV pool's builder: 0.5.15+, then 0.5.12


def after_pool(runner_cls, env: str, action) -> None:
    """The runner's KV pool builder then calls ``action(runner, device)`` (``env``: the ablation, named in errors)."""
    name = next((n for n in POOL_METHODS if callable(getattr(runner_cls, n, None))), None)
    if name is None:
        raise AttributeError(f"{env}: {runner_cls.__name__} has none of {', '.join(POOL_METHODS)}")
    original = getattr(runner_cls, name)

    @functools.wraps(original)
    def build_pool(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        import torch

        action(self, torch.device(self.device, self.gpu_id) if self.device == "cuda" else torch.device(self.device))
        return result

    setattr(runner_cls, name, build_pool)


def wrap(runner_cls, nbytes: int) -> None:
    """The runner's KV pool builder then holds ``nbytes`` more device bytes (``kvc_diag_device_bytes``)."""
    def hold(runner, device) -> None:
        import torch

        runner.kvc_diag_device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        print(f"kvc_diag_device_bytes={nbytes} pid={os.getpid()} (bench ablation: held after the KV pool)",
              file=sys.stderr)

    after_pool(runner_cls, ENV, hold)


def positive_int(env: str, what: str) -> int:
    """``env``'s value as a number > 0 (``what`` it counts, for the message), or exit naming the variable."""
    raw = os.environ.get(env, "")
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{env}={raw!r}: expected {what}") from None
    if value <= 0:
        raise SystemExit(f"{env}={raw!r}: expected {what} > 0")
    return value


def positive_bytes(env: str) -> int:
    """``env``'s value as a number of bytes > 0, or exit naming the variable."""
    return positive_int(env, "a number of bytes")


def install() -> None:
    nbytes = positive_bytes(ENV)
    if TARGET in sys.modules:
        wrap(sys.modules[TARGET].ModelRunner, nbytes)
    else:
        from kv_canary._autoload import install_after_import

        install_after_import(TARGET, lambda module: wrap(module.ModelRunner, nbytes))
