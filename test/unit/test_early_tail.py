"""``EarlyTail``: the TAIL at the model's last stage, on a side stream that forks there and joins at the forward's end."""

import pytest
import torch

from kv_canary.runner.early_tail import EarlyTail


class Stage(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_on_cpu_the_tail_runs_in_line_at_the_anchor_once_per_armed_forward():
    stage, seen = Stage(), []
    early = EarlyTail(stage, lambda view: seen.append(view), torch.device("cpu"))
    stage(torch.ones(1))  # not armed: nothing
    early.arm("v1")
    stage(torch.ones(1))
    stage(torch.ones(1))  # the anchor's second call in one forward: nothing
    assert early.finish() is True and seen == ["v1"] and early.early_tails == 1
    early.arm("v2")  # a forward that never reaches the anchor: the caller runs its TAIL
    assert early.finish() is False and seen == ["v1"]
    stage(torch.ones(1))  # disarmed by finish
    assert seen == ["v1"]


def test_a_non_module_anchor_is_refused():
    with pytest.raises(TypeError, match="torch module"):
        EarlyTail(object(), lambda view: None, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams and CUDA graphs need a GPU")
@pytest.mark.parametrize("graphed", [False, True])
def test_on_cuda_the_tail_sees_every_store_before_the_anchor_and_the_forward_waits_for_it(graphed):
    dev = torch.device("cuda")
    kv = torch.zeros(1 << 20, device=dev)
    out = torch.zeros(1, device=dev)
    after = torch.zeros(1, device=dev)
    stage = Stage()

    def tail(view):
        torch.cuda._sleep(20_000_000)  # ~10 ms on the side stream: a missing join would let `after` read 0
        out.copy_(kv.sum().reshape(1))

    early = EarlyTail(stage, tail, dev)

    def forward():
        early.arm("view")
        kv.fill_(1.0)  # the layers' K/V stores
        stage(torch.ones(8, device=dev))  # the last stage: the TAIL forks here
        ran = early.finish()
        after.copy_(out)  # the forward's stream, after the join
        return ran

    if graphed:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        kv.zero_(), out.zero_(), after.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert forward() is True
        torch.cuda.synchronize()
        kv.zero_(), out.zero_(), after.zero_()
        torch.cuda.synchronize()
        graph.replay()
    else:
        assert forward() is True
    torch.cuda.synchronize()
    assert float(after) == float(kv.numel())
