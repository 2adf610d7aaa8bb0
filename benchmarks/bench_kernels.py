#!/usr/bin/env python3
"""Microbenchmark of the kv-canary's HEAD-verify and TAIL-write kernels on decode-shaped forwards (no server).

For each batch size x context length it builds what the runtime has after a
prefill: a KV pool with the Llama-3-8B row shape (8 KV heads x 128 dims bf16;
only the hashed layers are allocated, since the kernels read nothing else),
fingerprint records written by the real TAIL kernel, and req_to_token rows
whose slots are scattered over the pool as after churn (``--slot-layout``).
It then times one decode forward's canary work, launched exactly as
``SingleForwardManager`` does: ``launch_verify`` over every request's
``ctx`` cached slots (programs per request from
``LaunchCapacities.verify_programs_per_request``) and ``launch_write`` of one
new token per request.

Timing (CUDA): each kernel is captured into a CUDA graph (as in the server's
decode graphs); every timed replay follows an L2 flush, between CUDA events
("cold", like a forward whose model layers evicted L2). "hot" is the same work
replayed back to back, several launches per graph. The graph floor (cold replay
of a one-kernel graph) is printed: it is included in every cold number.
Bandwidth counts bytes a verified slot needs (req_to_token entry + its
predecessor entry, the 32-byte record, the predecessor's chain, hashed K/V
bytes) against the device's nominal HBM bandwidth.

    export PYTHONPATH=/tmp/site:$PWD/python
    python benchmarks/bench_kernels.py --out bench_kernels.json
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke      # CPU: proves it runs; timings meaningless
    python benchmarks/bench_kernels.py --full-row [bench_full_row.py's options]   # FULL_HASH: TAIL, HEAD all, scrub
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_timing import GIB, Timer, device_info, graph_floor_us, measured_copy_gbps, nominal_hbm_gbps  # noqa: E402

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 8192, 32768)
SMOKE_BATCH_SIZES = (1, 3)
SMOKE_CONTEXTS = (16, 300)  # 300: more than one verify block

KV_HEADS = 8  # Llama-3-8B
HEAD_DIM = 128
KV_DTYPE_BYTES = 2  # bf16
KV_ROW_BYTES = KV_HEADS * HEAD_DIM * KV_DTYPE_BYTES
REQ_TO_TOKEN_ENTRY_BYTES = 4  # int32, as sglang's req_to_token
CHAIN_BYTES = 8
RECORD_BYTES = 32  # int64[RECORD_WIDTH]
INT64_BYTES = 8

DEFAULT_MAX_CONTEXT_LEN = 131072  # req_to_token width (sglang: the model's context length)
DEFAULT_MEM_BUDGET_GIB = 24.0
VERIFY_PROGRAMS_PER_SM = 2  # kv_canary.api.compute_capacities: target = 2 * SMs on CUDA
CPU_VERIFY_PROGRAMS_TARGET = 1  # same function, CPU/interpreter


@dataclass(frozen=True)
class Case:
    bs: int
    ctx: int

    @property
    def slots_verified(self) -> int:
        return self.bs * self.ctx

    @property
    def pool_slots(self) -> int:
        return self.bs * (self.ctx + 1) + 1  # + the new token per request, + padding slot 0


def case_bytes(case: Case, hashed_layers: int, r2t_width: int, verify_tokens: bool) -> int:
    """Device bytes one case allocates (K/V of the hashed layers, records, req_to_token, tokens, setup tensors)."""
    pool = case.pool_slots * (2 * hashed_layers * KV_ROW_BYTES + RECORD_BYTES)
    del verify_tokens  # the token oracle is O(rows + tokens of one forward): negligible here
    r2t = (case.bs + 1) * r2t_width * REQ_TO_TOKEN_ENTRY_BYTES
    setup = case.slots_verified * 3 * INT64_BYTES  # prefill ids, slots, permutation
    return pool + r2t + setup


def verify_bytes_per_slot(hash_words: int, hashed_layers: int, verify_tokens: bool) -> int:
    """Bytes HEAD verify needs per slot: 2 req_to_token entries, record, predecessor chain, hashed K and V
    (the token check reads one chain per request, not per slot)."""
    del verify_tokens
    tokens = 0
    return 2 * REQ_TO_TOKEN_ENTRY_BYTES + RECORD_BYTES + CHAIN_BYTES + 2 * hashed_layers * hash_words * 4 + tokens


class CaseRig:
    """Pool, records, req_to_token and a ``SingleForwardManager`` for one case.

    HEAD and TAIL go through ``SingleForwardManager.pre_ops/post_ops_maybe_inside_graph``,
    so the launches (programs per request, token check, group loop) are exactly the runtime's.
    """

    def __init__(self, torch, device, case: Case, args, config):
        from kv_canary import fingerprint as fp
        from kv_canary.config import KernelBackend
        from kv_canary.kernels import VERIFY_BLOCK, select_kernels
        from kv_canary.views import ForwardView, LaunchCapacities
        from kv_canary.buffer_groups import PoolLayout, build_group
        from kv_canary.runner import SingleForwardManager
        from kv_canary.token_oracle import TokenOracle

        self.fp, self.case = fp, case
        bs, ctx = case.bs, case.ctx
        gen = torch.Generator(device=device).manual_seed(args.seed)
        n = case.pool_slots

        def kv_buffer():
            buf = torch.empty((n, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
            buf.view(torch.int16).random_(generator=gen)  # arbitrary bytes: only hashed, never used as numbers
            return buf

        # Only hashed layers get a real buffer; the others are one-slot stand-ins the kernels never read.
        stand_in = torch.zeros((1, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
        hashed = set(config.kv_hash_layers)
        k = [kv_buffer() if i in hashed else stand_in for i in range(max(hashed) + 1)]
        v = [kv_buffer() if i in hashed else stand_in for i in range(max(hashed) + 1)]
        self.group = build_group(PoolLayout("full", k, v), config, device)

        # Slots 1..n-1, one row of ctx + 1 per request (ctx cached tokens + the new one).
        if args.slot_layout == "shuffled":
            slots = torch.randperm(n - 1, generator=gen, device=device) + 1
        else:
            slots = torch.arange(1, n, device=device)
        slots = slots.view(bs, ctx + 1)
        width = max(args.max_context_len, ctx + 1)
        r2t = torch.zeros((bs + 1, width), dtype=torch.int32, device=device)
        rows = torch.arange(1, bs + 1, dtype=torch.int64, device=device)  # row 0 unused, as in sglang
        r2t[1:, : ctx + 1] = slots.to(torch.int32)
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=device)
        self.counters[fp.C_REPORT_ENABLED] = 1
        ring = torch.zeros((config.ring_capacity, fp.RING_WIDTH), dtype=torch.int64, device=device)
        def make_oracle():
            return (TokenOracle(rows=r2t.shape[0], max_batch_size=max(args.batch_sizes) + 1,
                                max_tokens_per_forward=bs * ctx, device=device,
                                verify_reads=config.verify_tokens, check_fed=config.write_input_assert)
                    if config.uses_token_oracle else None)

        oracle = make_oracle()
        target = (VERIFY_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
                  if device.type == "cuda" else CPU_VERIFY_PROGRAMS_TARGET)
        capacities = LaunchCapacities(max_batch_size=max(args.batch_sizes) + 1, max_context_len=width,
                                      verify_programs_target=target)
        self.programs = capacities.verify_programs_per_request(bs, VERIFY_BLOCK)
        self.sfm = SingleForwardManager(
            index=0, groups=[self.group], kernels=select_kernels(KernelBackend.TRITON, device), req_to_token=r2t,
            counters=self.counters, ring=ring, capacities=capacities, on_tail=lambda: None,
            token_oracle=oracle,
        )
        # The timed decode step is replayed at the same positions: its TAIL's token-oracle updates (the row's
        # expected chain, the next-token announcements) go to a twin oracle, so HEAD keeps seeing a clean prefix.
        self.sfm_write = SingleForwardManager(
            index=0, groups=[self.group], kernels=select_kernels(KernelBackend.TRITON, device), req_to_token=r2t,
            counters=self.counters, ring=ring, capacities=capacities, on_tail=lambda: None,
            token_oracle=make_oracle(),
        )

        def ids(count):
            return torch.randint(1, args.vocab, (count,), generator=gen, device=device, dtype=torch.int64)

        # Prefill: the real TAIL fingerprints positions [0, ctx) of every request (and stores their tokens).
        prefill_ids = ids(bs * ctx)
        decode_ids = ids(bs)
        prefill = ForwardView(
            input_ids=prefill_ids,
            positions=torch.arange(ctx, dtype=torch.int64, device=device).repeat(bs),
            out_cache_loc=slots[:, :ctx].reshape(-1).to(torch.int64).contiguous(),
            req_pool_indices=rows,
            seq_lens=torch.full((bs,), ctx, dtype=torch.int64, device=device),
            new_starts=torch.arange(bs, dtype=torch.int64, device=device) * ctx,
            new_lens=torch.full((bs,), ctx, dtype=torch.int64, device=device),
            batch_size=bs,
            max_new_len=ctx,
        )
        select_kernels(KernelBackend.TRITON, device).write(self.group, prefill, r2t, self.counters, ring, True,
                                                           check_fed=False)
        del prefill
        for o in (oracle, self.sfm_write._oracle):
            if o is not None:  # each request's own prefix (its chain) and next (decode) token
                o.row_chain[rows] = self.group.records[slots[:, ctx - 1].to(torch.int64), fp.F_CHAIN]
                o.next_token[rows] = decode_ids
        # Decode: one new token per request at position ctx; HEAD verifies the ctx cached slots.
        self.view = ForwardView(
            input_ids=decode_ids,
            positions=torch.full((bs,), ctx, dtype=torch.int64, device=device),
            out_cache_loc=slots[:, ctx].to(torch.int64).contiguous(),
            req_pool_indices=rows,
            seq_lens=torch.full((bs,), ctx + 1, dtype=torch.int64, device=device),
            new_starts=torch.arange(bs, dtype=torch.int64, device=device),
            new_lens=torch.ones(bs, dtype=torch.int64, device=device),
            batch_size=bs,
            max_new_len=1,
        )
        self.check_clean(first=True)

    def verify(self) -> None:
        self.sfm.pre_ops_maybe_inside_graph(self.view)

    def write(self) -> None:
        self.sfm_write.post_ops_maybe_inside_graph(self.view)

    def forward(self) -> None:
        self.verify()
        self.write()

    def check_clean(self, first: bool = False) -> None:
        """The timed path must be the clean one: every slot verified, no violation."""
        fp = self.fp
        before = int(self.counters[fp.C_SLOTS_VERIFIED])
        self.verify()
        verified = int(self.counters[fp.C_SLOTS_VERIFIED]) - before
        violations = int(self.counters[fp.C_VIOLATIONS])
        if violations or verified != self.case.slots_verified:
            raise RuntimeError(
                f"bs={self.case.bs} ctx={self.case.ctx}: verify saw {violations} violations and checked "
                f"{verified} slots (expected 0 and {self.case.slots_verified}){' after setup' if first else ''}"
            )


def run_case(torch, device, case: Case, args, config, timer: Timer, bytes_per_slot: int,
             hbm: Optional[float]) -> dict:
    rig = CaseRig(torch, device, case, args, config)
    verify_us = timer.cold_us(rig.verify)
    write_us = timer.cold_us(rig.write)
    total_us = timer.cold_us(rig.forward)
    total_hot_us = timer.hot_us(rig.forward)
    rig.check_clean()
    secs = verify_us / 1e6
    gbps = bytes_per_slot * case.slots_verified / secs / 1e9 if secs > 0 else None
    out = {
        "bs": case.bs, "ctx": case.ctx, "slots_verified": case.slots_verified,
        "verify_programs_per_request": rig.programs,
        "verify_us": round(verify_us, 2), "write_us": round(write_us, 2), "total_us": round(total_us, 2),
        "total_hot_us": None if total_hot_us is None else round(total_hot_us, 2),
        "gslots_per_s": round(case.slots_verified / secs / 1e9, 3) if secs > 0 else None,
        "verify_gbps": None if gbps is None else round(gbps, 1),
        "verify_pct_of_hbm": None if gbps is None or not hbm else round(100 * gbps / hbm, 1),
    }
    del rig
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _cell(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def markdown_table(results: Sequence[dict]) -> str:
    head = ["bs", "ctx", "slots verified", "verify µs", "write µs", "total µs", "total hot µs",
            "Gslots/s", "verify GB/s", "% of HBM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['bs']} | {r['ctx']} | {r['bs'] * r['ctx']} | skipped: {r['skipped']} |"
                         + " |" * (len(head) - 4))
            continue
        lines.append("| " + " | ".join([
            str(r["bs"]), str(r["ctx"]), str(r["slots_verified"]),
            _cell(r["verify_us"], ".1f"), _cell(r["write_us"], ".1f"), _cell(r["total_us"], ".1f"),
            _cell(r["total_hot_us"], ".1f"), _cell(r["gslots_per_s"], ".2f"),
            _cell(r["verify_gbps"], ".0f"), _cell(r["verify_pct_of_hbm"], ".1f"),
        ]) + " |")
    return "\n".join(lines)


def _int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CPU run under TRITON_INTERPRET=1 on a tiny grid (proves the script runs; timings meaningless)")
    p.add_argument("--batch-sizes", type=_int_list, default=None,
                   help=f"comma-separated batch sizes (default {','.join(map(str, BATCH_SIZES))})")
    p.add_argument("--contexts", type=_int_list, default=None,
                   help=f"comma-separated cached tokens per request (default {','.join(map(str, CONTEXTS))})")
    p.add_argument("--mem-budget-gib", type=float, default=DEFAULT_MEM_BUDGET_GIB,
                   help=f"skip cases needing more device memory than this (default {DEFAULT_MEM_BUDGET_GIB:g})")
    p.add_argument("--canary-env", action="append", default=[], metavar="SGLANG_KV_CANARY_X=V",
                   help="canary setting as its env var, parsed by CanaryConfig.build (repeatable; default: the "
                        "canary's defaults), e.g. SGLANG_KV_CANARY_KV_HASH_BYTES=64 or "
                        "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=0")
    p.add_argument("--max-context-len", type=int, default=DEFAULT_MAX_CONTEXT_LEN,
                   help="req_to_token width, which caps verify programs per request "
                        f"(default {DEFAULT_MAX_CONTEXT_LEN})")
    p.add_argument("--slot-layout", choices=["shuffled", "contiguous"], default="shuffled",
                   help="slots of a request scattered over the pool (after churn) or consecutive (default shuffled)")
    p.add_argument("--iters", type=int, default=None, help="timed replays per measurement (default 100; smoke 3)")
    p.add_argument("--hot-launches", type=int, default=20, help="launches per graph for the hot number (default 20)")
    p.add_argument("--no-graphs", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--vocab", type=int, default=128256, help="token ids are drawn from [1, vocab) (default 128256)")
    p.add_argument("--hbm-gbps", type=float, default=None, help="nominal HBM GB/s (default: by device name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_kernels.json", help="JSON results file (default bench_kernels.json)")
    args = p.parse_args(argv)
    args.batch_sizes = args.batch_sizes or list(SMOKE_BATCH_SIZES if args.smoke else BATCH_SIZES)
    args.contexts = args.contexts or list(SMOKE_CONTEXTS if args.smoke else CONTEXTS)
    args.iters = args.iters or (3 if args.smoke else 100)
    args.canary_environ = {}
    for pair in args.canary_env:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("SGLANG_KV_CANARY_"):
            p.error(f"--canary-env expects SGLANG_KV_CANARY_NAME=VALUE, got {pair!r}")
        args.canary_environ[key] = value
    if args.iters < 1 or args.hot_launches < 1:
        p.error("--iters and --hot-launches must be >= 1")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--full-row" in argv:  # issue 22's whole-row paths, old vs new: benchmarks/bench_full_row.py
        import bench_full_row

        argv.remove("--full-row")
        return bench_full_row.main(argv)
    args = parse_args(argv)
    if args.smoke:
        # Must be set before triton.jit decorates the kernels (at import of kv_canary.kernels.triton_kernels).
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kv_canary.config import CanaryConfig, CanaryConfigError

    try:  # the same parser and defaults as the server's SGLANG_KV_CANARY_* env vars
        config = CanaryConfig.build(mode="log", environ=args.canary_environ)
    except CanaryConfigError as exc:
        raise SystemExit(f"--canary-env: {exc}") from None

    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device (or TRITON_INTERPRET=1 is set): run on a GPU, or pass --smoke on CPU")

    info = device_info(torch, device)
    hbm = args.hbm_gbps or nominal_hbm_gbps(info["device_name"])
    timer = Timer(torch, device, args.iters, args.hot_launches, use_graphs=not args.no_graphs)
    layers = len(config.kv_hash_layers)
    hash_words = min(config.kv_hash_bytes, KV_ROW_BYTES) // 4  # build_group caps it at the row size
    bytes_per_slot = verify_bytes_per_slot(hash_words, layers, config.verify_tokens)
    setup = (f"kv_hash_bytes={config.kv_hash_bytes} kv_hash_layers={','.join(map(str, config.kv_hash_layers))} "
             f"verify_tokens={int(config.verify_tokens)} slots={args.slot_layout}")
    floor = graph_floor_us(torch, timer)
    copy_gbps = measured_copy_gbps(torch, device)
    print(f"device: {info['device_name']}  nominal HBM: {_cell(hbm, '.0f')} GB/s  measured copy: "
          f"{_cell(copy_gbps, '.0f')} GB/s  graph floor: {_cell(floor, '.1f')} µs  "
          f"bytes per verified slot: {bytes_per_slot}\ncanary: {setup}", flush=True)
    if args.smoke:
        print("note: Triton interpreter on CPU: this proves the script runs; the timings are meaningless.", flush=True)

    results = []
    budget = args.mem_budget_gib * GIB
    for ctx in args.contexts:
        for bs in args.batch_sizes:
            case = Case(bs, ctx)
            need = case_bytes(case, layers, max(args.max_context_len, ctx + 1), config.verify_tokens)
            if need > budget:
                reason = f"needs {need / GIB:.2f} GiB > {args.mem_budget_gib:g} GiB budget"
                results.append({"bs": bs, "ctx": ctx, "skipped": reason})
                print(f"bs={bs:<4} ctx={ctx:<6} skipped ({reason})", flush=True)
                continue
            r = run_case(torch, device, case, args, config, timer, bytes_per_slot, hbm)
            results.append(r)
            print(f"bs={bs:<4} ctx={ctx:<6} verify {r['verify_us']:9.1f} µs  write {r['write_us']:7.1f} µs  "
                  f"total {r['total_us']:9.1f} µs  {_cell(r['verify_gbps'], '.0f')} GB/s", flush=True)

    table = markdown_table(results)
    report = {
        "benchmark": "kv_canary kernel microbenchmark (decode-shaped forwards)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "host": platform.node(),
        "device": info,
        "versions": {"torch": torch.__version__, "triton": _triton_version(), "python": platform.python_version()},
        "smoke_interpreter": args.smoke,
        "timing": ("CUDA graph replay after an L2 flush, CUDA events, median of iters (cold); hot = back-to-back "
                   "launches in one graph" if device.type == "cuda" and not args.no_graphs else
                   "eager launches" + (" after an L2 flush, CUDA events" if device.type == "cuda" else
                                       ", wall clock (Triton interpreter: meaningless)")),
        "graph_floor_us": floor,
        "nominal_hbm_gbps": hbm,
        "measured_copy_gbps": copy_gbps,
        "verify_bytes_per_slot": bytes_per_slot,
        "canary_config": {"kv_hash_bytes": config.kv_hash_bytes, "kv_hash_layers": list(config.kv_hash_layers),
                          "verify_tokens": config.verify_tokens, "ring_capacity": config.ring_capacity},
        "kv_row": {"heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "params": {k: v for k, v in vars(args).items() if k not in ("out", "canary_env")},
        "results": results,
        "table_markdown": table,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n## kv-canary kernels per decode forward ({info['device_name']}; {setup}; {report['timing']})\n")
    print(table)
    print(f"\nverify GB/s counts {bytes_per_slot} B per verified slot; % of HBM is against "
          f"{_cell(hbm, '.0f')} GB/s nominal. Cold numbers include the graph floor ({_cell(floor, '.1f')} µs).")
    if args.smoke:
        print("note: Triton interpreter on CPU: the timings above are meaningless.")
    print(f"results: {Path(args.out).resolve()}")
    return 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    raise SystemExit(main())
