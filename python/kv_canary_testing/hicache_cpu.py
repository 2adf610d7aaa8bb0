"""HiCache on CPU for the e2e tests (test-only): sglang 0.5.12's host pool with unpinned memory and torch copies.

Stock sglang cannot run ``--enable-hierarchical-cache`` on CPU (docs/hicache.md section 2): the host pool is
``cudaHostRegister``ed and every transfer is a CUDA op. This shim replaces exactly those: the host buffer is a
plain CPU tensor, and ``MHATokenToKVPoolHost.load_to_device_per_layer`` / ``backup_from_device_all_layer`` copy
rows with ``index_select`` / ``index_copy_`` (the ``layer_first`` layout, what the CUDA kernels do for it); the
storage tier's page read target (``get_dummy_flat_data_page``) is unpinned. sglang's tree, controller, acks, layer
events, write policies and file storage tier run unchanged, and so does the canary. Transfers are synchronous here,
so stream races are not exercised (the GPU host covers them).

Enabled by the e2e fixture's env (``KVC_TEST_HICACHE_CPU=1``, read when the tiny model package is imported in
the scheduler process), never by the plugin. Also lowers sglang's 10 GiB host-memory reserve check to 0 (the
tiny model's host pool is a few MB; the CI machine is shared).
"""

from __future__ import annotations

import os

import torch

ENV = "KVC_TEST_HICACHE_CPU"


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator):
    del pin_memory, allocator
    return torch.zeros(dims, dtype=dtype, device=device)


def _layer_first(host) -> None:
    if host.layout != "layer_first":
        raise ValueError(f"kv_canary_testing.hicache_cpu: host layout {host.layout} is not shimmed (layer_first)")


def _load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend):
    """H2D of one layer: device K/V rows ``device_indices`` <- host rows ``host_indices``."""
    del io_backend
    _layer_first(self)
    h = host_indices.to(torch.int64).cpu()
    d = device_indices.to(torch.int64).to(device_pool.k_buffer[layer_id].device)
    device_pool.k_buffer[layer_id].index_copy_(0, d, self.k_buffer[layer_id].index_select(0, h))
    device_pool.v_buffer[layer_id].index_copy_(0, d, self.v_buffer[layer_id].index_select(0, h))


def _backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    """D2H of every layer: host rows ``host_indices`` <- device K/V rows ``device_indices``."""
    del io_backend
    _layer_first(self)
    h = host_indices.to(torch.int64).cpu()
    for layer in range(self.layer_num):
        d = device_indices.to(torch.int64).to(device_pool.k_buffer[layer].device)
        self.k_buffer[layer].index_copy_(0, h, device_pool.k_buffer[layer].index_select(0, d).cpu())
        self.v_buffer[layer].index_copy_(0, h, device_pool.v_buffer[layer].index_select(0, d).cpu())


def _dummy_flat_data_page(self):
    """The storage tier's read target (``HiCacheFile`` reads a page into it): unpinned."""
    return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype,
                       device=self.device).flatten()


def install() -> None:
    """Patch sglang 0.5.12's host pool module (idempotent)."""
    from sglang.srt.mem_cache import memory_pool_host as mph

    mph.alloc_with_host_register = _alloc_unpinned  # ALLOC_MEMORY_FUNCS' default looks the name up per call
    mph.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
    mph.MHATokenToKVPoolHost.load_to_device_per_layer = _load_to_device_per_layer
    mph.MHATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer
    mph.MHATokenToKVPoolHost.get_dummy_flat_data_page = _dummy_flat_data_page  # pinned as shipped


def install_if_enabled() -> None:
    if os.environ.get(ENV) == "1":
        install()
