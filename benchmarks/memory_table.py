#!/usr/bin/env python3
"""Canary device memory against the KV pool (Llama-3-8B shape), from ``kv_canary.memory.canary_memory_bytes``.

Prints the markdown table docs/history/performance.md and docs/operations.md quote: the pool of the
recorded H200 run (131,073 slots of 128 KiB K/V each), 65 and 4,097 request rows, contexts
from 32k to 1M tokens, sweep on and off; the last two columns add what ``--kv-canary-real-data all`` allocates
(``FullRowState``: 20 bytes per slot and the first-read work list, for the scrub and first-read hashing) to the
total. ``--before`` adds the token table the oracle had before issue 12 (int32[rows x context]) for comparison.

    PYTHONPATH=python python benchmarks/memory_table.py [--before]
"""

from __future__ import annotations

import argparse

from kv_canary.memory import canary_memory_bytes

KV_BYTES_PER_SLOT = 32 * 2 * 8 * 128 * 2  # Llama-3-8B: 32 layers x (K, V) x 8 KV heads x 128 x bf16
SLOTS = 131_073  # the H200 run's pool (16 GiB)
CONTEXTS = (32_768, 131_072, 1 << 20)
ROWS = (65, 4_097)


def rows_of_table(before: bool):
    for rows in ROWS:
        for ctx in CONTEXTS:
            for sweep in (False, True):
                m = canary_memory_bytes(num_slots=SLOTS, num_groups=1, req_rows=rows, context_len=ctx + 4,
                                        ring_capacity=4096, token_oracle=True, max_batch_size=rows, sweep=sweep)
                every_byte = canary_memory_bytes(num_slots=SLOTS, num_groups=1, req_rows=rows, context_len=ctx + 4,
                                                 ring_capacity=4096, token_oracle=True, max_batch_size=rows,
                                                 sweep=sweep, full_row=True, first_read=True)
                kv = SLOTS * KV_BYTES_PER_SLOT
                old = None
                if before:  # int32[rows, ctx] + int32[rows] + 2 x int64[max_bs]
                    old_token = rows * (ctx + 4) * 4 + rows * 4 + 2 * rows * 8
                    old = m.total - m.token_table + old_token
                yield rows, ctx, sweep, m, every_byte, kv, old


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", action="store_true", help="add the pre-issue-12 token table for comparison")
    args = p.parse_args()
    mib = 1 << 20
    head = ("| request rows | context | sweep | records + sweep index | token oracle | ring + counters | canary total "
            "| % of KV pool (16 GiB) | with real data `all` | `all`, % of KV pool |")
    sep = "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    if args.before:
        head += " before issue 12 | before, % |"
        sep += "---:|---:|"
    print(head)
    print(sep)
    for rows, ctx, sweep, m, every_byte, kv, old in rows_of_table(args.before):
        line = (f"| {rows:,} | {ctx:,} | {'on' if sweep else 'off'} | {(m.records + m.sweep_index) / mib:.1f} MiB | "
                f"{m.token_table / mib:.2f} MiB | {(m.ring + m.counters) / mib:.2f} MiB | {m.total / mib:.1f} MiB | "
                f"{m.pct_of(kv):.3f}% | {every_byte.total / mib:.1f} MiB | {every_byte.pct_of(kv):.3f}% |")
        if old is not None:
            line += f" {old / mib:,.1f} MiB | {100.0 * old / kv:.2f}% |"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
