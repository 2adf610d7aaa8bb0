"""HiCache on CPU for the e2e tests (test-only): sglang's host pool with unpinned memory and torch copies.

Stock sglang cannot run ``--enable-hierarchical-cache`` on CPU (docs/history/hicache.md section 2): the host pool is
``cudaHostRegister``ed and every transfer is a CUDA op (0.5.23 does not even bind them off CUDA). This shim replaces
exactly those, per installed sglang line: the host buffer is a plain CPU tensor, and
``MHATokenToKVPoolHost.load_to_device_per_layer`` / ``backup_from_device_all_layer`` copy rows with ``index_select``
/ ``index_copy_`` (the ``layer_first`` and ``page_first`` layouts, what the CUDA kernels do for them; 0.5.23's L2
transfer engine reaches them through ``HostKVCache.*_physical``); on 0.5.12 the storage tier's page read target
(``get_dummy_flat_data_page``) is unpinned. sglang's tree, controller, acks, layer events, write policies and
(0.5.12) file storage tier run unchanged, and so does the canary. Transfers are synchronous here, so stream races
are not exercised (the GPU host covers them, on 0.5.12).

Enabled by the e2e fixture's env (``KVC_TEST_HICACHE_CPU=1``, read when the tiny model package is imported in
the scheduler process), never by the plugin. Also lowers sglang's 10 GiB host-memory reserve check to 0 (the
tiny model's host pool is a few MB; the CI machine is shared).
"""

from __future__ import annotations

import os

import torch

ENV = "KVC_TEST_HICACHE_CPU"


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """A plain (unpinned, unregistered) host tensor of ``dims`` and ``dtype``, zeroed."""
    del pin_memory, allocator, registration_granularity_bytes
    return torch.zeros(dims, dtype=dtype, device=device)


def _layer(host, buf, layer: int):
    """Layer ``layer`` of a host K or V buffer, ``[host slots, heads, dim]``, as sglang lays it out (the canary's own
    reader, ``adapter.hicache.host_layer``); the CUDA kernels copy the same rows."""
    from kv_canary.adapter.hicache import host_layer

    return host_layer(buf, host.layout, layer)


def _copy_in(dst_k, dst_v, src_k, src_v, dst_idx, src_idx) -> None:
    """``dst[dst_idx] = src[src_idx]`` for K and V rows (``[slots, heads, dim]`` each)."""
    d = dst_idx.to(torch.int64).to(dst_k.device)
    s = src_idx.to(torch.int64).to(src_k.device)
    dst_k.index_copy_(0, d, src_k.index_select(0, s).to(dst_k.device))
    dst_v.index_copy_(0, d, src_v.index_select(0, s).to(dst_v.device))


# ---------------------------------------------------------------- sglang 0.5.12 (mem_cache/memory_pool_host.py)


def _load_to_device_per_layer_0_5_12(self, device_pool, host_indices, device_indices, layer_id, io_backend):
    """H2D of one layer: device K/V rows ``device_indices`` <- host rows ``host_indices``."""
    del io_backend
    _copy_in(device_pool.k_buffer[layer_id], device_pool.v_buffer[layer_id], _layer(self, self.k_buffer, layer_id),
             _layer(self, self.v_buffer, layer_id), device_indices, host_indices)


def _backup_from_device_all_layer_0_5_12(self, device_pool, host_indices, device_indices, io_backend):
    """D2H of every layer: host rows ``host_indices`` <- device K/V rows ``device_indices``."""
    del io_backend
    for layer in range(self.layer_num):
        _copy_in(_layer(self, self.k_buffer, layer), _layer(self, self.v_buffer, layer), device_pool.k_buffer[layer],
                 device_pool.v_buffer[layer], host_indices, device_indices)


def _dummy_flat_data_page_0_5_12(self):
    """The storage tier's read target (``HiCacheFile`` reads a page into it): unpinned."""
    return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype,
                       device=self.device).flatten()


def _install_0_5_12() -> None:
    from sglang.srt.mem_cache import memory_pool_host as mph

    mph.alloc_with_host_register = _alloc_unpinned  # ALLOC_MEMORY_FUNCS' default looks the name up per call
    mph.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
    mph.MHATokenToKVPoolHost.load_to_device_per_layer = _load_to_device_per_layer_0_5_12
    mph.MHATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer_0_5_12
    mph.MHATokenToKVPoolHost.get_dummy_flat_data_page = _dummy_flat_data_page_0_5_12  # pinned as shipped


# ---------------------------------------------------------------- sglang 0.5.23 (mem_cache/pool_host/)
# The host pool keeps the device pool's per-layer K/V tensors itself (device_k_buffers / device_v_buffers, target
# layers first); sglang's own methods ignore the device_pool argument for MHA.


def _load_to_device_per_layer_0_5_23(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                     is_draft: bool = False):
    """H2D of one layer: device K/V rows ``device_indices`` <- host rows ``host_indices`` (layer ``layer_id``)."""
    del device_pool, io_backend
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    _copy_in(self.device_k_buffers[layer_id], self.device_v_buffers[layer_id], _layer(self, self.k_buffer, layer_id),
             _layer(self, self.v_buffer, layer_id), device_indices, host_indices)


def _backup_from_device_all_layer_0_5_23(self, device_pool, host_indices, device_indices, io_backend):
    """D2H of every layer: host rows ``host_indices`` <- device K/V rows ``device_indices``."""
    del device_pool, io_backend
    for layer in range(self.layer_num):
        _copy_in(_layer(self, self.k_buffer, layer), _layer(self, self.v_buffer, layer), self.device_k_buffers[layer],
                 self.device_v_buffers[layer], host_indices, device_indices)


def _install_0_5_23() -> None:
    from sglang.srt.mem_cache.pool_host import base, common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned  # the pool allocates through the device type's entry
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0  # read per call by host_memory_budget_bytes
    mha.MHATokenToKVPoolHost.load_to_device_per_layer = _load_to_device_per_layer_0_5_23
    mha.MHATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer_0_5_23


_INSTALL = {"0.5.12": _install_0_5_12, "0.5.23": _install_0_5_23}


def install() -> None:
    """Patch the installed sglang line's host pool modules (idempotent)."""
    from sglang.version import __version__ as version

    if version not in _INSTALL:
        raise RuntimeError(f"kv_canary_testing.hicache_cpu: no HiCache CPU shim for sglang {version} "
                           f"(shimmed: {', '.join(_INSTALL)})")
    _INSTALL[version]()


def install_if_enabled() -> None:
    if os.environ.get(ENV) == "1":
        install()
