"""KvcTinyTpForCausalLM: the tiny model with its attention heads split over the tensor-parallel ranks.

For ``--tp-size N`` on CPU, where sglang's own Llama cannot be built (its rotary embedding imports
``vllm`` custom ops off CUDA). Each rank holds ``num_attention_heads / N`` query heads and
``num_key_value_heads / N`` KV heads -- so its ``RadixAttention`` writes and reads only its own KV
shard, and sglang sizes each rank's KV pool for ``num_key_value_heads / N`` heads -- and the partial
``o_proj`` outputs are summed with sglang's TP group ``all_reduce`` (gloo on CPU).
Embedding, norms, MLP and LM head are replicated (full logits on every rank: no all-gather). A dummy load re-initialises every weight from the
*unsharded* model's seeded values and keeps this rank's slice (q/k/v rows, o_proj columns), so the
ranks together compute exactly ``KvcTinyForCausalLM`` with the same config.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group  # 0.5.12 and 0.5.23 alike
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention

from .kvc_tiny import KvcTinyAttention, KvcTinyForCausalLM, Rotary, _cfg, _rope_theta

_ROW_SHARDED = ("q_proj.weight", "k_proj.weight", "v_proj.weight")  # output features split over the ranks
_COL_SHARDED = ("o_proj.weight",)  # input features split over the ranks


class KvcTinyTpAttention(KvcTinyAttention):
    """This rank's heads of ``KvcTinyAttention``; the output summed over the ranks."""

    def __init__(self, config, layer_id: int):
        nn.Module.__init__(self)
        tp = get_tp_group().world_size
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = _cfg(config, "num_key_value_heads", heads)
        if heads % tp or kv_heads % tp:
            raise ValueError(f"KvcTinyTpForCausalLM: {heads} query / {kv_heads} KV heads do not split over {tp} ranks")
        self.num_heads, self.num_kv_heads = heads // tp, kv_heads // tp
        self.head_dim = _cfg(config, "head_dim", hidden // heads)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.rotary = Rotary(self.head_dim, _cfg(config, "max_position_embeddings", 4096), _rope_theta(config))
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                                   layer_id=layer_id, prefix=f"model.layers.{layer_id}.self_attn.attn")

    def forward(self, positions, hidden_states, forward_batch):
        return get_tp_group().all_reduce(super().forward(positions, hidden_states, forward_batch))


class KvcTinyTpForCausalLM(KvcTinyForCausalLM):
    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__(config, quant_config=quant_config, prefix=prefix, **kwargs)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = KvcTinyTpAttention(config, i)
        self.logits_processor = LogitsProcessor(config, skip_all_gather=True)  # the LM head is replicated
        self.tp_size, self.tp_rank = get_tp_group().world_size, get_tp_group().rank_in_group

    def load_weights(self, weights) -> None:
        raise ValueError("KvcTinyTpForCausalLM runs with --load-format dummy only (its weights are seeded)")

    def full_shape(self, name: str, param) -> tuple:
        shape = list(param.shape)
        if name.endswith(_ROW_SHARDED):
            shape[0] *= self.tp_size
        elif name.endswith(_COL_SHARDED):
            shape[1] *= self.tp_size
        return tuple(shape)

    def shard(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name.endswith(_ROW_SHARDED):
            n = value.shape[0] // self.tp_size
            return value[self.tp_rank * n:(self.tp_rank + 1) * n]
        if name.endswith(_COL_SHARDED):
            n = value.shape[1] // self.tp_size
            return value[:, self.tp_rank * n:(self.tp_rank + 1) * n]
        return value


EntryClass = [KvcTinyTpForCausalLM]
