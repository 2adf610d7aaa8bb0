"""An MLA (multi-head latent attention) variant of the tiny model, under a name sglang 0.5.12 treats as MLA.

sglang picks ``MLATokenToKVPool`` (one latent row per layer and slot:
``kv_lora_rank + qk_rope_head_dim`` values, no V half) from ``architectures``
(``ModelConfig``: ``MiniCPM3ForCausalLM`` -> ``AttentionArch.MLA`` with the
config's ``kv_lora_rank`` and ``qk_rope_head_dim``; no server-argument special
case), so this external class takes that name. Attention is the "absorbed" MLA
form sglang's MLA backends run: per token one latent ``c`` (``kv_lora_rank``)
and one rotary key part (``qk_rope_head_dim``) shared by every head; K =
``[c, rope(k_r)]``, V = ``c`` (the first ``kv_lora_rank`` values of the same
stored row), queries projected straight into that space. Plain torch plus
sglang's ``RadixAttention`` (``num_kv_heads=1``, ``v_head_dim=kv_lora_rank``),
so every KV write and read goes through sglang's MLA pool and the
``torch_native`` backend on CPU.

``kvc_mla_rope_apart`` (config, default false): pass the latent as K and the rotary key part as ``k_rope``, the way
DeepSeek's absorbed path calls the backends that store the row from its two halves (``set_mla_kv_buffer``: fa3,
flashinfer, ...). Default: the whole row as K (``set_kv_buffer``: torch_native, triton).
"""

from __future__ import annotations

from torch import nn

from sglang.srt.layers.radix_attention import RadixAttention

from .kvc_tiny import KvcTinyForCausalLM, Rotary, _cfg, _rope_theta


class KvcTinyMLAAttention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.lora = int(config.kv_lora_rank)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.q_proj = nn.Linear(hidden, self.num_heads * (self.lora + self.rope_dim), bias=False)
        self.kv_a_proj = nn.Linear(hidden, self.lora + self.rope_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.lora, hidden, bias=False)
        self.rope_apart = bool(_cfg(config, "kvc_mla_rope_apart", False))
        self.rotary = Rotary(self.rope_dim, _cfg(config, "max_position_embeddings", 4096), _rope_theta(config))
        self.attn = RadixAttention(
            self.num_heads, self.lora + self.rope_dim, (self.lora + self.rope_dim) ** -0.5, num_kv_heads=1,
            layer_id=layer_id, v_head_dim=self.lora, prefix=f"model.layers.{layer_id}.self_attn.attn",
        )

    def forward(self, positions, hidden_states, forward_batch):
        n = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(n, self.num_heads, self.lora + self.rope_dim)
        q_nope, q_rope = q.split([self.lora, self.rope_dim], dim=-1)
        q = q.new_empty(q.shape)
        q[..., : self.lora] = q_nope
        q[..., self.lora:] = self.rotary(positions, q_rope.contiguous())
        kv = self.kv_a_proj(hidden_states).view(n, 1, self.lora + self.rope_dim)
        c, k_rope = kv.split([self.lora, self.rope_dim], dim=-1)
        k = kv.new_empty(kv.shape)
        k[..., : self.lora] = c
        k[..., self.lora:] = self.rotary(positions, k_rope.contiguous())
        if self.rope_apart:
            c = c.contiguous()
            out = self.attn(q.reshape(n, -1), c, c, forward_batch, k_rope=k[..., self.lora:].contiguous())
        else:
            out = self.attn(q.reshape(n, -1), k, c.contiguous(), forward_batch)
        return self.o_proj(out.reshape(n, -1))


class MiniCPM3ForCausalLM(KvcTinyForCausalLM):
    """``KvcTinyForCausalLM`` with MLA attention, under an MLA architecture name (see the module doc)."""

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__(config, quant_config=quant_config, prefix=prefix, **kwargs)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = KvcTinyMLAAttention(config, i)


EntryClass = [MiniCPM3ForCausalLM]
