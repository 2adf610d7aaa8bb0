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
    """``KvcTinyForCausalLM`` under a hybrid-SWA architecture name (see the module doc)."""


EntryClass = [LagunaForCausalLM]
