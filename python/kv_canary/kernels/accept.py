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
from .triton_kernels import _chain_term

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
    record_accepted_kernel[(batch_size,)](staged, row_chain, sampled, req_pool_indices, committed, next_token_ids,
                                          accept_lens, n, BLOCK=ACCEPT_BLOCK)
