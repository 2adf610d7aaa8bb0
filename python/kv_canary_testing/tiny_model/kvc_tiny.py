"""KvcTinyForCausalLM: a tiny Llama-like decoder for running sglang on CPU.

Plain torch layers (embedding, RMSNorm, q/k/v/o and MLP linears, rotary position
embedding computed in torch) plus sglang's ``RadixAttention`` -- so every KV-cache
write and read goes through sglang's attention backend and KV pool -- and
sglang's ``LogitsProcessor``. No sglang/vllm custom ops are used.

With ``--load-format dummy`` sglang fills every weight with uniform(-1e-3, 1e-3);
``post_load_weights`` then re-initialises the weights deterministically (seeded by
``config.kvc_init_seed``) with a useful scale, so that outputs depend on the
context held in the KV cache.

``KVC_TINY_FAIL_AT_EXTEND=N`` (tests): the model's N-th extend (prefill) forward of the process (1-based; decode
forwards, which CUDA graphs replay without calling it, are not counted) raises ``RuntimeError`` after its logits: an
engine error of the model's own, after the canary's TAIL ran.

Served with ``--is-embedding`` (sglang passes ``get_embedding=True``), the forward returns sglang's ``Pooler``
output (the last token's hidden state, normalized) instead of logits.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.pooler import Pooler, PoolingType
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def _cfg(config, name, default):
    value = getattr(config, name, None)
    return default if value is None else value


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or 10000.0)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm in plain torch."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Neox-style rotary position embedding from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Non-persistent: not in state_dict, so the dummy loader leaves it alone.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]
        pos = positions.long().clamp(0, self.max_positions - 1)
        cos = self.cos[pos].unsqueeze(1).to(x.dtype)
        sin = self.sin[pos].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class KvcTinyAttention(nn.Module):
    """Self-attention: plain projections + rotary, KV cache via RadixAttention."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = _cfg(config, "num_key_value_heads", self.num_heads)
        self.head_dim = _cfg(config, "head_dim", hidden // self.num_heads)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.rotary = Rotary(
            self.head_dim, _cfg(config, "max_position_embeddings", 4096), _rope_theta(config)
        )
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            prefix=f"model.layers.{layer_id}.self_attn.attn",
        )

    def forward(self, positions, hidden_states, forward_batch: ForwardBatch):
        n = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states)
        q = self.rotary(positions, q).reshape(n, -1)
        k = self.rotary(positions, k).reshape(n, -1)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out)


class KvcTinyMLP(nn.Module):
    """SwiGLU MLP in plain torch."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class KvcTinyDecoderLayer(nn.Module):
    """Pre-norm decoder block: attention + MLP with residuals."""

    def __init__(self, config, layer_id: int):
        super().__init__()
        eps = _cfg(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = KvcTinyAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = KvcTinyMLP(config.hidden_size, config.intermediate_size)

    def forward(self, positions, hidden_states, forward_batch):
        h = hidden_states + self.self_attn(
            positions, self.input_layernorm(hidden_states), forward_batch
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class KvcTinyModel(nn.Module):
    """Embedding, decoder layers and final norm (``.layers`` as sglang expects)."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            KvcTinyDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, _cfg(config, "rms_norm_eps", 1e-6))
        self.layers_to_capture = []  # EAGLE3: the residual stream entering these layers (set_eagle3_layers_to_capture)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        """[tokens, hidden] after the final norm; with layers to capture, also the list of captured [tokens, hidden]."""
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(h)
            h = layer(positions, h, forward_batch)
        return (self.norm(h), aux) if self.layers_to_capture else self.norm(h)


class KvcTinyForCausalLM(nn.Module):
    """Causal LM wrapper with sglang's LogitsProcessor."""

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()
        if quant_config is not None:
            raise ValueError("KvcTinyForCausalLM does not support quantization")
        self.config = config
        self.model = KvcTinyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor(config)
        self.pooler = Pooler(pooling_type=PoolingType.LAST, normalize=True)  # --is-embedding
        self.capture_aux_hidden_states = False

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_embed_and_head(self):
        """(embedding, lm_head) weights: an EAGLE draft model shares them."""
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_eagle3_layers_to_capture(self, layer_ids: Optional[List[int]] = None) -> None:
        """EAGLE3 (``ModelRunner.init_aux_hidden_state_capture``), as sglang's ``LlamaForCausalLM`` does it: the
        hidden states entering layers ``id + 1`` (None: 2, n // 2, n - 3) go to the draft, concatenated."""
        n = self.config.num_hidden_layers
        layers = [2, n // 2, n - 3] if layer_ids is None else [i + 1 for i in layer_ids]
        if any(not 0 <= i < n for i in layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {layer_ids}: the target has {n} layers; each id + 1 "
                             f"must be one of them (the draft's config.json eagle_config)")
        self.model.layers_to_capture = layers
        self.capture_aux_hidden_states = True

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
        aux = None
        if self.capture_aux_hidden_states:
            hidden, aux = hidden
        if get_embedding:
            out = self.pooler(hidden, forward_batch)
        else:
            out = self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)
        if forward_batch.forward_mode.is_extend():
            _count_extend_and_maybe_fail()
        return out

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by name (HF Llama names map 1:1)."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {name!r} for KvcTinyForCausalLM")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
                )
            param.data.copy_(tensor.to(param.dtype))

    def post_load_weights(self) -> None:
        """After a dummy load, re-initialise weights deterministically with a useful scale."""
        if not _is_dummy_load():
            return
        self.reset_parameters(int(_cfg(self.config, "kvc_init_seed", 0)))

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Seeded init: norms = 1, linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            shape = self.full_shape(name, param)  # the unsharded weight (a TP shard is cut from it: same model)
            if name.endswith("norm.weight"):
                value = torch.ones(shape)
            elif param.dim() == 2 and "embed_tokens" in name:
                value = torch.randn(shape, generator=gen)
            elif param.dim() == 2:
                value = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
            else:
                continue
            value = self.shard(name, value)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                # kvc_branch_scale: how much attention/MLP add to the residual stream (0: the next token
                # is a function of the current one; small: mostly, which an EAGLE draft can guess)
                value = value * float(_cfg(self.config, "kvc_branch_scale", 1.0))
            param.data.copy_(value.to(device=param.device, dtype=param.dtype))


    def full_shape(self, name: str, param) -> tuple:
        """The shape of ``name``'s weight in the unsharded model (this model is not sharded)."""
        del name
        return tuple(param.shape)

    def shard(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``name``'s unsharded weight (all of it here)."""
        del name
        return value


_EXTENDS = [0]


def _count_extend_and_maybe_fail() -> None:
    """``KVC_TINY_FAIL_AT_EXTEND`` (module docstring)."""
    _EXTENDS[0] += 1
    fail_at = os.environ.get("KVC_TINY_FAIL_AT_EXTEND")
    if fail_at and _EXTENDS[0] == int(fail_at):
        raise RuntimeError(f"kvc tiny model: injected engine error at extend {_EXTENDS[0]} (KVC_TINY_FAIL_AT_EXTEND)")


def _is_dummy_load() -> bool:
    """``--load-format dummy`` (sglang 0.5.23 reads server args through ``runtime_context``; 0.5.12 globally)."""
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        from sglang.srt.server_args import get_global_server_args as get_server_args
    try:
        return str(get_server_args().load_format) == "dummy"
    except Exception:
        return False


EntryClass = [KvcTinyForCausalLM]
