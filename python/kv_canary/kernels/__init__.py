"""HEAD-verify / TAIL-write kernels: Triton (GPU, or CPU under TRITON_INTERPRET=1) and a torch reference.

``select_kernels`` returns a ``CanaryKernels`` whose functions have the same
signature in both backends:

    verify(group, view, req_to_token, counters, ring, programs_per_req, block, group_index=, token_oracle=,
           defer_first_read=)
    first_read(group, counters, ring, group_index=, rows=, finalize=)   (the deferred first-read LIST, or a part)
    write(group, view, req_to_token, counters, ring, bump_forward, group_index=, check_fed=, token_oracle=)
    scrub(group, counters, ring, per_forward, group_index=, after_write=)   (after_write: launched after the
          forward's bump, the window still its forward's)
    sweep_index(group, cached_slot_index, counters, ring, group_index=)
    record_accepted(staged=, row_chain=, sampled=, req_pool_indices=, committed=, next_token_ids=,
                    accept_lens=, batch_size=, n=)   (EAGLE's accepted drafts into the token oracle)
    accepted_drafts(out=, staged=, req_to_token=, rows=, committed=, kept_nodes=, kept=, batch_size=, n=,
                    fed_tokens=, fed_positions=, appended=)   (spec v1: a tree verify's deferred TAIL inputs)
    witness_stamp(group, view, group_index=)                    (the write witness: HEAD's stamp, kernels/witness.py)
    witness_check(group, view, counters, ring, group_index=)    (TAIL: every stamp gone, else ``unwritten``)
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
    scrub: Callable[..., None]
    sweep_index: Callable[..., None]
    record_accepted: Callable[..., None]
    accepted_drafts: Callable[..., None]
    witness_stamp: Callable[..., None]
    witness_check: Callable[..., None]
    first_read: Callable[..., None]
    graph_safe: bool


def resolve_backend(requested: KernelBackend, device: torch.device) -> KernelBackend:
    if requested is not KernelBackend.AUTO:
        return requested
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return KernelBackend.TRITON
    return KernelBackend.TORCH


def select_kernels(requested: KernelBackend, device: torch.device) -> CanaryKernels:
    backend = resolve_backend(requested, device)
    if backend is KernelBackend.TRITON:
        from . import accept, index_sweep, witness
        from . import triton_kernels as tk

        return CanaryKernels("triton", tk.launch_verify, tk.launch_write, tk.launch_scrub,
                             index_sweep.launch_index_sweep, accept.launch_record_accepted,
                             accept.launch_accepted_drafts, witness.launch_stamp, witness.launch_check,
                             tk.launch_first_read, graph_safe=True)
    from ..speculative import build_accepted_drafts, record_accepted
    from . import reference as ref

    return CanaryKernels("torch", ref.launch_verify, ref.launch_write, ref.launch_scrub, ref.launch_index_sweep,
                         record_accepted, build_accepted_drafts, ref.launch_witness_stamp, ref.launch_witness_check,
                         ref.launch_first_read, graph_safe=False)
