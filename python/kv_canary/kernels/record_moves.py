"""A HiCache load-back's record moves in one launch (Triton on a GPU, a torch reference elsewhere).

A load-back puts host copies back into new device slots; before any forward reads them, each new slot gets the
record its host copy carried, its first-read tag cleared (the slot is listed at its first read) and a load-book
row (host slot, the consuming forward) for violation lines. As torch ops that was a gather, a scatter, a fill, a
``full_like``, a ``stack`` and a second scatter: six launches on the scheduler thread at every load-back boundary,
whose extend launch is host-bound (docs/history/hicache.md 7.19). ``load_records`` is one launch.

Shapes: ``host_records`` int64[num_host_slots, RECORD_WIDTH]; ``host_idx`` int64[n] (host slots, on the device);
``records`` int64[num_slots, RECORD_WIDTH] (a buffer group's, rows may be strided); ``dev_idx`` int64[n] (new
device slots, distinct: fresh allocations); ``tags`` int64[num_slots]; ``loaded_from`` int64[num_slots, 2].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fingerprint as fp
from .launch import BoundKernel, cdiv

LOAD_BLOCK = 256  # slots per program (a 9,000-slot load: 36 programs)


@triton.jit(do_not_specialize=["host_stride", "rec_stride", "n", "forward",
                               "host_records", "host_idx", "records", "dev_idx", "tags", "loaded_from"])
def load_records_kernel(host_records, host_stride, host_idx, records, rec_stride, dev_idx, tags, loaded_from, n,
                        forward, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """records[dev] = host_records[host]; tags[dev] = 0; loaded_from[dev] = (host, forward), per lane."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    h = tl.load(host_idx + i, mask=m, other=0).to(tl.int64)
    d = tl.load(dev_idx + i, mask=m, other=0).to(tl.int64)
    for w in tl.static_range(WIDTH):
        tl.store(records + d * rec_stride + w, tl.load(host_records + h * host_stride + w, mask=m, other=0), mask=m)
    tl.store(tags + d, tl.zeros_like(d), mask=m)
    tl.store(loaded_from + d * 2, h, mask=m)
    tl.store(loaded_from + d * 2 + 1, tl.zeros_like(d) + forward, mask=m)


_load_records_bound = BoundKernel(load_records_kernel)


def _check(host_records, host_idx, records, dev_idx, tags, loaded_from) -> None:
    if dev_idx.numel() != host_idx.numel():
        raise ValueError(f"kv-canary: a load of {host_idx.numel()} host slots into {dev_idx.numel()} device slots")
    if host_records.shape[1] != fp.RECORD_WIDTH or records.shape[1] != fp.RECORD_WIDTH:
        raise ValueError(f"kv-canary: record tables need {fp.RECORD_WIDTH} columns, got "
                         f"{tuple(host_records.shape)} and {tuple(records.shape)}")
    if (host_records.stride(1), records.stride(1)) != (1, 1) or not loaded_from.is_contiguous() or (
            not tags.is_contiguous()):
        raise ValueError("kv-canary: load_records needs rows of contiguous columns and contiguous tags / load book")


def load_records_torch(host_records, host_idx, records, dev_idx, tags, loaded_from, forward: int) -> None:
    """The reference (and the CPU path): the same moves as torch ops on the current stream."""
    records.index_copy_(0, dev_idx, host_records.index_select(0, host_idx))
    tags.index_fill_(0, dev_idx, 0)
    loaded_from.index_copy_(0, dev_idx, torch.stack([host_idx, torch.full_like(host_idx, forward)], dim=1))


def load_records(host_records: torch.Tensor, host_idx: torch.Tensor, records: torch.Tensor, dev_idx: torch.Tensor,
                 tags: torch.Tensor, loaded_from: torch.Tensor, forward: int, *, triton_ok: bool) -> None:
    """One load-back's moves (see the module), queued on the current stream; ``triton_ok``: the Triton kernel
    (a GPU, or the interpreter), else the torch reference. ``host_idx`` / ``dev_idx`` int64 on the tables' device."""
    _check(host_records, host_idx, records, dev_idx, tags, loaded_from)
    if not triton_ok:
        load_records_torch(host_records, host_idx, records, dev_idx, tags, loaded_from, forward)
        return
    n = host_idx.numel()
    _load_records_bound[(max(1, cdiv(n, LOAD_BLOCK)),)](
        host_records, host_records.stride(0), host_idx, records, records.stride(0), dev_idx, tags, loaded_from, n,
        int(forward), WIDTH=fp.RECORD_WIDTH, BLOCK=LOAD_BLOCK)
