"""Which compile-time variants of the canary's kernels ran, and a check that none is new after startup.

A Triton kernel is compiled once per combination of its ``tl.constexpr``
arguments (and of Triton's integer/pointer specializations). The canary's
variants come from a handful of choices: the buffer group (hash layout, group
bits), whether the launch stores tokens / bumps the forward counter, and the TAIL
block size (``write_block``: a power of two from 16 to 1024 by the longest new
run). ``track`` wraps a ``CanaryKernels`` so every launch records its variant
key; ``seal`` marks the end of startup (install-time precompile + CUDA-graph
capture), after which a launch with an unseen key logs one
``kv_canary_jit_after_startup=`` warning per key and is counted: a compile on
the serving path, which the precompile is meant to make impossible.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, Set, Tuple

logger = logging.getLogger("kv_canary")


class VariantTracker:
    def __init__(self):
        self.seen: Set[Tuple] = set()
        self.sealed = False
        self.after_startup: Dict[Tuple, int] = {}

    def note(self, key: Tuple) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        if self.sealed:
            self.after_startup[key] = self.after_startup.get(key, 0) + 1
            logger.warning("kv_canary_jit_after_startup=1 kernel=%s variant=%s", key[0],
                           ",".join(str(x).replace("torch.", "") for x in key[1:]))

    def seal(self) -> None:
        self.sealed = True

    def describe(self) -> str:
        by_kernel: Dict[str, int] = {}
        for key in self.seen:
            by_kernel[key[0]] = by_kernel.get(key[0], 0) + 1
        return " ".join(f"{k}={v}" for k, v in sorted(by_kernel.items()))


def _group_key(group) -> Tuple:
    return (group.name, len(group.sources), group.longest_source_words)


def _spec(v: int) -> int:
    """Triton's integer specialization class: 1, a multiple of 16, or other (0)."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def _dtypes(view, *names) -> Tuple:
    """The dtypes of ``view``'s named tensors (torch dtypes: hashable, and named only in the warning)."""
    return tuple(getattr(view, n).dtype for n in names)


def track(kernels, tracker: VariantTracker, write_block: Callable[[int], object]):
    """A copy of ``kernels`` whose launches record their variant keys in ``tracker`` (``write_block``: the
    TAIL's variant for a longest new run, ``triton_kernels.tail_variant``)."""

    def verify(group, view, req_to_token, counters, ring, programs_per_req, block, group_index=0,
               token_oracle=None, **kw):
        tracker.note(("verify", *_group_key(group), group_index, block, token_oracle is not None,
                      token_oracle is not None and token_oracle.verify_reads,
                      _spec(programs_per_req), *_dtypes(view, "req_pool_indices", "seq_lens", "new_lens")))
        return kernels.verify(group, view, req_to_token, counters, ring, programs_per_req, block,
                              group_index=group_index, token_oracle=token_oracle, **kw)

    def write(group, view, req_to_token, counters, ring, bump_forward, block=0, group_index=0, check_fed=True,
              token_oracle=None):
        tracker.note(("write", *_group_key(group), group_index, bool(bump_forward), bool(check_fed),
                      token_oracle is not None, token_oracle is not None and view.staged, group.full_row is not None,
                      block, write_block(view.max_new_len),
                      *_dtypes(view, "input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                               "new_starts", "new_lens")))
        return kernels.write(group, view, req_to_token, counters, ring, bump_forward, block=block,
                             group_index=group_index, check_fed=check_fed, token_oracle=token_oracle)

    def scrub(group, counters, ring, per_forward, group_index=0, after_write=False):
        tracker.note(("scrub", *_group_key(group), group_index, _spec(per_forward)))
        return kernels.scrub(group, counters, ring, per_forward, group_index=group_index, after_write=after_write)

    def first_read(group, counters, ring, group_index=0, rows=None, finalize=True):
        # a part hashes rows with the same kernel variant as the whole (a row range is a table slice)
        tracker.note(("first_read", *_group_key(group), group_index, rows is None or rows[1] > rows[0], finalize))
        return kernels.first_read(group, counters, ring, group_index=group_index, rows=rows, finalize=finalize)

    def sweep_index(group, index, counters, ring, group_index=0):
        tracker.note(("sweep_index", *_group_key(group), group_index))
        return kernels.sweep_index(group, index, counters, ring, group_index=group_index)

    def record_accepted(**kw):
        tracker.note(("record_accepted", *(str(kw[k].dtype).replace("torch.", "") for k in (
            "req_pool_indices", "committed", "next_token_ids", "accept_lens"))))
        return kernels.record_accepted(**kw)

    def accepted_drafts(**kw):
        tracker.note(("accepted_drafts", *(str(kw[k].dtype).replace("torch.", "") for k in (
            "req_to_token", "rows", "committed", "kept_nodes", "fed_tokens", "fed_positions", "appended"))))
        return kernels.accepted_drafts(**kw)

    def witness_stamp(group, view, group_index=0):
        tracker.note(("witness_stamp", group.name, group.slot_map is not None, *_dtypes(view, "out_cache_loc")))
        return kernels.witness_stamp(group, view, group_index=group_index)

    def witness_check(group, view, counters, ring, group_index=0):
        tracker.note(("witness_check", group.name, group_index, group.slot_map is not None,
                      *_dtypes(view, "out_cache_loc", "positions", "req_pool_indices", "seq_lens", "new_starts",
                               "new_lens")))
        return kernels.witness_check(group, view, counters, ring, group_index=group_index)

    return dataclasses.replace(kernels, verify=verify, write=write, scrub=scrub, sweep_index=sweep_index,
                               record_accepted=record_accepted, accepted_drafts=accepted_drafts,
                               witness_stamp=witness_stamp, witness_check=witness_check,
                               first_read=first_read)


def write_block_lengths(write_block: Callable[[int], object], max_new_len: int) -> Dict[object, int]:
    """{block: the shortest new run that selects it} for every block ``write_block`` picks up to ``max_new_len``.

    ``write_block`` is a non-decreasing step function with steps at powers of two, so probing 1 and
    every 2**k + 1 finds each block's first length.
    """
    out: Dict[object, int] = {}
    for n in [1] + [(1 << k) + 1 for k in range(max(1, max_new_len).bit_length())]:
        if n <= max(1, max_new_len):
            out.setdefault(write_block(n), n)
    return out


def programs_classes(programs_for_batch: Callable[[int], int], max_batch_size: int) -> Dict[int, int]:
    """{specialization class of programs_per_req: the smallest batch size that gives it}."""
    out: Dict[int, int] = {}
    for bs in range(1, max_batch_size + 1):
        out.setdefault(_spec(programs_for_batch(bs)), bs)
    return out
