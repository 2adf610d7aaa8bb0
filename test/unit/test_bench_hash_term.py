"""benchmarks/bench_hash_term.py runs end to end on CPU (Triton interpreter, a tiny buffer): every term's pass sums
to the torch reference (the run exits otherwise), two programs stepping their keys; the reference itself is
checked against the fingerprint's own word term."""

from __future__ import annotations

import json

import pytest
import torch

from kv_canary import fingerprint as fp
from script_loader import kernel_bench, on_cpu_kernels  # test/unit: on the path under pytest

bench_hash_term = kernel_bench("bench_hash_term")
ON_CPU_KERNELS = on_cpu_kernels("hash-term")


@ON_CPU_KERNELS
def test_the_smoke_run_checks_every_term_and_writes_its_report(tmp_path):
    out = tmp_path / "hash_term.json"
    assert bench_hash_term.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["terms"]) == {"read", "mix32", "linear"}
    assert all(t["best"]["programs"] == 2 for t in report["terms"].values())


def test_the_reference_terms_are_the_fingerprints():
    """``mix32``'s sum is the FULL_HASH's pre-mix sum of the same words (``full_hash_from_words`` of one row, before
    its final mix64 and seed); ``read`` is the unsigned sum; ``linear`` catches a flipped bit and a swap of words."""
    gen = torch.Generator().manual_seed(3)
    words = torch.randint(-(1 << 31), 1 << 31, (64,), dtype=torch.int32, generator=gen)
    total = bench_hash_term.reference_sum(torch, words, "mix32")
    mixed = fp.mix64(torch.tensor([total], dtype=torch.int64) ^ fp.HASH_SEED)
    assert torch.equal(mixed, fp.full_hash_from_words(words[None, :]))
    assert bench_hash_term.reference_sum(torch, words, "read") == int((words.to(torch.int64) & fp.MASK_32).sum())
    base = bench_hash_term.reference_sum(torch, words, "linear")
    flipped = words.clone()
    flipped[17] ^= 1 << 30
    swapped = words.clone()
    swapped[[3, 40]] = words[[40, 3]]
    assert bench_hash_term.reference_sum(torch, flipped, "linear") != base
    assert bench_hash_term.reference_sum(torch, swapped, "linear") != base


def test_bad_sizes_are_refused_naming_the_flags():
    with pytest.raises(SystemExit):
        bench_hash_term.parse_args(["--mib", "0"])
