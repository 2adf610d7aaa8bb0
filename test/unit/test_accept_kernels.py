"""Speculative decoding's one-launch kernels (``kernels/accept.py``) against their torch references, bit for bit
(on CPU under the Triton interpreter, compiled on the GPU host)."""

from __future__ import annotations

import pytest
import torch

from kv_canary_testing.kernel_sim import DEVICE
from kv_canary.views import CanaryCapacityError




@pytest.mark.parametrize("bs,n", [(1, 1), (1, 4), (3, 4), (5, 17), (2, 40)])
def test_the_one_launch_record_accepted_equals_the_torch_reference_bit_for_bit(bs, n):
    """kernels/accept.py (the Triton backend's verify hook: one launch) against speculative.record_accepted."""
    from kv_canary.kernels.accept import launch_record_accepted
    from kv_canary.speculative import record_accepted

    dev = DEVICE  # the GPU host's unit run compiles it for real
    g = torch.Generator().manual_seed(bs * 100 + n)
    rows = torch.randperm(16, generator=g)[:bs].to(torch.int64)
    kw = dict(req_pool_indices=rows.to(dev), committed=torch.randint(1, 5000, (bs,), generator=g).to(dev),
              next_token_ids=torch.randint(0, 32000, (bs * n,), generator=g, dtype=torch.int32).to(dev),
              accept_lens=torch.randint(1, n + 1, (bs,), generator=g, dtype=torch.int32).to(dev), batch_size=bs, n=n)
    staged = torch.randint(0, 32000, (bs * (n + 1) + 3,), generator=g).to(dev)
    chain = torch.randint(-2**62, 2**62, (16,), generator=g).to(dev)
    out = []
    for fn in (record_accepted, launch_record_accepted):
        o = dict(staged=staged.clone(), row_chain=chain.clone(), sampled=torch.full((16,), -7, device=dev))
        fn(**o, **kw)
        out.append(o)
    assert torch.equal(out[0]["row_chain"], out[1]["row_chain"])
    assert torch.equal(out[0]["sampled"], out[1]["sampled"])
    assert not torch.equal(out[1]["row_chain"], chain) or n == 1
    with pytest.raises(CanaryCapacityError, match="staged entries"):
        launch_record_accepted(staged=staged[:bs * (n + 1) - 1], row_chain=chain.clone(),
                               sampled=torch.zeros(16, dtype=torch.int64, device=dev), **kw)


@pytest.mark.parametrize("bs,n,max_kept", [(1, 4, 4), (3, 4, 4), (5, 6, 4), (9, 8, 8)])
def test_the_one_launch_deferred_tail_inputs_equal_the_torch_reference_bit_for_bit(bs, n, max_kept):
    """kernels/accept.py's spec v1 launch against speculative.build_accepted_drafts: random kept paths (root
    first, 1..max_kept nodes a request, some cut to the root as after a finishing token) over ``bs * n`` tree
    nodes, sglang 0.5.12's dtypes (accept_index and accept_tokens int32, draft tokens/positions int64)."""
    from kv_canary.kernels.accept import launch_accepted_drafts
    from kv_canary.speculative import AcceptedDraftBuffers, build_accepted_drafts

    dev = DEVICE  # the GPU host's unit run compiles it for real
    g = torch.Generator().manual_seed(bs * 1000 + n * 10 + max_kept)
    lens = torch.randint(1, min(n, max_kept) + 1, (bs,), generator=g)
    lens[0] = 1  # cut to the root
    kept_nodes = torch.cat([i * n + torch.cat([torch.zeros(1, dtype=torch.int64),
                                               1 + torch.randperm(n - 1, generator=g)[: int(a) - 1]])
                            for i, a in enumerate(lens)]).to(torch.int32)
    kept = int(lens.sum())
    r2t = torch.randint(1, 50000, (20, 300), generator=g, dtype=torch.int32)
    kw = dict(req_to_token=r2t.to(dev), rows=torch.randperm(20, generator=g)[:bs].to(dev),
              committed=torch.randint(0, 300 - max_kept, (bs,), generator=g).to(dev),
              kept_nodes=kept_nodes.to(dev), kept=kept, batch_size=bs, n=n,
              fed_tokens=torch.randint(0, 32000, (bs * n,), generator=g).to(dev),
              fed_positions=torch.randint(0, 5000, (bs * n,), generator=g).to(dev),
              appended=torch.randint(0, 32000, (kept,), generator=g, dtype=torch.int32).to(dev))
    junk = torch.randint(0, 32000, (bs * (max_kept + 1) + 5,), generator=g).to(dev)
    outs = []
    for fn in (build_accepted_drafts, launch_accepted_drafts):
        out = AcceptedDraftBuffers.allocate(bs + 2, max_kept, torch.device(dev))
        for t in (out.ids, out.positions, out.out_cache_loc, out.seq_lens, out.bonus):
            t.fill_(-9)
        staged = junk.clone()
        fn(out=out, staged=staged, **kw)
        outs.append((out, staged))
    (ref, ref_staged), (tri, tri_staged) = outs
    for name in ("ids", "positions", "out_cache_loc", "seq_lens", "new_starts", "new_lens", "bonus"):
        assert torch.equal(getattr(ref, name), getattr(tri, name)), name
    assert torch.equal(ref_staged, tri_staged)
    # and what they hold: request i's kept nodes at new_starts[i], the row's slots at c + k, the appended tokens
    starts = torch.cumsum(lens, 0) - lens
    assert tri.new_lens[:bs].tolist() == lens.tolist() and tri.new_starts[:bs].tolist() == starts.tolist()
    rows, c = kw["rows"].cpu(), kw["committed"].cpu()
    for i in range(bs):
        s, a = int(starts[i]), int(lens[i])
        nodes = kept_nodes[s:s + a].long()
        assert tri.ids[s:s + a].cpu().tolist() == kw["fed_tokens"].cpu()[nodes].tolist()
        assert tri.out_cache_loc[s:s + a].cpu().tolist() == r2t[rows[i], c[i]:c[i] + a].long().tolist()
        assert int(tri.seq_lens[i]) == int(c[i]) + a
        app = kw["appended"].cpu()[s:s + a].long().tolist()
        assert tri_staged[s + i:s + i + a + 1].cpu().tolist() == [-1] + app[:-1] + [-1]
        assert int(tri.bonus[i]) == app[-1]
    assert int(tri.ids[kept]) == -9 and int(tri.seq_lens[bs]) == -9  # nothing past the batch
    assert torch.equal(tri_staged[kept + bs:], junk[kept + bs:])
