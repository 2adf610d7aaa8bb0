"""The install-time launch of every kernel variant (``CanaryManager.precompile``), so Triton compiles none while
serving."""

from __future__ import annotations

from typing import Sequence

import torch

from ..views import ForwardView


def precompile(m, block_lengths: Sequence[int], batch_sizes: Sequence[int],
               verify_staged: bool = False) -> None:
    """Launch every kernel variant once at install so Triton compiles none while serving; ``m``: the
    ``CanaryManager`` (manager.py imports this module, not the reverse).

    Inert launches: every request is row 0 with a new run of n tokens at position 0
    written to the padding slot 0, so nothing is read (no prefix) and nothing is
    written (slot 0 is masked); only counters move, and init zeroes them. One launch
    per (batch size, new-run length) in both index dtypes sglang uses (extend batches:
    int32 starts/lengths; decode-like batches: int64; with ``verify_staged``, speculative verify
    batches too: int64 and staged drafts, and the verify hook's ``record_accepted``; its
    effect on the token oracle is cleared by ``mark_init_finished``; after ``enable_deferred_writes``, the
    deferred TAIL of speculative tree verifies: its inputs' launch and an extend-like write that bumps no
    forward), the PD decode side's fake-arrival writes, plus the sweep.
    """
    dev = m.counters.device
    deferred_writes = m._accepted is not None
    with m.capturing():
        for bs in batch_sizes:
            for n in block_lengths:
                # (dtype of starts/lengths, staged expected tokens): extend, decode[, verify]
                for lens_dtype, staged in ((torch.int32, True), (torch.int64, False),
                                           *(((torch.int64, True),) if verify_staged else ())):
                    view = ForwardView(
                        input_ids=torch.zeros(bs * n, dtype=torch.int64, device=dev),
                        positions=torch.zeros(bs * n, dtype=torch.int64, device=dev),
                        out_cache_loc=torch.zeros(bs * n, dtype=torch.int64, device=dev),
                        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=dev),
                        seq_lens=torch.full((bs,), n, dtype=torch.int64, device=dev),
                        # extend: every request reads tokens [0, n) (inert), so the staged reads stay in bounds
                        new_starts=torch.arange(bs, dtype=lens_dtype, device=dev) * (0 if staged else n),
                        new_lens=torch.full((bs,), n, dtype=lens_dtype, device=dev),
                        batch_size=bs, max_new_len=n, staged=staged,
                    )
                    for sfm in m.single_forward_managers:
                        sfm.pre_ops_maybe_inside_graph(view)
                        sfm.post_ops_maybe_inside_graph(view)
                    if deferred_writes and lens_dtype == torch.int32:  # write_accepted_drafts' launches
                        m.single_forward_managers[0].deferred_post_ops(view)
        m._precompile_fake_arrivals(block_lengths)  # PD decode: warm-up / health-check fake transfers
        if verify_staged and m.token_oracle is not None:  # the verify hook's launch (sglang's dtypes)
            z64, z32 = (torch.zeros(1, dtype=dt, device=dev) for dt in (torch.int64, torch.int32))
            m.record_accepted(req_pool_indices=z64, committed=z64, next_token_ids=torch.zeros(
                2, dtype=torch.int32, device=dev), accept_lens=z32 + 1, batch_size=1, n=2)
        if deferred_writes:  # spec v1's inputs launch, in sglang 0.5.12's dtypes
            z64, z32 = (torch.zeros(2, dtype=dt, device=dev) for dt in (torch.int64, torch.int32))
            m.kernels.accepted_drafts(
                out=m._accepted, staged=m._accepted_staged, req_to_token=m._req_to_token,
                rows=z64[:1], committed=z64[:1], kept_nodes=z32[:1], kept=1, batch_size=1, n=2,
                fed_tokens=z64, fed_positions=z64, appended=z32[:1])
        for group_index, group in enumerate(m.groups):  # a load's first reads: a part, the finalize
            if group.full_row is not None and group.full_row.first_read:
                for rows, finalize in (((0, 1), False), ((0, 0), True)):  # load_hashing's two launches
                    m.kernels.first_read(group, m.counters, m.ring, group_index=group_index, rows=rows,
                                         finalize=finalize)
        if m.cache_index is not None:  # empty: nothing held, nothing checked
            for group_index, group in enumerate(m.groups):
                m.kernels.sweep_index(group, m.cache_index, m.counters, m.ring, group_index=group_index)
