"""The engine's K/V store calls, wrapped for the write-path perturbations (``perturb/write_paths``); and its K/V
moves, wrapped to forget the records of the slots they overwrite (``forget_kv_moves``).

sglang's attention backends store each layer's new K/V through the pool's ``set_kv_buffer(layer, loc, ...)``
(MLA: ``set_mla_kv_buffer(layer, loc, ...)``), ``loc`` being the forward's ``out_cache_loc`` (0.5.23: a
``KVWriteLoc`` record carrying it). The wrapper hands ``loc`` through ``WriteRedirect.apply`` with the
layer id, so an armed perturbation breaks the store itself, as a write-path bug would; disarmed, it
returns ``loc``'s values unchanged. Installed only when a write-path perturbation is configured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from ..config import CanaryConfigError

STORE_METHODS = ("set_kv_buffer", "set_mla_kv_buffer")


def wrap_kv_stores(pool: Any, redirect) -> None:
    """Route ``pool``'s K/V store methods through ``redirect`` (a ``WriteRedirect``)."""
    wrapped = [name for name in STORE_METHODS if getattr(pool, name, None) is not None]
    if not wrapped:
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_PERTURB_WRITE_*: the KV pool {type(pool).__name__} has none of "
            f"{', '.join(STORE_METHODS)}; unset the write-path perturbations for this pool")
    for name in wrapped:
        setattr(pool, name, _redirected(getattr(pool, name), redirect))
    redirect.installed = True


def _redirected(store: Callable, redirect) -> Callable:
    @functools.wraps(store)
    def redirected_store(layer, loc, *args, **kwargs):
        override = kwargs.get("layer_id_override")
        layer_id = override if override is not None else getattr(layer, "layer_id", -1)
        return store(layer, _map_loc(loc, functools.partial(redirect.apply, int(layer_id))), *args, **kwargs)

    return redirected_store


def _map_loc(loc: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to the engine slots of a store's ``loc``: a tensor, or a record holding ``loc`` (and an
    optional ``full_loc`` in the same slot space; an SWA sub-pool's ``swa_loc`` is left as it is)."""
    if isinstance(loc, torch.Tensor):
        return fn(loc)
    if dataclasses.is_dataclass(loc) and isinstance(getattr(loc, "loc", None), torch.Tensor):
        changes = {"loc": fn(loc.loc)}
        if isinstance(getattr(loc, "full_loc", None), torch.Tensor):
            changes["full_loc"] = fn(loc.full_loc)
        return dataclasses.replace(loc, **changes)
    raise TypeError(f"kv-canary write-path perturbation: unexpected store location {type(loc).__name__}")


def forget_kv_moves(pool: Any, groups) -> None:
    """After ``pool.move_kv_cache(tgt_loc, src_loc)`` (K/V copied into ``tgt_loc``, no TAIL) the ``groups`` forget
    ``tgt_loc``'s records (``CanaryBufferGroup.forget``), which belonged to the slots' earlier owners.

    For spec v1's draft pool: with page size > 1 and topk > 1, ``EAGLEWorker._draft_preprocess_decode`` copies each
    request's last partial page into every other branch's fresh page (scratch pages given back after the phase, not
    in the draft steps' ``out_cache_loc``). sglang moves eagerly, outside any graph; its ``tgt_loc`` is int32 there,
    copied to int64 (one small tensor a draft phase, as sglang allocates its own)."""
    move = getattr(pool, "move_kv_cache", None)
    if move is None:
        raise CanaryConfigError(f"kv-canary: the KV pool {type(pool).__name__} has no move_kv_cache; spec v1's draft "
                                "pool is verified over MHATokenToKVPool only")

    @functools.wraps(move)
    def move_then_forget(tgt_loc, src_loc, *args, **kwargs):
        out = move(tgt_loc, src_loc, *args, **kwargs)
        slots = tgt_loc.to(torch.int64)
        for group in groups:
            group.forget(slots)
        return out

    pool.move_kv_cache = move_then_forget
