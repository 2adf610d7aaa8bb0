"""KvcTinyForCausalLMEagle: a tiny EAGLE draft model for running sglang's EAGLE on CPU.

EAGLE's draft consumes the target's hidden states (``forward_batch.spec_info.hidden_states``):
``h = fc([embed(input_ids), target_hidden])``, then decoder layers of its own (their
KV lives in the draft worker's own pool), a final norm, and the target's lm_head.
Embedding and lm_head are shared with the target (``set_embed_and_head``), as in
sglang's ``LlamaForCausalLMEagle``. Plain torch layers plus sglang's
``RadixAttention`` and ``LogitsProcessor``, like ``KvcTinyForCausalLM``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from kv_canary_testing.tiny_model.kvc_tiny import (
    KvcTinyDecoderLayer,
    RMSNorm,
    _cfg,
    _is_dummy_load,
)


class KvcTinyEagleModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            KvcTinyDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        h = self.fc(torch.cat((h, forward_batch.spec_info.hidden_states.to(h.dtype)), dim=-1))
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.norm(h)


class KvcTinyForCausalLMEagle(nn.Module):
    INIT_SEED_OFFSET = 1  # post_load_weights' generator: kvc_init_seed + this

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()
        if quant_config is not None:
            raise ValueError(f"{type(self).__name__} does not support quantization")
        self.config = config
        self.model = self.make_model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

    @staticmethod
    def make_model(config) -> nn.Module:
        return KvcTinyEagleModel(config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed, head):
        """Share the target's embedding and lm_head (EAGLE)."""
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head

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
        hidden = self.model(input_ids, positions, forward_batch, input_embeds)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"unexpected weight {name!r} for {type(self).__name__}")
            params[name].data.copy_(tensor.to(params[name].dtype))

    def post_load_weights(self) -> None:
        """After a dummy load, seeded init with a useful scale (embedding/head are shared later)."""
        if not _is_dummy_load():
            return
        import math

        gen = torch.Generator(device="cpu").manual_seed(int(_cfg(self.config, "kvc_init_seed", 0)) + self.INIT_SEED_OFFSET)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    value = torch.ones(param.shape)
                elif param.dim() == 2:
                    value = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
                else:
                    continue
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    value = value * float(_cfg(self.config, "kvc_branch_scale", 1.0))
                if name == "model.fc.weight" and _cfg(self.config, "kvc_eagle_identity_fc", False):
                    # h = embed(token): with kvc_branch_scale 0 the draft predicts what a target whose
                    # branches are small predicts (shared lm_head), so drafts are often accepted
                    hidden = param.shape[0]
                    value = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
                param.data.copy_(value.to(device=param.device, dtype=param.dtype))


EntryClass = [KvcTinyForCausalLMEagle]
