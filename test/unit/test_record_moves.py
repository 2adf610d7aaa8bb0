"""A HiCache load-back's record moves (``kernels/record_moves.py``): the one-launch Triton kernel against its torch
reference, on strided record rows, loads larger than a program, an empty load; bad tables are refused.

On CPU the Triton kernel runs under TRITON_INTERPRET=1; on a GPU host the compiled one runs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

import pytest  # noqa: E402

from kv_canary import fingerprint as fp  # noqa: E402
from kv_canary.kernels.record_moves import LOAD_BLOCK, load_records  # noqa: E402

W = fp.RECORD_WIDTH


def _tables(num_host: int, num_slots: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(-2**62, 2**62, (num_host, W), generator=g, dtype=torch.int64)
    # a buffer group's records may be a view with a row stride (here every other row of a wider table)
    wide = torch.randint(-2**62, 2**62, (num_slots, W + 3), generator=g, dtype=torch.int64)
    tags = torch.randint(1, 2**62, (num_slots,), generator=g, dtype=torch.int64)
    book = torch.full((num_slots, 2), -1, dtype=torch.int64)
    return [t.to(DEVICE) for t in (host, wide, tags, book)]


@pytest.mark.parametrize("n", [0, 1, 7, LOAD_BLOCK + 5])
def test_the_kernel_moves_what_the_reference_moves(n):
    num_host, num_slots = 3 * LOAD_BLOCK, 4 * LOAD_BLOCK
    g = torch.Generator().manual_seed(n)
    host_idx = torch.randperm(num_host, generator=g)[:n].to(DEVICE)
    dev_idx = torch.randperm(num_slots - 1, generator=g)[:n].add(1).to(DEVICE)  # distinct, slot 0 never loaded
    results = []
    for triton_ok in (True, False):
        host, wide, tags, book = _tables(num_host, num_slots, seed=5)
        records = wide[:, 1:1 + W]  # strided rows, contiguous columns
        before = records.clone()
        load_records(host, host_idx, records, dev_idx, tags, book, 41, triton_ok=triton_ok)
        results.append((wide.cpu(), tags.cpu(), book.cpu()))
        moved = torch.zeros(num_slots, dtype=torch.bool)
        moved[dev_idx.cpu()] = True
        # the loaded slots carry their host rows, tag 0 and (host slot, forward); every other slot is untouched
        assert torch.equal(records.cpu()[dev_idx.cpu()], host.cpu()[host_idx.cpu()])
        assert torch.equal(records.cpu()[~moved], before.cpu()[~moved])
        assert (tags.cpu()[dev_idx.cpu()] == 0).all() and (tags.cpu()[~moved] != 0).all()
        assert torch.equal(book.cpu()[dev_idx.cpu()], torch.stack([host_idx.cpu(), torch.full((n,), 41)], dim=1))
        assert (book.cpu()[~moved] == -1).all()
        assert torch.equal(wide.cpu()[:, 0], _tables(num_host, num_slots, seed=5)[1].cpu()[:, 0])  # outside the view
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_tables_are_refused():
    host, wide, tags, book = _tables(8, 8, seed=1)
    idx = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="columns"):
        load_records(host[:, :3], idx, wide[:, :W], idx, tags, book, 0, triton_ok=True)
    with pytest.raises(ValueError, match="contiguous"):
        load_records(host, idx, wide[:, :W], idx, tags, book.t().contiguous().t(), 0, triton_ok=True)
    for triton_ok in (True, False):  # both paths refuse a load of mismatched lengths the same way
        with pytest.raises(ValueError, match="into 2 device slots"):
            load_records(host, idx, wide[:, :W], torch.zeros(2, dtype=torch.int64, device=DEVICE), tags, book, 0,
                         triton_ok=triton_ok)
