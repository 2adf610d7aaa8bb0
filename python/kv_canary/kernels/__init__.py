"""HEAD-verify / TAIL-write kernels: Triton (GPU, or CPU under TRITON_INTERPRET=1) and a torch reference.

``select_kernels`` returns a ``CanaryKernels`` with two functions of the same
signature in both backends:

    verify(group, view, req_to_token, counters, ring, programs_per_req, block, group_index=, expected_tokens=)
    write(group, view, req_to_token, counters, bump_forward, expected_tokens=)
    sweep(group, entries, counters, ring, group_index=)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import KernelBackend

VERIFY_BLOCK = 256


@dataclass(frozen=True)
class CanaryKernels:
    name: str
    verify: Callable[..., None]
    write: Callable[..., None]
    sweep: Callable[..., None]
    graph_safe: bool
    sweep_index: Callable[..., None] = None  # sweep(group, CachedSlotIndex, counters, ring, group_index=)


def resolve_backend(requested: KernelBackend, device: torch.device) -> KernelBackend:
    if requested is not KernelBackend.AUTO:
        return requested
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return KernelBackend.TRITON
    return KernelBackend.TORCH


def select_kernels(requested: KernelBackend, device: torch.device) -> CanaryKernels:
    backend = resolve_backend(requested, device)
    if backend is KernelBackend.TRITON:
        from . import index_sweep
        from . import triton_kernels as tk

        return CanaryKernels("triton", tk.launch_verify, tk.launch_write, tk.launch_sweep, graph_safe=True,
                             sweep_index=index_sweep.launch_index_sweep)
    from . import reference as ref

    return CanaryKernels("torch", ref.launch_verify, ref.launch_write, ref.launch_sweep, graph_safe=False,
                         sweep_index=ref.launch_index_sweep)
