"""The write witness's stamp against real activations: the tiny model's own K/V (``kv_canary/witness_stamp.py``).

The tiny e2e model (``kv_canary_testing/tiny_model/kvc_tiny.py``: its own layers, its seeded weights) runs prompts
of the e2e vocabulary through plain causal attention in place of sglang's ``RadixAttention``; the K (after rotary)
and V rows each layer would store are taken as they are (fp32) and as each KV element type stores them (bf16,
fp16, fp8 e4m3fn and e5m2 at sglang's default scale 1). Then:

* no stored row end (its first or last two int32 words) equals the stamp: the check's false-alarm case;
* per element type, the chance that a correct store leaves one end equal to the stamp, estimated from these
  activations (each stamp element's code frequency, or where a code never occurs, the density of elements near 0
  times the code's width), is far below any realistic serving lifetime's
  reach (< 1e-15 an end).
"""

from __future__ import annotations

import math

import pytest
import torch

from kv_canary.witness_stamp import STAMP_WORDS, WITNESS_STAMPS

torch.manual_seed(0)
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, getattr(torch, "float8_e4m3fn", None): 3,
                  getattr(torch, "float8_e5m2", None): 2}
N_PROMPTS, PROMPT_LEN = 8, 512


def _tiny_model_kv():
    """[(K rows, V rows)] per layer of the tiny model over random prompts: fp32 [tokens, kv_heads * head_dim]."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from kv_canary_testing.model_dir import DEFAULT_CONFIG, FIRST_WORD_ID, NUM_WORDS
    from kv_canary_testing.tiny_model import kvc_tiny

    config = SimpleNamespace(**DEFAULT_CONFIG)
    model = kvc_tiny.KvcTinyModel(config)
    # the tiny model's own seeded init (KvcTinyForCausalLM.reset_parameters), over the same sorted parameter names
    gen = torch.Generator().manual_seed(DEFAULT_CONFIG["kvc_init_seed"])
    params = dict(model.named_parameters(prefix="model"))
    params["lm_head.weight"] = torch.nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
    for name, p in sorted(params.items()):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.dim() == 2:
            p.data.copy_(torch.randn(p.shape, generator=gen) / (1 if "embed_tokens" in name else math.sqrt(p.shape[1])))
    stored = {i: ([], []) for i in range(config.num_hidden_layers)}

    class CausalAttention(torch.nn.Module):  # sglang's RadixAttention stores k, v, then attends causally
        def __init__(self, layer_id, attn):
            super().__init__()
            self.layer_id, self.h, self.kvh, self.d = layer_id, attn.tp_q_head_num, attn.tp_k_head_num, attn.head_dim

        def forward(self, q, k, v, forward_batch):
            stored[self.layer_id][0].append(k.detach().clone())
            stored[self.layer_id][1].append(v.detach().clone())
            n = q.shape[0]
            q, k, v = (t.view(n, -1, self.d).transpose(0, 1) for t in (q, k, v))
            k, v = (t.repeat_interleave(self.h // self.kvh, dim=0) for t in (k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(0, 1).reshape(n, -1)

    for i, layer in enumerate(model.layers):
        layer.self_attn.attn = CausalAttention(i, layer.self_attn.attn)
    with torch.no_grad():
        for _ in range(N_PROMPTS):
            ids = FIRST_WORD_ID + torch.randint(0, NUM_WORDS, (PROMPT_LEN,))
            model(ids, torch.arange(PROMPT_LEN), None)
    return [(torch.cat(k), torch.cat(v)) for k, v in stored.values()]


@pytest.fixture(scope="module")
def rows():
    kv = _tiny_model_kv()
    return torch.cat([t for pair in kv for t in pair])  # fp32 [rows, row elements]


def _stored(rows, dtype):
    """The rows as a pool of ``dtype`` stores them, as int32 words [rows, words]."""
    return rows.to(dtype).contiguous().view(torch.uint8).view(torch.int32)


@pytest.mark.parametrize("dtype", list(WITNESS_STAMPS), ids=str)
def test_no_real_row_end_holds_the_stamp_and_the_odds_are_negligible(rows, dtype):
    stamp = WITNESS_STAMPS[dtype]
    words = _stored(rows, dtype)
    ends = torch.stack([(words[:, :STAMP_WORDS] == stamp).all(dim=1),
                        (words[:, -STAMP_WORDS:] == stamp).all(dim=1)], dim=1)
    assert not ends.any(), f"{int(ends.sum())} real rows of {dtype} hold the stamp at an end"

    # odds an end: the product over the end's elements of each stamp code's chance in these activations
    elements = rows.to(dtype).flatten()
    codes = elements.view(torch.uint8 if dtype.itemsize == 1 else torch.int16 if dtype.itemsize == 2 else torch.int32)
    stamp_codes = torch.tensor([stamp], dtype=torch.int32).view(codes.dtype).tolist()
    values = torch.tensor([stamp], dtype=torch.int32).view(dtype).float().tolist()
    n = codes.numel()
    width = torch.finfo(dtype).smallest_normal / 2 ** _MANTISSA_BITS[dtype]  # a subnormal code's width
    near = float((elements.float().abs() < 0.05).sum()) / n / 0.1  # density of elements near 0, per unit
    p_end = 1.0
    for code, value in zip(stamp_codes * STAMP_WORDS, values * STAMP_WORDS):
        seen = int((codes == code).sum())
        p_code = seen / n if seen else near * width
        p_end *= p_code
    print(f"witness_stamp_odds dtype={dtype} elements={n} density_near_0={near:.3f} "
          f"stamp_values={[f'{v:.3g}' for v in values]} p_end={p_end:.3g}")
    assert p_end < 1e-15, (dtype, p_end)
