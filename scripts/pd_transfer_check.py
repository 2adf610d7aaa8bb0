#!/usr/bin/env python3
"""Mooncake's transfer engine alone, as sglang's PD path drives it: one buffer written into another over TCP.

    python scripts/pd_transfer_check.py [--device cuda|cpu] [--mib 64]

Two ``TransferEngine`` s in this process (sglang's calls: ``initialize(host, "P2PHANDSHAKE", "rdma", "")``
with ``MC_FORCE_TCP=true``, ``register_memory``, ``batch_transfer_sync_write`` to ``host:rpc_port``) on
127.0.0.1; the destination must equal the source. On the GPU host this tells a broken CUDA build of mooncake (or a
missing library) apart from a PD e2e failure; the non-CUDA build passes on CPU and fails on GPU memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--mib", type=int, default=64, help="bytes to move, in MiB")
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_FORCE_TCP", "true")
    import torch  # before mooncake: torch loads the CUDA runtime that mooncake's engine.so links

    from mooncake.engine import TransferEngine

    def engine():
        e = TransferEngine()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") != 0:
            raise SystemExit("pd_transfer_check: TransferEngine.initialize failed")
        return e

    sender, receiver = engine(), engine()
    n = args.mib * (1 << 20) // 4
    src = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, device=args.device)
    dst = torch.zeros(n, dtype=torch.int32, device=args.device)
    if args.device == "cuda":
        torch.cuda.synchronize()
    for e, t in ((sender, src), (receiver, dst)):
        if e.register_memory(t.data_ptr(), t.numel() * 4) != 0:
            raise SystemExit(f"pd_transfer_check: register_memory failed ({args.device})")
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    # three pieces, as sglang sends a request's pages: several (src, dst, length) in one call
    q = n // 4
    pieces = [(0, q), (q, 2 * q), (2 * q, n)]
    t0 = time.perf_counter()
    ret = sender.batch_transfer_sync_write(session, [src.data_ptr() + 4 * a for a, _ in pieces],
                                           [dst.data_ptr() + 4 * a for a, _ in pieces],
                                           [4 * (b - a) for a, b in pieces])
    dt = time.perf_counter() - t0
    if args.device == "cuda":
        torch.cuda.synchronize()
    moved = 4 * sum(b - a for a, b in pieces)
    same = torch.equal(src, dst)
    print(f"pd_transfer_check device={args.device} ret={ret} bytes={moved} equal={same} "
          f"seconds={dt:.3f} GB/s={moved / dt / 1e9:.2f}")
    return 0 if ret == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
