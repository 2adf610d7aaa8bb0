"""A hybrid sliding-window variant of the tiny model, under a name sglang 0.5.12 treats as hybrid SWA.

sglang decides "hybrid SWA" (``SWAKVPool``: a ``full`` and a ``swa`` KV pool with
a full-slot -> swa-slot mapping, ``SWARadixCache``) from ``architectures`` alone
(``is_hybrid_swa_model``) and takes the layer split from ``config.layer_types``
and the window from ``config.sliding_window``. ``LagunaForCausalLM`` is on that
list and has no server-argument special case (gpt-oss forces the Triton
attention backend, which CPU lacks), so this external class takes its name; the
model itself is ``KvcTinyForCausalLM`` (model_type ``llama``).

On CPU with ``torch_native`` attention the window is *not* applied by attention
(torch_native ignores sliding windows and reads SWA layers through
``req_to_token`` untranslated); the pool, its allocator, the mapping and the
SWA eviction are sglang's own and run as on GPU. What the model computes on the
SWA layers is therefore not what a GPU would compute, but every KV byte it writes
goes through ``SWAKVPool.set_kv_buffer`` (translated), which is what the canary
fingerprints and verifies.
"""

from __future__ import annotations

from .kvc_tiny import KvcTinyForCausalLM


class LagunaForCausalLM(KvcTinyForCausalLM):
    """``KvcTinyForCausalLM`` under a hybrid-SWA architecture name (see the module doc).

    The sliding layers' ``RadixAttention`` get ``sliding_window_size = config.sliding_window`` (the
    window sglang's SWA allocator and radix cache use too), so a backend that applies windows (Triton on
    the GPU host) reads them windowed and through the full -> swa translation; ``torch_native`` ignores it.
    """

    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__(config, quant_config=quant_config, prefix=prefix, **kwargs)
        window = int(getattr(config, "sliding_window", 0) or 0)
        for layer, kind in zip(self.model.layers, getattr(config, "layer_types", None) or []):
            if kind == "sliding_attention" and window > 0:
                layer.self_attn.attn.sliding_window_size = window

    def get_attention_sliding_window_size(self) -> int:
        return int(self.config.sliding_window)


EntryClass = [LagunaForCausalLM]
