"""--kv-canary contain under tensor parallel: the ranks agree on one order at the scheduler's safe point.

Two real processes and a real gloo group (the kind sglang's ``tp_cpu_group`` is): rank 1 alone found a
violation (its KV shard), rank 0 found another one; after ``_agree`` both ranks queue the same aborts with the
same messages and the same slots to evict.
"""

import os
import socket
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from kv_canary.adapter.contain import SchedulerContainment
from kv_canary.containment import ContainOrder


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        c = SchedulerContainment(SimpleNamespace(tp_size=2, tp_cpu_group=dist.group.WORLD))
        c._agree()  # nothing pending anywhere: one all-reduce, no exchange
        idle_exchanges = c.exchanges
        if rank == 1:
            c.submit(ContainOrder(aborts={"r-a": "rank1 says a", "r-b": "rank1 says b"}, slots=(7, 9)))
        else:
            c.submit(ContainOrder(aborts={"r-b": "rank0 says b"}, slots=(3,)))
        queued_before = dict(c._aborts)
        c._agree()
        slots = sorted(slot for _tier, slot in c._slots)
        queue.put((rank, idle_exchanges, queued_before, dict(c._aborts), slots, c.exchanges))
    finally:
        dist.destroy_process_group()


def test_tp_ranks_agree_on_aborts_and_evictions():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (_, idle0, before0, aborts0, slots0, ex0), (_, idle1, before1, aborts1, slots1, ex1) = results
    assert idle0 == idle1 == 0 and ex0 == ex1 == 1
    assert before0 == before1 == {}  # nothing is applied before the ranks agreed
    assert aborts0 == aborts1 == {"r-a": "rank1 says a", "r-b": "rank0 says b"}  # lowest rank's message wins
    assert slots0 == slots1 == [3, 7, 9]
