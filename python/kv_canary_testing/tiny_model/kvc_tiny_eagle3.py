"""KvcTinyForCausalLMEagle3: a tiny EAGLE3 draft model for running sglang's EAGLE3 on CPU.

Shaped like sglang 0.5.12's ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``), which cannot
run on this CPU path (its rotary embedding imports ``vllm._custom_ops``): the target hands over
the concatenation of ``num_aux`` captured hidden states (``KvcTinyForCausalLM.
set_eagle3_layers_to_capture``; width ``num_aux * hidden``), which ``fc`` maps to ``hidden``; in
the draft's own decode steps ``spec_info.hidden_states`` is the draft's previous output (width
``hidden``) and skips ``fc``. One decoder layer whose attention input is ``[norm(embed(token)),
norm(hidden)]`` (width ``2 * hidden``), its KV in the draft worker's own pool through sglang's
``RadixAttention``; the layer's residual is the hidden state; the pre-norm output goes back as the
next step's hidden state (``capture_aux_hidden_states``). The target's embedding and lm_head are
shared (``load_lm_head_from_target``: no draft vocabulary, ``hot_token_id`` None).

``kvc_eagle3_embed_residual`` (test knob): the residual starts from the token's embedding instead of
the hidden state, so with ``kvc_branch_scale`` 0 the draft predicts what a target without its
branches would -- drafts are accepted often, not always (as ``kvc_eagle_identity_fc`` does for EAGLE).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from kv_canary_testing.tiny_model.kvc_tiny import KvcTinyMLP, RMSNorm, Rotary, _cfg, _rope_theta
from kv_canary_testing.tiny_model.kvc_tiny_eagle import KvcTinyForCausalLMEagle


def num_aux_hidden_states(config) -> int:
    """sglang's resolution: ``num_aux_hidden_states`` > ``len(eagle_config.eagle_aux_hidden_state_layer_ids)`` > 3."""
    n = getattr(config, "num_aux_hidden_states", None)
    if n is None:
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        n = len(ids) if ids else 3
    return int(n)


class KvcTinyEagle3Layer(nn.Module):
    """The draft's one decoder layer: attention over ``[norm(embeds), norm(hidden)]``, then a SwiGLU MLP."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        eps = _cfg(config, "rms_norm_eps", 1e-6)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = _cfg(config, "num_key_value_heads", self.num_heads)
        self.head_dim = _cfg(config, "head_dim", hidden // self.num_heads)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.rotary = Rotary(self.head_dim, _cfg(config, "max_position_embeddings", 4096), _rope_theta(config))
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                                   layer_id=0, prefix="model.layers.0.self_attn.attn")
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = KvcTinyMLP(hidden, config.intermediate_size)
        self.embed_residual = bool(_cfg(config, "kvc_eagle3_embed_residual", False))

    def forward(self, positions, embeds, hidden_states, forward_batch):
        n = embeds.shape[0]
        residual = embeds if self.embed_residual else hidden_states
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden_states)), dim=-1)
        q = self.rotary(positions, self.q_proj(x).view(n, self.num_heads, self.head_dim)).reshape(n, -1)
        k = self.rotary(positions, self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)).reshape(n, -1)
        h = residual + self.o_proj(self.attn(q, k, self.v_proj(x), forward_batch))
        return h + self.mlp(self.post_attention_layernorm(h))


class KvcTinyEagle3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(_cfg(config, "target_hidden_size", hidden) * num_aux_hidden_states(config), hidden,
                            bias=False)
        self.layers = nn.ModuleList([KvcTinyEagle3Layer(config)])
        self.norm = RMSNorm(hidden, _cfg(config, "rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        """(normed [tokens, hidden] for the logits, [pre-norm [tokens, hidden]] for the next draft step)."""
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        h = forward_batch.spec_info.hidden_states.to(embeds.dtype)
        if h.shape[-1] != embeds.shape[-1]:  # the target's captured states (extends); draft steps feed their own
            h = self.fc(h)
        if h.shape[0] == 0:
            return h, [h]
        h = self.layers[0](positions, embeds, h, forward_batch)
        return self.norm(h), [h]


class KvcTinyForCausalLMEagle3(KvcTinyForCausalLMEagle):
    """The EAGLE draft's weights handling and embedding/head sharing; its own model and aux outputs."""

    INIT_SEED_OFFSET = 3

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__(config, quant_config, prefix, **kwargs)
        self.capture_aux_hidden_states = True
        self.load_lm_head_from_target = True  # EagleDraftWorker.init_lm_head: set_embed_and_head
        self.hot_token_id = None  # no draft vocabulary (d2t)

    @staticmethod
    def make_model(config) -> nn.Module:
        return KvcTinyEagle3Model(config)

    def set_embed(self, embed):
        del self.model.embed_tokens.weight
        self.model.embed_tokens.weight = embed

    def get_hot_token_id(self):
        return self.hot_token_id

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
        get_embedding: bool = False,
        **kwargs,
    ):
        hidden, aux = self.model(input_ids, positions, forward_batch, input_embeds)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)


EntryClass = [KvcTinyForCausalLMEagle3]
