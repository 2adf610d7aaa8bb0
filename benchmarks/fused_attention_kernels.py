"""The kernels of ``bench_fused_attention_hash.py``: one layer of decode attention (GQA, split over the context,
merged by a second launch), with each loaded K and V word's hash term summed per read lane (``HASH`` 1: the
canary's ``mix32(word ^ key)``; 2: ``word x (key | 1)``). The project's own kernels, written for the measurement.
Imported after ``--smoke`` sets the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _term(k, key, HASH: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr):
    """[BN, D] bf16 -> [BN] int64: the sum over each row's D/2 words (two bf16 a word) of the HASH term."""
    pairs = tl.reshape(k.to(tl.int16, bitcast=True), (k.shape[0], k.shape[1] // 2, 2))
    lo, hi = tl.split(pairs)
    x = lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    if HASH == 1:
        y = x ^ key[None, :]
        y = y ^ (y >> 16)
        y = y * M1
        y = y ^ (y >> 15)
        y = y * M2
        t = (y ^ (y >> 16)).to(tl.int64)
    else:
        t = (x.to(tl.uint64) * (key[None, :] | 1).to(tl.uint64)).to(tl.int64, bitcast=True)
    return tl.sum(t, axis=1)


@triton.jit
def stage1(q, k_buf, v_buf, req_to_token, ctx, part_o, part_lse, lane_sums, sm_scale, split_len,
           HASH: tl.constexpr, KEY: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, GROUP: tl.constexpr,
           KVH: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, DOT_F32: tl.constexpr):
    """One request's KV head over one split of its context: the partial softmax of its query heads, and with
    ``HASH`` each position's K and V words' terms added to ``lane_sums[b, pos]``. ``DOT_F32``: the dot products in
    float32 (the interpreter multiplies bf16 as raw bits); on a GPU they run in bf16 on tensor cores."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.arange(0, BH)
    hm = heads < GROUP
    d = tl.arange(0, D)
    qh = h * GROUP + heads
    qv = tl.load(q + (b * GROUP * KVH + qh[:, None]) * D + d[None, :], mask=hm[:, None], other=0.0)
    m_i = tl.zeros((BH,), dtype=tl.float32) - float("inf")
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, D), dtype=tl.float32)
    w = tl.arange(0, D // 2)
    k_key = ((h * 2 * (D // 2) + w + 1).to(tl.uint32)) * KEY  # K's words, then V's, of this KV head
    v_key = ((h * 2 * (D // 2) + D // 2 + w + 1).to(tl.uint32)) * KEY
    start = s * split_len
    for n0 in range(start, tl.minimum(start + split_len, ctx), BN):
        pos = n0 + tl.arange(0, BN)
        pm = pos < tl.minimum(start + split_len, ctx)
        slot = tl.load(req_to_token + b * ctx + pos, mask=pm, other=0).to(tl.int64)
        row = (slot[:, None] * KVH + h) * D + d[None, :]
        k = tl.load(k_buf + row, mask=pm[:, None], other=0.0)
        if DOT_F32:
            qk = tl.dot(qv.to(tl.float32), tl.trans(k.to(tl.float32))) * sm_scale
        else:
            qk = tl.dot(qv, tl.trans(k)) * sm_scale
        qk = tl.where(pm[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_buf + row, mask=pm[:, None], other=0.0)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if HASH != 0:
            sums = _term(k, k_key, HASH, M1, M2) + _term(v, v_key, HASH, M1, M2)
            tl.atomic_add(lane_sums + b * ctx + pos, sums, mask=pm, sem="relaxed")
    nsplit = tl.num_programs(2)
    out = (b * GROUP * KVH + qh) * nsplit + s
    tl.store(part_o + out[:, None] * D + d[None, :], acc / l_i[:, None], mask=hm[:, None] & (l_i[:, None] > 0))
    tl.store(part_lse + out, tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf")), mask=hm)


@triton.jit
def stage2(part_o, part_lse, o, NSPLIT: tl.constexpr, D: tl.constexpr):
    """One (request, query head): its splits' partial outputs merged by their log-sum-exp weights."""
    r = tl.program_id(0)  # one (request, query head)
    s = tl.arange(0, NSPLIT)
    d = tl.arange(0, D)
    lse = tl.load(part_lse + r * NSPLIT + s)
    wt = tl.exp(lse - tl.max(lse, axis=0))
    wt = tl.where(lse == float("-inf"), 0.0, wt)
    parts = tl.load(part_o + (r * NSPLIT + s[:, None]) * D + d[None, :], mask=(lse != float("-inf"))[:, None],
                    other=0.0)
    tl.store(o + r * D + d, (tl.sum(parts * wt[:, None], axis=0) / tl.sum(wt, axis=0)).to(o.dtype.element_ty))
