"""benchmarks/bench_fused_attention_hash.py runs end to end on CPU (Triton interpreter, a tiny case): the attention
kernel's output matches the torch reference and, with each hash, every read lane's sum equals the reference's (the
run exits otherwise); the reference's mix32 lane sum is the FULL_HASH word term of those bytes."""

from __future__ import annotations

import json

import pytest
import torch

from kv_canary import fingerprint as fp
from script_loader import kernel_bench, on_cpu_kernels  # test/unit: on the path under pytest

bench = kernel_bench("bench_fused_attention_hash")
ON_CPU_KERNELS = on_cpu_kernels("fused-attention-hash")


@ON_CPU_KERNELS
def test_the_smoke_run_checks_the_output_and_every_lane_sum(tmp_path):
    out = tmp_path / "fused.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["bs"], row["ctx"], row["splits"]) == (2, 40, 2)
    assert all(row[f"{name}_us"] > 0 for name in bench.HASHES)


def test_the_reference_lane_sum_is_the_word_term_of_the_lanes_bytes():
    """One lane (request 0, position 3): its mix32 sum is the sum over every KV head's K and V words of
    ``mix32(word ^ key)``, keys numbered K then V per head; a flipped byte of that slot changes only that lane."""
    gen = torch.Generator().manual_seed(5)
    k_buf, v_buf = (torch.randn((9, bench.KV_HEADS, bench.HEAD_DIM), generator=gen).to(torch.bfloat16)
                    for _ in range(2))
    q = torch.randn((1, bench.Q_HEADS, bench.HEAD_DIM), generator=gen).to(torch.bfloat16)
    r2t = torch.arange(1, 9, dtype=torch.int32).view(1, 8)
    _, sums = bench.reference(torch, fp, q, k_buf, v_buf, r2t, 0.1)
    half = bench.HEAD_DIM // 2
    slot = int(r2t[0, 3])
    want = 0
    for h in range(bench.KV_HEADS):
        for j, buf in enumerate((k_buf, v_buf)):
            words = buf[slot, h].view(torch.int32).to(torch.int64) & fp.MASK_32
            keys = ((h * 2 * half + j * half + torch.arange(half) + 1) * fp.FULL_WORD_KEY) & fp.MASK_32
            want += int(fp.mix32(words ^ keys).sum())
    assert int(sums["mix32"][0, 3]) == want and int(sums["none"].abs().sum()) == 0
    v_buf.view(torch.int16)[slot, 2, 7] ^= 1 << 4
    _, after = bench.reference(torch, fp, q, k_buf, v_buf, r2t, 0.1)
    for name in ("mix32", "linear"):
        changed = (after[name] != sums[name]).nonzero().tolist()
        assert changed == [[0, 3]]


def test_bad_cases_are_refused_naming_the_flag():
    with pytest.raises(SystemExit):
        bench.parse_args(["--cases", "64by1024"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--splits", "0"])
