"""One Triton launch for ``speculative.record_accepted`` (EAGLE spec v2: the accepted drafts join the token oracle).

The torch reference (``kv_canary.speculative.record_accepted``) is ~45 small device ops; after every verify
they sat between the verify and the draft extend, eagerly, on the device's critical path (measured on an
H200: EAGLE decode bs 1 +2.2% with them). This kernel computes the same bits in one program per request:

    row_chain[row_i] += sum_{1 <= j < n} ([j < a_i] g(next_token_ids[i*n + j - 1], c_i + j) - g(staged[i*(n+1) + j], c_i + j))
    sampled[i] = next_token_ids[i*n + max(a_i - 1, 0)]

g = ``fingerprint.chain_term`` (wrapping int64). ``n`` is not specialized (one compiled variant per dtype
combination, precompiled at install); rows of one verify batch are distinct, so the read-modify-write of
``row_chain`` needs no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..speculative import verify_table_entries
from ..token_oracle import UNKNOWN
from .launch import BoundKernel
from .slot_checks import _chain_term

ACCEPT_BLOCK = 16


@triton.jit(do_not_specialize=["n"])
def record_accepted_kernel(staged, row_chain, sampled, req_pool_indices, committed, next_token_ids, accept_lens, n,
                           BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    c = tl.load(committed + i).to(tl.int64)
    a = tl.load(accept_lens + i).to(tl.int64)
    nn = n.to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for j0 in range(1, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        m = j < nn
        pos = c + j
        draft = tl.load(staged + i * (nn + 1) + j, mask=m, other=0)
        appended = tl.load(next_token_ids + i * nn + j - 1, mask=m, other=0).to(tl.int64)
        term = tl.where(j < a, _chain_term(appended, pos), 0) - _chain_term(draft, pos)
        acc += tl.where(m, term, 0)
    tl.store(row_chain + row, tl.load(row_chain + row) + tl.sum(acc, axis=0))
    last = tl.maximum(a - 1, 0)
    tl.store(sampled + i, tl.load(next_token_ids + i * nn + last).to(tl.int64))


def launch_record_accepted(*, staged: torch.Tensor, row_chain: torch.Tensor, sampled: torch.Tensor,
                           req_pool_indices: torch.Tensor, committed: torch.Tensor, next_token_ids: torch.Tensor,
                           accept_lens: torch.Tensor, batch_size: int, n: int) -> None:
    """Same arguments and effect as ``speculative.record_accepted``; one launch of ``batch_size`` programs."""
    if batch_size == 0:
        return
    verify_table_entries(staged, batch_size, n)  # the capacity check (host ints only)
    _record_accepted_kernel_bound[(batch_size,)](staged, row_chain, sampled, req_pool_indices, committed,
                                                 next_token_ids, accept_lens, n, BLOCK=ACCEPT_BLOCK)


# ---------------------------------------------------------------------------------------------------------------
# Spec v1: the deferred TAIL's inputs of a tree verify (``speculative.build_accepted_drafts``) in one launch.
# Its torch version is ~30 small device ops and an H2D copy of the kept counts (a stream sync), all on the host's
# critical path between sglang's verify (which has just synced) and the draft extend: EAGLE spec v1 decode bs 1
# +12% on an H200 (docs/results/gpu-h200-2026-11-23b/). One program per request; kept counts and starts are
# counted from the kept nodes on the device (no host list crosses).
# ---------------------------------------------------------------------------------------------------------------

_UNKNOWN = tl.constexpr(UNKNOWN)  # token_oracle.UNKNOWN: no staged token


@triton.jit(do_not_specialize=["kept", "n", "r2t_stride"])
def accepted_drafts_kernel(req_to_token, r2t_stride, rows, committed, kept_nodes, kept, n, fed_tokens, fed_positions,
                           appended, ids, positions, out_cache_loc, seq_lens, new_starts, new_lens, bonus, staged,
                           BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    nn = n.to(tl.int64)
    lo = i * nn
    before = tl.zeros([BLOCK], dtype=tl.int64)
    mine = tl.zeros([BLOCK], dtype=tl.int64)
    for j0 in range(0, kept, BLOCK):
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        m = j < kept
        node = tl.load(kept_nodes + j, mask=m, other=0).to(tl.int64)
        before += tl.where(m & (node < lo), 1, 0)
        mine += tl.where(m & (node >= lo) & (node < lo + nn), 1, 0)
    start = tl.sum(before, axis=0)
    a = tl.sum(mine, axis=0)
    row = tl.load(rows + i).to(tl.int64)
    c = tl.load(committed + i).to(tl.int64)
    for k0 in range(0, a, BLOCK):
        k = k0 + tl.arange(0, BLOCK).to(tl.int64)
        m = k < a
        lane = start + k
        node = tl.load(kept_nodes + lane, mask=m, other=0).to(tl.int64)
        tl.store(ids + lane, tl.load(fed_tokens + node, mask=m, other=0).to(tl.int64), mask=m)
        tl.store(positions + lane, tl.load(fed_positions + node, mask=m, other=0).to(tl.int64), mask=m)
        slot = tl.load(req_to_token + row * r2t_stride + c + k, mask=m, other=0).to(tl.int64)
        tl.store(out_cache_loc + lane, slot, mask=m)
        prev = tl.load(appended + lane - 1, mask=m & (k > 0), other=_UNKNOWN).to(tl.int64)
        tl.store(staged + start + i + k, tl.where(k > 0, prev, _UNKNOWN), mask=m)
    tl.store(staged + start + i + a, _UNKNOWN)
    tl.store(seq_lens + i, c + a)
    tl.store(new_starts + i, start.to(tl.int32))
    tl.store(new_lens + i, a.to(tl.int32))
    last = tl.maximum(start + a - 1, 0)
    b = tl.load(appended + last, mask=a > 0, other=_UNKNOWN).to(tl.int64)
    tl.store(bonus + i, tl.where(a > 0, b, _UNKNOWN))


def launch_accepted_drafts(*, out, staged: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                           committed: torch.Tensor, kept_nodes: torch.Tensor, kept: int, batch_size: int, n: int,
                           fed_tokens: torch.Tensor, fed_positions: torch.Tensor, appended: torch.Tensor) -> None:
    """Same arguments and effect as ``speculative.build_accepted_drafts``; one launch of ``batch_size`` programs."""
    if batch_size == 0:
        return
    _accepted_drafts_kernel_bound[(batch_size,)](
        req_to_token, req_to_token.stride(0), rows, committed, kept_nodes, kept, n, fed_tokens, fed_positions,
        appended, out.ids, out.positions, out.out_cache_loc, out.seq_lens, out.new_starts, out.new_lens, out.bonus,
        staged, BLOCK=ACCEPT_BLOCK)


# launched through their compiled launchers once Triton bound a variant (kernels/launch.py)
_record_accepted_kernel_bound = BoundKernel(record_accepted_kernel)
_accepted_drafts_kernel_bound = BoundKernel(accepted_drafts_kernel)
