"""``BoundKernel``: a Triton kernel launched through its compiled launcher once Triton has bound a variant.

``kernel[grid](*args, **constexprs)`` binds every argument on every call (Triton's ``JITFunction.run``: the
specialization of each argument, a cache key built from it and the options as a string, a check of the kernel's
globals, the launch metadata): 64-72 us a launch of the canary's ~40-argument kernels on an H200 host's CPU, 7 an
eager extend, on the scheduler thread, while that launch is the HiCache row's critical path (docs/history/hicache.md
7.12; ``scripts/bench_extend_host.py (at 686ff20, benchmarks/README.md)``). The compiled launcher called directly: ~8-14 us.

``BoundKernel`` keeps, per variant, what Triton compiled for it and calls its launcher directly. The variant key
is a superset of what Triton specializes on: every keyword (constexprs and options such as ``num_warps``, by name),
and per positional argument its class and what Triton reads of it: a tensor's dtype and 16-byte alignment, an
integer's type range, whether it is 1, whether it is a multiple of 16; a bool's or ``None``'s value. So two calls
with one key always run the same compiled kernel Triton itself would pick; a new key (or any argument of another
kind) goes through ``kernel[grid]`` once, which compiles or finds the variant and returns it. Launch hooks (a
profiler's) and the interpreter always take Triton's own path.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional, Tuple

import torch
import triton

try:  # Triton >= 3.3: launch hooks are knobs (chains of hooks from 3.4)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always its own launch path
    _knobs = None

# the Triton lines whose compiled launcher this calls as ``JITFunction.run`` does (checked in their source)
_LAUNCHER_VERSIONS = ("3.4.", "3.5.", "3.6.", "3.7.", "3.8.")
_I32 = 1 << 31
_U64 = 1 << 63


def _direct_launch_supported() -> bool:
    return _knobs is not None and triton.__version__.startswith(_LAUNCHER_VERSIONS) \
        and not _knobs.runtime.interpret


def _no_hooks() -> bool:
    """No launch hook registered (a profiler's): the launcher may be called without them."""
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_UNKEYED = object()  # an argument of a kind ``_arg_key`` does not key


def _arg_key(a):
    """What Triton specializes one positional argument on, and more (``_UNKEYED``: a kind not keyed here)."""
    c = a.__class__
    if c is int:
        return (-_I32 <= a < _I32, a >= _U64, a == 1, not a & 15)
    if c is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    if c is bool or a is None:
        return a
    if c is float:
        return float
    return _UNKEYED


def _variant_key(args: tuple, kwargs: dict, constexprs: Tuple[int, ...]) -> Optional[tuple]:
    """What Triton specializes a launch on, and more (None: an argument of a kind not keyed here). ``constexprs``:
    the positions of the kernel's constexpr parameters (a positional one is keyed by its value)."""
    key = [tuple(args[i] for i in constexprs if i < len(args))] if constexprs else []
    for a in args:
        k = _arg_key(a)
        if k is _UNKEYED:
            return None
        key.append(k)
    key.append(tuple(kwargs.items()))
    return tuple(key)


def _rekey(args: tuple, kwargs: dict, constexprs: Tuple[int, ...], last: tuple) -> Optional[tuple]:
    """``_variant_key(args, kwargs, constexprs)`` from the last launch's (``last``: its args, kwargs and key): the
    same objects keep their parts of the key (a tensor object keeps its dtype, and its storage: the canary's and
    the engine's buffers are never ``set_`` or resized); only the arguments that are other objects are keyed again
    (a launch's per-forward tensors and sizes: a few of its ~40). A constexpr passed positionally, other keywords
    or another count of arguments: keyed whole."""
    last_args, last_kwargs, last_key = last
    if len(args) != len(last_args) or kwargs != last_kwargs:
        return _variant_key(args, kwargs, constexprs)
    changed = [i for i, a, b in zip(range(len(args)), args, last_args) if a is not b]
    if not changed:
        return last_key
    off = 1 if constexprs else 0
    key = list(last_key)
    for i in changed:
        if i in constexprs:
            return _variant_key(args, kwargs, constexprs)
        k = _arg_key(args[i])
        if k is _UNKEYED:
            return None
        key[i + off] = k
    return tuple(key)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code (Triton's is a constexpr function: ~5 us a call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (n >= 1; 0 stays 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class BoundKernel:
    """``kernel[grid](*args, **kwargs)`` as Triton launches it, with the binding done once per variant."""

    def __init__(self, fn):
        self.fn = fn
        self._variants: Dict[tuple, Tuple[object, tuple]] = {}
        self._params = list(inspect.signature(fn.fn).parameters.values()) if hasattr(fn, "fn") else None
        self._direct = self._params is not None and _direct_launch_supported()
        self._constexprs = tuple(i for i, p in enumerate(getattr(fn, "params", ())) if p.is_constexpr)
        self._driver = None  # Triton's active driver, at the first launch (none on a host without a GPU)
        self._last: Optional[tuple] = None  # the last keyed launch's (args, kwargs, key), for ``_rekey``

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        key = None
        if self._direct and self._driver is None:
            from triton.runtime import driver

            self._driver = driver.active  # Triton's own launch needs it too: an error here is Triton's
        if self._direct and _no_hooks():
            device = self._driver.get_current_device()
            last = self._last
            key = _variant_key(args, kwargs, self._constexprs) if last is None else _rekey(
                args, kwargs, self._constexprs, last)
            # kept for the next launch (holding its objects: none of them can be freed and another take its id)
            self._last = None if key is None else (args, kwargs, key)
            if key is not None:
                key = (device, len(grid), *key)
                hit = self._variants.get(key)
                if hit is not None:
                    compiled, tail = hit
                    g1 = grid[1] if len(grid) > 1 else 1
                    g2 = grid[2] if len(grid) > 2 else 1
                    compiled.run(grid[0], g1, g2, self._driver.get_current_stream(device), compiled.function,
                                 compiled.packed_metadata, None, None, None, *args, *tail)
                    return compiled
        compiled = self.fn[grid](*args, **kwargs)
        if key is not None and hasattr(compiled, "packed_metadata") and hasattr(compiled, "function"):
            self._variants[key] = (compiled, self._tail(args, kwargs))
        return compiled

    def _tail(self, args: tuple, kwargs: dict) -> tuple:
        """The values of the parameters after the positional ones, in signature order (keywords, else defaults):
        the launcher takes every parameter, constexprs included, as Triton's own launch passes them."""
        tail = []
        for p in self._params[len(args):]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                raise TypeError(f"kv-canary: kernel {p.name!r} argument missing in a launch of {self.fn}")
        return tuple(tail)
