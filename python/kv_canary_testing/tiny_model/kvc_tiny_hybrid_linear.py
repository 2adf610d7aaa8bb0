"""KvcTinyHybridLinearForCausalLM: the tiny model on a hybrid linear-attention (Qwen3-Next class) config.

sglang picks the hybrid linear-attention machinery from the config class (``model_type: qwen3_next`` ->
``Qwen3NextConfig``): ``HybridLinearKVPool`` (the full-attention layers' K/V in an inner
``MHATokenToKVPool``, one conv/ssm state per request in a ``MambaPool``), the FULL + MAMBA radix cache and
the hybrid linear attention backend. sglang's own ``Qwen3NextForCausalLM`` cannot be built on CPU (CUDA
device calls, CUDA-only kernels), so this class stands in: its full-attention layers (the config's ``full_attention_layer_ids``)
are the tiny model's (RadixAttention: every K/V byte through sglang's pool), its linear-attention layers
are a plain torch token-local mix that neither reads nor writes the mamba state -- the one thing the
canary does not cover anyway. Everything the canary checks (the inner pool, the slots, the radix cache's
FULL + MAMBA tree, its tombstones and evictions) is sglang's own.
"""

from __future__ import annotations

from torch import nn

from .kvc_tiny import KvcTinyForCausalLM


class KvcTinyLinearMix(nn.Module):
    """A linear-attention layer's stand-in: a gated per-token projection (no KV, no recurrent state)."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.gate = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch):
        del positions, forward_batch
        return self.proj(hidden_states) * nn.functional.sigmoid(self.gate(hidden_states))


class KvcTinyHybridLinearForCausalLM(KvcTinyForCausalLM):
    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__(config, quant_config=quant_config, prefix=prefix, **kwargs)
        full = set(config.full_attention_layer_ids)  # sglang's Qwen3NextConfig (full_attention_interval)
        for i, layer in enumerate(self.model.layers):
            if i not in full:
                layer.self_attn = KvcTinyLinearMix(config, i)


EntryClass = [KvcTinyHybridLinearForCausalLM]
