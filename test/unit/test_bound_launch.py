"""``BoundKernel`` (kernels/launch.py): a bound launch runs exactly the variant Triton's own launch would.

On a GPU host the compiled launcher is called directly once a variant is bound; every case compares the outputs with
``kernel[grid]``'s and checks that a launch Triton would specialize differently (a misaligned tensor, an integer that
becomes 1 or a multiple of 16, another constexpr, positional or keyword) gets its own variant. On CPU (the
interpreter) every launch takes Triton's own path.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kv_canary.kernels.launch import BoundKernel  # noqa: E402


@triton.jit
def _scaled_copy(dst, src, n, scale, SHIFT: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(src + offs, mask=m, other=0)
    tl.store(dst + offs, (x * scale << SHIFT) + ADD, mask=m)


def _launch(kernel, dst, src, n, scale, shift, add=None):
    kw = {} if add is None else {"ADD": add}
    kernel[(triton.cdiv(max(n, 1), 64),)](dst, src, n, scale, shift, BLOCK=64, **kw)


CASES = [  # (src offset, n, scale, SHIFT, ADD): each a variant Triton specializes apart from the one before
    (0, 200, 3, 1, None),
    (0, 100, 5, 1, None),   # same variant (n and scale: other values of one class)
    (1, 100, 5, 1, None),   # src misaligned (8 bytes past a 16-byte boundary)
    (0, 160, 5, 1, None),   # n a multiple of 16
    (0, 100, 1, 1, None),   # scale 1
    (0, 100, 5, 2, None),   # another positional constexpr
    (0, 100, 5, 1, 7),      # a keyword constexpr given, not its default
]


def test_bound_launch_runs_the_variant_triton_would():
    bound = BoundKernel(_scaled_copy)
    src = torch.arange(1, 1001, dtype=torch.int64, device=DEVICE)
    for offset, n, scale, shift, add in CASES:
        s = src[offset:]
        want = torch.zeros(1000, dtype=torch.int64, device=DEVICE)
        got = torch.zeros_like(want)
        _launch(_scaled_copy, want, s, n, scale, shift, add)
        for _ in range(2):  # the first binds (or finds) the variant, the second runs it through the launcher
            got.zero_()
            _launch(bound, got, s, n, scale, shift, add)
            assert torch.equal(got, want), (offset, n, scale, shift, add)
    if DEVICE.type == "cuda":  # one variant per case but the second (the first's specialization)
        assert bound._direct and len(bound._variants) == len(CASES) - 1
    else:
        assert not bound._direct and not bound._variants


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the compiled launcher needs a GPU (this runs on the GPU host)")
def test_bound_launch_keys_integer_ranges_and_follows_the_current_stream():
    bound = BoundKernel(_scaled_copy)
    src = torch.arange(1, 65, dtype=torch.int64, device=DEVICE)
    dst = torch.zeros_like(src)
    # an n past int32 compiles an int64 variant of its own (the grid covers the buffer only: n masks nothing here)
    bound[(1,)](dst, src, 64, 3, 0, BLOCK=64)
    bound[(1,)](dst, src, (1 << 33) + 1, 3, 0, BLOCK=64)
    assert len(bound._variants) == 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the launch below must queue behind this on the side stream
        dst.zero_()
        bound[(1,)](dst, src, 64, 3, 0, BLOCK=64)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(dst, src * 3)


def test_variant_key_tells_apart_what_triton_specializes_on():
    """The key (CPU: no launch) is equal only where Triton's specialization is: a tensor's dtype and 16-byte
    alignment, an integer's range and its == 1 / multiple-of-16 classes, bools and None by value, keywords by name and
    value, positional constexprs by value; anything else is not keyed (Triton's own launch then)."""
    from kv_canary.kernels.launch import _variant_key

    buf = torch.zeros(64, dtype=torch.int64)
    key = lambda *args, constexprs=(), **kw: _variant_key(args, kw, constexprs)  # noqa: E731
    assert key(buf, 3, X=1) == key(torch.ones(8, dtype=torch.int64), 5, X=1)  # other values of one class
    different = [key(buf[1:], 3, X=1), key(buf.to(torch.int32), 3, X=1), key(buf, 1, X=1), key(buf, 32, X=1),
                 key(buf, 1 << 40, X=1), key(buf, 1 << 63, X=1), key(buf, 3, X=2), key(buf, 3, Y=1),
                 key(buf, 3, None, X=1), key(buf, 3, True, X=1), key(buf, 3, 3.0, X=1)]
    assert len({key(buf, 3, X=1), *different}) == len(different) + 1
    assert key(buf, 3, 7, constexprs=(2,)) != key(buf, 3, 5, constexprs=(2,))  # a positional constexpr: by value
    assert key(buf, 3, 7) == key(buf, 3, 5)
    assert key(buf, "text") is None and key(buf, (1, 2)) is None


def test_rekey_from_the_last_launch_equals_the_whole_key():
    """A launch keyed from the last one's key (only the arguments that are other objects keyed again) gets the key
    it would get keyed whole, through every change that test above tells apart, and a kind not keyed is None."""
    from kv_canary.kernels.launch import _rekey, _variant_key

    buf, other = torch.zeros(64, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    calls = [((buf, 3, 7, None), {"X": 1}), ((buf, 3, 7, None), {"X": 1}), ((buf[1:], 3, 7, None), {"X": 1}),
             ((buf, 1, 7, None), {"X": 1}), ((other, 1 << 40, 7, True), {"X": 1}), ((other, 5, 9, True), {"X": 1}),
             ((buf, 5, 9, True), {"X": 2}), ((buf, 5, 9), {"X": 2}), ((buf, 32, 9, 2.0), {"X": 2}),
             ((buf, "text", 9, 2.0), {"X": 2}), ((buf, 3, 9, 2.0), {"X": 2})]
    for constexprs in ((), (2,)):
        last = None
        for args, kw in calls:
            whole = _variant_key(args, kw, constexprs)
            got = whole if last is None else _rekey(args, kw, constexprs, last)
            assert got == whole, (args, kw, constexprs)
            last = None if got is None else (args, kw, got)
