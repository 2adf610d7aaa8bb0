"""The decode step beside the model's LM head (``bench_decode_kernels.py --lm-head VOCAB``): the canary's HEAD, TAIL and
verify as the server lays them out around the last GEMM of a forward (in line, or on a side stream beside it), each
layout captured in a CUDA graph and timed against the GEMM alone."""

from __future__ import annotations

import statistics


def time_lm_head(torch, device, rig, iters, vocab):
    """The step's wall time on the GPU with the LM head's GEMM last (no L2 flush: the GEMM's 1 GB read is one):
    ``base`` (store + GEMM, no canary), ``serial`` (HEAD, store, GEMM, TAIL: the TAIL after the forward, as the
    patched model.forward runs it today), ``forked`` (HEAD, store, then the TAIL on a side stream beside the GEMM,
    joined before the graph ends), ``forked_verify`` (HEAD's stamp, store, then the verify and the TAIL beside the
    GEMM: the server's path with ``runner/early_tail.py``), ``forked_verify_hi`` (that on a side stream of higher
    priority) and ``forked_verify_scrub_hi`` (the scrub moved out of HEAD, after the TAIL on that stream). Median µs
    of ``iters`` replays each, interleaved."""
    w = torch.empty((vocab, 4096), dtype=torch.bfloat16, device=device).normal_()
    h = torch.empty((rig.bs, 4096), dtype=torch.bfloat16, device=device).normal_()
    side = torch.cuda.Stream(device=device)
    # the same side stream at a higher priority: its blocks are placed ahead of the GEMM's waiting ones (does the
    # canary's side work then end inside the LM head instead of after it?)
    side_hi = torch.cuda.Stream(device=device, priority=-1)  # torch: 0 (default) or negative, lower = higher

    def lm():
        return h @ w.t()

    def base():
        rig.store()
        lm()

    def serial():
        rig.head()
        rig.store()
        lm()
        rig.tail()

    def forked():
        rig.head()
        rig.store()
        cur = torch.cuda.current_stream(device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            rig.tail()
        lm()
        cur.wait_stream(side)

    def forked_verify(stream=side, scrub_beside=False):  # the server's path with an anchor: HEAD stamps only, the
        # verify runs before the TAIL (HEAD's own oracle); ``scrub_beside``: the scrub too, after the TAIL
        scrub, rig.head_mgr._scrub = rig.head_mgr._scrub, 0 if scrub_beside else rig.head_mgr._scrub
        rig.head_mgr.pre_ops_maybe_inside_graph(rig.view, verify_later=True)
        rig.head_mgr._verify_pending, rig.head_mgr._scrub = False, scrub  # its verify runs below, on the stream
        rig.store()
        cur = torch.cuda.current_stream(device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            rig.head_mgr._verify(rig.view)
            rig.tail()
            if scrub_beside and scrub:
                rig.head_mgr._scrub_groups()
        lm()
        cur.wait_stream(stream)

    variants = (("base", base), ("serial", serial), ("forked", forked), ("forked_verify", forked_verify),
                ("forked_verify_hi", lambda: forked_verify(side_hi)),
                ("forked_verify_scrub_hi", lambda: forked_verify(side_hi, scrub_beside=True)))
    graphs = {}
    for name, fn in variants:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[name] = g
    torch.cuda.synchronize()
    ev = {k: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
          for k in graphs}
    for i in range(iters):
        names = [name for name, _ in variants]
        for k in (names if i % 2 else names[::-1]):
            ev[k][i][0].record()
            graphs[k].replay()
            ev[k][i][1].record()
    torch.cuda.synchronize()
    rig.check(0)
    out = {f"lm_{k}_us": round(statistics.median(s.elapsed_time(e) for s, e in ev[k]) * 1e3, 2) for k in ev}
    out.update({f"lm_{k}_mean_us": round(statistics.mean(s.elapsed_time(e) for s, e in ev[k]) * 1e3, 2) for k in ev})
    for name, _ in variants[1:]:
        out[f"lm_{name}_minus_base_us"] = round(out[f"lm_{name}_us"] - out["lm_base_us"], 2)
        out[f"lm_{name}_minus_base_mean_us"] = round(out[f"lm_{name}_mean_us"] - out["lm_base_mean_us"], 2)
    return out
